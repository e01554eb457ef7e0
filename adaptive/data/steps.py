"""How a loader cuts its epoch into optimizer steps: the shared vocabulary of batching strategies.

An :class:`~adaptive.AdaptiveDataLoader` walks one global, seeded stream per
epoch (guarantee G2).  *How* that stream becomes steps is a batching
strategy:

* :class:`adaptive.data.sample_batches.SampleBatching`: a fixed number of samples
  per step (constant, ramped up by a schedule, or chosen by autoscale);
* :class:`adaptive.data.tokens.batching.TokenBatching`: micro-batches bounded by a
  token budget (see :mod:`adaptive.data.tokens.planner`).

Both produce :class:`PlannedStep` records from the loader's committed
position, lazily and deterministically, so that the data-fetching side may
run ahead of training (prefetching) and a restart from a checkpoint replays
exactly the same steps.  What a step looks like (its *shape*: micro-batch
size and micro-steps) comes from a :class:`StepSizer`, which combines the
three ways the global batch can be set:

=====================  ==================================================
sizing                 the step's global batch
=====================  ==================================================
constant               ``batch_size`` (samples; tokens with a budget)
ramp-up schedule       ``schedule.batch_size_at(consumed)``
autoscale              the goodput model's choice, capped by the schedule
=====================  ==================================================

``consumed`` counts the samples (or real tokens) trained by this loader
over the whole job; it is checkpointed with the position, so a resume in
the middle of a ramp continues the schedule exactly.  With autoscale *and*
a schedule, the schedule bounds autoscale from above
(:meth:`adaptive.batchsize.rampup.BatchSizeSchedule.bounds_at`): autoscale may pick
any size up to the scheduled one but never more.

How a step's loss is weighted (for both strategies) is
:func:`adaptive.data.weighting.loss_weight`.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
from typing import Any, Callable, Iterator

from adaptive.batchsize.rampup import BatchSizeSchedule

__all__ = ["PlannedStep", "StepShape", "StepSizer", "Batching"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The shape of one optimizer step.

    ``micro`` is the size of one micro-step: for sample batches the global
    number of samples of one micro-step (summed over replicas), for token
    budgets the padded-token budget of one replica's micro-batch.
    ``accum`` is the number of micro-steps per replica.
    """

    micro: int
    accum: int


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedStep:
    """One optimizer step as this replica sees it.

    Attributes:
        indices: this replica's sample indices, one list per micro-step.
        padding: per micro-step, True where the micro-batch only repeats
            samples to keep replicas in lock-step (epoch end); its loss
            weight is 0.
        unit: ``"samples"`` or ``"tokens"``: what ``size`` counts.
        size: the step's actual size over all replicas: fresh samples, or
            real (unpadded) tokens.
        planned_size: the size the step's shape stands for (what the
            gradient-noise statistics and the model's LR scaling rule are
            told); ``size / planned_size`` drives the per-step LR factor.
        num_samples: fresh samples of the step over all replicas.
        num_tokens: real tokens of the step (token budgets only, else None).
        padded_tokens: padded tokens computed by all replicas (token
            budgets only, else None).
        shape: the shape the step was planned with.
        position: the strategy's position after this step (committed by
            the loader once the step's samples were all yielded).
    """

    indices: tuple[list[int], ...]
    padding: tuple[bool, ...]
    unit: str
    size: int
    planned_size: int
    num_samples: int
    num_tokens: int | None
    padded_tokens: int | None
    shape: StepShape
    position: Any

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps of this step (the same on every replica)."""
        return len(self.indices)

    @property
    def padding_efficiency(self) -> float | None:
        """Real tokens over padded tokens of the step (token budgets only)."""
        if self.num_tokens is None or not self.padded_tokens:
            return None
        return self.num_tokens / self.padded_tokens


def _cap_shape(shape: StepShape, cap: int, replicas: int, per_replica: bool, floor: int) -> StepShape:
    """Shrink ``shape`` so its global size does not exceed ``cap`` (the schedule's size).

    Drops micro-steps first; if one micro-step is still too large, shrinks
    the micro-step (never below ``floor``).
    """
    width = replicas if per_replica else 1  # micro-steps' global size is micro * width
    if shape.micro * width * shape.accum <= cap:
        return shape
    accum = max(1, cap // (shape.micro * width))
    micro = shape.micro
    if micro * width > cap:
        micro = max(floor, cap // width)
    return StepShape(micro, accum)


class StepSizer:
    """The shape of the next step as a function of ``consumed`` (see the module docstring).

    Args:
        unit: ``"samples"`` or ``"tokens"``.
        schedule: a ramp-up (or constant) schedule of the global batch, in
            ``unit``; None without one.
        cap_only: the schedule only caps autoscale (True whenever autoscale
            is on).
        constant: the step's shape when neither a schedule nor autoscale
            sets it, as a function of the replica count.
        max_micro: the largest micro size (token budget: ``max_tokens``;
            samples: unbounded).
        min_micro: the smallest micro size a shrunk step may use (token
            budget: the longest sample, so that a ramp never makes a
            sample oversize; samples: the replica count).
    """

    def __init__(self, unit: str, schedule: BatchSizeSchedule | None, constant: Callable[[int], StepShape],
                 *, max_micro: int | None = None, min_micro: Callable[[int], int] | None = None) -> None:
        self.unit = unit
        self.schedule = schedule
        self.constant = constant
        self.max_micro = max_micro
        self.min_micro = min_micro or (lambda replicas: 1)
        self.autoscale: Callable[[], tuple[int, int]] | None = None  # controller.current, when on
        self._warned_floor = False

    @property
    def per_replica(self) -> bool:
        """Whether ``StepShape.micro`` is a per-replica size (token budgets) or a global one."""
        return self.unit == "tokens"

    def shape(self, consumed: int, replicas: int) -> StepShape:
        """The shape of the step that starts after ``consumed`` samples (tokens)."""
        floor = self.min_micro(replicas)
        if self.autoscale is not None:
            local, accum = self.autoscale()
            micro = min(local, self.max_micro) if (self.per_replica and self.max_micro) else local
            shape = StepShape(micro if self.per_replica else local * replicas, accum)
            if self.schedule is not None:
                shape = _cap_shape(shape, self.schedule.batch_size_at(consumed), replicas, self.per_replica, floor)
            return shape
        if self.schedule is not None:
            return self._scheduled(self.schedule.batch_size_at(consumed), replicas, floor)
        return self.constant(replicas)

    def _scheduled(self, size: int, replicas: int, floor: int) -> StepShape:
        """A step of ``size`` global samples (one micro-step), or of at most ``size`` padded tokens."""
        if not self.per_replica:
            return StepShape(size, 1)
        limit = self.max_micro or size
        accum = max(1, math.ceil(size / (replicas * limit)))
        budget = min(limit, size // (replicas * accum))
        if budget < floor:
            if not self._warned_floor:
                logger.warning("the scheduled batch of %d tokens gives each of %d replicas a budget of %d tokens, "
                               "below the longest sample (%d tokens); using %d (steps exceed the schedule until "
                               "it grows)", size, replicas, budget, floor, floor)
                self._warned_floor = True
            budget = floor
        return StepShape(budget, accum)

    def planned_size(self, shape: StepShape, replicas: int, micro_steps: int) -> int:
        """The global size a step of ``shape`` with ``micro_steps`` micro-steps stands for."""
        width = replicas if self.per_replica else 1
        return shape.micro * width * micro_steps


class Batching(abc.ABC):
    """A strategy turning the loader's committed position into :class:`PlannedStep` records.

    The position lives in the loader's checkpointed state (``index``,
    ``consumed`` and, for token budgets, ``plan``); strategies read it in
    :meth:`plan` and advance it in :meth:`commit`.
    """

    unit = "samples"
    #: The largest micro-batch in tokens, for token budgets; None for sample batches.
    max_tokens: int | None = None

    @abc.abstractmethod
    def default_batch_size(self, accumulation_steps: int, replicas: int) -> int:
        """The global batch size when neither ``batch_size=`` nor a schedule gives one."""

    @abc.abstractmethod
    def make_sizer(self, batch_size: int, schedule: Any, accumulation_steps: int, global_size: bool) -> StepSizer:
        """How steps are sized: from the reference ``batch_size``, a ramp-up ``schedule`` or autoscale.

        ``global_size``: ``batch_size`` is a fixed global size that must hold
        (token budgets given a global batch of tokens).
        """

    @abc.abstractmethod
    def autoscale_bounds(self, max_batch_size: int, bounds: tuple[int, int] | None) -> tuple[int, int]:
        """The per-replica micro-batch bounds that autoscale may choose from, checked against the batching."""

    @abc.abstractmethod
    def plan(self, state: Any, sizer: StepSizer, replicas: int, rank: int) -> Iterator[PlannedStep]:
        """Steps from the committed position to the end of the epoch (the sampler's epoch is set)."""

    @abc.abstractmethod
    def commit(self, state: Any, step: PlannedStep) -> None:
        """Advance ``state`` past ``step`` (all its micro-batches were yielded)."""

    @abc.abstractmethod
    def reset(self, state: Any) -> None:
        """Forget the position within the loop (a new loop starts at the beginning)."""

    @abc.abstractmethod
    def remaining_micro_steps(self, state: Any, sizer: StepSizer, replicas: int) -> int:
        """Micro-steps of a whole epoch, from its start, at the current shape (what ``len(loader)`` returns)."""

    def resuming(self, state: Any) -> bool:
        """Whether ``state`` is in the middle of a loop."""
        return state.index > 0
