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

Exit status: ``0`` once every node's launcher exited 0; a node's non-zero
exit ends the incarnation with that status (the other nodes are killed); a
lost actor or node ends it with :data:`LOST_NODE_EXIT`, a crash, so the
executor relaunches the job from its checkpoint. A stop is SIGTERM through
the actors to their process groups (jobs checkpoint and exit 143), a kill is
SIGKILL; the placement group and actors of an ended incarnation are always
released.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.executor.backend import Assignment, Backend
from scheduler.executor.jobspec import JobSpec
from scheduler.executor.ray_import import import_ray
from scheduler.executor.ray_pool import RayPool

ray = import_ray()
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from scheduler.executor.ray_node import NodeLauncher  # noqa: E402

logger = logging.getLogger(__name__)

#: Exit status of an incarnation whose actor or node was lost (a crash: the job is relaunched).
LOST_NODE_EXIT = 75
#: Exit status of an incarnation that could not be started (no placement in time, actor errors).
LAUNCH_FAILED_EXIT = 70
#: Ray's label with a node's id, which pins a bundle to that node.
NODE_ID_LABEL = "ray.io/node-id"

_RemoteLauncher = ray.remote(NodeLauncher)


@dataclass
class RayHandle:
    """One incarnation: its placement group, actors (one per node) and state."""

    name: str
    attempt: int
    nodes: tuple[int, ...]
    log_paths: tuple[str, ...]
    placement_group: Any = None
    actors: list[Any] = field(default_factory=list)
    exit_code: int | None = None
    stopping: bool = False
    codes: dict[int, int] = field(default_factory=dict)


