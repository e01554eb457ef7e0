"""Local backend in live mode: jobs are resized while they train (``adaptive-run --live``).

A job with ``N`` replicas runs as ``N`` launchers on this machine, one
worker each, on one TCPStore (the first launcher hosts it on a free port of
127.0.0.1)::

    python -m adaptive.elastic.launcher --live --nnodes=1:MAX --nproc-per-node=1 \\
        --max-restarts=R --rdzv-endpoint=127.0.0.1:PORT <command...>

A decision that changes the replica count does not stop the job
(:meth:`LiveLocalBackend.resize`): growing starts more launchers, whose
workers join the running job and take the state from their peers; shrinking
sends SIGTERM to the newest launchers, whose workers leave at their next
agreed step while the others continue (see docs/live.md).  A graceful stop
of the whole job is SIGTERM to every launcher (every member leaves at once:
the job checkpoints and exits 143), a kill kills them all.  Each launcher is
bound to the executor, as :class:`~scheduler.executor.local.LocalBackend`'s launchers are.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import portpicker

from adaptive.runtime import process_tree
from scheduler.executor.backend import Assignment, Backend, exit_status, read_tail
from scheduler.executor.jobspec import JobSpec
from scheduler.executor.local import job_environment, signal_group

logger = logging.getLogger(__name__)

__all__ = ["LiveLocalBackend", "LiveLocalHandle", "live_command"]


def live_command(launcher: Sequence[str], spec: JobSpec, num_replicas: int, endpoint: str,
                 max_restarts: int) -> list[str]:
    """The command line of one live launcher of ``spec`` (one replica) on the job's store at ``endpoint``
    (``HOST:PORT``), in a job of ``num_replicas`` replicas; also the Ray backend's in live mode."""
    return [*launcher, "--live", f"--nnodes=1:{max(spec.max_replicas, num_replicas)}", "--nproc-per-node=1",
            f"--max-restarts={max_restarts}", f"--rdzv-endpoint={endpoint}", *spec.command]


@dataclass
class LiveLocalHandle:
    """The launchers of one live job: the first hosts the store; removed ones until they have exited."""

    spec: JobSpec
    port: int
    attempt: int
    launchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_paths: list[str] = field(default_factory=list)
    leaving: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.launchers[0].pid


class LiveLocalBackend(Backend):
    """Runs jobs as live launchers on this machine and resizes them in place.

    Args:
        log_dir: folder for the launchers' logs (``<job>/attempt-<k>.node-<i>.log``).
        launcher: command prefix that takes ``adaptive-run``'s arguments.
        cuda: map slots to ``CUDA_VISIBLE_DEVICES`` (one device per launcher).
        max_restarts: restarts of a failed worker per launcher.
    """

    def __init__(self, log_dir: str, launcher: list[str] | None = None, cuda: bool = False,
                 max_restarts: int = 3) -> None:
        self.log_dir = log_dir
        self.launcher = list(launcher) if launcher else [sys.executable, "-m", "adaptive.elastic.launcher"]
        self.cuda = cuda
        self.max_restarts = int(max_restarts)

    def command(self, spec: JobSpec, num_replicas: int, port: int = 0) -> list[str]:
        """The command line of one of the job's launchers (one replica each)."""
        return live_command(self.launcher, spec, num_replicas, f"127.0.0.1:{port}", self.max_restarts)

    def launch(self, spec: JobSpec, assignment: Assignment, attempt: int) -> LiveLocalHandle:
        if len(set(assignment.nodes)) != 1:
            raise ValueError(f"the local backend runs on one node; got nodes {sorted(set(assignment.nodes))}")
        os.makedirs(spec.checkpoint_dir, exist_ok=True)
        handle = LiveLocalHandle(spec, portpicker.pick_unused_port(), attempt)
        for device in assignment.devices:
            self._start(handle, device)
        logger.info("launched %s live with %d replicas (store on port %d)", spec.name, assignment.num_replicas,
                    handle.port)
        return handle

    def _start(self, handle: LiveLocalHandle, device: int) -> None:
        spec = handle.spec
        env = job_environment(spec, [device] if self.cuda else None)
        index = len(handle.log_paths)
        log_path = os.path.join(self.log_dir, spec.name, f"attempt-{handle.attempt}.node-{index}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(self.command(spec, len(handle.launchers) + 1, handle.port),
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        handle.launchers.append(process)
        handle.log_paths.append(log_path)

    def resize(self, handle: LiveLocalHandle, assignment: Assignment) -> bool:
        """Grow or shrink the running job to ``assignment`` without stopping it."""
        before = len(handle.launchers)
        wanted = assignment.num_replicas
        for device in assignment.devices[before:]:
            self._start(handle, device)
        while len(handle.launchers) > max(wanted, 1):
            process = handle.launchers.pop()
            signal_group(process.pid, signal.SIGTERM)  # its worker leaves at its next agreed step
            handle.leaving.append(process)
        logger.info("resized %s live from %d to %d replicas", handle.spec.name, before, len(handle.launchers))
        return True

    def poll(self, handle: LiveLocalHandle) -> int | None:
        handle.leaving = [process for process in handle.leaving if process.poll() is None]
        code = handle.launchers[0].poll()
        if code is None:
            return None
        for process in handle.launchers[1:] + handle.leaving:  # the host serves the store until they are done
            if process.poll() is None:
                return None
        return exit_status(code)

    def stop(self, handle: LiveLocalHandle) -> None:
        for process in handle.launchers:
            signal_group(process.pid, signal.SIGTERM)

    def kill(self, handle: LiveLocalHandle) -> None:
        for process in handle.launchers + handle.leaving:
            process_tree.kill_group_and_tree(process.pid)

    def log_tail(self, handle: LiveLocalHandle, lines: int = 20) -> str:
        return read_tail(handle.log_paths[0], lines)
