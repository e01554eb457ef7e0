"""Choosing the local batch size and accumulation steps while training runs.

The policy (Pollux): goodput = throughput x statistical efficiency.  The
throughput model is fitted to the step times this job measured
(:class:`~adaptive.batchsize.throughput_profile.ThroughputProfile`); the efficiency follows from
the gradient noise scale measured by :class:`~adaptive.batchsize.gns.GradientNoiseScale`.
Every ``adapt_every`` optimizer steps rank 0 picks the configuration that
maximises goodput within the user's bounds and broadcasts it; all replicas
switch at the same step boundary, so the data stream (G2) continues at the
same position.  A change is made only when it raises goodput by more than
``hysteresis`` (default 5%), so the choice does not flap.  After a restart
with a different number of replicas the decision is remade at once.

At every decision rank 0 also writes the job's *hints* for a cluster
scheduler (throughput-model parameters, gradient statistics, batch limits;
see :mod:`adaptive.goodput.hints`) to ``hints.json`` in the checkpoint folder, and
POSTs them to ``$ADAPTIVE_SUPERVISOR_URL/v1/jobs/<job id>/hints`` (bearer
token ``$ADAPTIVE_SUPERVISOR_TOKEN``) when that variable is set.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from adaptive._utils.checks import check_bool, check_float, check_int
from adaptive._utils.types import StateDict
from adaptive.checkpoint import fencing, states
from adaptive.runtime import collectives
from adaptive.runtime import env
from adaptive.batchsize.hint_posting import post_hints
from adaptive.batchsize.throughput_profile import ThroughputProfile
from adaptive.goodput import CurrentConfig, GoodputFunction, GradParams, Hints, PerfParams, write_hints

__all__ = ["AutoscaleConfig", "BatchSizeController", "Decision"]

logger = logging.getLogger(__name__)

#: Rank 0 re-evaluates the goodput model at most once per this many times the
#: last evaluation took (it then spends at most 1% of the time on it).
EVALUATION_BUDGET = 100
#: Hints are rewritten after every evaluation, and at least this often.
HINTS_REFRESH_SECONDS = 30.0
#: A local batch size this many times beyond the largest one measured on the
#: current placement is unexplored territory for the throughput model.
EXPLORATION_MARGIN = 1.25
#: The throughput model is trusted up to this many times the largest local
#: batch size measured: beyond that it extrapolates a line fitted to a few
#: small batches, whose fixed costs (communication, Python) hide how compute
#: grows.  Larger batches are reached in steps, each one measured first.
GROWTH_LIMIT = 4


@dataclass(frozen=True)
class AutoscaleConfig:
    """The user's limits for the batch-size choice."""

    init_batch_size: int
    max_batch_size: int
    local_bsz_bounds: tuple[int, int]
    gradient_accumulation: bool = False
    adapt_every: int = 20
    hysteresis: float = 0.05

    def __post_init__(self) -> None:
        check_int("init_batch_size", self.init_batch_size, 1)
        bounds = self.local_bsz_bounds
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
            raise TypeError(f"local_bsz_bounds must be two ints (lo, hi), got {bounds!r}")
        lo = check_int("local_bsz_bounds[0]", bounds[0], 1)
        check_int("local_bsz_bounds[1]", bounds[1], lo, hint=" (local_bsz_bounds must have lo <= hi)")
        check_int("max_batch_size", self.max_batch_size, self.init_batch_size,
                  hint=f" (it cannot be below batch_size, {self.init_batch_size})")
        check_int("adapt_every", self.adapt_every, 1, hint=" (optimizer steps)")
        check_bool("gradient_accumulation", self.gradient_accumulation)
        if check_float("hysteresis", self.hysteresis, 0.0) >= 1.0:
            raise ValueError(f"hysteresis must be a fraction in [0, 1), got {self.hysteresis!r}")


@dataclass(frozen=True)
class Decision:
    """A configuration and the goodput it is expected to reach."""

    local_bsz: int
    accum_steps: int
    goodput: float
    previous_goodput: float
    reason: str


