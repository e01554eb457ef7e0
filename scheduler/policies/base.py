"""The policy interface shared by the simulator and the executor.

A policy looks at the active jobs, the cluster and the current
allocations, and returns the allocations for the next round. It never
touches jobs itself: the simulator and the executor apply its decisions.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

from scheduler.cluster import Allocation, ClusterSpec
from scheduler.job_info import JobInfo


class Policy(abc.ABC):
    """Decides which job runs on which GPUs.

    Class attributes:
        name: registry name (``--policy NAME``).
        adaptive: ``True`` if jobs pick their batch size by goodput under
            this policy; ``False`` if they run their tuned fixed batch size
            with exactly ``max_replicas`` replicas.
        avoids_interference: ``True`` if the policy never puts two
            multi-node jobs on one node.
    """

    name: str = ""
    adaptive: bool = False
    avoids_interference: bool = False

    @abc.abstractmethod
    def optimize(self, jobs: Mapping[str, JobInfo], cluster: ClusterSpec,
                 current: Mapping[str, Allocation], now: float) -> dict[str, Allocation]:
        """Allocations for the next round.

        Args:
            jobs: the active (submitted, unfinished) jobs by name.
            cluster: the cluster to allocate.
            current: the allocations of the previous round (may name jobs
                that are gone; ignore those).
            now: current time in seconds.

        Returns:
            job name -> sorted tuple of node indices, one per replica; jobs
            left out get nothing.
        """
