"""Pollux policy: share GPUs to maximise a fair aggregate of job speedups.

This is the goodput policy as it reproduces Pollux (OSDI'21); it stays
available as ``pollux`` for comparison with :mod:`scheduler.policies.goodput`,
which builds on it.

Each job's *speedup* on ``r`` replicas is its best goodput there (at the
batch size it would pick) over its goodput on one device
(:class:`scheduler.speedup.SpeedupFunction`). The policy maximises the
power mean (exponent ``p``, ``p = -1`` by default: fairness-leaning) of
the jobs' speedups, each scaled by its speedup at a fair share of the
cluster, as Pollux does.

Restart cost. Moving a running job costs it ``delay`` seconds. Job lengths
are unknown, so the policy expects a job to run about as long again as it
has existed (``age``); a move then keeps ``(age - (restarts + 1) * delay) /
age`` of its speed over that horizon, counting its past restarts so that
often-moved jobs are moved less. A waiting job pays nothing extra to start.

Exploration. A job gets at most ``exploration_factor`` times the replicas
its throughput model has seen (one replica before it has a model), and
beyond what it has seen its speedup assumes no further growth of
synchronisation cost, so that it scales up quickly and learns.

Pollux searches this space with a genetic algorithm. Here, instead:

1. **Replica counts by greedy marginal gain.** Starting from nothing,
   repeatedly give GPUs to the job whose utility rises most per GPU,
   looking at every larger count (not only ``+1``) so that non-concave
   speedups and the restart cost do not trap the search. This is exact
   for concave utilities and cheap: one vectorised pass per grant.
2. **Local search.** Moves of GPUs from one job to another are tried
   while they raise the objective.
3. **Placement.** Jobs that keep their count keep their GPUs (no
   restart). Others are placed largest first: multi-node jobs on whole
   free nodes plus at most one partial node that hosts no other
   multi-node job (interference avoidance), single-node jobs on the
   fullest node that fits (best fit, keeping whole nodes free; never
   split). A job that cannot be placed gets its count capped and the
   counts are recomputed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from scheduler.cluster import Allocation, ClusterSpec, free_gpus, make_allocation, num_nodes_of
from scheduler.job_info import JobInfo
from scheduler.policies.base import Policy

logger = logging.getLogger(__name__)

_EPS = 1e-3  # keeps the power mean finite when a job gets nothing


class PolluxPolicy(Policy):
    """Fairness-aware goodput maximisation with restart costs (Pollux's objective).

    Args:
        p: power-mean exponent over job speedups (``p <= 1``; ``-1`` leans
            to fairness, ``0`` is the geometric mean, ``1`` the sum).
        restart_penalty: seconds a reallocation costs a job (for the
            restart factor).
        exploration_factor: most replicas as a multiple of those a job's
            throughput model has seen (>= 1).
        local_search_passes: improvement passes after the greedy.
    """

    name = "pollux"
    adaptive = True
    avoids_interference = True

    def __init__(self, p: float = -1.0, restart_penalty: float = 30.0, exploration_factor: float = 4.0,
                 local_search_passes: int = 2):
        if p > 1:
            raise ValueError(f"p must be <= 1 (a concave power mean), got {p}")
        if restart_penalty < 0:
            raise ValueError(f"restart_penalty must be >= 0 seconds, got {restart_penalty}")
        if exploration_factor < 1:
            raise ValueError(f"exploration_factor must be >= 1, got {exploration_factor}")
        if local_search_passes < 0:
            raise ValueError(f"local_search_passes must be >= 0, got {local_search_passes}")
        self.p = float(p)
        self.restart_penalty = float(restart_penalty)
        self.exploration_factor = float(exploration_factor)
        self.local_search_passes = int(local_search_passes)

    # ----------------------------------------------------------------- public
    def optimize(self, jobs: Mapping[str, JobInfo], cluster: ClusterSpec,
                 current: Mapping[str, Allocation], now: float) -> dict[str, Allocation]:
        current = {n: tuple(a) for n, a in current.items() if n in jobs and a}
        pinned = {n: a for n, a in current.items() if jobs[n].is_pinned(a)}
        names = sorted((n for n in jobs if n not in pinned),
                       key=lambda n: (jobs[n].attained_service, jobs[n].submission_time, n))
        if not names:
            return dict(pinned)
        free = free_gpus(cluster, pinned)
        capacity = sum(free)
        utility = self._utility_table(names, jobs, cluster, current, now, capacity)
        caps = np.array([min(self._replica_cap(jobs[n]), capacity) for n in names])
        for _ in range(len(names) + 1):
            counts = self._counts(utility, caps, capacity)
            placed, shortfall = _place(names, counts, current, free, cluster.gpus_per_node, pinned)
            if not shortfall:
                break
            for i, fits in shortfall.items():
                caps[i] = min(caps[i], fits)
        allocations = dict(pinned)
        allocations.update({n: a for n, a in placed.items() if a})
        return allocations

    def _counts(self, utility: np.ndarray, caps: np.ndarray, capacity: int) -> np.ndarray:
        """Replica count per job: greedy marginal gain, then local search."""
        counts = _greedy_counts(utility, caps, capacity)
        return _local_search(utility, counts, caps, capacity, self.local_search_passes)

    # ---------------------------------------------------------------- utility
    def _utility_table(self, names: Sequence[str], jobs: Mapping[str, JobInfo], cluster: ClusterSpec,
                       current: Mapping[str, Allocation], now: float, capacity: int) -> np.ndarray:
        """``U[j, r]``: utility of job ``j`` holding ``r`` replicas (``-inf`` if not allowed)."""
        max_r = max(1, capacity)
        reps = np.arange(max_r + 1)
        fair = max(1, math.ceil(cluster.total_gpus / len(jobs)))
        table = np.full((len(names), max_r + 1), -np.inf)
        fastest = np.zeros(len(names))  # best speedup among each job's allowed counts
        for i, name in enumerate(names):
            job = jobs[name]
            speedup = self._speedups(job, reps, cluster.gpus_per_node, current.get(name, ()))
            base = self._speedups(job, np.array([fair]), cluster.gpus_per_node, ())[0]
            scaled = speedup / max(base, 1e-12) / cluster.gpus_per_node
            held = len(current.get(name, ()))
            if held:  # moving a running job costs it a restart; starting a waiting one costs nothing extra
                factor = self._restart_factor(job, now, speedup[held])
                scaled = np.where((reps != held) & (reps > 0), scaled * factor, scaled)
            allowed = self._allowed(job, reps, speedup)
            table[i] = np.where(allowed, self._u(scaled), -np.inf)
            fastest[i] = speedup[allowed].max(initial=0.0)
        weighted: np.ndarray = table * self._job_weights(names, jobs, fastest)[:, None]
        return weighted

    def _allowed(self, job: JobInfo, reps: np.ndarray, speedup: np.ndarray) -> np.ndarray:
        """Replica counts ``job`` may have: none, or within its limits and cap."""
        allowed: np.ndarray = (reps == 0) | ((reps >= max(job.min_replicas, 1)) & (reps <= self._replica_cap(job)))
        return allowed

    def _job_weights(self, names: Sequence[str], jobs: Mapping[str, JobInfo],
                     fastest: np.ndarray) -> np.ndarray:
        """Positive weight of each job's utility in the objective (all equal
        here; ``fastest`` is each job's best speedup among its allowed counts)."""
        return np.ones(len(names))

    def _replica_cap(self, job: JobInfo) -> int:
        """``max_replicas``, and at most ``exploration_factor`` times what the
        job's throughput model has seen (never below ``min_replicas``)."""
        if job.profiled_replicas is None:
            return job.max_replicas
        explore = max(1, int(self.exploration_factor * job.profiled_replicas))
        return max(min(job.max_replicas, explore), job.min_replicas)

    @staticmethod
    def _speedups(job: JobInfo, reps: np.ndarray, gpus_per_node: int, held: Allocation) -> np.ndarray:
        """Speedup on ``reps`` replicas, packed on as few nodes as possible
        (the job's actual node count for its current size)."""
        nodes = np.where(reps <= gpus_per_node, 1, -(-reps // gpus_per_node))
        if held:
            nodes = np.where(reps == len(held), num_nodes_of(held), nodes)
        out = np.zeros(len(reps))
        positive = reps > 0
        if job.speedup_fn is None:
            out[positive] = reps[positive]
        else:
            out[positive] = job.speedup_fn(nodes[positive], reps[positive])
        return out

    #: Restarts a move must pay back, besides one per past restart (Pollux: 1).
    payback = 1.0

    def _restart_factor(self, job: JobInfo, now: float, speedup_now: float) -> float:
        """Share of its speed a running job keeps over its expected remaining
        time ``h`` if moved now: ``(h - (restarts + payback) * delay) / h``."""
        delay = self.restart_penalty
        if delay == 0:
            return 1.0
        horizon = self._expected_remaining(job, now, speedup_now)
        charged = (job.num_restarts + self.payback) * delay
        return max(horizon - charged, 0.0) / max(horizon, delay)

    def _expected_remaining(self, job: JobInfo, now: float, speedup_now: float) -> float:
        """Seconds a running job is expected to run on: about its age, since
        job lengths are unknown (``speedup_now``, its speedup where it runs,
        is not needed for that guess)."""
        return max(now - job.submission_time, 0.0)

    def _u(self, x: np.ndarray) -> np.ndarray:
        """Per-job utility whose sum ranks allocations like the power mean."""
        x = np.asarray(x, dtype=float) + _EPS
        if self.p == 0:
            return np.log(x)
        if self.p < 0:
            return -np.power(x, self.p)
        return np.power(x, self.p)


def _greedy_counts(utility: np.ndarray, caps: np.ndarray, capacity: int) -> np.ndarray:
    """Grant GPUs by best utility gain per GPU until none helps or none is left."""
    n_jobs, width = utility.shape
    counts = np.zeros(n_jobs, dtype=int)
    reps = np.arange(width)
    left = capacity
    rows = np.arange(n_jobs)
    while left > 0:
        base = utility[rows, counts]
        step = reps[None, :] - counts[:, None]
        ok = (step > 0) & (step <= left) & (reps[None, :] <= caps[:, None]) & np.isfinite(utility)
        with np.errstate(invalid="ignore"):
            gain = np.where(ok, (utility - base[:, None]) / np.maximum(step, 1), -np.inf)
        j, r = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[j, r] > 0:
            break
        left -= r - counts[j]
        counts[j] = r
    return counts


def _local_search(utility: np.ndarray, counts: np.ndarray, caps: np.ndarray, capacity: int,
                  passes: int) -> np.ndarray:
    """Move GPUs between pairs of jobs while the total utility rises."""
    counts = counts.copy()
    n_jobs, width = utility.shape
    rows = np.arange(n_jobs)
    for _ in range(passes):
        improved = False
        for giver in np.flatnonzero(counts > 0):
            have = counts[giver]
            cur = utility[rows, counts]
            # Every smaller count for the giver, and every larger one for the others.
            for new_giver in range(have):
                if not np.isfinite(utility[giver, new_giver]):
                    continue
                spare = capacity - counts.sum() + have - new_giver
                loss = utility[giver, have] - utility[giver, new_giver]
                reps = np.arange(width)
                step = reps[None, :] - counts[:, None]
                ok = (step > 0) & (step <= spare) & (reps[None, :] <= caps[:, None]) & np.isfinite(utility)
                ok[giver] = False
                gain = np.where(ok, utility - cur[:, None], -np.inf)
                j, r = np.unravel_index(int(np.argmax(gain)), gain.shape)
                if gain[j, r] > loss + 1e-12:
                    counts[giver] = new_giver
                    counts[j] = r
                    improved = True
                    break
        if not improved:
            break
    return counts


def _place(names: Sequence[str], counts: np.ndarray, current: Mapping[str, Allocation],
           free: Sequence[int], gpus_per_node: int,
           pinned: Mapping[str, Allocation]) -> tuple[dict[str, Allocation], dict[int, int]]:
    """Assign nodes for the chosen counts (``free`` excludes the ``pinned`` jobs' GPUs).

    Returns the allocations and, for jobs that did not fit, the most
    replicas they could have had (their new cap).  The nodes of pinned
    multi-node jobs are closed to other multi-node jobs, as are those of
    every multi-node job placed here.
    """
    free = list(free)
    multi_nodes = {node for alloc in pinned.values() if num_nodes_of(alloc) > 1 for node in alloc}
    placed: dict[str, Allocation] = {}
    for name, count in zip(names, counts):
        held = current.get(name, ())
        if count > 0 and len(held) == count:
            placed[name] = held
            for node in held:
                free[node] -= 1
            if num_nodes_of(held) > 1:
                multi_nodes.update(held)
    shortfall: dict[int, int] = {}
    order = sorted((i for i, n in enumerate(names) if counts[i] > 0 and n not in placed),
                   key=lambda i: (-counts[i], i))
    for i in order:
        alloc = _fit(int(counts[i]), free, multi_nodes, gpus_per_node)
        if alloc is None:
            shortfall[i] = _most_placeable(free, multi_nodes, int(counts[i]) - 1, gpus_per_node)
            continue
        placed[names[i]] = alloc
        for node in alloc:
            free[node] -= 1
        if num_nodes_of(alloc) > 1:
            multi_nodes.update(alloc)
    return placed, shortfall


def _fit(count: int, free: Sequence[int], multi_nodes: set[int], gpus_per_node: int) -> Allocation | None:
    """Nodes for a job of ``count`` replicas, or ``None`` if it does not fit.

    A job that fits on one node is never split (its speedup was computed for
    one node); a larger job takes whole free nodes first, then the partial
    node that best fits the rest, never a node with another multi-node job.
    """
    if count <= gpus_per_node:
        single = [n for n in range(len(free)) if free[n] >= count]
        if not single:
            return None
        best = min(single, key=lambda n: (free[n], n))  # best fit keeps whole nodes free
        return make_allocation([best] * count)
    eligible = [n for n in range(len(free)) if free[n] > 0 and n not in multi_nodes]
    if sum(free[n] for n in eligible) < count:
        return None
    nodes: list[int] = []
    for n in sorted(eligible, key=lambda n: (-free[n], n)):
        if len(nodes) + free[n] > count:
            continue
        nodes.extend([n] * free[n])
        if len(nodes) == count:
            return make_allocation(nodes)
    rest = count - len(nodes)
    used = set(nodes)
    partial = [n for n in eligible if n not in used and free[n] >= rest]
    if partial:
        nodes.extend([min(partial, key=lambda n: (free[n], n))] * rest)
        return make_allocation(nodes)
    for n in sorted((n for n in eligible if n not in used), key=lambda n: (-free[n], n)):
        take = min(free[n], count - len(nodes))
        nodes.extend([n] * take)
        if len(nodes) == count:
            return make_allocation(nodes)
    return None


def _most_placeable(free: Sequence[int], multi_nodes: set[int], upper: int, gpus_per_node: int) -> int:
    """Largest replica count up to ``upper`` that :func:`_fit` could place now."""
    single = min(max(free, default=0), gpus_per_node)
    spread = sum(f for n, f in enumerate(free) if n not in multi_nodes)
    best = spread if spread > gpus_per_node else single
    return max(0, min(upper, best))
