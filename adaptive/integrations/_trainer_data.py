"""The training data and the checkpointed record of :class:`~adaptive.integrations.transformers.AdaptiveTrainer`.

Private to :mod:`adaptive.integrations.transformers` (kept apart to keep
that module short); nothing here imports transformers:

* :class:`TrainerRecord`: the first launch's batch arithmetic and the
  Trainer's counters, one checkpointed state;
* :class:`TrainerEpochs`: what the Trainer iterates as its training
  DataLoader: one pass of the elastic loader per epoch of
  :func:`adaptive.remaining_epochs_until`, ended with the Trainer's epochs
  and training;
* :func:`refuse_unsupported`: the ``TrainingArguments`` the trainer cannot
  honour, refused with an error naming the argument.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from typing import Any, Callable, Iterator

from adaptive.checkpoint.states import State, load_state
from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.elastic import epoch as epochs
from adaptive.runtime import env

__all__ = ["ORDERS", "RECORD_STATE_NAME", "TrainerEpochs", "TrainerRecord", "refuse_unsupported", "sampling_strategy"]

logger = logging.getLogger(__name__)

#: The checkpointed record of the first launch and of the Trainer's state (see :class:`TrainerRecord`).
RECORD_STATE_NAME = "adaptive.integrations.transformers"

#: What an exhausted pass gives ``next()`` here.
_END = object()

#: Training sample orders the elastic loader can honour (``TrainingArguments.train_sampling_strategy``).
ORDERS = {"random": True, "sequential": False}


# ---------------------------------------------------------------- checkpointed record

class TrainerRecord(State):
    """The first launch's batch arithmetic and the Trainer's counters, checkpointed.

    The global batch is computed once, at the first launch, and restored
    from then on, so that a relaunch on another number of processes keeps
    it.  The Trainer's state is read live at every save (``trainer_state``
    is a callable) and kept, as restored, until training applies it.
    ``run`` names the training run (made at the first launch, kept by every
    resume), so that a resume can tell a later checkpoint of the same run
    from another run's.
    """

    version = 2  # 2 adds "run"
    migrations = {1: lambda state: dict(state, run="")}

    def __init__(self, processes: int, per_device: int, accumulation: int) -> None:
        super().__init__(RECORD_STATE_NAME)
        self.processes = processes
        self.per_device = per_device
        self.accumulation = accumulation
        self.global_batch = per_device * processes * accumulation
        self.run = uuid.uuid4().hex  # only rank 0's is saved, and every rank reads that one back
        self.saved_trainer_state: dict[str, Any] | None = None
        # the live TrainerState fields, once training runs (set by the trainer after it restored them)
        self.trainer_state: Callable[[], dict[str, Any]] | None = None
        # applies the restored fields to the Trainer when a live joiner is admitted (after training started)
        self.on_admission: Callable[[], None] | None = None
        self.restored = load_state(self)
        if self.restored and (self.processes, self.per_device, self.accumulation) != (
                processes, per_device, accumulation) and env.rank() == 0:
            logger.info("first launch: %d per device x %d processes x %d accumulation steps = global batch %d; now "
                        "%d x %d x %d: the first launch's global batch is kept", self.per_device, self.processes,
                        self.accumulation, self.global_batch, per_device, processes, accumulation)

    def state_dict(self) -> dict[str, Any]:
        fields = self.trainer_state() if self.trainer_state is not None else self.saved_trainer_state
        return {"processes": self.processes, "per_device": self.per_device, "accumulation": self.accumulation,
                "global_batch": self.global_batch, "trainer_state": json.dumps(fields), "run": self.run}

    def restore_on_admission(self) -> None:
        super().restore_on_admission()
        if self.on_admission is not None:
            self.on_admission()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.processes = int(state["processes"])
        self.per_device = int(state["per_device"])
        self.accumulation = int(state["accumulation"])
        self.global_batch = int(state["global_batch"])
        self.saved_trainer_state = json.loads(state["trainer_state"])
        if state["run"]:  # (a version-1 record has none: keep the new one)
            self.run = str(state["run"])


# ---------------------------------------------------------------- the epochs the Trainer iterates

class TrainerEpochs:
    """What the Trainer iterates as its training "DataLoader": one pass of the elastic loader per epoch.

    Each ``iter()`` (the Trainer starts an epoch) enters the next epoch of
    :func:`adaptive.remaining_epochs_until`, which after a restart is the
    interrupted one, and returns the loader's pass over it, which resumes at
    the committed sample (an epoch resumed with no sample left is passed
    over: the Trainer stops training at an epoch without a batch).  The Trainer takes exactly the steps of an epoch
    and never asks for the end, so :meth:`end_epoch` ends the pass (the
    loader commits its last step there) and :meth:`finish` ends training.
    ``len()`` is the optimizer steps of a whole epoch at the global batch.
    """

    def __init__(self, loader: AdaptiveDataLoader, total_epochs: Callable[[], int]) -> None:
        self.loader = loader
        self.dataset = loader.dataset  # Trainer.num_examples reads it
        self._total_epochs = total_epochs  # callable: the epoch count the Trainer computed for this train()
        self._epochs: Iterator[int] | None = None
        self._pass: Iterator[Any] | None = None
        self._finished = False

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._finished:
            raise RuntimeError("AdaptiveTrainer's training data was iterated after training ended")
        if self._pass is not None:
            self.end_epoch()
        if self._epochs is None:
            self._epochs = epochs.remaining_epochs_until(int(self._total_epochs()))
        while next(self._epochs, None) is not None:
            running = iter(self.loader)
            first = next(running, _END)
            if first is not _END:
                self._pass = running
                return itertools.chain([first], running)  # the Trainer takes the first batch at once
            # The epoch's pass was already complete (resumed from a checkpoint written at its end, after its
            # last step): the Trainer would stop training at an epoch without a batch, so on to the next epoch.
        return iter(())  # every epoch is done (a relaunch of a finished job)

    def end_epoch(self) -> None:
        """The Trainer ended an epoch: let the loader commit the last step and end its pass.

        Raises:
            RuntimeError: the loader still had steps in this epoch (a
                callback set ``should_epoch_stop``, which an elastic epoch
                cannot honour: the epoch's remaining samples would be lost).
        """
        if self._pass is None:
            return
        running, self._pass = self._pass, None
        if next(running, None) is not None:
            raise RuntimeError("the Trainer ended an epoch before the elastic loader did (should_epoch_stop): "
                               "AdaptiveTrainer trains every sample of each epoch; stop training instead "
                               "(should_training_stop)")

    def finish(self) -> None:
        """Training ended (``max_steps`` reached, or a callback stopped it): checkpoint it as finished.

        When the last step the Trainer took ends the last epoch, the epoch
        loop ends as in a plain script (every epoch finished); otherwise
        training is ended where it is (:func:`adaptive.finish_training`).
        Collective: every process ends training after the same step.
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
        for running in (self._pass, self._epochs):
            close = getattr(running, "close", None)
            if close is not None:
                close()
        self._pass = None

    def _at_epoch_end(self) -> bool:
        """Whether the step the loader's pass is on is the last of its epoch."""
        step = self.loader.current_step
        return step is not None and self.loader.sampler.step_size(step.position, self.loader.batch_size) == 0


# ---------------------------------------------------------------- arguments

def refuse_unsupported(args: Any) -> None:
    """What the elastic loader and AdaptiveDataParallel cannot replace: say which argument asked for it."""
    if args.deepspeed:
        raise ValueError("AdaptiveTrainer supports data parallelism only; drop TrainingArguments(deepspeed=...)")
    if args.fsdp:
        raise ValueError("AdaptiveTrainer supports data parallelism only; drop TrainingArguments(fsdp=...)")
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError("AdaptiveTrainer supports data parallelism only; drop TrainingArguments(parallelism_config=)")
    if args.auto_find_batch_size:
        raise ValueError("AdaptiveTrainer keeps the first launch's global batch; drop "
                         "TrainingArguments(auto_find_batch_size=True)")
    strategy = sampling_strategy(args)
    if strategy not in ORDERS:
        raise ValueError(f"AdaptiveTrainer supports train_sampling_strategy {' or '.join(map(repr, ORDERS))} "
                         f"(the elastic loader's orders), got {strategy!r}")


def sampling_strategy(args: Any) -> str:
    """``train_sampling_strategy`` (transformers 5; ``group_by_length=True`` before it)."""
    default = "group_by_length" if getattr(args, "group_by_length", False) else "random"
    return str(getattr(args, "train_sampling_strategy", default))
