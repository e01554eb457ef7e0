"""Local backend: each job incarnation is a launcher process group on this machine.

A job with ``N`` replicas runs as::

    python -m adaptive.elastic.launcher --standalone --nproc-per-node=N <command...>

(the ``adaptive-run`` console command) in its own session, with
``ADAPTIVE_JOB_ID``, ``ADAPTIVE_CHECKPOINT_PATH`` and ``ADAPTIVE_SHARE_PATH``
set, output appended to ``<log_dir>/<job>/attempt-<k>.log``. A graceful stop
is SIGTERM to the process group (jobs checkpoint and exit with 143); a kill
is SIGKILL to the launcher and every process below it (torchrun's workers
run in sessions of their own, out of the group's reach). The launcher is
bound to the process that launched it (:mod:`adaptive.runtime.process_tree`):
if the executor dies, even by SIGKILL, its incarnations die with it, and the
next executor relaunches them (call :meth:`LocalBackend.launch` from a thread
that lives as long as the executor: the main thread, as the CLI does). With
``cuda=True`` the job's slots become its ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from adaptive.runtime import process_tree
from scheduler.executor.backend import Assignment, Backend, exit_status, read_tail
from scheduler.executor.jobspec import JobSpec

logger = logging.getLogger(__name__)


def job_environment(spec: JobSpec, devices: Sequence[int] | None) -> dict[str, str]:
    """The environment of a launcher of ``spec``: bound to this process, the job's folders, its devices
    (``CUDA_VISIBLE_DEVICES`` when ``devices`` is given)."""
    env = process_tree.child_environment()
    env.update(spec.env)
    env.update({"ADAPTIVE_JOB_ID": spec.name, "ADAPTIVE_CHECKPOINT_PATH": spec.checkpoint_dir,
                "ADAPTIVE_SHARE_PATH": spec.share_dir})
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


@dataclass
class LocalHandle:
    """A running launcher process."""

    process: subprocess.Popen[bytes]
    log_path: str

    @property
    def pid(self) -> int:
        return self.process.pid


class LocalBackend(Backend):
    """Runs incarnations as local process groups.

    Args:
        log_dir: folder for per-attempt logs.
        launcher: command prefix that takes torchrun's arguments
            (default: this Python running ``-m adaptive.elastic.launcher``).
        cuda: map slots to ``CUDA_VISIBLE_DEVICES``.
    """

    def __init__(self, log_dir: str, launcher: Sequence[str] | None = None, cuda: bool = False):
        self.log_dir = log_dir
        self.launcher = list(launcher) if launcher else [sys.executable, "-m", "adaptive.elastic.launcher"]
        self.cuda = cuda

    def command(self, spec: JobSpec, num_replicas: int) -> list[str]:
        """The full command line of one incarnation."""
        return [*self.launcher, "--standalone", f"--nproc-per-node={num_replicas}", *spec.command]

    def launch(self, spec: JobSpec, assignment: Assignment, attempt: int) -> LocalHandle:
        if len(set(assignment.nodes)) != 1:
            raise ValueError(f"the local backend runs on one node; got nodes {sorted(set(assignment.nodes))}")
        num_replicas = assignment.num_replicas
        env = job_environment(spec, assignment.devices if self.cuda else None)
        os.makedirs(spec.checkpoint_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, spec.name, f"attempt-{attempt}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        cmd = self.command(spec, num_replicas)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        logger.info("launched %s with %d replicas (pid %d, log %s)", spec.name, num_replicas, process.pid,
                    log_path)
        return LocalHandle(process, log_path)

    def poll(self, handle: LocalHandle) -> int | None:
        code = handle.process.poll()
        return None if code is None else exit_status(code)

    def stop(self, handle: LocalHandle) -> None:
        self._signal(handle, signal.SIGTERM)

    def kill(self, handle: LocalHandle) -> None:
        killed = process_tree.kill_group_and_tree(handle.pid)
        logger.debug("sent SIGKILL to process group %d and %d process(es) below it", handle.pid, killed)

    def log_tail(self, handle: LocalHandle, lines: int = 20) -> str:
        """The last ``lines`` lines of the incarnation's log (empty if it cannot be read)."""
        return read_tail(handle.log_path, lines)

    @staticmethod
    def _signal(handle: LocalHandle, sig: signal.Signals) -> None:
        signal_group(handle.pid, sig)


def signal_group(leader: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group a launcher leads (its own session: pgid == pid).

    Its workers are in the group too, and are signalled even if the
    launcher already exited; a group that is gone is left alone.
    """
    try:
        os.killpg(leader, sig)
    except (ProcessLookupError, PermissionError):
        return
    logger.debug("sent %s to process group %d", sig.name, leader)
