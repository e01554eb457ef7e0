"""Where the executor's jobs actually run: the backend interface.

The executor decides *what* runs with how many replicas; a backend knows
*how* to start, watch and stop one incarnation of a job. The local backend
starts processes on this machine; a Kubernetes backend would create and
delete pods behind the same four methods, without any change to the
executor or the policy.

What an incarnation's exit status means to the executor (and to any
supervisor of ``adaptive-run``: Kubernetes, Slurm; see docs/live.md, "Exit
statuses"): 0 done; 143 stopped gracefully (checkpointed, or drained);
:data:`STORE_LOST_EXIT` / :data:`LOST_NODE_EXIT` (75) relaunch now, it
resumes from its checkpoint (an infrastructure failure, not the job's);
:data:`CONFIG_ERROR_EXIT` (2) a usage or configuration error: do not
relaunch; 3 fenced by a newer incarnation; anything else a crash.
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
#: Exit status of a live launcher whose job's store was lost with the node that hosted it
#: (``adaptive.elastic.live_agent.STORE_LOST_EXIT_CODE``): relaunch the job's nodes, it resumes from its newest
#: checkpoint. The same number as :data:`LOST_NODE_EXIT` (sysexits' ``EX_TEMPFAIL``), read the same way: an
#: infrastructure failure, relaunched at once and not charged to ``max_failures``.
STORE_LOST_EXIT = LOST_NODE_EXIT
#: Exit status of a launcher (or a worker) that a relaunch cannot help: a usage or configuration error (a bad
#: argument, a checkpoint folder that cannot be created, a store that serves another job). Not relaunched.
CONFIG_ERROR_EXIT = 2
#: Exit status of an incarnation that stopped gracefully (128 + SIGTERM): it checkpointed, or it was drained.
STOPPED_EXIT = 143
#: Exit status of an incarnation that a newer one of the same job fenced off (it publishes nothing more).
STALE_EXIT = 3
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


def live_job_status(host: int, others: Sequence[int]) -> int:
    """The exit status of a live job from its launchers' (``adaptive-run --live``): the host's (the launcher
    that served the job's store), unless the host failed and another launcher ended with
    :data:`STORE_LOST_EXIT`.

    The store goes with the launcher that hosts it: when that launcher is killed (SIGKILL, the OOM killer: 137)
    the others end within seconds with 75, and the job resumes when relaunched. That reads as 75 (relaunch,
    not charged), not as the host's crash. A host that finished, stopped, or ended on a configuration error
    (2) or a fencing (3) gives its own status: ``others`` are statuses of the launchers that ended so far.
    """
    if host in (0, STOPPED_EXIT, CONFIG_ERROR_EXIT, STALE_EXIT) or STORE_LOST_EXIT not in others:
        return host
    return STORE_LOST_EXIT


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` when signal
    ``N`` ended it (``subprocess`` gives ``-N``), so that a stop (SIGTERM:
    143) reads the same whether the launcher exited or was killed."""
    return 128 - returncode if returncode < 0 else returncode
