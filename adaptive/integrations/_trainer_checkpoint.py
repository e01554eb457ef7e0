"""The library's part of the Trainer's own checkpoints (``output_dir/checkpoint-N``), and resuming from one.

Private to :mod:`adaptive.integrations.transformers`; nothing here imports
transformers.

* :func:`save_to_trainer_checkpoint` runs when the Trainer has written a
  checkpoint (its ``on_save`` callback event): every state the library
  checkpoints (the loader's position, the epoch, the random generators, the
  model wrapper with its optimizer, LR scheduler and noise-scale statistics,
  the trainer's record with its ``TrainerState``) goes into a verified
  library checkpoint under ``checkpoint-N/adaptive`` (written atomically by
  rank 0, loaded weights-only: guarantees G3 and G4), next to the Trainer's
  own files.
* :func:`choose_trainer_checkpoint` decides what ``train(resume_from_checkpoint=...)``
  resumes from: the Trainer checkpoint asked for, unless the library's own
  newest checkpoint continues the same run beyond it (a relaunch of the same
  command must not roll back).
* :func:`resume_from_trainer_checkpoint` makes ``checkpoint-N/adaptive`` the
  checkpoint this process resumes from: every state restores from it when
  it is made, as after a relaunch, at any world size.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from adaptive.checkpoint import states
from adaptive.checkpoint.store import Checkpoint
from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.integrations._library_folder import (LIBRARY_STATE_DIR, library_checkpoint, resume_library_states,
                                                  save_library_checkpoint)
from adaptive.runtime import env, membership

__all__ = ["LIBRARY_STATE_DIR", "choose_trainer_checkpoint", "resume_from_trainer_checkpoint",
           "save_to_trainer_checkpoint"]

logger = logging.getLogger(__name__)


def save_to_trainer_checkpoint(checkpoint_dir: str | os.PathLike[str], loader: AdaptiveDataLoader | None) -> Path:
    """Checkpoint every state of the library under ``checkpoint_dir/adaptive``; collective (the Trainer's
    ``on_save`` runs on every process).  Returns the folder.

    ``loader`` is the trainer's training loader: when the Trainer saves in
    the middle of a step's loop (after the optimizer step, before the
    loader moves on and commits the step), the loader's position is saved
    as it will be once it commits that step, so that the step is not
    trained again after a resume.
    """
    return save_library_checkpoint(checkpoint_dir, "Trainer checkpoint",
                                   lambda running: running.current_step if running is loader else None)


def _run_and_step(checkpoint: Checkpoint | None, record_name: str) -> tuple[str | None, int | None]:
    """The run id and global step the trainer's record holds in ``checkpoint`` ((None, None) without one)."""
    if checkpoint is None or record_name not in checkpoint.names():
        return None, None
    saved = checkpoint.load(record_name)
    fields = json.loads(saved["trainer_state"]) if saved.get("trainer_state") else None
    step = int(fields["global_step"]) if fields and fields.get("global_step") is not None else None
    return (str(saved["run"]) if saved.get("run") else None), step


