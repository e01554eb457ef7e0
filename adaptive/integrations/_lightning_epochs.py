"""What Lightning iterates as its training dataloader under :class:`~adaptive.integrations.lightning.AdaptiveStrategy`.

Private to :mod:`adaptive.integrations.lightning` (kept apart to keep that
module short); nothing here imports Lightning.  :class:`LightningEpochs` is
one pass of the elastic loader per epoch of
:func:`adaptive.remaining_epochs_until`, ended with Lightning's epochs and
training (the same scheme as the Trainer integration's epochs).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.elastic import epoch as epochs

__all__ = ["LightningEpochs"]

logger = logging.getLogger(__name__)


class LightningEpochs:
    """One pass of the elastic loader per ``iter()``, each in the next epoch of ``remaining_epochs_until``.

    Each ``iter()`` (Lightning starts an epoch) enters the next epoch of
    :func:`adaptive.remaining_epochs_until`, which after a restart is the
    interrupted one, and returns the loader's pass over it, which resumes at
    the committed sample.  Lightning takes exactly the batches of an epoch
    (it knows their number from ``len()``) and never asks for the end, so
    the pass is ended when the next epoch starts (the loader commits its
    last step there, and the epoch's end is agreed and checkpointed), or by
    :meth:`finish` when training ends.  ``len()`` is the micro-batches of a
    whole epoch at the global batch, the same at every world size.

    ``state_dict`` / ``load_state_dict`` make it "stateful" for Lightning
    (which otherwise warns that a mid-epoch resume is unreliable): its state
    there is empty, the position comes from the library's checkpoint.
    """

    def __init__(self, loader: AdaptiveDataLoader, total_epochs: Callable[[], int]) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self._total_epochs = total_epochs  # callable: the Trainer's epoch limit when training starts
        self._epochs: Iterator[int] | None = None
        self._pass: Iterator[Any] | None = None
        self._finished = False

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._finished:
            raise RuntimeError("AdaptiveStrategy's training data was iterated after training ended")
        if self._pass is not None:
            self.end_epoch()
        if self._epochs is None:
            self._epochs = epochs.remaining_epochs_until(int(self._total_epochs()))
        if next(self._epochs, None) is None:  # every epoch is done (a relaunch of a finished job)
            return iter(())
        self._pass = iter(self.loader)
        return self._pass

    def end_epoch(self) -> None:
        """Lightning ended an epoch: let the loader commit the last step and end its pass.

        Raises:
            RuntimeError: the loader still had steps in this epoch (Lightning
                ended the epoch early, ``limit_train_batches`` or an
                ``on_train_batch_start`` returning -1, which an elastic epoch
                cannot honour: the epoch's remaining samples would be lost).
        """
        if self._pass is None:
            return
        running, self._pass = self._pass, None
        if next(running, None) is not None:
            raise RuntimeError("Lightning ended an epoch before the elastic loader did (limit_train_batches, or "
                               "on_train_batch_start returned -1): AdaptiveStrategy trains every sample of each "
                               "epoch; stop training instead (trainer.should_stop = True)")

    def finish(self) -> None:
        """Training ended (``max_epochs``, ``max_steps``, ``trainer.should_stop``): checkpoint it as finished.

        When the last step Lightning took ends the last epoch, the epoch loop
        ends as in a plain script (every epoch finished); otherwise training
        is ended where it is (:func:`adaptive.finish_training`).  Collective:
        every process ends training after the same step.
        """
        if self._finished:
            return
        self._finished = True
        if self._epochs is None:
            return
        if self._pass is not None and self._at_epoch_end():
            self.end_epoch()  # the loader commits the epoch's last step
        if self._pass is None and not epochs.training_finished() and next(self._epochs, None) is None:
            return  # every epoch finished: the epoch loop checkpointed the job as finished
        if not epochs.training_finished():
            epochs.finish_training()  # inside the pass: the loader commits the step in progress, then saves
        self.close()

    def close(self) -> None:
        """End the loader's pass and the epoch loop now (``fit`` was interrupted, or training is finished),
        while the job that ran them is current: a stop checkpointed already; an error leaves the last checkpoint."""
        for running in (self._pass, self._epochs):
            close = getattr(running, "close", None)
            if close is not None:
                close()
        self._pass = None

    def _at_epoch_end(self) -> bool:
        """Whether the step the loader's pass is on is the last of its epoch."""
        step = self.loader.current_step
        return step is not None and self.loader.sampler.step_size(step.position, self.loader.batch_size) == 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # the loader's position comes from the library's checkpoint
