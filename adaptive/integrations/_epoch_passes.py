"""What a front-end's training loop iterates as its training dataloader: one elastic pass per epoch.

Private to :mod:`adaptive.integrations` (the Trainer and Lightning
integrations); nothing here imports a front-end.  A front-end's loop (the
Trainer's, Lightning's fit loop) calls ``iter()`` on its training
dataloader once per epoch and takes as many batches as ``len()`` says; it
never asks the loader for the end of an epoch.  :class:`EpochPasses` maps
that onto the library's epoch loop: each ``iter()`` enters the next epoch of
:func:`adaptive.remaining_epochs_until` and returns the elastic loader's
pass over it, and the front-end's own epoch-end and training-end hooks call
:meth:`EpochPasses.end_epoch` and :meth:`EpochPasses.finish`.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterator

from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.elastic import epoch as epochs

__all__ = ["EpochPasses"]

logger = logging.getLogger(__name__)

#: What an exhausted pass gives ``next()`` here.
_END = object()


class EpochPasses:
    """One pass of the elastic loader per ``iter()``, each in the next epoch of ``remaining_epochs_until``.

    After a restart the first ``iter()`` enters the interrupted epoch, and
    the loader's pass resumes at the committed sample.  ``len()`` is the
    loader's batches of a whole epoch at the global batch, the same at every
    world size.

    Args:
        loader: the elastic loader the front-end trains on.
        total_epochs: the front-end's epoch limit, read when training starts.
        front_end: the front-end's name, for errors (``"AdaptiveTrainer"``).
        early_end: what a front-end that ended an epoch early did and should
            do instead, for the error :meth:`end_epoch` raises.
        skip_finished_epochs: an epoch resumed with no sample left (from a
            checkpoint written after its last step) is passed over, for a
            front-end that stops training at an epoch without a batch (the
            Trainer); otherwise its empty pass is returned.
    """

    def __init__(self, loader: AdaptiveDataLoader, total_epochs: Callable[[], int], *, front_end: str,
                 early_end: str, skip_finished_epochs: bool = False) -> None:
        self.loader = loader
        self.dataset = loader.dataset  # (the front-ends count examples through it)
        self._total_epochs = total_epochs
        self._front_end, self._early_end = front_end, early_end
        self._skip_finished = skip_finished_epochs
        self._epochs: Iterator[int] | None = None
        self._pass: Iterator[Any] | None = None
        self._finished = False

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._finished:
            raise RuntimeError(f"{self._front_end}'s training data was iterated after training ended")
        if self._pass is not None:
            self.end_epoch()
        if self._epochs is None:
            self._epochs = epochs.remaining_epochs_until(int(self._total_epochs()))
        while next(self._epochs, None) is not None:
            running = iter(self.loader)
            if not self._skip_finished:
                self._pass = running
                return running
            first = next(running, _END)
            if first is not _END:
                self._pass = running
                return itertools.chain([first], running)  # the front-end takes the first batch at once
            # The epoch's pass was already complete (resumed from a checkpoint written after its last step):
            # on to the next epoch.
        return iter(())  # every epoch is done (a relaunch of a finished job)

    def end_epoch(self) -> None:
        """The front-end ended an epoch: let the loader commit the last step and end its pass.

        Raises:
            RuntimeError: the loader still had steps in this epoch (the
                front-end ended it early, which an elastic epoch cannot
                honour: the epoch's remaining samples would be lost).
        """
        if self._pass is None:
            return
        running, self._pass = self._pass, None
        if next(running, None) is not None:
            raise RuntimeError(f"{self._early_end}: {self._front_end} trains every sample of each epoch")

    def finish(self) -> None:
        """Training ended (its epoch or step limit, or a stop the script asked for): checkpoint it as finished.

        When the last step taken ends the last epoch, the epoch loop ends as
        in a plain script (every epoch finished); otherwise training is ended
        where it is (:func:`adaptive.finish_training`).  Collective: every
        process ends training after the same step.
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
        """End the loader's pass and the epoch loop now (training was interrupted, or is finished), while the
        job that ran them is current: a stop checkpointed already; an error leaves the last checkpoint."""
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
        """Empty: the position comes from the library's checkpoint (a front-end that saves the state of its
        "stateful" dataloaders, Lightning's, then trusts a resume mid-epoch)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the loader's position comes from the library's checkpoint."""
