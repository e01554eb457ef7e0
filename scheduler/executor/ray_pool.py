"""The Ray cluster as the executor's pool of nodes and slots.

Every alive Ray node that has the slot resource (``GPU`` by default; ``CPU``
or a custom resource such as ``slot`` where there are no GPUs) is a node of
the pool. A node's index is given the first time it is seen and never
reused, so that the executor's assignments stay valid while other nodes come
and go. :class:`~scheduler.cluster.ClusterSpec` is homogeneous: every node
offers the same number of slots, the smallest any node has (or fewer, with
``slots_per_node``).
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


class RayPool:
    """Reads the Ray cluster's nodes into executor node indices.

    Args:
        resource: the Ray resource one slot takes one unit of (``GPU``, ``CPU``, a custom name).
        slots_per_node: use at most this many slots per node (default: all the resource).
        refresh: seconds for which a read of the node table is reused.
        list_nodes: returns Ray's node table (default ``ray.nodes``; tests may pass another).
    """

    def __init__(self, resource: str = "GPU", slots_per_node: int | None = None, refresh: float = 1.0,
                 list_nodes: Callable[[], list[dict[str, Any]]] | None = None):
        if not isinstance(resource, str) or not resource:
            raise ValueError(f"resource must be a Ray resource name such as 'GPU', 'CPU' or 'slot', got {resource!r}")
        if slots_per_node is not None and (isinstance(slots_per_node, bool) or not isinstance(slots_per_node, int)
                                           or slots_per_node < 1):
            raise ValueError(f"slots_per_node must be an integer >= 1 or None, got {slots_per_node!r}")
        if refresh < 0:
            raise ValueError(f"refresh must be >= 0 s, got {refresh}")
        self.resource = resource
        self.slots_per_node = slots_per_node
        self.refresh = float(refresh)
        self._list_nodes = list_nodes or import_ray().nodes
        self._index: dict[str, int] = {}
        self._nodes: dict[int, RayNode] = {}
        self._read_at = -math.inf

    def nodes(self) -> list[RayNode]:
        """Every node seen so far (alive or not), by index; re-read at most every ``refresh`` s."""
        if time.monotonic() - self._read_at >= self.refresh:
            self._read()
        return [self._nodes[i] for i in sorted(self._nodes)]

    def alive_nodes(self) -> list[int]:
        """Indices of the alive nodes that offer at least the cluster's slots per node."""
        need = self._slots_floor()
        return [n.index for n in self.nodes() if n.alive and n.slots >= need]

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
                logger.warning("Ray node %s (pool node %d) is gone", node_id[:12], index)
            self._nodes[index] = node
        self._read_at = time.monotonic()
