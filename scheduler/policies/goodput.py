"""Goodput policy: the Pollux objective, searched exactly, with costlier moves and larger first allocations.

Builds on :class:`scheduler.policies.pollux.PolluxPolicy` (same speedups,
exploration caps, placement and interference avoidance) and changes what
the measurements on the bundled workloads showed to matter, checked on the
generated ones of :mod:`scheduler.sim.generate` (``scheduler/README.md``
has the tables, including what did not help):

* **Fairness exponent** ``p``: the default is ``P_DEFAULT`` instead of
  Pollux's ``-1``. The average JCT is dominated by the few long jobs
  (ImageNet, YOLOv3: half of the summed JCT); a less fairness-leaning
  objective lets them keep the GPUs they use well, which shortens them and
  the tail without starving the short jobs, which still get a GPU first
  because their utility at zero replicas stays far below any other.
* **Restart payback** ``payback``: a move must pay back ``payback``
  restarts, not one, over the job's expected remaining time (its age, as in
  Pollux). Restarts cost 5-20% of every job class's JCT; a move that only
  just pays back one restart rarely pays back the move after it, which
  comes soon while jobs keep arriving and finishing.
* **Larger first allocations** ``initial_replicas``: a job whose
  throughput model has seen nothing yet may get up to this many replicas
  (Pollux: one), with its speedup assumed linear there. A job started on
  one GPU pays a restart to grow one round later and another to grow
  again; starting it on up to a node's worth (no cross-node
  synchronisation, so the linear guess is least wrong) saves one of those
  restarts, and its first measurements come from a placement nearer the
  one it will run on. Two GPUs or two nodes measured worse.
* **Exact counts** ``search="exact"``: replica counts from the dynamic
  program of :mod:`scheduler.policies.search` (the optimum of the
  separable objective) instead of greedy marginal gains plus local search.
"""

from __future__ import annotations

import logging

import numpy as np

from scheduler.job_info import JobInfo
from scheduler.policies.pollux import PolluxPolicy
from scheduler.policies.search import exact_counts

logger = logging.getLogger(__name__)

#: Default power-mean exponent (Pollux uses -1).
P_DEFAULT = 0.0

#: Default number of restarts a move must pay back.
PAYBACK_DEFAULT = 2.0

#: Default most replicas before a job has a throughput model (Pollux: 1).
INITIAL_REPLICAS_DEFAULT = 4

SEARCHES = ("exact", "greedy")


class GoodputPolicy(PolluxPolicy):
    """Pollux's objective with a tuned exponent, restart payback and exact search.

    Args:
        p: power-mean exponent over job speedups (``p <= 1``).
        restart_penalty: seconds a reallocation costs a job.
        exploration_factor: most replicas as a multiple of those a job's
            throughput model has seen (>= 1).
        local_search_passes: improvement passes after the greedy
            (``search="greedy"`` only).
        payback: restarts a move must pay back within the job's expected
            remaining time (``1`` is Pollux's rule; >= 1).
        search: ``"exact"`` (dynamic program) or ``"greedy"`` (Pollux's
            search in this package).
        initial_replicas: most replicas for a job whose throughput model has
            seen no placement yet (>= 1; ``1`` is Pollux's rule).
    """

    name = "goodput"

    def __init__(self, p: float = P_DEFAULT, restart_penalty: float = 30.0, exploration_factor: float = 4.0,
                 local_search_passes: int = 2, payback: float = PAYBACK_DEFAULT, search: str = "exact",
                 initial_replicas: int = INITIAL_REPLICAS_DEFAULT):
        super().__init__(p=p, restart_penalty=restart_penalty, exploration_factor=exploration_factor,
                         local_search_passes=local_search_passes)
        if payback < 1:
            raise ValueError(f"payback must be >= 1 restart, got {payback}")
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
        if initial_replicas < 1:
            raise ValueError(f"initial_replicas must be >= 1, got {initial_replicas}")
        self.payback = float(payback)
        self.search = search
        self.initial_replicas = int(initial_replicas)

    def _replica_cap(self, job: JobInfo) -> int:
        """Pollux's cap once the job has been profiled; before that, up to
        ``initial_replicas`` (within ``min_replicas``/``max_replicas``)."""
        if job.profiled_replicas == 0:
            return max(min(job.max_replicas, self.initial_replicas), job.min_replicas)
        return super()._replica_cap(job)

    def _counts(self, utility: np.ndarray, caps: np.ndarray, capacity: int) -> np.ndarray:
        """Replica counts: exact dynamic program, or Pollux's greedy search."""
        if self.search == "exact":
            return exact_counts(utility, caps, capacity)
        return super()._counts(utility, caps, capacity)

    def _restart_factor(self, job: JobInfo, now: float) -> float:
        """Share of its speed a running job keeps over its expected remaining
        time (about its age) if moved now, charging ``payback`` restarts
        (plus one per past restart) for the move."""
        delay = self.restart_penalty
        if delay == 0:
            return 1.0
        age = max(now - job.submission_time, 0.0)
        charged = (job.num_restarts + self.payback) * delay
        return max(age - charged, 0.0) / max(age, delay)
