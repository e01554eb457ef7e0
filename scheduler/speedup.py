"""Speedup of a job on an allocation, from its goodput model.

``speedup(nodes, replicas) = best goodput on (nodes, replicas) / best
goodput on one device``, where "best" lets the job pick its global batch
size (local batch and accumulation steps) within its limits, as the
adaptive loader does. Goodput comes from
:meth:`adaptive.goodput.GoodputFunction.evaluate` (fitted throughput model
times statistical efficiency).

The policy needs this for every job and replica count each round, so the
best batch is searched on a geometric grid of global batch sizes (one
vectorised ``evaluate`` call per job) rather than exactly: the goodput
curve is flat near its optimum, so the grid loses little, and the job
itself still picks its exact best batch once it runs.

Beyond the largest replica count a job has been profiled with, its model
extrapolates how synchronisation cost grows, which it learned from few
points and often overestimates. There the speedup is computed with the
synchronisation time held at its value for the profiled count (optimism
in the face of uncertainty): the job gets to try, the policy caps how far
(``GoodputPolicy(exploration_factor=...)``), and its model learns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from adaptive.goodput import GoodputFunction, PerfParams

logger = logging.getLogger(__name__)

#: Global batch sizes tried per placement.
GRID_POINTS = 48


class SpeedupFunction:
    """Memoised speedup table over (num_nodes, num_replicas).

    Args:
        goodput_fn: an ``adaptive.goodput.GoodputFunction`` (anything with
            its vectorised ``evaluate`` and ``init_batch_size``).
        max_batch_size: the job's largest global batch (default: its
            initial batch, i.e. a fixed batch size).
        local_bsz_bounds: ``(min, max)`` samples per replica per micro-batch.
        gradient_accumulation: whether the job may accumulate micro-batches.
        profiled_replicas: largest replica count the throughput model has
            seen; above it synchronisation cost is not extrapolated upwards
            (``None``: trust the model everywhere).
    """

    def __init__(self, goodput_fn: Any, max_batch_size: int | None = None,
                 local_bsz_bounds: Sequence[int | None] | None = None,
                 gradient_accumulation: bool = False, profiled_replicas: int | None = None):
        self._goodput_fn = goodput_fn
        self._profiled = profiled_replicas
        self._optimistic_fn = (flat_sync_beyond(goodput_fn, profiled_replicas)
                               if profiled_replicas is not None else goodput_fn)
        self._init = int(goodput_fn.init_batch_size)
        self._max_batch = int(max_batch_size) if max_batch_size is not None else self._init
        if self._max_batch < self._init:
            raise ValueError(f"max_batch_size must be >= init_batch_size ({self._init}), got {max_batch_size}")
        lo, hi = tuple(local_bsz_bounds) if local_bsz_bounds is not None else (None, None)
        self._lo = int(lo) if lo is not None else 1
        self._hi = int(hi) if hi is not None else self._max_batch
        if not 1 <= self._lo <= self._hi:
            raise ValueError(f"local_bsz_bounds must satisfy 1 <= lo <= hi, got {local_bsz_bounds}")
        self._accumulation = bool(gradient_accumulation)
        self._memo: dict[tuple[int, int], float] = {}
        self._base = self._base_goodput()

    def _base_goodput(self) -> float:
        """Goodput on one device; if one device cannot run the job, the best
        per-replica goodput of the smallest replica count that can."""
        base = self.goodput([1], [1])[0]
        if base > 0:
            return float(base)
        reps = np.arange(2, 65)
        goodput = self.goodput(np.ones_like(reps), reps)
        feasible = np.flatnonzero(goodput > 0)
        if not feasible.size:
            raise ValueError("the goodput model gives no feasible configuration up to 64 replicas")
        first = int(feasible[0])
        logger.debug("one device cannot run the job; speedups are relative to %d replicas", reps[first])
        return float(goodput[first] / reps[first])

    @property
    def base_goodput(self) -> float:
        """Goodput on one device (samples per second, weighted by statistical
        efficiency), the unit of every speedup."""
        return self._base

    @property
    def init_batch_size(self) -> int:
        """The job's initial (reference) global batch size."""
        return self._init

    def _search(self, nodes: np.ndarray, reps: np.ndarray) -> np.ndarray:
        """Best goodput on a grid of global batch sizes, for each placement."""
        beyond = reps > self._profiled if self._profiled is not None else np.zeros(len(reps), dtype=bool)
        out = np.zeros(len(reps))
        for mask, fn in ((~beyond, self._goodput_fn), (beyond, self._optimistic_fn)):
            if mask.any():
                out[mask] = self._grid_search(fn, nodes[mask], reps[mask])
        return out

    def _grid_search(self, goodput_fn: Any, nodes: np.ndarray, reps: np.ndarray) -> np.ndarray:
        """Best ``goodput_fn`` value over the batch-size grid, per placement."""
        r = reps.astype(float)[:, None]
        low = np.maximum(self._init, self._lo * r)
        high = np.full_like(low, float(self._max_batch))
        if not self._accumulation:
            high = np.minimum(high, self._hi * r)
            low = np.minimum(low, high)  # below the initial batch only if nothing else fits
        steps = np.linspace(0.0, 1.0, GRID_POINTS)[None, :]
        batch = np.exp(np.log(low) + (np.log(np.maximum(high, low)) - np.log(low)) * steps)
        accum = np.maximum(np.ceil(batch / (r * self._hi) - 1e-9), 1.0) if self._accumulation else np.ones_like(batch)
        local = np.minimum(np.ceil(batch / (r * accum) - 1e-9), np.floor(self._max_batch / (r * accum) + 1e-9))
        local = np.minimum(local, self._hi)
        feasible = local >= self._lo
        local = np.maximum(local, self._lo)
        shape = local.shape
        goodput = np.asarray(goodput_fn.evaluate(
            np.broadcast_to(nodes[:, None], shape), np.broadcast_to(reps[:, None], shape), local, accum))
        best: np.ndarray = np.where(feasible, goodput, 0.0).max(axis=1)
        return best

    def goodput(self, num_nodes: Sequence[int] | np.ndarray, num_replicas: Sequence[int] | np.ndarray) -> np.ndarray:
        """Best goodput on each (nodes, replicas) pair; 0 for 0 replicas."""
        keys = [(int(n), int(r)) for n, r in zip(num_nodes, num_replicas)]
        missing = sorted({k for k in keys if k[1] > 0 and k not in self._memo})
        if missing:
            nodes = np.array([max(k[0], 1) for k in missing])
            reps = np.array([k[1] for k in missing])
            for key, value in zip(missing, self._search(nodes, reps)):
                self._memo[key] = float(value)
        return np.array([self._memo[k] if k[1] > 0 else 0.0 for k in keys])

    def __call__(self, num_nodes: Sequence[int] | np.ndarray, num_replicas: Sequence[int] | np.ndarray) -> np.ndarray:
        """Speedup over one device for each (nodes, replicas) pair."""
        return self.goodput(num_nodes, num_replicas) / self._base