def choose_trainer_checkpoint(requested: str | os.PathLike[str] | bool | None, last_in_output_dir: str | None,
                              record_name: str) -> str | None:
    """The Trainer checkpoint ``train(resume_from_checkpoint=requested)`` resumes from; None: the library's own.

    * ``None`` / ``False``: the library's own newest checkpoint (or a fresh start).
    * a process joining a running live job: the members' state, whatever
      ``requested`` says.
    * a path, or ``True`` (then ``last_in_output_dir``, the newest
      ``checkpoint-N`` in ``output_dir``): that Trainer checkpoint, exactly,
      unless the library's own newest checkpoint continues the *same run*
      beyond it (same run id in the trainer's record, more optimizer steps):
      then the job was stopped after it and relaunched with the same
      command, and the library's checkpoint wins so that nothing is trained
      twice.  ``True`` with neither checkpoint raises as the Trainer does.

    Raises:
        ValueError: ``requested`` names no folder, or one without the
            library's state (a checkpoint not written by AdaptiveTrainer,
            whose data position cannot be restored exactly).
        TypeError: ``requested`` is not a path, a bool or None.
    """
    if requested is None or requested is False:
        return None
    own = states.resumed_checkpoint()  # (live: joins the job first)
    if membership.is_live() and membership.is_awaiting_admission():
        logger.info("resume_from_checkpoint=%s: this process joins a running live job, and takes the state of its "
                    "members instead", requested)
        return None
    if requested is True:
        if last_in_output_dir is None:
            if own is not None:
                return None
            raise ValueError("resume_from_checkpoint=True: no valid checkpoint found in output_dir, and the library "
                             "has none")
        path = last_in_output_dir
    elif isinstance(requested, (str, os.PathLike)):
        path = os.fspath(requested)
    else:
        raise TypeError(f"resume_from_checkpoint must be a path, a bool or None, got {type(requested).__name__}")
    if not os.path.isdir(path):
        raise ValueError(f"resume_from_checkpoint={path!r} is not a folder")
    part = library_checkpoint(path)
    if part is None:
        raise ValueError(f"resume_from_checkpoint={path!r} holds no library state ({LIBRARY_STATE_DIR}/): it was not "
                         "written by AdaptiveTrainer, and its data position cannot be restored exactly")
    run, step = _run_and_step(part, record_name)
    own_run, own_step = _run_and_step(own, record_name)
    if run is not None and run == own_run and own_step is not None and step is not None and own_step >= step:
        if env.rank() == 0:
            logger.info("resume_from_checkpoint=%s (global step %d): the library's checkpoint %d of the same run is "
                        "at global step %d, and wins (a relaunch resumes where the job stopped; remove the library's "
                        "checkpoint folder to roll back on purpose)", path, step, own.info.seq if own else -1, own_step)
        return None
    return path


def resume_from_trainer_checkpoint(path: str | os.PathLike[str]) -> None:
    """Resume every library state from ``path/adaptive``, as a relaunch resumes from the library's checkpoint.

    Must run before the states are made (before training starts) or outside
    the epoch loop; states made already are restored now.

    Raises:
        ValueError: ``path`` holds no library state.
        RuntimeError: called inside the epoch loop or a loader loop.
    """
    checkpoint = library_checkpoint(path)
    if checkpoint is None:
        raise ValueError(f"resume_from_checkpoint={os.fspath(path)!r} holds no library state ({LIBRARY_STATE_DIR}/)")
    resume_library_states(checkpoint, "resume_from_checkpoint")


def trainer_checkpoint_dir(output_dir: str | None, prefix: str, global_step: int) -> str:
    """The folder the Trainer writes its checkpoint of ``global_step`` to (``output_dir/checkpoint-N``)."""
    return os.path.join(output_dir or ".", f"{prefix}-{global_step}")


def callback_states(callbacks: list[Any], exportable: type[Any]) -> dict[str, list[dict[str, Any]]]:
    """``{class name: [state(), ...]}`` of the ``exportable`` (``ExportableState``) callbacks, as the Trainer
    records them in ``trainer_state.json``."""
    found: dict[str, list[dict[str, Any]]] = {}
    for callback in callbacks:
        if isinstance(callback, exportable):
            found.setdefault(type(callback).__name__, []).append(callback.state())
    return found


def restore_callback_states(callbacks: list[Any], exportable: type[Any], saved: dict[str, list[dict[str, Any]]]) -> None:
    """Set the saved attributes of each ``exportable`` callback in place (in order, per class); the callbacks'
    constructor arguments are the script's."""
    seen: dict[str, int] = {}
    for callback in callbacks:
        if not isinstance(callback, exportable):
            continue
        name = type(callback).__name__
        index = seen.get(name, 0)
        seen[name] = index + 1
        entries = saved.get(name) or []
        if index < len(entries):
            for attribute, value in (entries[index].get("attributes") or {}).items():
                setattr(callback, attribute, value)
