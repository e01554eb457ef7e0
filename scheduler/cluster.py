"""The cluster a policy allocates: nodes with GPU slots, and allocations.

An *allocation* of a job is a sorted tuple with one node index per replica:
``(0, 0, 3)`` is two replicas on node 0 and one on node 3; ``()`` means the
job holds nothing. Policies return a mapping from job name to allocation;
:func:`check_allocations` verifies the invariants every policy must keep.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

Allocation = tuple[int, ...]


class ReplicaBounds(Protocol):
    """What :func:`check_allocations` reads of a job (a :class:`scheduler.job_info.JobInfo` has it)."""

    @property
    def min_replicas(self) -> int:
        """The fewest replicas the job runs with."""

    @property
    def max_replicas(self) -> int:
        """The most replicas the job runs with."""

    def is_pinned(self, current: Allocation) -> bool:
        """Whether the job must keep ``current`` (non-preemptible and running)."""


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_nodes`` nodes with ``gpus_per_node`` slots each."""

    num_nodes: int = 16
    gpus_per_node: int = 4

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @property
    def total_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


def make_allocation(nodes: Iterable[int]) -> Allocation:
    """Normalise node indices (one per replica) into a sorted allocation."""
    return tuple(sorted(int(n) for n in nodes))


def placement_of(allocation: Allocation) -> tuple[int, ...]:
    """Replicas per used node, in node order: ``(0, 0, 3) -> (2, 1)``."""
    counts = Counter(allocation)
    return tuple(counts[n] for n in sorted(counts))


def num_nodes_of(allocation: Allocation) -> int:
    """Number of distinct nodes an allocation spans."""
    return len(set(allocation))


def free_gpus(cluster: ClusterSpec, allocations: Mapping[str, Allocation]) -> list[int]:
    """Unallocated GPUs on each node."""
    free = [cluster.gpus_per_node] * cluster.num_nodes
    for alloc in allocations.values():
        for node in alloc:
            free[node] -= 1
    return free


def check_allocations(allocations: Mapping[str, Allocation], cluster: ClusterSpec,
                      jobs: Mapping[str, ReplicaBounds],
                      current: Mapping[str, Allocation] | None = None,
                      exclusive_multinode: bool = True) -> None:
    """Raise ``ValueError`` if ``allocations`` break a policy invariant.

    Invariants: only known jobs; node indices in range; no node over
    capacity; each job within ``[min_replicas, max_replicas]`` or empty;
    pinned jobs (non-preemptible with a current allocation) keep exactly
    their current allocation; with ``exclusive_multinode``, at most one
    multi-node job per node (interference avoidance).
    """
    current = current or {}
    unknown = sorted(set(allocations) - set(jobs))
    if unknown:
        raise ValueError(f"allocations for unknown jobs: {unknown}")
    used: dict[int, int] = Counter()
    distributed_on: dict[int, list[str]] = {}
    for name, alloc in allocations.items():
        job = jobs[name]
        if tuple(alloc) != make_allocation(alloc):
            raise ValueError(f"job {name!r}: allocation {alloc} is not a sorted tuple of node indices")
        for node in alloc:
            if not 0 <= node < cluster.num_nodes:
                raise ValueError(f"job {name!r}: node {node} outside [0, {cluster.num_nodes})")
            used[node] += 1
        if alloc and not job.min_replicas <= len(alloc) <= job.max_replicas:
            raise ValueError(f"job {name!r}: {len(alloc)} replicas outside "
                             f"[{job.min_replicas}, {job.max_replicas}]")
        if num_nodes_of(alloc) > 1:
            for node in set(alloc):
                distributed_on.setdefault(node, []).append(name)
    for name, job in jobs.items():
        pinned_to = tuple(current.get(name, ()))
        if job.is_pinned(pinned_to) and tuple(allocations.get(name, ())) != pinned_to:
            raise ValueError(f"job {name!r} is pinned to {pinned_to} but got {allocations.get(name, ())}")
    over = {n: c for n, c in used.items() if c > cluster.gpus_per_node}
    if over:
        raise ValueError(f"nodes over capacity ({cluster.gpus_per_node} GPUs): {over}")
    shared = {n: names for n, names in distributed_on.items() if len(names) > 1}
    if shared and exclusive_multinode:
        raise ValueError(f"nodes shared by more than one multi-node job: {shared}")
