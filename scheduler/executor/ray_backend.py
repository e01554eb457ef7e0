"""Ray backend: each job incarnation is a placement group and one launcher actor per node.

An incarnation on an assignment over ``K`` nodes gets a placement group with
one bundle per node, pinned to that node (``bundle_label_selector`` on the
node's ``ray.io/node-id`` label) and holding that node's replicas' slots
(``n_i`` units of the slot resource). One bundle per *node*, not per replica:
an actor can use one bundle only, and the node's launcher actor must hold all
of its node's slots for Ray to hand it the GPU ids. In each bundle a
:class:`~scheduler.executor.ray_node.NodeLauncher` actor runs::

    python -m adaptive.elastic.launcher --nnodes=K --nproc-per-node=n_i --node-rank=i
        --rdzv-backend=c10d --rdzv-endpoint=<first node's IP>:<free port there>
        --rdzv-id=<job>-<attempt> --rdzv-conf=is_host=<1 on the first node, else 0> <command...>

with ``ADAPTIVE_JOB_ID``, ``ADAPTIVE_CHECKPOINT_PATH`` and
``ADAPTIVE_SHARE_PATH`` (on storage every node sees), ``CUDA_VISIBLE_DEVICES``
from Ray's GPU assignment when the slots are GPUs, and output appended to
``<log_dir>/<job>/attempt-<k>.node-<index>.log``.

**Nothing here waits.** The executor's loop calls this backend every step,
so every Ray call it makes returns at once: :meth:`RayBackend.launch` only
asks for the placement group, and each :meth:`RayBackend.poll` advances the
incarnation through its phases (:class:`Phase`: placing -> creating the
actors and reading the rendezvous address -> starting the launchers ->
running) by checking the pending Ray calls with ``ray.wait(timeout=0)``. A
phase not done within ``timeout`` seconds ends that launch alone
(:data:`LAUNCH_FAILED_EXIT`). While it runs, each node's actor is asked for
its launcher's exit status about twice a second: that is also the
heartbeat.

Exit status: ``0`` once every node's launcher exited 0; a node's non-zero
exit ends the incarnation with that status (2, a usage or configuration
error, when one node exited with it; the other nodes are killed),
once every other node has answered a heartbeat sent after that exit: peers
of a lost node fail too, often before the lost node's actor is seen dead,
and their exit must not pass for the job's own crash. A node that is lost
ends the incarnation with :data:`LOST_NODE_EXIT`, which the executor
counts as an infrastructure failure, not the job's: Ray reports the node
dead, or one of its actors raised ``RayActorError`` or did not answer a
heartbeat within ``heartbeat_timeout`` s. In the last two cases the node
becomes suspect in the pool (:meth:`RayPool.suspect
<scheduler.executor.ray_pool.RayPool.suspect>`), so no job is placed on it
until a probe shows it alive. A stop is SIGTERM through the actors to their
process groups (jobs checkpoint and exit 143; one still being launched just
ends with 143), a kill is SIGKILL. The actors and the placement group of an
ended incarnation are released shortly after (once the actors confirmed the
SIGKILL of their process groups, or after :data:`RELEASE_GRACE` s).

In live mode (:mod:`scheduler.executor.ray_live`) each replica of a job is
a one-node incarnation of this backend, started by
:meth:`RayBackend.launch_nodes` with the replica's own command line
(``adaptive-run --live``), log and the job's rendezvous endpoint; resizing
a job adds and ends such incarnations while the others run.

Modules: this one is the backend, the phases and the heartbeats. The record
of an incarnation (:class:`RayHandle`, :class:`Phase`, :data:`NodeCommand`,
re-exported here) is :mod:`scheduler.executor._ray_handle`; reserving the
placement group and the actors and freeing them once the incarnation ended is
:mod:`scheduler.executor._ray_resources`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from scheduler.executor._ray_handle import NodeCommand, Phase, RayHandle
from scheduler.executor._ray_resources import NODE_ID_LABEL, RELEASE_GRACE  # noqa: F401  (importable from here)
from scheduler.executor._ray_resources import Releases, launcher_actor, reserve
from scheduler.executor.backend import (CONFIG_ERROR_EXIT, LAUNCH_FAILED_EXIT, LOST_NODE_EXIT, Assignment, Backend,
                                        read_tail)
from scheduler.executor.jobspec import JobSpec
from scheduler.executor.ray_import import import_ray
from scheduler.executor.ray_pool import RayPool

ray = import_ray()

logger = logging.getLogger(__name__)

__all__ = ["LAUNCH_FAILED_EXIT", "LOST_NODE_EXIT", "NodeCommand", "Phase", "RayBackend", "RayHandle"]

#: Seconds between two heartbeats (exit-status polls) of one node's actor.
HEARTBEAT_INTERVAL = 0.5
#: Seconds after a node's failure from which the other nodes' heartbeats tell a crash from a lost node.
FAILURE_GRACE = 2.0


class RayBackend(Backend):
    """Runs incarnations on a Ray cluster (``ray.init`` must have connected to it).

    Args:
        log_dir: folder for per-attempt, per-node logs (on storage the driver can read).
        pool: the Ray nodes and slots (default: GPUs of all nodes).
        launcher: command prefix taking torchrun's arguments, run on the nodes
            (default: the node's Python running ``-m adaptive.elastic.launcher``).
        timeout: seconds each launch phase may take (placement, actors, start).
        heartbeat_timeout: seconds a node's actor may take to answer a heartbeat before its node is
            taken as lost.
        clock: monotonic time source in seconds.
    """

    def __init__(self, log_dir: str, pool: RayPool | None = None, launcher: Sequence[str] | None = None,
                 timeout: float = 120.0, heartbeat_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 s, got {timeout}")
        if heartbeat_timeout <= 0:
            raise ValueError(f"heartbeat_timeout must be > 0 s, got {heartbeat_timeout}")
        self.log_dir = log_dir
        self.pool = pool or RayPool()
        self.launcher = list(launcher) if launcher else [sys.executable, "-m", "adaptive.elastic.launcher"]
        self.timeout = float(timeout)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.clock = clock
        self._releases = Releases()

    # ---------------------------------------------------------------- Backend
    def alive_nodes(self) -> list[int]:
        self._finish_releases()
        return self.pool.alive_nodes()

    def command(self, spec: JobSpec, num_nodes: int, nproc: int, rank: int, endpoint: str,
                attempt: int) -> list[str]:
        """One node's command line."""
        return [*self.launcher, f"--nnodes={num_nodes}", f"--nproc-per-node={nproc}", f"--node-rank={rank}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={spec.name}-{attempt}",
                f"--rdzv-conf=is_host={1 if rank == 0 else 0}", *spec.command]

    def launch(self, spec: JobSpec, assignment: Assignment, attempt: int) -> RayHandle:
        """Ask for the placement group and return at once; :meth:`poll` does the rest."""
        nodes = sorted(set(assignment.nodes))
        logs = [os.path.join(self.log_dir, spec.name, f"attempt-{attempt}.node-{n}.log") for n in nodes]

        def command(rank: int, nproc: int, endpoint: str) -> list[str]:
            return self.command(spec, len(nodes), nproc, rank, endpoint, attempt)

        return self.launch_nodes(spec, assignment, attempt, command, logs)

    def launch_nodes(self, spec: JobSpec, assignment: Assignment, attempt: int, command: NodeCommand,
                     log_paths: Sequence[str], endpoint: str | None = None, label: str | None = None) -> RayHandle:
        """Like :meth:`launch`, with each node's command line and log given: the node of rank ``i`` (in node
        order) runs ``command(i, its replicas, endpoint)`` with its output appended to ``log_paths[i]``.

        The rendezvous endpoint is ``endpoint`` when given (a running job's), else a free port on the
        first node. ``label`` names the incarnation in the logs and its placement group
        (``<label>-<attempt>``, default ``<job>-<attempt>``: Ray wants each name once).
        :class:`~scheduler.executor.ray_live.LiveRayBackend` runs each replica this way.
        """
        self._finish_releases()
        per_node = Counter(assignment.nodes)
        nodes = tuple(sorted(per_node))
        if len(log_paths) != len(nodes):
            raise ValueError(f"need one log path per node of {list(nodes)}, got {list(log_paths)}")
        handle = RayHandle(spec, attempt, nodes, tuple(per_node[n] for n in nodes), tuple(log_paths), command,
                           deadline=self.clock() + self.timeout, endpoint=endpoint, label=label or spec.name)
        try:
            handle.placement_group = reserve(self.pool, nodes, handle.slots, f"{handle.name}-{attempt}")
            handle.pending = [(0, handle.placement_group.ready())]
        except (KeyError, ValueError, ray.exceptions.RayError) as exc:
            logger.error("%s attempt %d could not be placed on nodes %s: %s", handle.name, attempt, list(nodes),
                         exc)
            self._end(handle, LAUNCH_FAILED_EXIT)
            return handle
        logger.info("%s attempt %d: placing %s", handle.name, attempt,
                    ", ".join(f"node {n} x{k}" for n, k in zip(nodes, handle.slots)))
        return handle

    def poll(self, handle: RayHandle) -> int | None:
        """Advance ``handle`` by what its pending Ray calls answered; its exit status once it ended."""
        self._finish_releases()
        if handle.exit_code is not None:
            return handle.exit_code
        lost = [n for n in handle.nodes if not self.pool.usable(n)]
        if lost:
            logger.warning("%s attempt %d: node(s) %s lost while %s", handle.name, handle.attempt, lost,
                           handle.phase.value)
            return self._end(handle, LOST_NODE_EXIT)
        step = {Phase.PLACING: self._placing, Phase.CREATING: self._creating, Phase.STARTING: self._starting,
                Phase.RUNNING: self._running}[handle.phase]
        return step(handle)

    def stop(self, handle: RayHandle) -> None:
        """SIGTERM to the launchers; an incarnation still being launched just ends (exit 143)."""
        if handle.exit_code is not None:
            return
        handle.stopping = True
        if handle.phase is Phase.RUNNING:
            self._signal(handle, signal.SIGTERM)
        else:
            logger.info("%s attempt %d stopped while %s", handle.name, handle.attempt, handle.phase.value)
            self._end(handle, 128 + signal.SIGTERM)

    def kill(self, handle: RayHandle) -> None:
        if handle.exit_code is None:
            self._end(handle, 128 + signal.SIGKILL)

    def describe(self) -> list[dict[str, Any]]:
        """The pool's nodes (with their state: alive, suspect, lost), for the status file."""
        return self.pool.describe()

    def log_tail(self, handle: RayHandle, lines: int = 20) -> str:
        """The last ``lines`` lines of the incarnation's logs: of the nodes that failed, else of every node."""
        failed = [i for i, code in handle.codes.items() if code not in (0, 143)]
        positions = failed or list(range(len(handle.nodes)))
        parts = []
        for i in positions:
            text = read_tail(handle.log_paths[i], lines)
            if text and len(handle.nodes) > 1:
                parts.append(f"--- node {handle.nodes[i]} ({os.path.basename(handle.log_paths[i])})")
            if text:
                parts.append(text)
        return "\n".join(parts)

    def close(self, timeout: float = 10.0) -> None:
        """Free what ended incarnations still hold, waiting up to ``timeout`` s for their SIGKILLs."""
        deadline = self.clock() + timeout
        while self._releases and self.clock() < deadline:
            self._finish_releases()
            time.sleep(0.05)
        self._finish_releases(force=True)

    # ------------------------------------------------------------ the phases
    def _placing(self, handle: RayHandle) -> int | None:
        answered = self._answered(handle)
        if answered is None:
            return self._check_deadline(handle, "placement group ready")
        for i in range(len(handle.nodes)):
            handle.actors.append(launcher_actor(handle.placement_group, i, handle.slots[i], self.pool.resource))
        handle.pending = [] if handle.endpoint else [(0, handle.actors[0].address.remote())]
        if self.pool.resource == "GPU":
            handle.pending += [(i, actor.gpu_ids.remote()) for i, actor in enumerate(handle.actors)]
        self._next_phase(handle, Phase.CREATING)
        return None

    def _creating(self, handle: RayHandle) -> int | None:
        answered = self._answered(handle)
        if answered is None:
            return self._check_deadline(handle, "actors created")
        if handle.endpoint is None:
            ip, port = answered.pop(0)
            handle.endpoint = f"{ip}:{port}"
        handle.gpus = dict(enumerate(answered))
        spec = handle.spec
        base_env = dict(spec.env)
        base_env.update({"ADAPTIVE_JOB_ID": spec.name, "ADAPTIVE_CHECKPOINT_PATH": spec.checkpoint_dir,
                         "ADAPTIVE_SHARE_PATH": spec.share_dir})
        os.makedirs(spec.checkpoint_dir, exist_ok=True)
        handle.pending = []
        for rank, (actor, nproc, log) in enumerate(zip(handle.actors, handle.slots, handle.log_paths)):
            env = dict(base_env)
            if rank in handle.gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(handle.gpus[rank])
            cmd = handle.command(rank, nproc, handle.endpoint)
            handle.pending.append((rank, actor.start.remote(cmd, env, log)))
        self._next_phase(handle, Phase.STARTING)
        return None

    def _starting(self, handle: RayHandle) -> int | None:
        answered = self._answered(handle)
        if answered is None:
            return self._check_deadline(handle, "launchers started")
        handle.pids = tuple(answered)
        logger.info("launched %s attempt %d: %s (rendezvous %s, pids %s)", handle.name, handle.attempt,
                    ", ".join(f"node {n} x{k}" for n, k in zip(handle.nodes, handle.slots)), handle.endpoint,
                    list(handle.pids))
        self._next_phase(handle, Phase.RUNNING)
        return None

    def _running(self, handle: RayHandle) -> int | None:
        now = self.clock()
        if now >= handle.next_heartbeat:
            for i, actor in enumerate(handle.actors):
                if i not in handle.codes and i not in handle.heartbeats:
                    handle.heartbeats[i] = (actor.poll.remote(), now)
            handle.next_heartbeat = now + HEARTBEAT_INTERVAL
        refs = [ref for ref, _ in handle.heartbeats.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for i, (ref, sent) in sorted(handle.heartbeats.items()):
            if ref in ready:
                del handle.heartbeats[i]
                try:
                    code = ray.get(ref, timeout=0)
                except ray.exceptions.RayError as exc:
                    return self._failed(handle, i, exc)
                handle.answered[i] = sent
                if code is not None:
                    handle.codes[i] = code
                    logger.info("%s attempt %d: node %d's launcher exited %d", handle.name, handle.attempt,
                                handle.nodes[i], code)
            elif now - sent > self.heartbeat_timeout:
                return self._unresponsive(handle, i, now - sent)
        return self._exit_status(handle, now)

    # ------------------------------------------------------------- internals
    def _answered(self, handle: RayHandle) -> list[Any] | None:
        """The results of the phase's pending calls, in order, once all are ready; ``None`` before, or
        when one raised (the handle then ended, see :meth:`_failed`)."""
        refs = [ref for _, ref in handle.pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        if len(ready) < len(refs):
            return None
        results = []
        for position, ref in handle.pending:
            try:
                results.append(ray.get(ref, timeout=0))
            except ray.exceptions.RayError as exc:
                self._failed(handle, position, exc)
                return None
        return results

    def _next_phase(self, handle: RayHandle, phase: Phase) -> None:
        handle.phase, handle.deadline = phase, self.clock() + self.timeout

    def _check_deadline(self, handle: RayHandle, what: str) -> int | None:
        if handle.exit_code is not None:  # a pending call failed (see _answered)
            return handle.exit_code
        if self.clock() < handle.deadline:
            return None
        logger.error("%s attempt %d could not start on nodes %s: not %s within %.0f s", handle.name,
                     handle.attempt, list(handle.nodes), what, self.timeout)
        return self._end(handle, LAUNCH_FAILED_EXIT)

    def _failed(self, handle: RayHandle, position: int, exc: BaseException) -> int:
        """A Ray call of ``handle`` raised: a dead actor makes its node suspect (lost node), anything else
        fails the launch."""
        node = handle.nodes[position]
        if isinstance(exc, ray.exceptions.RayActorError):
            self.pool.suspect(node, f"{handle.name} attempt {handle.attempt}: its actor failed "
                                    f"({type(exc).__name__})")
            return self._end(handle, LOST_NODE_EXIT)
        logger.error("%s attempt %d on node %d failed while %s: %s", handle.name, handle.attempt, node,
                     handle.phase.value, exc)
        return self._end(handle, LAUNCH_FAILED_EXIT)

    def _unresponsive(self, handle: RayHandle, position: int, waited: float) -> int:
        node = handle.nodes[position]
        self.pool.suspect(node, f"{handle.name} attempt {handle.attempt}: its actor did not answer a heartbeat "
                                f"for {waited:.1f} s")
        return self._end(handle, LOST_NODE_EXIT)

    def _exit_status(self, handle: RayHandle, now: float) -> int | None:
        """The incarnation's status from its nodes' exits so far (``None``: still running).

        A node's failure ends the incarnation only once every other node that still runs has answered a
        heartbeat sent :data:`FAILURE_GRACE` seconds or more after it: a lost node makes its peers fail
        too, often before its own actor is seen dead (an actor can answer for a moment after its node's
        raylet died), and that must read as the lost node (an infrastructure failure), not as the job's
        crash.
        """
        codes = handle.codes
        failed = [c for c in codes.values() if c not in (0, 143)]
        if failed or (codes and not handle.stopping and 143 in codes.values()):
            if handle.failed_at is None:
                handle.failed_at, handle.next_heartbeat = now, now  # confirm the others at once
            running = [i for i in range(len(handle.actors)) if i not in codes]
            confirmed_after = handle.failed_at + FAILURE_GRACE
            if any(handle.answered.get(i, -math.inf) < confirmed_after for i in running):
                return None
            if CONFIG_ERROR_EXIT in failed:  # its peers failed because of it: a relaunch would end the same way
                return self._end(handle, CONFIG_ERROR_EXIT)
            return self._end(handle, failed[0] if failed else 143)
        if len(codes) < len(handle.actors):
            return None
        seen = set(codes.values())
        return self._end(handle, 0 if seen == {0} else 143 if seen == {143} else 1)

    def _signal(self, handle: RayHandle, sig: signal.Signals) -> None:
        for actor in handle.actors:
            actor.signal.remote(int(sig))  # fire and forget: returns at once; a dead actor is seen by poll

    def _end(self, handle: RayHandle, code: int) -> int:
        handle.exit_code, handle.phase = code, Phase.ENDED
        handle.pending, handle.heartbeats = [], {}
        self._release(handle)
        logger.info("%s attempt %d ended with %d", handle.name, handle.attempt, code)
        return code

    def _release(self, handle: RayHandle) -> None:
        """SIGKILL what may still run; the actors and the placement group go once that is confirmed."""
        self._releases.release(handle, self.clock())

    def _finish_releases(self, force: bool = False) -> None:
        self._releases.finish(self.clock(), force)
