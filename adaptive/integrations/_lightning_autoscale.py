"""Autoscale for :class:`~adaptive.integrations.lightning.AdaptiveStrategy`: Lightning's view of adaptive steps.

Private to :mod:`adaptive.integrations.lightning`; nothing here imports
Lightning (the strategy passes Lightning's values in, and Lightning's
private parts stay in :mod:`adaptive.integrations._lightning_loops`).

With autoscale on, the training loader chooses the micro-batch size and the
number of micro-batches of each optimizer step from the goodput model
(:meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`).  Lightning
still takes one micro-batch per training batch; what changes:

* the strategy's autoscale arguments and the steps its LR schedule counts
  are the other front-ends' (:mod:`adaptive.integrations._autoscale_settings`);
* :class:`PlannedPasses`: the loader's passes, which tell the strategy
  about every micro-batch *before* Lightning's data fetcher counts it, so
  that Lightning's accumulation (``accumulate_grad_batches``, whether the
  optimizer steps) and its count of the epoch's batches (its last batch,
  its validation, epoch-interval schedulers) follow the loader's plan;
* :func:`epoch_micro_batches`: that count for the epoch in progress.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.integrations._epoch_passes import EpochPasses

__all__ = ["PlannedPasses", "epoch_micro_batches"]

logger = logging.getLogger(__name__)


def epoch_micro_batches(loader: AdaptiveDataLoader, fetched_before: int) -> int:
    """The micro-batches of the epoch in progress, with the loader on a micro-batch ``fetched_before`` follow.

    The rest of the step in progress, then the rest of the epoch at the
    step's shape: exact until the loader next changes the shape (then
    counted again, at the next micro-batch).
    """
    step, micro = loader.current_step, loader.micro_step
    if step is None or micro is None:
        return fetched_before
    index, count = micro
    sampler = loader.sampler
    after = sampler.num_steps(step.position, step.shape.micro) if step.position < sampler.num_samples else 0
    return fetched_before + (count - index) + after


class PlannedPasses(EpochPasses):
    """:class:`EpochPasses` that calls ``on_micro_batch()`` as the loader yields each micro-batch.

    The call comes before the front-end's fetcher receives the batch, so
    that Lightning's count of the epoch's batches is right when the fetcher
    decides whether the batch is the epoch's last.  ``len()`` is the
    reference steps of an epoch (one micro-batch each), so that what
    Lightning estimates before training (``estimated_stepping_batches``,
    with ``accumulate_grad_batches`` 1 until the first batch) counts the
    steps the LR schedule counts, at every launch.
    """

    def __init__(self, loader: AdaptiveDataLoader, total_epochs: Callable[[], int], *, front_end: str,
                 early_end: str, on_micro_batch: Callable[[], None], reference_batch: int) -> None:
        super().__init__(loader, total_epochs, front_end=front_end, early_end=early_end)
        self._on_micro_batch = on_micro_batch
        self.reference_batch = reference_batch

    def __len__(self) -> int:
        return max(1, self.loader.sampler.num_steps(0, self.reference_batch))

    def __iter__(self) -> Iterator[Any]:
        return self._announced(super().__iter__())

    def _announced(self, running: Iterator[Any]) -> Iterator[Any]:
        for batch in running:
            self._on_micro_batch()
            yield batch
