"""The Ray cluster as the executor's pool of nodes and slots.

Every alive Ray node that has the slot resource (``GPU`` by default; ``CPU``
or a custom resource such as ``slot`` where there are no GPUs) is a node of
the pool. A node's index is given the first time it is seen and never
reused, so that the executor's assignments stay valid while other nodes come
and go. :class:`~scheduler.cluster.ClusterSpec` is homogeneous: every node
offers the same number of slots, the smallest any node has (or fewer, with
``slots_per_node``).

**Suspect nodes.** Ray marks a node dead only after its health checks have
failed for a while (tens of seconds); the backend usually knows sooner,
because the node's actors stop answering. Such a node is *suspect*
(:meth:`RayPool.suspect`) from that moment: :meth:`RayPool.alive_nodes`
leaves it out, so the executor places nothing on it and ends what runs
there. A suspicion is cleared only when a probe pinned to the node (a
zero-CPU task with a hard node affinity, sent and checked without ever
waiting) answers from it; a node that Ray reports dead stays out for good,
since a dead Ray node never comes back under the same id.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from scheduler.cluster import ClusterSpec
from scheduler.executor.ray_import import import_ray

logger = logging.getLogger(__name__)

#: Seconds between two probes of a suspect node whose last probe failed.
PROBE_RETRY = 2.0


@dataclass(frozen=True)
class RayNode:
    """One Ray node of the pool."""

    index: int
    node_id: str
    address: str
    slots: int
    alive: bool

    def public(self) -> dict[str, Any]:
        return {"index": self.index, "node_id": self.node_id, "address": self.address, "slots": self.slots,
                "alive": self.alive}


@dataclass
class Suspicion:
    """Why a node is suspect, and its probe (an ``ObjectRef``) while one is out."""

    reason: str
    since: float
    probe: Any = None
    probe_sent: float = 0.0
    next_probe: float = 0.0


def _answer() -> str:
    """The probe's body: the id of the node it ran on."""
    return import_ray().get_runtime_context().get_node_id()


_probe_task: Any = None


def send_probe(node_id: str) -> Any:
    """Start a zero-CPU task that may run on node ``node_id`` only; its ``ObjectRef`` (the node id it ran on)."""
    global _probe_task
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if _probe_task is None:
        _probe_task = ray.remote(num_cpus=0, max_retries=0)(_answer)
    return _probe_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()


