"""Policies and models shared by the scheduler tests: a synthetic goodput model with a known closed form
(test_scheduler_policy_search, test_scheduler_policy_length) and a scripted policy (the executor tests)."""

from __future__ import annotations

import numpy as np

from scheduler.cluster import make_allocation
from scheduler.policies.base import Policy


class ScriptedPolicy(Policy):
    """Test policy: the allocations ``plan(active job names, number of nodes)`` dictates."""

    name = "scripted"
    adaptive = False

    def __init__(self, plan):
        self.plan = plan

    def optimize(self, jobs, cluster, current, now):
        plan = self.plan(set(jobs), cluster.num_nodes)
        return {name: make_allocation(plan[name]) for name in jobs if name in plan}


class PowerLawGoodput:
    """goodput = replicas ** exponent samples/s at any batch size (1 on one
    device), 20% lower across nodes."""

    init_batch_size = 32

    def __init__(self, exponent: float):
        self.exponent = exponent

    def evaluate(self, num_nodes, num_replicas, local_bsz, accum_steps):
        nodes, reps, _, _ = np.broadcast_arrays(num_nodes, num_replicas, local_bsz, accum_steps)
        return np.power(reps, self.exponent) * np.where(nodes > 1, 0.8, 1.0)
