"""Autoscale for :class:`~adaptive.integrations.transformers.AdaptiveTrainer`: the Trainer's view of adaptive steps.

Private to :mod:`adaptive.integrations.transformers`; nothing here imports
transformers.  With autoscale on, the loader chooses the micro-batch size
and the number of micro-batches of each optimizer step (the goodput model,
:meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`).  The Trainer
still takes one batch per optimizer step, so that its prefetching never
runs ahead of the loader's plan:

* the trainer's autoscale arguments and its step count are the other
  front-ends' (:mod:`adaptive.integrations._autoscale_settings`);
* :class:`StepBatch`: what the Trainer takes as one batch, one optimizer
  step whose micro-batches are drawn from the loader one at a time, as the
  trainer's ``training_step`` trains them (each micro-batch is published to
  the model wrapper only when it is drawn: gradient synchronisation and the
  noise-scale measurement follow the step's own micro-steps);
* :class:`OptimizerSteps`: the training dataloader the Trainer iterates,
  one :class:`StepBatch` per optimizer step, whose ``len()`` is the epoch's
  *reference* steps (see below);
* the Trainer's step counter in reference batches
  (:func:`~adaptive.integrations._autoscale_settings.reference_steps`).

**Reference steps.**  The Trainer counts ``global_step``, ``max_steps``,
warm-up, decay, logging, evaluation and save intervals in steps of the
reference global batch (the first launch's ``per_device_train_batch_size``
x processes x ``gradient_accumulation_steps``): after a step that ends at
sample ``p`` of epoch ``e`` the count is ``e x S + floor(p / B0)``, and
``(e + 1) x S`` at the epoch's end (``S`` the reference steps of an epoch,
``B0`` the reference batch), so that the schedule follows the samples
whatever batch autoscale chooses, and is the Trainer's own count when the
batch stays at ``B0``.  An optimizer step always advances it by at least
one (a step smaller than ``B0``, which autoscale chooses only when its
bounds allow nothing larger, puts the count ahead of the samples).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch

from adaptive.integrations._epoch_passes import EpochPasses

__all__ = ["OptimizerSteps", "StepBatch"]

logger = logging.getLogger(__name__)


class StepBatch(dict):
    """One optimizer step as the Trainer takes it: its micro-batches, drawn from the loader as they are trained.

    A ``dict`` (the Trainer looks for input names in its batches): once the
    step is trained it holds, flattened over the micro-batches, the inputs
    the Trainer counts tokens with (``count_keys``), so that its token and
    FLO counters see the whole step.
    """

    def __init__(self, first: Any, count: int, rest: Iterator[Any]) -> None:
        super().__init__()
        self._first: Any = first
        self._rest = rest
        self.count = count
        self.flos = 0.0

    @property
    def trained(self) -> bool:
        """Whether the step's micro-batches were drawn (by :meth:`micro_batches`)."""
        return self._first is None

    def micro_batches(self) -> Iterator[Any]:
        """The step's micro-batches, each drawn from the loader when the previous one was trained."""
        if self._first is None:
            raise RuntimeError("an optimizer step's micro-batches can be trained once")
        first, self._first = self._first, None
        yield first
        for _ in range(self.count - 1):
            yield next(self._rest)

    def keep_counts(self, parts: dict[str, list[torch.Tensor]]) -> None:
        """Hold the concatenation of each input's flattened micro-batch tensors (for the Trainer's counters)."""
        for key, tensors in parts.items():
            if tensors:
                self[key] = torch.cat([tensor.reshape(-1) for tensor in tensors])


class OptimizerSteps:
    """The training dataloader the Trainer iterates under autoscale: one :class:`StepBatch` per optimizer step.

    ``len()`` is the reference steps of an epoch (what the Trainer sizes
    ``max_steps`` and the LR schedule with); the number of optimizer steps
    varies with the batch autoscale chooses, and the trainer ends the
    Trainer's epoch when the loader's pass is over.
    """

    def __init__(self, passes: EpochPasses, reference_batch: Callable[[], int]) -> None:
        self.passes = passes
        self.loader = passes.loader
        self.dataset = passes.dataset
        self._reference_batch = reference_batch

    def __len__(self) -> int:
        return max(1, self.loader.sampler.num_steps(0, self._reference_batch()))

    def __iter__(self) -> Iterator[StepBatch]:
        return self._steps(iter(self.passes))

    def _steps(self, micro_batches: Iterator[Any]) -> Iterator[StepBatch]:
        for first in micro_batches:
            where = self.loader.micro_step
            count = where[1] if where is not None else 1
            step = StepBatch(first, count, micro_batches)
            yield step
            if not step.trained:
                raise RuntimeError("AdaptiveTrainer: an optimizer step was taken without training its micro-batches")
