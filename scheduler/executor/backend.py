"""Where the executor's jobs actually run: the backend interface.

The executor decides *what* runs with how many replicas; a backend knows
*how* to start, watch and stop one incarnation of a job. The local backend
starts processes on this machine; a Kubernetes backend would create and
delete pods behind the same four methods, without any change to the
executor or the policy.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

from scheduler.executor.jobspec import JobSpec


#: Exit status of an incarnation that a lost node (or its lost actor) ended: an infrastructure failure.
LOST_NODE_EXIT = 75
#: Exit status of an incarnation that could not be started (no placement in time, actor errors): a crash.
LAUNCH_FAILED_EXIT = 70
#: Characters kept of each line of an incarnation's output in :func:`read_tail`.
MAX_LINE = 400


@dataclass(frozen=True)
class Assignment:
    """Where one incarnation runs: per replica, its node and device on that node."""

    nodes: tuple[int, ...]
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.devices) or not self.nodes:
            raise ValueError(f"need one node and one device per replica (>= 1), got {self.nodes}, {self.devices}")

    @property
    def num_replicas(self) -> int:
        return len(self.nodes)


class Backend(abc.ABC):
    """Starts and stops job incarnations (one launch = one replica count)."""

    @abc.abstractmethod
    def launch(self, spec: JobSpec, assignment: Assignment, attempt: int) -> Any:
        """Start ``spec`` on ``assignment`` (one replica per entry); return a handle.

        ``attempt`` numbers the launches of this job (for logs). The job must
        resume from ``spec.checkpoint_dir``.
        """

    @abc.abstractmethod
    def poll(self, handle: Any) -> int | None:
        """Exit code if the incarnation has ended, else ``None``."""

    @abc.abstractmethod
    def stop(self, handle: Any) -> None:
        """Ask for a graceful stop (the job checkpoints and exits); returns at once."""

    @abc.abstractmethod
    def kill(self, handle: Any) -> None:
        """Force the incarnation to end (after a graceful stop timed out)."""

    def resize(self, handle: Any, assignment: Assignment) -> bool:
        """Move the running incarnation to ``assignment`` without stopping it, if this backend can.

        Returns False (the default) when it cannot: the executor then stops
        the incarnation and launches it again on the new assignment.  A
        backend in live mode (:class:`~scheduler.executor.local_live.LiveLocalBackend`)
        starts joiners and removes leavers while the job trains.
        """
        return False

    def log_tail(self, handle: Any, lines: int = 20) -> str:
        """The last ``lines`` lines of the incarnation's output ("" if none is kept); read after it ended,
        to report why it failed."""
        return ""

    def close(self) -> None:
        """Release what ended incarnations still hold; called once, by :meth:`Executor.shutdown`."""

    def alive_nodes(self) -> Sequence[int] | None:
        """Indices of the nodes that can run replicas now, or ``None`` for "all, always".

        A backend whose pool changes (Ray nodes that come and go) reports it
        here; the executor then kills incarnations that touch a lost node and
        allocates only alive ones. The local backend keeps the default.
        """
        return None


def read_tail(path: str, lines: int = 20, max_bytes: int = 64 << 10) -> str:
    """The last ``lines`` lines of the text file at ``path`` (at most ``max_bytes`` read, each line cut to
    :data:`MAX_LINE` characters); "" if it cannot be read."""
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - max_bytes))
            data = file.read()
    except OSError:
        return ""
    tail = data.decode("utf-8", errors="replace").rstrip("\n").splitlines()[-lines:] if lines > 0 else []
    return "\n".join(line if len(line) <= MAX_LINE else line[:MAX_LINE] + " ..." for line in tail)


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` when signal
    ``N`` ended it (``subprocess`` gives ``-N``), so that a stop (SIGTERM:
    143) reads the same whether the launcher exited or was killed."""
    return 128 - returncode if returncode < 0 else returncode
