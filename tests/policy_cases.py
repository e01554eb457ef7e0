"""A synthetic goodput model shared by the policy tests (test_scheduler_policy_search,
test_scheduler_policy_length): speedups with a known closed form."""

from __future__ import annotations

import numpy as np


class PowerLawGoodput:
    """goodput = replicas ** exponent samples/s at any batch size (1 on one
    device), 20% lower across nodes."""

    init_batch_size = 32

    def __init__(self, exponent: float):
        self.exponent = exponent

    def evaluate(self, num_nodes, num_replicas, local_bsz, accum_steps):
        nodes, reps, _, _ = np.broadcast_arrays(num_nodes, num_replicas, local_bsz, accum_steps)
        return np.power(reps, self.exponent) * np.where(nodes > 1, 0.8, 1.0)
