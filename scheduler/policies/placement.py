"""Turning replica counts into node assignments.

Helpers shared by policies: which nodes a job of ``n`` replicas should use
given the free GPUs per node.
"""

from __future__ import annotations

from collections.abc import MutableSequence

from scheduler.cluster import Allocation, make_allocation


def take_most_free(count: int, free: MutableSequence[int]) -> Allocation:
    """Take ``count`` GPUs, always from the node with the most free GPUs.

    Consolidates a job on as few nodes as the free capacity allows (ties go
    to the lowest node index). ``free`` is updated in place.

    Raises:
        ValueError: if fewer than ``count`` GPUs are free in total.
    """
    if count > sum(free):
        raise ValueError(f"cannot take {count} GPUs: only {sum(free)} free")
    nodes: list[int] = []
    while len(nodes) < count:
        node = max(range(len(free)), key=lambda i: (free[i], -i))
        take = min(free[node], count - len(nodes))
        nodes.extend([node] * take)
        free[node] -= take
    return make_allocation(nodes)
