"""What a policy knows about a job when it decides allocations.

The same :class:`JobInfo` is built by the simulator (from a simulated job)
and by the supervisor/executor (from a job's reported hints), so a policy
never knows which of the two is calling it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.cluster import Allocation
from scheduler.speedup import SpeedupCache, SpeedupFunction

if TYPE_CHECKING:
    from adaptive.goodput import Hints

logger = logging.getLogger(__name__)


@dataclass
class JobInfo:
    """Scheduling view of one active job.

    Attributes:
        name: unique job id.
        submission_time: when the job arrived (seconds, same clock as ``now``).
        min_replicas: fewest replicas the job can run with (0 = no guarantee).
        max_replicas: most replicas it may get; fixed-size policies give
            exactly this many.
        preemptible: ``False`` pins the job to its allocation once it has one.
        attained_service: GPU-seconds used so far (restart time included).
        num_restarts: reallocations after the first start.
        speedup_fn: speedup by (nodes, replicas); ``None`` until the job has
            reported a throughput model (then speedup is assumed linear).
        profiled_replicas: largest replica count its throughput model has
            seen (0: none yet); goodput-driven policies explore from there.
            ``None`` when not applicable (fixed-size jobs).
        remaining_work: estimated seconds one device would need to finish
            the job at its best batch size (see :func:`estimate_remaining_work`);
            ``None`` when unknown (no declared epoch count, too little done
            yet, or no goodput model).
    """

    name: str
    submission_time: float = 0.0
    min_replicas: int = 0
    max_replicas: int = 1
    preemptible: bool = True
    attained_service: float = 0.0
    num_restarts: int = 0
    speedup_fn: SpeedupFunction | None = None
    profiled_replicas: int | None = None
    remaining_work: float | None = None

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"job {self.name!r}: min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"job {self.name!r}: max_replicas must be >= max(min_replicas, 1), "
                             f"got min={self.min_replicas}, max={self.max_replicas}")
        if self.remaining_work is not None and not self.remaining_work >= 0:
            raise ValueError(f"job {self.name!r}: remaining_work must be >= 0 seconds or None, "
                             f"got {self.remaining_work}")

    def is_pinned(self, current: Allocation) -> bool:
        """A non-preemptible job that already runs keeps its allocation."""
        return not self.preemptible and bool(current)


def batch_replica_limit(max_replicas: int, max_batch_size: int | None = None,
                        local_bsz_bounds: Sequence[int | None] | None = None) -> int:
    """Most replicas a job may use: its own limit, and no more than its
    largest batch can feed with the smallest local batch."""
    limit = max_replicas
    low = local_bsz_bounds[0] if local_bsz_bounds is not None else None
    if max_batch_size is not None and low:
        limit = min(limit, max(1, int(max_batch_size) // int(low)))
    return limit


def estimate_remaining_work(speedup_fn: SpeedupFunction | None, progress: float,
                            completed_fraction: float | None) -> float | None:
    """Seconds one device would need to finish a job, or ``None`` if unknown.

    A job that declares its epoch count reports the fraction ``f`` of it that
    is done and its scale-invariant ``progress`` (reference-batch steps
    gained so far). The rest is extrapolated at the same progress per epoch,
    ``progress * (1 - f) / f`` reference steps, and turned into time at the
    job's goodput on one device (``init_batch_size`` samples per reference
    step). Dividing by the speedup of an allocation gives the time left
    there, which is what the policy weighs and what a restart is charged
    against. ``None`` before the job has a goodput model or any progress,
    and when it declared no epoch count.
    """
    if speedup_fn is None or completed_fraction is None or progress <= 0:
        return None
    if not 0 < completed_fraction <= 1:
        return None
    steps_left = progress * (1.0 - completed_fraction) / completed_fraction
    return float(steps_left * speedup_fn.init_batch_size / speedup_fn.base_goodput)


def job_info_from_model(name: str, goodput_fn: Any, *, submission_time: float,
                        max_batch_size: int | None, local_bsz_bounds: Sequence[int | None] | None,
                        gradient_accumulation: bool, max_profiled_replicas: int,
                        min_replicas: int = 0, max_replicas: int = 64, preemptible: bool = True,
                        attained_service: float = 0.0, num_restarts: int = 0,
                        speedup_cache: SpeedupCache | None = None, progress: float = 0.0,
                        completed_fraction: float | None = None) -> JobInfo:
    """A :class:`JobInfo` for a job whose goodput model is ``goodput_fn``
    (``None``: no throughput model yet, so speedup is assumed linear);
    ``progress`` and ``completed_fraction`` (as in the hints) give its
    remaining work."""
    limit = batch_replica_limit(max_replicas, max_batch_size, local_bsz_bounds)
    speedup_fn = None
    if goodput_fn is not None:
        profiled = max(int(max_profiled_replicas), 1)
        try:
            if speedup_cache is not None:
                speedup_fn = speedup_cache.get(name, goodput_fn, max_batch_size, local_bsz_bounds,
                                               gradient_accumulation, profiled)
            else:
                speedup_fn = SpeedupFunction(goodput_fn, max_batch_size, local_bsz_bounds, gradient_accumulation,
                                             profiled)
        except ValueError as exc:
            logger.warning("job %s: ignoring its goodput model: %s", name, exc)
    return JobInfo(name=name, submission_time=submission_time, min_replicas=min_replicas,
                   max_replicas=max(limit, min_replicas, 1), preemptible=preemptible,
                   attained_service=attained_service, num_restarts=num_restarts, speedup_fn=speedup_fn,
                   profiled_replicas=int(max_profiled_replicas),
                   remaining_work=estimate_remaining_work(speedup_fn, progress, completed_fraction))


def job_info_from_hints(name: str, hints: Hints | None, *, submission_time: float, min_replicas: int = 0,
                        max_replicas: int = 64, preemptible: bool = True, attained_service: float = 0.0,
                        num_restarts: int = 0, speedup_cache: SpeedupCache | None = None) -> JobInfo:
    """A :class:`JobInfo` from a job's reported :class:`adaptive.goodput.Hints`
    (``None`` if it has not reported yet: nothing profiled, no model)."""
    common: dict[str, Any] = dict(submission_time=submission_time, min_replicas=min_replicas,
                                  max_replicas=max_replicas, preemptible=preemptible,
                                  attained_service=attained_service, num_restarts=num_restarts)
    if hints is None:
        return job_info_from_model(name, None, max_batch_size=None, local_bsz_bounds=None,
                                   gradient_accumulation=False, max_profiled_replicas=0, **common)
    return job_info_from_model(
        name, hints.goodput_function(), max_batch_size=hints.max_batch_size,
        local_bsz_bounds=hints.local_bsz_bounds, gradient_accumulation=hints.gradient_accumulation,
        max_profiled_replicas=hints.max_profiled_replicas, speedup_cache=speedup_cache,
        progress=hints.progress, completed_fraction=hints.completed_fraction, **common)