class RayPool:
    """Reads the Ray cluster's nodes into executor node indices, and keeps the suspect ones out.

    Args:
        resource: the Ray resource one slot takes one unit of (``GPU``, ``CPU``, a custom name).
        slots_per_node: use at most this many slots per node (default: all the resource).
        refresh: seconds for which a read of the node table is reused.
        list_nodes: returns Ray's node table (default ``ray.nodes``; tests may pass another).
        probe_timeout: seconds after which an unanswered probe of a suspect node is replaced by a new one.
        clock: monotonic time source in seconds.
    """

    def __init__(self, resource: str = "GPU", slots_per_node: int | None = None, refresh: float = 1.0,
                 list_nodes: Callable[[], list[dict[str, Any]]] | None = None, probe_timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if not isinstance(resource, str) or not resource:
            raise ValueError(f"resource must be a Ray resource name such as 'GPU', 'CPU' or 'slot', got {resource!r}")
        if slots_per_node is not None and (isinstance(slots_per_node, bool) or not isinstance(slots_per_node, int)
                                           or slots_per_node < 1):
            raise ValueError(f"slots_per_node must be an integer >= 1 or None, got {slots_per_node!r}")
        if refresh < 0:
            raise ValueError(f"refresh must be >= 0 s, got {refresh}")
        if probe_timeout <= 0:
            raise ValueError(f"probe_timeout must be > 0 s, got {probe_timeout}")
        self.resource = resource
        self.slots_per_node = slots_per_node
        self.refresh = float(refresh)
        self.probe_timeout = float(probe_timeout)
        self.clock = clock
        self._list_nodes = list_nodes or import_ray().nodes
        self._index: dict[str, int] = {}
        self._nodes: dict[int, RayNode] = {}
        self._suspects: dict[int, Suspicion] = {}
        self._read_at = -math.inf

    # ------------------------------------------------------------ node table
    def nodes(self) -> list[RayNode]:
        """Every node seen so far (alive or not), by index; re-read at most every ``refresh`` s."""
        if self.clock() - self._read_at >= self.refresh:
            self._read()
        return [self._nodes[i] for i in sorted(self._nodes)]

    def alive_nodes(self) -> list[int]:
        """Indices of the nodes jobs may use now: alive in Ray's table, not suspect, with the cluster's slots.

        Also advances the probes of suspect nodes (without waiting for them).
        """
        nodes = self.nodes()
        self._check_probes()
        need = self._slots_floor()
        return [n.index for n in nodes if n.alive and n.slots >= need and n.index not in self._suspects]

    def usable(self, index: int) -> bool:
        """Whether node ``index`` is alive in Ray's table and not suspect (its slots aside)."""
        self.nodes()
        node = self._nodes.get(index)
        return node is not None and node.alive and index not in self._suspects

    def node(self, index: int) -> RayNode:
        """One node by index (``KeyError`` names the known ones)."""
        self.nodes()
        if index not in self._nodes:
            raise KeyError(f"no Ray node with executor index {index}; known: {sorted(self._nodes)}")
        return self._nodes[index]

    def cluster_spec(self) -> ClusterSpec:
        """The homogeneous cluster the policy allocates: alive nodes x the smallest slot count."""
        self._read()
        alive = [n for n in self._nodes.values() if n.alive and n.slots >= 1]
        if not alive:
            raise ValueError(f"the Ray cluster has no alive node with resource {self.resource!r}; nodes: "
                             f"{[n.public() for n in self._nodes.values()]}")
        return ClusterSpec(len(alive), self._slots_floor())

    def describe(self) -> list[dict[str, Any]]:
        """Every node for the status file: :meth:`RayNode.public` plus ``state`` (alive, suspect or lost)."""
        out = []
        for node in self.nodes():
            suspicion = self._suspects.get(node.index)
            state = "lost" if not node.alive else "suspect" if suspicion else "alive"
            out.append({**node.public(), "state": state, "suspect_reason": suspicion.reason if suspicion else None})
        return out

    # -------------------------------------------------------------- suspects
    @property
    def suspects(self) -> dict[int, str]:
        """Suspect node indices and why each is suspect."""
        return {index: s.reason for index, s in self._suspects.items()}

    def suspect(self, index: int, reason: str) -> None:
        """Keep node ``index`` out of :meth:`alive_nodes` until a probe pinned to it answers.

        ``reason`` says what was seen (an actor that died or stopped answering); the first one is kept.
        """
        if index not in self._nodes:
            raise KeyError(f"no Ray node with executor index {index}; known: {sorted(self._nodes)}")
        if index in self._suspects:
            return
        self._suspects[index] = Suspicion(reason, since=self.clock())
        logger.warning("pool node %d (%s) is suspect: %s; nothing is placed there until it answers a probe",
                       index, self._nodes[index].address, reason)

    def _check_probes(self) -> None:
        """Clear the suspects whose probe answered; send probes where none is out. Never waits."""
        if not self._suspects:
            return
        ray = import_ray()
        now = self.clock()
        for index, suspicion in list(self._suspects.items()):
            node = self._nodes[index]
            if not node.alive:
                suspicion.probe = None  # dead in Ray's table: it never comes back under this id
                continue
            if suspicion.probe is not None and self._probe_answered(ray, node, suspicion, now):
                del self._suspects[index]
                logger.info("pool node %d (%s) answered a probe %.1f s after it became suspect; usable again",
                            index, node.address, now - suspicion.since)
                continue
            if suspicion.probe is None and now >= suspicion.next_probe:
                suspicion.probe, suspicion.probe_sent = send_probe(node.node_id), now

    def _probe_answered(self, ray: Any, node: RayNode, suspicion: Suspicion, now: float) -> bool:
        """Whether the probe out for ``node`` came back from it; drops a failed or overdue probe."""
        ready, _ = ray.wait([suspicion.probe], timeout=0)
        if not ready:
            if now - suspicion.probe_sent > self.probe_timeout:
                try:
                    ray.cancel(suspicion.probe)
                except (ray.exceptions.RayError, ValueError) as exc:
                    logger.debug("could not cancel the probe of pool node %d: %s", node.index, exc)
                suspicion.probe, suspicion.next_probe = None, now
            return False
        try:
            answered = ray.get(suspicion.probe, timeout=0) == node.node_id
        except ray.exceptions.RayError as exc:
            logger.debug("probe of pool node %d failed: %s", node.index, type(exc).__name__)
            answered = False
        suspicion.probe, suspicion.next_probe = None, now + PROBE_RETRY
        return answered

    # ------------------------------------------------------------- internals
    def _slots_floor(self) -> int:
        """The fewest slots an alive node offers (already capped at ``slots_per_node`` by :meth:`_read`)."""
        offered = [n.slots for n in self._nodes.values() if n.alive and n.slots >= 1]
        return min(offered) if offered else 1

    def _read(self) -> None:
        for raw in self._list_nodes():
            node_id = raw["NodeID"]
            slots = int(raw.get("Resources", {}).get(self.resource, 0) + 1e-9)
            if self.slots_per_node:
                slots = min(slots, self.slots_per_node)
            if node_id not in self._index:
                if not raw.get("Alive") or slots < 1:
                    continue  # only nodes that can run replicas get an index
                self._index[node_id] = len(self._index)
                logger.info("Ray node %s (%s) is pool node %d with %d %s slot(s)", node_id[:12],
                            raw.get("NodeManagerAddress"), self._index[node_id], slots, self.resource)
            index = self._index[node_id]
            node = RayNode(index, node_id, str(raw.get("NodeManagerAddress", "")), slots, bool(raw.get("Alive")))
            old = self._nodes.get(index)
            if old is not None and old.alive and not node.alive:
                logger.warning("Ray reports node %s (pool node %d) dead", node_id[:12], index)
            self._nodes[index] = node
        self._read_at = self.clock()
