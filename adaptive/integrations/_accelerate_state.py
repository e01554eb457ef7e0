"""What AdaptiveAccelerator keeps across launches, and the library's part of ``save_state`` / ``load_state``.

* :class:`LaunchRecord`, a checkpointed state: the world size and
  accumulation of the job's first launch (the global batch of every loader
  follows from them) and which loaders' loops the optimizer steps in (the
  training loaders).  The accelerator's step and sample counters
  (:func:`completed_steps`, :func:`samples_seen`) are those loaders'
  own checkpointed counters (``loader.step``, ``loader.consumed``), so a
  relaunch restores them with the loader positions, with no counter of its own.
* :func:`save_library_state` / :func:`load_library_state`, run by
  Accelerate's ``save_state`` / ``load_state`` pre-hooks: every state the
  library checkpoints (loader positions, epoch, random generators,
  accumulators, the model wrapper with its optimizer, scheduler and
  noise-scale statistics, the launch record) goes into a verified library
  checkpoint under ``<dir>/adaptive`` (written atomically by rank 0, loaded
  weights-only: guarantees G3 and G4), next to Accelerate's own files.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Iterable

from adaptive.checkpoint import states
from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.elastic import epoch
from adaptive.integrations._library_folder import LIBRARY_STATE_DIR, library_checkpoint, save_library_checkpoint
from adaptive.runtime import env
from adaptive.runtime.step import stream

__all__ = ["LAUNCH_STATE_NAME", "LIBRARY_STATE_DIR", "LaunchRecord", "completed_steps", "samples_seen",
           "save_library_state", "load_library_state"]

logger = logging.getLogger(__name__)

#: The checkpointed name of the :class:`LaunchRecord`.
LAUNCH_STATE_NAME = "adaptive.integrations.accelerate"


@dataclasses.dataclass(frozen=True)
class _Taken:
    """An optimizer step taken in a loader's step that the loader has not committed yet."""

    loader: AdaptiveDataLoader
    step: object  # the loader's current_step (a PlannedStep) when the optimizer stepped


class LaunchRecord(states.State):
    """The first launch's world size and accumulation, and the training loaders; checkpointed.

    The global batch of every loader the accelerator converts is computed
    from the first launch, so that a relaunch on another number of
    processes keeps it; the scheduler steps per optimizer step (Accelerate's
    convention: one per process) are kept for the same reason.
    """

    version = 2  # 2 adds "trained_loaders"
    migrations = {1: lambda state: dict(state, trained_loaders=[])}

    def __init__(self, num_processes: int, gradient_accumulation_steps: int) -> None:
        super().__init__(LAUNCH_STATE_NAME)
        self.num_processes = num_processes
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.trained_loaders: list[str] = []  # names of the loaders whose loops the optimizer stepped in
        self.taken: _Taken | None = None  # not checkpointed: an uncommitted step is not in any checkpoint
        self.restored = states.load_state(self)
        if self.restored and (self.num_processes, self.gradient_accumulation_steps) != (
                num_processes, gradient_accumulation_steps):
            self.log_first_launch(num_processes, gradient_accumulation_steps)

    def log_first_launch(self, num_processes: int, gradient_accumulation_steps: int) -> None:
        if env.rank() == 0:
            logger.info("first launch: %d processes x %d accumulation steps; now %d processes x %d: the batch "
                        "sizes and scheduler steps of the first launch are kept", self.num_processes,
                        self.gradient_accumulation_steps, num_processes, gradient_accumulation_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"num_processes": self.num_processes, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "trained_loaders": list(self.trained_loaders)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_processes = int(state["num_processes"])
        self.gradient_accumulation_steps = int(state["gradient_accumulation_steps"])
        self.trained_loaders = [str(name) for name in state["trained_loaders"]]

    def step_taken(self, loader: AdaptiveDataLoader) -> None:
        """The optimizer stepped on the last micro-batch of ``loader``'s current step."""
        if loader.name not in self.trained_loaders:
            self.trained_loaders.append(loader.name)
        self.taken = _Taken(loader, loader.current_step)

    def uncommitted(self, loader: AdaptiveDataLoader) -> object | None:
        """The step of ``loader`` being trained if its optimizer step was taken (the loader commits it when the
        loop goes on), else None."""
        taken = self.taken
        step = loader.current_step
        if taken is None or taken.loader is not loader or step is None or taken.step is not step:
            return None
        return step


def _trained(record: LaunchRecord, loaders: Iterable[AdaptiveDataLoader]) -> list[AdaptiveDataLoader]:
    unique = {id(loader): loader for loader in loaders}.values()
    return [loader for loader in unique if loader.name in record.trained_loaders]


def completed_steps(record: LaunchRecord, loaders: Iterable[AdaptiveDataLoader]) -> int:
    """Optimizer steps taken over the whole job: the training loaders' steps, the one just taken included."""
    return sum(loader.step + (record.uncommitted(loader) is not None) for loader in _trained(record, loaders))


def samples_seen(record: LaunchRecord, loaders: Iterable[AdaptiveDataLoader]) -> int:
    """Samples (tokens, for a token-budget loader) the training loaders trained over the whole job."""
    total = 0
    for loader in _trained(record, loaders):
        step = record.uncommitted(loader)
        total += loader.consumed + (int(getattr(step, "size")) if step is not None else 0)
    return total


# ---------------------------------------------------------------------- save_state / load_state

def save_library_state(output_dir: str, record: LaunchRecord) -> Path:
    """Checkpoint every state of the library under ``output_dir/adaptive``; collective (every process calls
    ``save_state``).  Returns the folder; a step whose optimizer step was taken counts as done."""
    return save_library_checkpoint(output_dir, "accelerate save_state", record.uncommitted)


def load_library_state(input_dir: str) -> bool:
    """Restore every state of the library from ``input_dir/adaptive``; False (with a warning) if it has none.

    The checkpoint becomes the one this process resumed from
    (:func:`adaptive.checkpoint.states.resume_from`): the states that exist
    are restored now, those made later (the epoch counter, random generators)
    when they are made, as after a relaunch.
    """
    if current_dataloader() is not None or epoch.current_epoch() is not None:
        raise RuntimeError("load_state must be called before the epoch loop (adaptive.remaining_epochs_until) and "
                           "outside loader loops: the library restores positions where a relaunch would")
    checkpoint = library_checkpoint(input_dir)
    if checkpoint is None:
        logger.warning("load_state: %s holds no library state (it was not saved by AdaptiveAccelerator): the "
                       "loader positions, epoch and random generators are not restored", input_dir)
        return False
    states.resume_from(checkpoint, steps_at_save=stream().steps_committed)
    for state in states.registered_states():
        if state.name in checkpoint.names():
            state.restore_on_admission()  # restored after it was made: loaders follow the saved batch size
    meta = checkpoint.info.metadata or {}
    if env.rank() == 0:
        logger.info("load_state: restored the library's state from %s (epoch %s, loader steps %s, saved by %s "
                    "processes; now %d)", checkpoint.info.path, meta.get("epoch"), meta.get("loader_steps"),
                    meta.get("replicas"), env.num_replicas())
    return True
