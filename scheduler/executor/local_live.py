"""Local backend in live mode: jobs are resized while they train (``adaptive-run --live``).

A job with ``N`` replicas runs as ``N`` launchers on this machine, one
worker each, on one TCPStore (the first launcher hosts it on a free port of
127.0.0.1; the others are started once it listens, so that the first one is
the one that hosts it)::

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

**Exit status**: the first launcher's (it hosts the job's store, and serves it
until the others are done), once every launcher exited. When the first
launcher dies (killed, or its node lost), the store goes with it: the others
end within seconds with 75 (:data:`~scheduler.executor.backend.STORE_LOST_EXIT`),
and the job's status is 75, which the executor relaunches at once as an
infrastructure failure (:func:`~scheduler.executor.backend.live_job_status`);
launchers still running :data:`STORE_LOSS_WAIT` seconds after the first one
died are killed.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import portpicker
import psutil

from adaptive.runtime import process_tree
from adaptive.runtime.env import LIVE_SECRET_FILE_VAR, LIVE_SECRET_VAR
from scheduler.executor.backend import STOPPED_EXIT, Assignment, Backend, exit_status, live_job_status, read_tail
from scheduler.executor.jobspec import JobSpec
from scheduler.executor.local import job_environment, signal_group

logger = logging.getLogger(__name__)

__all__ = ["LiveLocalBackend", "LiveLocalHandle", "live_command", "STORE_LOSS_WAIT", "new_secret",
           "secret_environment"]

#: Seconds the other launchers get to end once the first one (the store's host) died: theirs notice within
#: about 4 s (the live agent's grace of 3 s) and end their workers; what still runs after this is killed.
STORE_LOSS_WAIT = 20.0
#: Seconds the first launcher may take to listen on the job's store before it is killed (the job then ends).
STORE_LISTEN_TIMEOUT = 120.0


def live_command(launcher: Sequence[str], spec: JobSpec, num_replicas: int, endpoint: str,
                 max_restarts: int) -> list[str]:
    """The command line of one live launcher of ``spec`` (one replica) on the job's store at ``endpoint``
    (``HOST:PORT``), in a job of ``num_replicas`` replicas; also the Ray backend's in live mode."""
    return [*launcher, "--live", f"--nnodes=1:{max(spec.max_replicas, num_replicas)}", "--nproc-per-node=1",
            f"--max-restarts={max_restarts}", f"--rdzv-endpoint={endpoint}", *spec.command]


def new_secret() -> str:
    """A new secret for one launch of a live job: its launchers sign the job's membership records with it, so
    no other process that reaches its store can steer the job (docs/live.md)."""
    return secrets.token_hex(32)


def secret_environment(secret: str) -> dict[str, str]:
    """The variables that give a live job's launchers its ``secret`` (a secret file named in the executor's own
    environment is overridden: the launchers take one or the other)."""
    return {LIVE_SECRET_VAR: secret, LIVE_SECRET_FILE_VAR: ""}


