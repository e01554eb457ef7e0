"""Autoscale for :class:`~adaptive.integrations.transformers.AdaptiveTrainer`: the Trainer's view of adaptive steps.

Private to :mod:`adaptive.integrations.transformers`; nothing here imports
transformers.  With autoscale on, the loader chooses the micro-batch size
and the number of micro-batches of each optimizer step (the goodput model,
:meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`).  The Trainer
still takes one batch per optimizer step, so that its prefetching never
runs ahead of the loader's plan:

* :class:`AutoscaleSettings`: the trainer's autoscale arguments, checked
  with the library's own validator and applied to the training loader;
* :class:`StepBatch`: what the Trainer takes as one batch, one optimizer
  step whose micro-batches are drawn from the loader one at a time, as the
  trainer's ``training_step`` trains them (each micro-batch is published to
  the model wrapper only when it is drawn: gradient synchronisation and the
  noise-scale measurement follow the step's own micro-steps);
* :class:`OptimizerSteps`: the training dataloader the Trainer iterates,
  one :class:`StepBatch` per optimizer step, whose ``len()`` is the epoch's
  *reference* steps (see below);
* :func:`reference_steps`: the Trainer's step counter in reference batches.

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

import dataclasses
import logging
from typing import Any, Callable, Iterator

import torch

from adaptive.batchsize.autoscale import AutoscaleConfig
from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.integrations._epoch_passes import EpochPasses

__all__ = ["AutoscaleSettings", "OptimizerSteps", "StepBatch", "reference_steps", "settings_from"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AutoscaleSettings:
    """The arguments of :meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`, as the trainer takes them."""

    max_batch_size: int
    local_bsz_bounds: tuple[int, int] | None = None
    gradient_accumulation: bool = False
    adapt_every: int = 20
    hysteresis: float = 0.05

    def check(self) -> None:
        """The library's validator (:class:`~adaptive.batchsize.autoscale.AutoscaleConfig`), at construction.

        ``max_batch_size`` >= the reference global batch is checked when the
        loader is made (the reference is the first launch's, restored from
        the checkpoint).

        Raises:
            ValueError, TypeError: a value out of range, naming the argument.
        """
        bounds = self.local_bsz_bounds if self.local_bsz_bounds is not None else (1, self.max_batch_size)
        AutoscaleConfig(1, self.max_batch_size, bounds, self.gradient_accumulation, self.adapt_every,
                        self.hysteresis)

    def apply(self, loader: AdaptiveDataLoader) -> None:
        """Turn autoscale on for ``loader`` (which checks ``max_batch_size`` against its reference batch)."""
        loader.autoscale_batch_size(self.max_batch_size, self.local_bsz_bounds, self.gradient_accumulation,
                                    adapt_every=self.adapt_every, hysteresis=self.hysteresis)


def settings_from(max_batch_size: int | None, local_bsz_bounds: tuple[int, int] | None,
                  gradient_accumulation: bool, adapt_every: int, hysteresis: float) -> AutoscaleSettings | None:
    """The checked settings, or None when autoscale is off (``max_batch_size`` not given).

    Raises:
        ValueError: another autoscale setting given without ``max_batch_size``,
            or a value out of range (naming the argument).
    """
    if max_batch_size is None:
        given = {"local_bsz_bounds": local_bsz_bounds is not None, "gradient_accumulation": bool(gradient_accumulation),
                 "adapt_every": adapt_every != 20, "hysteresis": hysteresis != 0.05}
        named = [name for name, value in given.items() if value]
        if named:
            raise ValueError(f"AdaptiveTrainer: {', '.join(named)} only apply with autoscale; pass "
                             "max_batch_size= (the largest global batch) to turn it on")
        return None
    settings = AutoscaleSettings(max_batch_size, local_bsz_bounds, gradient_accumulation, adapt_every, hysteresis)
    settings.check()  # (local_bsz_bounds: two ints, or a TypeError naming it)
    if local_bsz_bounds is None:
        return settings
    return dataclasses.replace(settings, local_bsz_bounds=(local_bsz_bounds[0], local_bsz_bounds[1]))


def reference_steps(loader: AdaptiveDataLoader, reference_batch: int, epoch: int, position: int) -> int:
    """The Trainer's step count after a step that ends at sample ``position`` of ``epoch`` (see the module)."""
    per_epoch = max(1, loader.sampler.num_steps(0, reference_batch))
    if position >= loader.sampler.num_samples:  # the epoch's end: its (possibly partial) last step counts whole
        return (epoch + 1) * per_epoch
    return epoch * per_epoch + min(per_epoch, position // reference_batch)


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