def flat_sync_beyond(goodput_fn: GoodputFunction, replicas: int) -> GoodputFunction:
    """``goodput_fn`` with synchronisation time frozen at its value for ``replicas``."""
    p = goodput_fn.perf_params
    extra = max(int(replicas) - 2, 0)
    flat = PerfParams(alpha_c=p.alpha_c, beta_c=p.beta_c, alpha_n=p.alpha_n + p.beta_n * extra, beta_n=0.0,
                      alpha_r=p.alpha_r + p.beta_r * extra, beta_r=0.0, gamma=p.gamma)
    return GoodputFunction(flat, goodput_fn.grad_params, goodput_fn.init_batch_size)


class SpeedupCache:
    """One :class:`SpeedupFunction` per job, rebuilt only when its model changes.

    Jobs report hints every round; while a job's throughput model and
    gradient statistics stay the same, its speedup table (and everything
    it memoised) is reused.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[object, ...], SpeedupFunction]] = {}

    def get(self, job: str, goodput_fn: Any, max_batch_size: int | None,
            local_bsz_bounds: Sequence[int | None] | None,
            gradient_accumulation: bool, profiled_replicas: int | None = None) -> SpeedupFunction:
        bounds = tuple(local_bsz_bounds) if local_bsz_bounds is not None else None
        key = (goodput_fn.perf_params, goodput_fn.grad_params, goodput_fn.init_batch_size,
               max_batch_size, bounds, bool(gradient_accumulation), profiled_replicas)
        entry = self._entries.get(job)
        if entry is None or entry[0] != key:
            entry = (key, SpeedupFunction(goodput_fn, max_batch_size, bounds, gradient_accumulation,
                                          profiled_replicas))
            self._entries[job] = entry
        return entry[1]

    def retain(self, jobs: Sequence[str]) -> None:
        """Forget every job not in ``jobs``."""
        keep = set(jobs)
        self._entries = {k: v for k, v in self._entries.items() if k in keep}
