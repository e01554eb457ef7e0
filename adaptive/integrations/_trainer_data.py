"""The checkpointed record and the refused arguments of :class:`~adaptive.integrations.transformers.AdaptiveTrainer`.

Private to :mod:`adaptive.integrations.transformers` (kept apart to keep
that module short); nothing here imports transformers:

* :class:`TrainerRecord`: the first launch's batch arithmetic and the
  Trainer's counters, one checkpointed state;
* :func:`refuse_unsupported`: the ``TrainingArguments`` the trainer cannot
  honour, refused with an error naming the argument.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable

from adaptive.checkpoint.states import State, load_state
from adaptive.runtime import env

__all__ = ["ORDERS", "RECORD_STATE_NAME", "TrainerRecord", "refuse_unsupported", "sampling_strategy"]

logger = logging.getLogger(__name__)

#: The checkpointed record of the first launch and of the Trainer's state (see :class:`TrainerRecord`).
RECORD_STATE_NAME = "adaptive.integrations.transformers"

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
