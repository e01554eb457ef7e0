"""One scheduling round over live jobs: hints in, allocations out.

Connects a :class:`~scheduler.policies.base.Policy` to the
:class:`~scheduler.supervisor.state.SupervisorState` that collects jobs'
hints. Used by the supervisor service and by the executor; the simulator
calls policies directly on simulated jobs.
"""

from __future__ import annotations

import logging
import time

from scheduler.cluster import Allocation, ClusterSpec, check_allocations
from scheduler.job_info import JobInfo, job_info_from_hints
from scheduler.policies.base import Policy
from scheduler.supervisor.state import JobRecord, SupervisorState

logger = logging.getLogger(__name__)


class Allocator:
    """Runs ``policy`` over the jobs registered in ``state``.

    Args:
        policy: the allocation policy.
        cluster: the devices to share.
        state: registered jobs with their hints and current allocations.
    """

    def __init__(self, policy: Policy, cluster: ClusterSpec, state: SupervisorState):
        self.policy = policy
        self.cluster = cluster
        self.state = state

    def job_info(self, record: JobRecord) -> JobInfo:
        """The policy's view of one registered job."""
        max_replicas = min(record.max_replicas, self.cluster.total_gpus)
        if not self.policy.adaptive:
            return JobInfo(name=record.job_id, submission_time=record.submission_time,
                           min_replicas=0, max_replicas=max(max_replicas, 1),
                           preemptible=record.preemptible, attained_service=record.attained_service,
                           num_restarts=record.num_restarts)
        return job_info_from_hints(record.job_id, self.state.parsed_hints(record.job_id),
                                   submission_time=record.submission_time,
                                   min_replicas=record.min_replicas, max_replicas=max_replicas,
                                   preemptible=record.preemptible,
                                   attained_service=record.attained_service,
                                   num_restarts=record.num_restarts)

    def step(self, now: float | None = None) -> dict[str, Allocation]:
        """Decide and record the allocations for the next round."""
        now = time.time() if now is None else now
        records = self.state.jobs()
        infos = {job_id: self.job_info(rec) for job_id, rec in records.items()}
        current = {job_id: rec.allocation for job_id, rec in records.items() if rec.allocation}
        decided = self.policy.optimize(infos, self.cluster, current, now) if infos else {}
        decided = {k: tuple(v) for k, v in decided.items() if v}
        check_allocations(decided, self.cluster, infos, current,
                          exclusive_multinode=self.policy.avoids_interference)
        changed = sorted(k for k in set(decided) | set(current) if decided.get(k, ()) != current.get(k, ()))
        if changed:
            logger.info("new allocations for %s", ", ".join(f"{k}={len(decided.get(k, ()))}" for k in changed))
        self.state.set_allocations(decided, now)
        return decided
