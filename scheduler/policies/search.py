"""Exact replica counts for a separable utility: dynamic programming over jobs.

The goodput policies score an allocation as a sum of per-job utilities
``U[j, r]`` (job ``j`` holding ``r`` replicas) under one capacity
constraint, ``sum_j r_j <= capacity``. That is a multiple-choice knapsack,
which a dynamic program over the jobs solves *exactly* in
``O(jobs x capacity x replicas)``: after job ``j``, ``best[c]`` is the best
total utility of jobs ``0..j`` using at most ``c`` GPUs. Unlike a greedy
search over marginal gains it is not misled by non-concave utilities (a
job that only pays off at a whole node, a restart cost on every count but
the current one). For 160 jobs on 64 GPUs one vectorised step per job
takes a few milliseconds.

Placement constraints (which node, interference) are not part of this
objective; the policy handles them by capping counts and solving again.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def exact_counts(utility: np.ndarray, caps: np.ndarray, capacity: int) -> np.ndarray:
    """Replica counts maximising ``sum_j utility[j, counts[j]]``.

    Args:
        utility: ``(jobs, width)`` table; ``-inf`` marks counts a job may not
            have. Column 0 (no replicas) must be finite.
        caps: most replicas per job.
        capacity: GPUs available in total.

    Returns:
        counts with ``counts.sum() <= capacity`` and ``counts <= caps``;
        ties go to fewer replicas (earlier jobs first), so the result is
        deterministic.
    """
    utility = np.asarray(utility, dtype=float)
    n_jobs, width = utility.shape
    capacity = max(int(capacity), 0)
    if n_jobs == 0:
        return np.zeros(0, dtype=int)
    if not np.isfinite(utility[:, 0]).all():
        raise ValueError("every job must be allowed zero replicas (finite utility[:, 0])")
    reps = np.arange(min(width, capacity + 1))
    used = np.arange(capacity + 1)
    before = used[:, None] - reps[None, :]  # GPUs left for earlier jobs
    feasible = before >= 0
    safe = np.clip(before, 0, None)
    best = np.zeros(capacity + 1)
    choice = np.zeros((n_jobs, capacity + 1), dtype=np.int64)
    for j in range(n_jobs):
        row = utility[j, :len(reps)].copy()
        row[reps > caps[j]] = -np.inf
        candidates = np.where(feasible, best[safe] + row[None, :], -np.inf)
        choice[j] = np.argmax(candidates, axis=1)
        best = candidates[used, choice[j]]
    counts = np.zeros(n_jobs, dtype=int)
    left = capacity
    for j in range(n_jobs - 1, -1, -1):
        counts[j] = choice[j, left]
        left -= counts[j]
    return counts
