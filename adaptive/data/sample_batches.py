"""Sample batches: each step takes the next global batch of samples from the epoch's stream.

The batching strategy behind ``AdaptiveDataLoader(dataset, batch_size=...)``
(see :mod:`adaptive.data.steps`).  A step of shape ``(micro, accum)`` takes
up to ``accum`` micro-steps of ``micro`` global samples each from stream
position ``state.index`` on; each micro-step is split across replicas by
:meth:`adaptive.data.sampler.ElasticSampler.local_indices` (even shares, larger
ones to lower ranks).  Everything is a function of the committed position,
the shape and the replica count, so a job may restart, rescale or change
its batch size between any two steps (guarantee G2).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from adaptive.data.sampler import ElasticSampler
from adaptive.data.steps import Batching, PlannedStep, StepShape, StepSizer

__all__ = ["SampleBatching"]

logger = logging.getLogger(__name__)


class SampleBatching(Batching):
    """Steps of a fixed (or scheduled, or autoscaled) number of samples."""

    unit = "samples"

    def __init__(self, sampler: ElasticSampler, name: str) -> None:
        self.sampler = sampler
        self.name = name

    def default_batch_size(self, accumulation_steps: int, replicas: int) -> int:
        return 1  # as torch's DataLoader

    def make_sizer(self, batch_size: int, schedule: Any, accumulation_steps: int, global_size: bool) -> StepSizer:
        """Steps of ``batch_size`` samples, in ``accumulation_steps`` micro-batches of equal global size."""
        if batch_size % accumulation_steps:  # a checkpointed batch size that the accumulation does not divide
            logger.warning("loader %s: batch size %d is not a multiple of accumulation_steps=%d; each step is one "
                           "micro-batch", self.name, batch_size, accumulation_steps)
            accumulation_steps = 1
        shape = StepShape(batch_size // accumulation_steps, accumulation_steps)
        return StepSizer("samples", schedule, lambda replicas: shape, min_micro=lambda replicas: replicas)

    def autoscale_bounds(self, max_batch_size: int, bounds: tuple[int, int] | None) -> tuple[int, int]:
        return (1, max_batch_size) if bounds is None else (bounds[0], bounds[1])

    def plan(self, state: Any, sizer: StepSizer, replicas: int, rank: int) -> Iterator[PlannedStep]:
        return self._steps(state.index, state.consumed, sizer, replicas, rank)

    def _steps(self, position: int, consumed: int, sizer: StepSizer, replicas: int,
               rank: int) -> Iterator[PlannedStep]:
        while True:
            shape = sizer.shape(consumed, replicas)
            step = self._step(position, shape, sizer, replicas, rank)
            if step is None:
                return
            yield step
            position, consumed = step.position, consumed + step.size

    def _step(self, position: int, shape: StepShape, sizer: StepSizer, replicas: int,
              rank: int) -> PlannedStep | None:
        if shape.micro < replicas:
            what = "batch_size" if shape.accum == 1 else "micro-batch (batch_size / accumulation_steps)"
            raise ValueError(f"loader {self.name}: {what}={shape.micro} is smaller than the number of "
                             f"replicas ({replicas}); every replica needs at least one sample per micro-batch")
        indices, padding, start = [], [], position
        for _ in range(shape.accum):
            taken = self.sampler.step_size(start, shape.micro)
            if taken == 0:
                break
            lo, hi = self.sampler.local_range(start, shape.micro, replicas, rank)
            indices.append(self.sampler.local_indices(start, shape.micro, replicas, rank).tolist())
            padding.append(lo == hi)
            start += taken
        if not indices:
            return None
        fresh = start - position
        return PlannedStep(tuple(indices), tuple(padding), "samples", fresh,
                           sizer.planned_size(shape, replicas, len(indices)), fresh, None, None, shape, start)

    def commit(self, state: Any, step: PlannedStep) -> None:
        state.index = step.position
        state.consumed += step.size

    def reset(self, state: Any) -> None:
        state.index = 0

    def remaining_micro_steps(self, state: Any, sizer: StepSizer, replicas: int) -> int:
        """Micro-steps from the start of the epoch at the current shape (for ``len(loader)``)."""
        shape = sizer.shape(state.consumed, replicas)
        return self.sampler.num_steps(0, shape.micro)
