"""Ray backend in live mode: jobs are resized on a Ray cluster while they train (``adaptive-run --live``).

A job with ``N`` replicas runs as ``N`` live launchers, one worker each,
each in a Ray actor on its replica's node. Each replica is a one-node,
one-slot incarnation of :class:`~scheduler.executor.ray_backend.RayBackend`
(started with :meth:`RayBackend.launch_nodes
<scheduler.executor.ray_backend.RayBackend.launch_nodes>`): a placement group
of one bundle pinned to the node, a
:class:`~scheduler.executor.ray_node.NodeLauncher` actor in it running::

    python -m adaptive.elastic.launcher --live --nnodes=1:MAX --nproc-per-node=1 \\
        --max-restarts=R --rdzv-endpoint=HOST:PORT <command...>

with the job's environment (``CUDA_VISIBLE_DEVICES`` from Ray's GPU
assignment), output appended to
``<log_dir>/<job>/attempt-<k>.replica-<i>.log``, heartbeats, lost-node
detection and the release of its actor and placement group once it ended,
all as the Ray backend does for a node of a job.

**The store.** The first replica (the *host*) gets a free port on its node:
its launcher hosts the job's TCPStore there. The others (*joiners*) are
started with that endpoint, and only once the store listens (the host's
actor is asked, without waiting: :meth:`NodeLauncher.serves
<scheduler.executor.ray_node.NodeLauncher.serves>`), so that the first
launcher is the one that hosts it.

**Resizing** (:meth:`LiveRayBackend.resize`) matches the replicas by node
(the assignment's devices are not used: Ray assigns the GPUs): each node
keeps its oldest replicas; the newest ones that the assignment no longer
has get SIGTERM, and their workers leave at their next agreed step while
the others keep training (each one's actor and placement group go once its
launcher exited; until then Ray still holds its slot, so a job placed there
meanwhile waits in its placement); the nodes that gain replicas get joiners,
whose workers join the running job and take the state from their peers (see
docs/live.md). A resize that would remove the host (no replica left on its
node) is refused: the executor stops and relaunches the job instead.

**Exit status**: the host's, once its launcher exited (it serves the store
until every other launcher is done; what is left of the others is then
killed). When the host's launcher fails (killed: 137), the store went with
it: the joiners end within seconds with 75, and the job's status is 75
(:func:`~scheduler.executor.backend.live_job_status`), which the executor
relaunches at once as an infrastructure failure; joiners still running
:data:`STORE_LOSS_WAIT` seconds after the host failed are killed and the
job ends with the host's status. A joiner that exits 0 or 143 is done; a joiner that fails, that
cannot be launched, or whose node is lost ends the whole job with its status
(:data:`~scheduler.executor.backend.LOST_NODE_EXIT` for a lost node, which
the executor relaunches as an infrastructure failure). A stop is SIGTERM to
every launcher (every member leaves at once: the job checkpoints and exits
143); a kill kills every replica.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.executor.backend import LAUNCH_FAILED_EXIT, STORE_LOST_EXIT, Assignment, Backend, live_job_status
from scheduler.executor.jobspec import JobSpec
from scheduler.executor.local_live import live_command, new_secret, secret_environment
from scheduler.executor.ray_backend import Phase, RayBackend, RayHandle
from scheduler.executor.ray_import import import_ray
from scheduler.executor.ray_pool import RayPool

ray = import_ray()

logger = logging.getLogger(__name__)

__all__ = ["LiveRayBackend", "LiveRayHandle", "Replica"]

#: Exit statuses after which a launcher is done (finished, or left), not failed.
DONE_EXIT_CODES = (0, 128 + signal.SIGTERM)
#: Seconds the other launchers get to exit on their own once the host's launcher is done (it serves the
#: store until they are done: they are exiting), before what is left of them is killed.
FINISH_GRACE = 5.0
#: Seconds the other launchers get to end (with 75: relaunch) once the host's launcher failed and took the job's
#: store with it: they notice within about 4 s (the live agent's grace of 3 s) and end their workers.
STORE_LOSS_WAIT = 20.0


@dataclass
class Replica:
    """One replica of a live job: its node, its number (its log's name), its one-node incarnation."""

    node: int
    number: int
    #: ``None`` while it waits for the host's store to listen (a joiner of a job just launched).
    incarnation: RayHandle | None = None


@dataclass
class LiveRayHandle:
    """The replicas of one live job: the first hosts the store; removed ones until they have exited."""

    spec: JobSpec
    attempt: int
    #: The job's replicas, oldest first; ``replicas[0]`` is the host.
    replicas: list[Replica] = field(default_factory=list)
    leaving: list[Replica] = field(default_factory=list)
    #: Replicas started so far (the next one's number).
    started: int = 0
    #: The host's store listens: joiners may start.
    serving: bool = False
    #: The outstanding :meth:`NodeLauncher.serves` call (an ``ObjectRef``), and until when the store may take
    #: to listen.
    probe: Any = None
    serve_deadline: float | None = None
    stopping: bool = False
    #: When the host's launcher was seen done (the others then get :data:`FINISH_GRACE` s to exit), or failed
    #: (they then get :data:`STORE_LOSS_WAIT` s to end with 75).
    host_done_at: float | None = None
    exit_code: int | None = None
    #: The replica whose exit ended the job.
    ended_by: Replica | None = None
    #: The secret its launchers sign the job's records with (one per launch).
    secret: str = field(default_factory=new_secret, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host(self) -> Replica:
        return self.replicas[0]


class LiveRayBackend(Backend):
    """Runs jobs as live launchers on a Ray cluster and resizes them in place (``ray.init`` must have
    connected to it).

    Args:
        log_dir: folder for the replicas' logs (``<job>/attempt-<k>.replica-<i>.log``).
        pool: the Ray nodes and slots (default: GPUs of all nodes).
        launcher: command prefix that takes ``adaptive-run``'s arguments, run on the nodes
            (default: the node's Python running ``-m adaptive.elastic.launcher``).
        max_restarts: restarts of a failed worker per launcher.
        timeout: seconds each launch phase of a replica may take, and the host's store to listen.
        heartbeat_timeout: seconds a replica's actor may take to answer a heartbeat before its node is
            taken as lost.
        clock: monotonic time source in seconds.
    """

    def __init__(self, log_dir: str, pool: RayPool | None = None, launcher: Sequence[str] | None = None,
                 max_restarts: int = 3, timeout: float = 120.0, heartbeat_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log_dir = log_dir
        self.max_restarts = int(max_restarts)
        #: Runs each replica as a one-node incarnation.
        self.ray_backend = RayBackend(log_dir, pool, launcher, timeout=timeout,
                                      heartbeat_timeout=heartbeat_timeout, clock=clock)

    @property
    def pool(self) -> RayPool:
        return self.ray_backend.pool

    # ---------------------------------------------------------------- Backend
    def alive_nodes(self) -> list[int]:
        return self.ray_backend.alive_nodes()

    def describe(self) -> list[dict[str, Any]]:
        """The pool's nodes (with their state: alive, suspect, lost), for the status file."""
        return self.ray_backend.describe()

    def command(self, spec: JobSpec, num_replicas: int, endpoint: str) -> list[str]:
        """The command line of one of the job's launchers (one replica each)."""
        return live_command(self.ray_backend.launcher, spec, num_replicas, endpoint, self.max_restarts)

    def launch(self, spec: JobSpec, assignment: Assignment, attempt: int) -> LiveRayHandle:
        """Start the host on the assignment's first node at once; the joiners once its store listens."""
        handle = LiveRayHandle(spec, attempt)
        for node in assignment.nodes:
            self._add(handle, node)
        logger.info("%s attempt %d: launching live with %d replica(s) on node(s) %s", spec.name, attempt,
                    assignment.num_replicas, list(assignment.nodes))
        return handle

    def poll(self, handle: LiveRayHandle) -> int | None:
        """Advance every replica; the job's exit status once it ended (see the module docstring)."""
        if handle.exit_code is not None:
            return handle.exit_code
        for replica in list(handle.leaving):
            code = self._poll(replica)
            if code is not None:
                handle.leaving.remove(replica)
                logger.info("%s: replica %d (node %d) left with %d", handle.name, replica.number, replica.node,
                            code)
        code = self._poll(handle.host)
        if code is not None:
            return self._host_exited(handle, code)
        for replica in handle.replicas[1:]:
            code = self._poll(replica)
            if code is not None and code not in DONE_EXIT_CODES:
                logger.warning("%s: replica %d (node %d) ended with %d; ending the job", handle.name,
                               replica.number, replica.node, code)
                return self._end(handle, code, replica)
        return self._start_joiners(handle)

    def resize(self, handle: LiveRayHandle, assignment: Assignment) -> bool:
        """Grow or shrink the running job to ``assignment`` (replicas matched by node) without stopping it;
        False where that would remove the host (or the job is ending)."""
        if handle.exit_code is not None or handle.stopping:
            return False
        wanted = Counter(assignment.nodes)
        if wanted[handle.host.node] == 0:
            logger.info("%s: no replica left on node %d, whose replica hosts the job's store: restarting the "
                        "job instead of resizing it live", handle.name, handle.host.node)
            return False
        before = [replica.node for replica in handle.replicas]
        have = Counter(before)
        for replica in reversed(handle.replicas[1:]):  # the newest leave first
            if have[replica.node] > wanted[replica.node]:
                have[replica.node] -= 1
                self._remove(handle, replica)
        for node in assignment.nodes:
            if have[node] < wanted[node]:
                have[node] += 1
                self._add(handle, node)
        after = [replica.node for replica in handle.replicas]
        if after != before:
            logger.info("%s: resizing live from %d to %d replicas (on nodes %s)", handle.name, len(before),
                        len(after), after)
        return True

    def stop(self, handle: LiveRayHandle) -> None:
        """SIGTERM to every launcher; replicas still being launched just end (exit 143)."""
        if handle.exit_code is not None:
            return
        handle.stopping = True
        for replica in list(handle.replicas):
            if replica.incarnation is None:  # a joiner waiting for the store: never started
                handle.replicas.remove(replica)
            else:
                self.ray_backend.stop(replica.incarnation)

    def kill(self, handle: LiveRayHandle) -> None:
        if handle.exit_code is None:
            self._end(handle, 128 + signal.SIGKILL, None)

    def log_tail(self, handle: LiveRayHandle, lines: int = 20) -> str:
        """The last ``lines`` lines of the log of the replica whose exit ended the job (else the host's)."""
        replica = handle.ended_by or handle.host
        if replica.incarnation is None:
            return ""
        text = self.ray_backend.log_tail(replica.incarnation, lines)
        if text and handle.started > 1:
            name = os.path.basename(replica.incarnation.log_paths[0])
            return f"--- replica {replica.number} on node {replica.node} ({name})\n{text}"
        return text

    def close(self, timeout: float = 10.0) -> None:
        """Free what ended replicas still hold (see :meth:`RayBackend.close`)."""
        self.ray_backend.close(timeout)

    # ------------------------------------------------------------- internals
    def _add(self, handle: LiveRayHandle, node: int) -> None:
        """A new replica on ``node``: the host at once, a joiner once the host's store listens."""
        replica = Replica(node, handle.started)
        handle.started += 1
        handle.replicas.append(replica)
        if replica is handle.host or handle.serving:
            self._place(handle, replica)

    def _place(self, handle: LiveRayHandle, replica: Replica) -> None:
        """Launch ``replica``'s one-node incarnation: the host on a free port of its node, a joiner on the
        host's endpoint."""
        spec, size, host = handle.spec, len(handle.replicas), handle.host.incarnation
        endpoint = None if replica is handle.host or host is None else host.endpoint
        log = os.path.join(self.log_dir, spec.name, f"attempt-{handle.attempt}.replica-{replica.number}.log")

        def command(_rank: int, _nproc: int, endpoint: str) -> list[str]:
            return self.command(spec, size, endpoint)

        signed = dataclasses.replace(spec, env={**spec.env, **secret_environment(handle.secret)})
        replica.incarnation = self.ray_backend.launch_nodes(
            signed, Assignment((replica.node,), (0,)), handle.attempt, command, [log], endpoint=endpoint,
            label=f"{spec.name}.replica-{replica.number}")

    def _remove(self, handle: LiveRayHandle, replica: Replica) -> None:
        """Take ``replica`` out of the job: SIGTERM to its launcher (one still being launched just ends)."""
        handle.replicas.remove(replica)
        if replica.incarnation is None:
            return
        self.ray_backend.stop(replica.incarnation)
        handle.leaving.append(replica)

    def _poll(self, replica: Replica) -> int | None:
        return None if replica.incarnation is None else self.ray_backend.poll(replica.incarnation)

    def _host_exited(self, handle: LiveRayHandle, code: int) -> int | None:
        """The job's status is the host's, once the others exited too; a host that failed is
        :meth:`_host_failed`."""
        if code not in DONE_EXIT_CODES:
            return self._host_failed(handle, code)
        now = self.ray_backend.clock()
        if handle.host_done_at is None:
            handle.host_done_at = now
        running = [r.number for r in handle.replicas[1:] + handle.leaving
                   if r.incarnation is not None and self._poll(r) is None]
        if running and now < handle.host_done_at + FINISH_GRACE:
            return None
        if running:
            logger.warning("%s: replica(s) %s still ran %.0f s after the launcher hosting the store exited",
                           handle.name, running, FINISH_GRACE)
        return self._end(handle, code, handle.host)

    def _host_failed(self, handle: LiveRayHandle, code: int) -> int | None:
        """The host's launcher failed with ``code`` and took the job's store with it: the job ends with 75 once
        a joiner ended with it (relaunch, :func:`~scheduler.executor.backend.live_job_status`), with ``code``
        when none did within :data:`STORE_LOSS_WAIT` s, at once when ``code`` stands whatever they say."""
        now = self.ray_backend.clock()
        if handle.host_done_at is None:
            handle.host_done_at = now
        if live_job_status(code, [STORE_LOST_EXIT]) == code:  # a configuration error, a fencing, a lost node
            return self._end(handle, code, handle.host)
        joiners = [(replica, self._poll(replica)) for replica in handle.replicas[1:] + handle.leaving
                   if replica.incarnation is not None]
        lost_store = next((replica for replica, ended in joiners if ended == STORE_LOST_EXIT), None)
        if lost_store is not None:
            logger.warning("%s: the launcher hosting the job's store ended with %d and the store with it; replica %d "
                           "ended with %d: relaunch", handle.name, code, lost_store.number, STORE_LOST_EXIT)
            return self._end(handle, STORE_LOST_EXIT, lost_store)
        if any(ended is None for _, ended in joiners) and now < handle.host_done_at + STORE_LOSS_WAIT:
            return None  # the joiners notice the loss of the store within seconds
        return self._end(handle, code, handle.host)

    def _start_joiners(self, handle: LiveRayHandle) -> int | None:
        """Place the joiners that wait, once the host's store listens (checked without waiting); ends the
        job when it does not listen within the backend's timeout of the host's launcher start."""
        waiting = [replica for replica in handle.replicas if replica.incarnation is None]
        host = handle.host.incarnation
        if not waiting or host is None or host.phase is not Phase.RUNNING:
            return None
        if not handle.serving:
            if handle.serve_deadline is None:
                handle.serve_deadline = self.ray_backend.clock() + self.ray_backend.timeout
            handle.serving = self._store_listens(handle, host)
            if not handle.serving:
                if self.ray_backend.clock() < handle.serve_deadline:
                    return None
                logger.error("%s attempt %d: the store of its first replica did not listen on %s within %.0f s",
                             handle.name, handle.attempt, host.endpoint, self.ray_backend.timeout)
                return self._end(handle, LAUNCH_FAILED_EXIT, handle.host)
            logger.info("%s attempt %d: the store listens on %s; starting %d joiner(s)", handle.name,
                        handle.attempt, host.endpoint, len(waiting))
        for replica in waiting:
            self._place(handle, replica)
        return None

    def _store_listens(self, handle: LiveRayHandle, host: RayHandle) -> bool:
        """Whether the host's actor said its store listens; sends that question when none is out."""
        if handle.probe is not None:
            if not ray.wait([handle.probe], timeout=0)[0]:
                return False
            probe, handle.probe = handle.probe, None
            try:
                if ray.get(probe, timeout=0):
                    return True
            except ray.exceptions.RayError as exc:  # the host's heartbeats tell what happened to its actor
                logger.debug("%s: could not ask whether the store listens: %s", handle.name, exc)
        if host.actors and host.endpoint:
            handle.probe = host.actors[0].serves.remote(int(host.endpoint.rpartition(":")[2]))
        return False

    def _end(self, handle: LiveRayHandle, code: int, by: Replica | None) -> int:
        """End the job with ``code``: kill what is left of every replica (released shortly after)."""
        handle.exit_code, handle.ended_by, handle.probe = code, by, None
        for replica in handle.replicas + handle.leaving:
            if replica.incarnation is not None:
                self.ray_backend.kill(replica.incarnation)
        handle.leaving = []
        logger.info("%s attempt %d (live) ended with %d", handle.name, handle.attempt, code)
        return code