class RayBackend(Backend):
    """Runs incarnations on a Ray cluster (``ray.init`` must have connected to it).

    Args:
        log_dir: folder for per-attempt, per-node logs (on storage the driver can read).
        pool: the Ray nodes and slots (default: GPUs of all nodes).
        launcher: command prefix taking torchrun's arguments, run on the nodes
            (default: the node's Python running ``-m adaptive.elastic.launcher``).
        timeout: seconds to wait for a placement group or an actor call.
    """

    def __init__(self, log_dir: str, pool: RayPool | None = None, launcher: Sequence[str] | None = None,
                 timeout: float = 120.0):
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 s, got {timeout}")
        self.log_dir = log_dir
        self.pool = pool or RayPool()
        self.launcher = list(launcher) if launcher else [sys.executable, "-m", "adaptive.elastic.launcher"]
        self.timeout = float(timeout)

    # ---------------------------------------------------------------- Backend
    def alive_nodes(self) -> list[int]:
        return self.pool.alive_nodes()

    def command(self, spec: JobSpec, num_nodes: int, nproc: int, rank: int, endpoint: str,
                attempt: int) -> list[str]:
        """One node's command line."""
        return [*self.launcher, f"--nnodes={num_nodes}", f"--nproc-per-node={nproc}", f"--node-rank={rank}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={spec.name}-{attempt}",
                f"--rdzv-conf=is_host={1 if rank == 0 else 0}", *spec.command]

    def launch(self, spec: JobSpec, assignment: Assignment, attempt: int) -> RayHandle:
        per_node = Counter(assignment.nodes)
        nodes = tuple(sorted(per_node))
        logs = tuple(os.path.join(self.log_dir, spec.name, f"attempt-{attempt}.node-{n}.log") for n in nodes)
        handle = RayHandle(spec.name, attempt, nodes, logs)
        try:
            self._start(handle, spec, per_node)
        except Exception as exc:  # noqa: BLE001 - any failure to start is this incarnation's crash
            logger.error("%s attempt %d could not start on nodes %s: %s", spec.name, attempt, list(nodes), exc)
            self._release(handle, signal.SIGKILL)
            handle.exit_code = LAUNCH_FAILED_EXIT
        return handle

    def poll(self, handle: RayHandle) -> int | None:
        if handle.exit_code is not None:
            return handle.exit_code
        pending = [i for i in range(len(handle.actors)) if i not in handle.codes]
        refs = [handle.actors[i].poll.remote() for i in pending]
        try:
            codes = ray.get(refs, timeout=self.timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            logger.warning("%s attempt %d lost a node actor (%s)", handle.name, handle.attempt,
                           type(exc).__name__)
            return self._end(handle, LOST_NODE_EXIT)
        for i, code in zip(pending, codes):
            if code is not None:
                handle.codes[i] = code
                logger.info("%s attempt %d: node %d's launcher exited %d", handle.name, handle.attempt,
                            handle.nodes[i], code)
        failed = [c for c in handle.codes.values() if c not in (0, 143)]
        if failed or (handle.codes and not handle.stopping and 143 in handle.codes.values()):
            return self._end(handle, failed[0] if failed else 143)
        if len(handle.codes) < len(handle.actors):
            return None
        codes_seen = set(handle.codes.values())
        return self._end(handle, 0 if codes_seen == {0} else 143 if codes_seen == {143} else 1)

    def stop(self, handle: RayHandle) -> None:
        handle.stopping = True
        self._signal(handle, signal.SIGTERM)

    def kill(self, handle: RayHandle) -> None:
        if handle.exit_code is None:
            self._end(handle, 128 + signal.SIGKILL)

    def describe(self) -> list[dict[str, Any]]:
        """The pool's nodes, for the status file."""
        return [n.public() for n in self.pool.nodes()]

    # -------------------------------------------------------------- internals
    def _start(self, handle: RayHandle, spec: JobSpec, per_node: Counter) -> None:
        ray_nodes = [self.pool.node(n) for n in handle.nodes]
        bundles = [self._resources(per_node[n]) for n in handle.nodes]
        handle.placement_group = placement_group(
            bundles, strategy="PACK", name=f"{spec.name}-{handle.attempt}",
            bundle_label_selector=[{NODE_ID_LABEL: node.node_id} for node in ray_nodes])
        ray.get(handle.placement_group.ready(), timeout=self.timeout)
        for i, node in enumerate(handle.nodes):
            resources = self._resources(per_node[node])
            options: dict[str, Any] = {"num_cpus": resources.pop("CPU", 0), "num_gpus": resources.pop("GPU", 0),
                                       "resources": resources, "max_restarts": 0, "max_concurrency": 4,
                                       "scheduling_strategy": PlacementGroupSchedulingStrategy(
                                           handle.placement_group, placement_group_bundle_index=i)}
            handle.actors.append(_RemoteLauncher.options(**options).remote())
        ip, port = ray.get(handle.actors[0].address.remote(), timeout=self.timeout)
        endpoint = f"{ip}:{port}"
        base_env = dict(spec.env)
        base_env.update({"ADAPTIVE_JOB_ID": spec.name, "ADAPTIVE_CHECKPOINT_PATH": spec.checkpoint_dir,
                         "ADAPTIVE_SHARE_PATH": spec.share_dir})
        os.makedirs(spec.checkpoint_dir, exist_ok=True)
        starts = []
        for rank, (node, actor, log) in enumerate(zip(handle.nodes, handle.actors, handle.log_paths)):
            env = dict(base_env)
            if self.pool.resource == "GPU":
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ray.get(actor.gpu_ids.remote(), timeout=self.timeout))
            cmd = self.command(spec, len(handle.nodes), per_node[node], rank, endpoint, handle.attempt)
            starts.append(actor.start.remote(cmd, env, log))
        pids = ray.get(starts, timeout=self.timeout)
        logger.info("launched %s attempt %d: %s (rendezvous %s, pids %s)", spec.name, handle.attempt,
                    ", ".join(f"node {n} x{per_node[n]}" for n in handle.nodes), endpoint, pids)

    def _resources(self, slots: int) -> dict[str, float]:
        return {self.pool.resource: float(slots)}

    def _signal(self, handle: RayHandle, sig: signal.Signals) -> None:
        for actor in handle.actors:
            actor.signal.remote(int(sig))  # fire and forget: returns at once; a dead actor is seen by poll

    def _end(self, handle: RayHandle, code: int) -> int:
        handle.exit_code = code
        self._release(handle, signal.SIGKILL)
        logger.info("%s attempt %d ended with %d", handle.name, handle.attempt, code)
        return code

    def _release(self, handle: RayHandle, sig: signal.Signals) -> None:
        """Kill what may still run, then free the actors and the placement group."""
        waits = []
        for actor in handle.actors:
            waits.append(actor.signal.remote(int(sig)))
        if waits:
            try:
                ray.wait(waits, num_returns=len(waits), timeout=min(self.timeout, 10.0))
            except ray.exceptions.RayError:
                pass
        for actor in handle.actors:
            try:
                ray.kill(actor, no_restart=True)
            except ray.exceptions.RayError as exc:
                logger.debug("%s: actor already gone: %s", handle.name, exc)
        handle.actors = []
        if handle.placement_group is not None:
            try:
                remove_placement_group(handle.placement_group)
            except ray.exceptions.RayError as exc:
                logger.debug("%s: placement group already gone: %s", handle.name, exc)
            handle.placement_group = None