class _AutoscaleState(states.State):
    """The throughput profile and the current choice, checkpointed with the loader."""

    def __init__(self, name: str, scope: int | None) -> None:
        super().__init__(name, scope=scope)
        self.profile = ThroughputProfile()
        self.perf_params: PerfParams | None = None
        self.local_bsz: int | None = None
        self.accum_steps = 1
        self.replicas: int | None = None

    def state_dict(self) -> StateDict:
        return {"profile": self.profile.state_dict(),
                "perf_params": None if self.perf_params is None else self.perf_params.state_dict(),
                "local_bsz": self.local_bsz, "accum_steps": self.accum_steps, "replicas": self.replicas}

    def load_state_dict(self, state: StateDict) -> None:
        self.profile.load_state_dict(state["profile"])
        # perf_params: release 0.1 saved the seven fields without a version (read as version 1).
        self.perf_params = None if state["perf_params"] is None else PerfParams.from_state_dict(state["perf_params"])
        self.local_bsz = state["local_bsz"]
        self.accum_steps = int(state["accum_steps"])
        self.replicas = state["replicas"]


class BatchSizeController:
    """Keeps a loader's (local batch size, accumulation steps) at the goodput optimum."""

    def __init__(self, name: str, config: AutoscaleConfig, scope: int | None = None) -> None:
        self.config = config
        self._state = _AutoscaleState(f"adaptive.autoscale.{name}", scope)
        states.load_state(self._state)
        self._warm: tuple[int, int, int] | None = None
        self._evaluated_at: float | None = None  # when rank 0 last evaluated the model (monotonic)
        self._evaluation_cost = 0.0  # seconds that evaluation took
        self._reported_at: float | None = None
        self._fresh = False  # evaluated since the hints were last reported

    @property
    def profile(self) -> ThroughputProfile:
        return self._state.profile

    @property
    def perf_params(self) -> PerfParams | None:
        return self._state.perf_params

    def current(self) -> tuple[int, int]:
        """The configuration in force: (local batch size, accumulation steps)."""
        if self._state.local_bsz is None or self._state.replicas != env.num_replicas():
            self._state.local_bsz, self._state.accum_steps = self._initial_choice(env.num_replicas())
        return self._state.local_bsz, self._state.accum_steps

    def _initial_choice(self, replicas: int) -> tuple[int, int]:
        """Close to the user's batch size, within the bounds."""
        lo, hi = self.config.local_bsz_bounds
        accum = 1
        if self.config.gradient_accumulation:
            accum = max(1, math.ceil(self.config.init_batch_size / (replicas * hi)))
        local = math.ceil(self.config.init_batch_size / (replicas * accum))
        return min(max(local, lo), hi), accum

    def replicas_changed(self) -> bool:
        """True on the first step after a restart with a different replica count."""
        return self._state.replicas is not None and self._state.replicas != env.num_replicas()

    def observe(self, local_bsz: int, accum_steps: int, step_time: float, compute_time: float | None,
                data_time: float | None) -> None:
        """Record one optimizer step's times (seconds).

        The first step after a change of configuration is not recorded: it
        pays one-off costs (DDP rebuilding its buckets, the loader's
        pipeline refilling) that say nothing about the steady state.
        """
        if step_time <= 0 or not math.isfinite(step_time):
            return
        config = (env.num_replicas(), local_bsz, accum_steps)
        if config != self._warm:
            self._warm = config
            return
        sync = 0.0 if env.num_replicas() == 1 else None
        if env.num_replicas() == 1 and accum_steps == 1:
            compute_time = step_time - (data_time or 0.0)
        self.profile.record(env.num_nodes(), env.num_replicas(), local_bsz, accum_steps, step_time=step_time,
                            compute_time=compute_time if compute_time and compute_time > 0 else None,
                            sync_time=sync, data_time=data_time)

    def goodput_function(self, grad_params: GradParams | None) -> GoodputFunction | None:
        """The fitted goodput model, or None while it cannot be built yet."""
        if grad_params is None:
            logger.debug("no gradient statistics yet; keeping the batch size")
            return None
        try:
            fitted = self.profile.fit(initial=self._state.perf_params)
        except (ValueError, FloatingPointError) as error:
            logger.debug("throughput fit failed: %s", error)
            return None
        if fitted is None:
            return None
        self._state.perf_params = fitted
        return GoodputFunction(self._state.perf_params, grad_params, self.config.init_batch_size)

    def hints(self, grad_params: GradParams | None, progress: float,
              completed_fraction: float | None = None) -> Hints:
        """What this job tells a cluster scheduler about itself.

        ``completed_fraction``: the part of the declared training done
        (:func:`adaptive.elastic.epoch.completed_fraction`), None when unknown.
        """
        local, accum = self.current()
        lo, hi = self.config.local_bsz_bounds
        arrays = self.profile.to_arrays()
        return Hints(job_id=env.job_id(), timestamp=time.time(), init_batch_size=self.config.init_batch_size,
                     max_batch_size=self.config.max_batch_size,
                     local_bsz_bounds=(lo, hi),
                     gradient_accumulation=self.config.gradient_accumulation,
                     perf_params=self._state.perf_params, grad_params=grad_params,
                     max_profiled_replicas=int(arrays["num_replicas"].max(initial=0)),
                     max_profiled_nodes=int(arrays["num_nodes"].max(initial=0)), progress=progress,
                     current=CurrentConfig(env.num_nodes(), env.num_replicas(), local, accum),
                     completed_fraction=completed_fraction)

    def report_hints(self, grad_params: GradParams | None, progress: float,
                     completed_fraction: float | None = None) -> None:
        """Write (and send, if a supervisor is configured) the hints; rank 0 only, never raises on I/O.

        ``completed_fraction`` as in :meth:`hints`.

        Only after a new evaluation of the model, or when the last report is
        older than :data:`HINTS_REFRESH_SECONDS` (progress moves on).
        """
        now = time.monotonic()
        if env.rank() != 0 or not (self._fresh or self._reported_at is None
                                   or now - self._reported_at >= HINTS_REFRESH_SECONDS):
            return
        if fencing.stale_generation() is not None:  # a fenced incarnation writes nothing into the folder
            return
        self._fresh, self._reported_at = False, now
        try:
            hints = self.hints(grad_params, progress, completed_fraction)
            write_hints(hints, env.checkpoint_path())
            supervisor = env.supervisor()
            if supervisor is not None:
                url, token = supervisor
                post_hints(f"{url.rstrip('/')}/v1/jobs/{hints.job_id}/hints", hints, token=token)
        except (OSError, ValueError) as error:
            logger.warning("could not report scheduler hints (%s); training goes on", error)

    def decide(self, grad_params: GradParams | None, force: bool = False) -> Decision | None:
        """Agree on the configuration for the next steps; collective, call on every replica.

        Rank 0 evaluates the model and broadcasts its choice; every replica
        returns the same :class:`Decision`, or None when nothing changes.
        """
        decision = None
        if env.rank() == 0 and (force or self._evaluation_due()):
            started = time.perf_counter()
            decision = self._propose(grad_params, force)
            self._evaluation_cost = time.perf_counter() - started
            self._evaluated_at, self._fresh = time.monotonic(), True
        decision = collectives.broadcast_object(decision)
        if force and env.rank() == 0:
            local, accum = self.current()
            logger.info("replica count changed from %s to %d: batch size re-decided: %s", self._state.replicas,
                        env.num_replicas(), "keeping local %d x %d steps" % (local, accum) if decision is None
                        else "local %d x %d steps" % (decision.local_bsz, decision.accum_steps))
        self._state.replicas = env.num_replicas()
        if decision is not None:
            self._state.local_bsz, self._state.accum_steps = decision.local_bsz, decision.accum_steps
        return decision

    def _evaluation_due(self) -> bool:
        """Whether fitting and optimizing again keeps them under 1/EVALUATION_BUDGET of the time.

        With short steps (small models, small batches) ``adapt_every`` steps
        can take less than a second while one evaluation takes milliseconds.
        """
        if self._evaluated_at is None:
            return True
        return time.monotonic() - self._evaluated_at >= EVALUATION_BUDGET * self._evaluation_cost

    def _propose(self, grad_params: GradParams | None, force: bool) -> Decision | None:
        function = self.goodput_function(grad_params)
        if function is None:
            return None
        nodes, replicas = env.num_nodes(), env.num_replicas()
        local, accum = self.current()
        profiled = self.profile.to_arrays()
        goodput, best_local, best_accum = function.optimize(
            nodes, replicas, max_batch_size=self.config.max_batch_size,
            local_bsz_bounds=self._trusted_bounds(profiled),
            gradient_accumulation=self.config.gradient_accumulation)
        goodput, best_local, best_accum = float(goodput), int(best_local), int(best_accum)
        now = float(function.evaluate(nodes, replicas, local, accum))
        logger.debug("goodput now %.1f at local %d x %d; best %.1f at local %d x %d", now, local, accum,
                     goodput, best_local, best_accum)
        if (best_local, best_accum) == (local, accum) or goodput <= 0 or \
                (not force and goodput <= now * (1 + self.config.hysteresis)):
            return self._explore(function, profiled, local, accum, now, (best_local, best_accum, goodput))
        reason = "the replica count changed" if force else f"goodput rises {100 * (goodput / max(now, 1e-12) - 1):.1f}%"
        return Decision(best_local, best_accum, goodput, now, reason)

    def _trusted_bounds(self, arrays: dict[str, np.ndarray]) -> tuple[int, int]:
        """The user's local batch bounds, capped at GROWTH_LIMIT times the largest size measured."""
        lo, hi = self.config.local_bsz_bounds
        largest = int(arrays["local_bsz"].max(initial=0))
        return (lo, hi) if largest == 0 else (lo, max(lo, min(hi, GROWTH_LIMIT * largest)))

    def _explore(self, function: GoodputFunction, arrays: dict[str, np.ndarray], local: int, accum: int, now: float,
                 best: tuple[int, int, float]) -> Decision | None:
        """Measure a larger local batch when the throughput model cannot judge it.

        * While only one size was measured on this placement, the model
          cannot tell fixed costs from per-sample costs, and its cautious
          prior would keep the batch where it started: try twice the size
          (skipped only when the model predicts losing more than half the
          goodput, since it is least trustworthy exactly here).
        * When the best configuration lies beyond the largest size measured
          (by EXPLORATION_MARGIN) and is predicted no worse than the current
          one, but by less than ``hysteresis``: the model extrapolates there,
          so measuring it is worth more than the margin.  Without this the
          batch can stay below sizes that would be faster, since an
          extrapolated gain rarely clears the hysteresis.
        """
        nodes, replicas = env.num_nodes(), env.num_replicas()
        here = (arrays["num_nodes"] == nodes) & (arrays["num_replicas"] == replicas)
        measured = set(arrays["local_bsz"][here].tolist())
        best_local, best_accum, best_goodput = best
        if len(measured) > 1:
            if best_local > EXPLORATION_MARGIN * max(measured) and best_goodput >= now and best_goodput > 0:
                return Decision(best_local, best_accum, best_goodput, now,
                                "exploring: the best size lies beyond those measured")
            return None
        larger = min(2 * local, self.config.local_bsz_bounds[1])
        if larger == local or larger * accum * replicas > self.config.max_batch_size:
            return None
        expected = float(function.evaluate(nodes, replicas, larger, accum))
        if expected < 0.5 * now:
            return None
        return Decision(larger, accum, expected, now, "exploring: measuring the throughput of a larger batch")
