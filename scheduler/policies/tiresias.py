"""Tiresias: two-queue least-attained-service with fixed-size jobs.

The baseline of the Pollux evaluation (Gu et al., NSDI'19, discretised
two-queue variant). Every job asks for a fixed gang of ``max_replicas``
GPUs (its tuned size). Jobs start in the high-priority queue and are
demoted to the low-priority queue once they have used ``queue_threshold``
GPU-seconds; each queue is first-come first-served (demotion order for the
low queue). Each round, jobs are admitted in queue order while their gang
fits in the GPUs left (smaller jobs behind a blocked one may still start);
admitted jobs keep their GPUs, new ones are packed onto the nodes with the
most free GPUs, and jobs not admitted are preempted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from scheduler.cluster import Allocation, ClusterSpec, free_gpus
from scheduler.job_info import JobInfo
from scheduler.policies.base import Policy
from scheduler.policies.placement import take_most_free

logger = logging.getLogger(__name__)


class TiresiasPolicy(Policy):
    """Two-queue LAS over fixed-size gangs.

    Args:
        queue_threshold: GPU-seconds of service after which a job is
            demoted to the low-priority queue (16 GPU-hours by default, as in
            the Pollux artifact).
    """

    name = "tiresias"
    adaptive = False
    avoids_interference = False

    def __init__(self, queue_threshold: float = 16 * 3600.0):
        if queue_threshold <= 0:
            raise ValueError(f"queue_threshold must be > 0, got {queue_threshold}")
        self.queue_threshold = float(queue_threshold)
        self._arrival: dict[str, int] = {}
        self._demoted: dict[str, int] = {}
        self._seq = 0

    def _queues(self, jobs: Mapping[str, JobInfo]) -> list[str]:
        """Job names in priority order: high queue, then low queue."""
        self._arrival = {k: v for k, v in self._arrival.items() if k in jobs}
        self._demoted = {k: v for k, v in self._demoted.items() if k in jobs}
        for name in sorted((n for n in jobs if n not in self._arrival),
                           key=lambda n: (jobs[n].submission_time, n)):
            self._arrival[name] = self._next_seq()
        for name in sorted(self._arrival, key=self._arrival.__getitem__):
            if name not in self._demoted and jobs[name].attained_service >= self.queue_threshold:
                self._demoted[name] = self._next_seq()
                logger.debug("%s demoted to the low-priority queue", name)
        high = sorted((n for n in jobs if n not in self._demoted), key=self._arrival.__getitem__)
        low = sorted(self._demoted, key=self._demoted.__getitem__)
        return high + low

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def optimize(self, jobs: Mapping[str, JobInfo], cluster: ClusterSpec,
                 current: Mapping[str, Allocation], now: float) -> dict[str, Allocation]:
        order = self._queues(jobs)
        pinned = {n: tuple(current[n]) for n in order if jobs[n].is_pinned(tuple(current.get(n, ())))}
        budget = cluster.total_gpus - sum(len(a) for a in pinned.values())
        admitted = []
        for name in order:
            if name in pinned:
                continue
            need = jobs[name].max_replicas
            if need <= budget:
                admitted.append(name)
                budget -= need
        allocations: dict[str, Allocation] = dict(pinned)
        for name in admitted:
            alloc = tuple(current.get(name, ()))
            if len(alloc) == jobs[name].max_replicas:
                allocations[name] = alloc
        free = free_gpus(cluster, allocations)
        for name in admitted:
            if name not in allocations:
                allocations[name] = take_most_free(jobs[name].max_replicas, free)
        return allocations
