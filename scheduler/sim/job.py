"""A simulated training job: progress, batch size and restarts over time.

The job advances through its epochs at the speed its measured profile
gives for its current placement and batch size:

    progress per second = gain(batch, epoch) / step_time(placement, batch)

and is done once its progress reaches the model's fixed number of epochs.
Every change of allocation costs a restart delay during which it holds its
GPUs but makes no progress.

A *fixed* job runs the workload's tuned global batch size. An *adaptive*
job behaves like a job using the adaptive loader:

* it learns its throughput model online: on every (nodes, replicas) it has
  run on, it knows the step times at the measured local batch sizes (a
  real job profiles the batch sizes it tries there), and its model is
  :func:`adaptive.goodput.fit_perf_params` over those measurements. The
  fit depends only on the model and the set of (nodes, replicas) visited,
  so :class:`ThroughputModels` shares it between jobs;
* it reports the gradient statistics of its current batch size and epoch;
* it picks the local batch and accumulation steps of best goodput on each
  new allocation and at each epoch boundary, changing only when goodput
  rises by more than 5% (as the adaptive loader's controller does).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from adaptive.goodput import GoodputFunction, GradParams, PerfParams, fit_perf_params
from scheduler.cluster import Allocation, num_nodes_of, placement_of
from scheduler.profiles import ModelProfile
from scheduler.sim.workload import WorkloadJob

logger = logging.getLogger(__name__)

#: A new batch size must raise predicted goodput by this much to be adopted.
HYSTERESIS = 0.05

_Visited = frozenset[tuple[int, int]]


class ThroughputModels:
    """Fitted throughput models by (model, set of (nodes, replicas) profiled).

    The measurements follow from the placements visited, so jobs that
    explored the same placements share one fit. A job that adds a placement
    refits starting from its previous model (``initial``), as the adaptive
    loader does, which is several times cheaper than a fit from scratch.
    """

    def __init__(self) -> None:
        self._fits: dict[tuple[str, _Visited], PerfParams] = {}

    def get(self, profile: ModelProfile, visited: _Visited, initial: PerfParams | None = None) -> PerfParams:
        key = (profile.name, visited)
        params = self._fits.get(key)
        if params is None:
            rows = [(n, r, b, step, sync) for n, r in sorted(visited)
                    for b, step, sync in profile.profile_points(n, r)]
            nodes, reps, bsz, step, sync = (np.array(col) for col in zip(*rows))
            params = fit_perf_params(nodes, reps, bsz, np.ones(len(rows), dtype=int), step, step - sync, sync,
                                     initial=initial)
            self._fits[key] = params
            logger.debug("fitted %s on %s: %s", profile.name, sorted(visited), params)
        return params

    def __len__(self) -> int:
        return len(self._fits)


class SimulatedJob:
    """State of one workload job inside the simulator.

    Args:
        spec: the workload row.
        profile: the model's measured profile.
        adaptive: pick the batch size by goodput (``True``) or run the
            tuned ``spec.batch_size`` (``False``).
        restart_penalty: seconds without progress after each (re)allocation.
        models: shared cache of fitted throughput models (adaptive jobs).
    """

    def __init__(self, spec: WorkloadJob, profile: ModelProfile, adaptive: bool,
                 restart_penalty: float, models: ThroughputModels | None = None):
        if restart_penalty < 0:
            raise ValueError(f"restart_penalty must be >= 0, got {restart_penalty}")
        self.spec = spec
        self.profile = profile
        self.adaptive = adaptive
        self.restart_penalty = float(restart_penalty)
        self.allocation: Allocation = ()
        self.local_bsz = 0
        self.accum_steps = 1
        self.epoch = 0
        self.progress = 0.0
        self.attained_service = 0.0
        self.completion_time: float | None = None
        self.num_starts = 0
        self._restart_left = 0.0
        self._placement: tuple[int, ...] = ()
        self._models = models if models is not None else ThroughputModels()
        self._visited: _Visited = frozenset()
        self._perf: PerfParams | None = None

    # ---------------------------------------------------------------- queries
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def submission_time(self) -> float:
        return self.spec.submission_time

    @property
    def done(self) -> bool:
        return self.completion_time is not None

    @property
    def num_restarts(self) -> int:
        """Reallocations after the first start."""
        return max(self.num_starts - 1, 0)

    @property
    def num_replicas(self) -> int:
        return len(self.allocation)

    @property
    def batch_size(self) -> int:
        """Current global batch: replicas x local batch x accumulation steps."""
        return self.num_replicas * self.local_bsz * self.accum_steps

    @property
    def max_profiled_replicas(self) -> int:
        return max((r for _, r in self._visited), default=0)

    @property
    def perf_params(self) -> PerfParams | None:
        """Throughput model learned so far (``None`` before the job first ran)."""
        return self._perf

    @property
    def completed_fraction(self) -> float:
        """Fraction of the job's training done, as it reports it in its hints.

        A real job looping over a declared number of epochs knows how many
        samples each epoch has, so it knows exactly how much of its
        training is done. Here an epoch is an amount of progress (see the
        module docstring), so the same knowledge is progress over the
        progress at the last epoch.
        """
        return min(self.progress / self.profile.total_progress, 1.0)

    def grad_stats(self) -> tuple[float, float]:
        """Gradient (sqr, var) the job currently measures (var relative to the initial batch)."""
        batch = self.batch_size or self.profile.init_batch_size
        return self.profile.grad_stats(batch, self.epoch)

    def goodput_function(self) -> GoodputFunction | None:
        """The job's goodput model as it would report it, or ``None``."""
        perf = self.perf_params
        if perf is None:
            return None
        sqr, var = self.grad_stats()
        return GoodputFunction(perf, GradParams(sqr=sqr, var=var), self.profile.init_batch_size)

    # -------------------------------------------------------------- lifecycle
    def reallocate(self, allocation: Allocation) -> None:
        """Move the job to ``allocation`` (``()`` suspends it).

        Any change of a non-empty allocation restarts the job from its
        checkpoint, which costs ``restart_penalty`` seconds.
        """
        allocation = tuple(allocation)
        if allocation == self.allocation or self.done:
            return
        self.allocation = allocation
        self._placement = placement_of(allocation) if allocation else ()
        if not allocation:
            self._restart_left = 0.0
            return
        self.num_starts += 1
        self._restart_left = self.restart_penalty
        if self.adaptive:
            placement = (len(self._placement), len(allocation))
            if placement not in self._visited:
                self._visited = self._visited | {placement}
                self._perf = self._models.get(self.profile, self._visited, initial=self._perf)
        self._choose_batch(force=True)

    def advance(self, start: float, seconds: float) -> None:
        """Simulate ``seconds`` of wall time starting at time ``start``."""
        if self.done or not self.allocation or seconds <= 0:
            return
        replicas = self.num_replicas
        delay = min(self._restart_left, seconds)
        self._restart_left -= delay
        self.attained_service += delay * replicas
        now, left = start + delay, seconds - delay
        while left > 0:
            rate = self._progress_rate()
            target = self.profile.progress_at_epoch(self.epoch + 1)
            needed = (target - self.progress) / rate
            if needed > left:
                self.progress += rate * left
                self.attained_service += left * replicas
                return
            self.progress = target
            self.epoch += 1
            now += needed
            left -= needed
            self.attained_service += needed * replicas
            if self.epoch >= self.profile.max_epochs:
                self.completion_time = now
                logger.debug("%s done at %.0f s", self.name, now)
                return
            self._choose_batch(force=False)

    # ---------------------------------------------------------------- physics
    def _progress_rate(self) -> float:
        """Progress per second at the current configuration and epoch."""
        step, sync = self.profile.step_time(self._placement, self.local_bsz)
        step_time = step + (self.accum_steps - 1) * (step - sync)
        return self.profile.gain(self.batch_size, self.epoch) / step_time

    # ------------------------------------------------------------- batch size
    def _choose_batch(self, force: bool) -> None:
        """Set (local batch, accumulation steps) for the current allocation."""
        if not self.adaptive:
            self.local_bsz, self.accum_steps = self._fixed_config()
            return
        model = self.goodput_function()
        if model is None:
            return
        prof, nodes, replicas = self.profile, num_nodes_of(self.allocation), self.num_replicas
        best, local, accum = model.optimize(
            nodes, replicas, max_batch_size=prof.max_batch_size,
            local_bsz_bounds=(prof.min_local_bsz, prof.max_local_bsz), gradient_accumulation=True)
        if not force and self.local_bsz:
            now = model.evaluate(nodes, replicas, self.local_bsz, self.accum_steps)
            if best <= now * (1 + HYSTERESIS):
                return
        self.local_bsz, self.accum_steps = int(local), max(int(accum), 1)

    def _fixed_config(self) -> tuple[int, int]:
        """Split the tuned global batch over replicas and micro-batches."""
        prof, replicas = self.profile, self.num_replicas
        local = math.ceil(self.spec.batch_size / replicas)
        accum = max(math.ceil(local / prof.max_local_bsz), 1)
        micro = math.ceil(local / accum)
        micro = min(micro, max(prof.max_batch_size // (replicas * accum), 1))
        return max(micro, 1), accum