@dataclass
class LiveLocalHandle:
    """The launchers of one live job: the first hosts the store; removed ones until they have exited."""

    spec: JobSpec
    port: int
    attempt: int
    launchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_paths: list[str] = field(default_factory=list)
    leaving: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: When the first launcher was seen to have failed (monotonic): the others then end with 75, or are killed.
    host_failed_at: float | None = None
    #: Devices of the launchers to start once the first one's store listens, and until when it may take.
    waiting: list[int] = field(default_factory=list)
    listen_deadline: float = 0.0
    #: The secret its launchers sign the job's records with (one per launch).
    secret: str = field(default_factory=new_secret, repr=False)

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
        self._start(handle, assignment.devices[0])
        handle.waiting = list(assignment.devices[1:])  # started by poll once the first one's store listens
        handle.listen_deadline = time.monotonic() + STORE_LISTEN_TIMEOUT
        logger.info("launched %s live with %d replicas (store on port %d)", spec.name, assignment.num_replicas,
                    handle.port)
        return handle

    def _start(self, handle: LiveLocalHandle, device: int) -> None:
        spec = handle.spec
        env = job_environment(spec, [device] if self.cuda else None)
        env.update(secret_environment(handle.secret))
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
        before = len(handle.launchers) + len(handle.waiting)
        wanted = assignment.num_replicas
        for device in assignment.devices[before:]:
            if handle.waiting:
                handle.waiting.append(device)  # with the others, once the store listens
            else:
                self._start(handle, device)
        while len(handle.launchers) + len(handle.waiting) > max(wanted, 1):
            if handle.waiting:
                handle.waiting.pop()  # never started
                continue
            process = handle.launchers.pop()
            signal_group(process.pid, signal.SIGTERM)  # its worker leaves at its next agreed step
            handle.leaving.append(process)
        logger.info("resized %s live from %d to %d replicas", handle.spec.name, before, len(handle.launchers))
        return True

    def poll(self, handle: LiveLocalHandle) -> int | None:
        """The job's status once every launcher exited (see the module docstring); None while one runs."""
        handle.leaving = [process for process in handle.leaving if process.poll() is None]
        code = handle.launchers[0].poll()
        if code is None:
            self._start_waiting(handle)
            return None
        handle.waiting = []  # nothing joins a store that is gone
        host, others = exit_status(code), handle.launchers[1:] + handle.leaving
        if any(process.poll() is None for process in others):
            if host in (0, STOPPED_EXIT) or not self._store_loss_waited(handle, host, others):
                return None  # a host that is done served the store until they were done: they are exiting
        ended = [exit_status(process.returncode) for process in others if process.returncode is not None]
        return live_job_status(host, ended)

    def _start_waiting(self, handle: LiveLocalHandle) -> None:
        """Start the launchers that wait, once the first one's store listens (checked without waiting); kill the
        first one when it does not listen within :data:`STORE_LISTEN_TIMEOUT` s (the job then ends)."""
        if not handle.waiting:
            return
        if _listens(handle.port):
            logger.info("%s: the store listens on port %d; starting %d more launcher(s)", handle.spec.name,
                        handle.port, len(handle.waiting))
            waiting, handle.waiting = handle.waiting, []
            for device in waiting:
                self._start(handle, device)
        elif time.monotonic() > handle.listen_deadline:
            logger.error("%s: the store of its first launcher did not listen on port %d within %.0f s; killing it",
                         handle.spec.name, handle.port, STORE_LISTEN_TIMEOUT)
            handle.waiting = []
            process_tree.kill_group_and_tree(handle.launchers[0].pid)

    def _store_loss_waited(self, handle: LiveLocalHandle, host: int, others: list[subprocess.Popen[bytes]]) -> bool:
        """The first launcher failed (``host``) while others run: whether their :data:`STORE_LOSS_WAIT` is over
        (what still runs is then killed)."""
        now = time.monotonic()
        if handle.host_failed_at is None:
            handle.host_failed_at = now
            logger.warning("%s: the launcher hosting the job's store ended with %d; the others end within seconds "
                           "(75: relaunch)", handle.spec.name, host)
        if now < handle.host_failed_at + STORE_LOSS_WAIT:
            return False
        running = [process for process in others if process.poll() is None]
        logger.warning("%s: %d launcher(s) still ran %.0f s after the one hosting the store ended; killing them",
                       handle.spec.name, len(running), STORE_LOSS_WAIT)
        for process in running:
            process_tree.kill_group_and_tree(process.pid)
        return True

    def stop(self, handle: LiveLocalHandle) -> None:
        handle.waiting = []  # never started
        for process in handle.launchers:
            signal_group(process.pid, signal.SIGTERM)

    def kill(self, handle: LiveLocalHandle) -> None:
        handle.waiting = []
        for process in handle.launchers + handle.leaving:
            process_tree.kill_group_and_tree(process.pid)

    def log_tail(self, handle: LiveLocalHandle, lines: int = 20) -> str:
        return read_tail(handle.log_paths[0], lines)


def _listens(port: int) -> bool:
    """Whether a process of this machine listens on TCP ``port`` now (the job's store, once its host is up)."""
    try:
        return any(conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
                   for conn in psutil.net_connections("tcp"))
    except psutil.Error as error:  # not allowed to read every process's sockets here: take it as listening
        logger.debug("could not read which ports listen: %s", error)
        return True
