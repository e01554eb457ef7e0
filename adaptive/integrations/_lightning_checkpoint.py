"""The library's state inside Lightning's own checkpoints, and ``trainer.fit(ckpt_path=...)`` resuming from it.

Private to :mod:`adaptive.integrations.lightning`; nothing here imports
Lightning (the strategy passes Lightning's values in).

* :func:`library_contents`: when Lightning writes a checkpoint
  (``Trainer.save_checkpoint``, ``ModelCheckpoint``), every state the
  library checkpoints (the loader's position, the epoch, the random
  generators, accumulators, the model wrapper with its optimizer and LR
  scheduler, the strategy's record with Lightning's counters) goes into
  Lightning's checkpoint dict under :data:`EMBEDDED_KEY`, checked as the
  library checks its own checkpoints (only values that
  ``torch.load(weights_only=True)`` reads back: guarantee G4).  The
  loader's step whose optimizer step was taken is saved as committed, so
  that it is not trained again after a resume.
* :func:`choose_embedded`: what ``fit(ckpt_path=...)`` resumes from: that
  checkpoint's library state, unless the library's own newest checkpoint
  continues the *same run* beyond it (a relaunch of the same command with
  ``ckpt_path="last"`` must not roll back), the rule of
  :func:`adaptive.integrations._trainer_checkpoint.choose_trainer_checkpoint`.
* :func:`resume_from_embedded`: the chosen state becomes the checkpoint
  this process resumes from; every state restores from it as after a
  relaunch, at any world size.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from adaptive.checkpoint import states
from adaptive.checkpoint._reading import Checkpoint, CheckpointInfo, MemoryCheckpoint
from adaptive.checkpoint._safe_load import validate_states
from adaptive.data.dataloader import AdaptiveDataLoader
from adaptive.integrations._library_folder import gather_library_states, resume_library_states
from adaptive.runtime import env, membership

__all__ = ["EMBEDDED_KEY", "choose_embedded", "embedded_checkpoint", "library_contents", "resume_from_embedded"]

logger = logging.getLogger(__name__)

#: The key of the library's state in a Lightning checkpoint dict.
EMBEDDED_KEY = "adaptive"


def embedded_checkpoint(path: str | os.PathLike[str], contents: dict[str, Any],
                        metadata: dict[str, Any]) -> MemoryCheckpoint:
    """The library's states carried in the Lightning checkpoint at ``path``, read like a library checkpoint."""
    info = CheckpointInfo(seq=0, path=Path(path), created=float(metadata.get("time", time.time())),
                          metadata=metadata, size=0)
    return MemoryCheckpoint(info, contents, f"the library state in {os.fspath(path)}")


def library_contents(loader: AdaptiveDataLoader | None, stepped: bool,
                     replace: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Every library state, as a checkpoint would hold it, for Lightning's checkpoint dict; collective.

    ``loader``: the strategy's training loader; when ``stepped``, the step
    it is on had its optimizer step taken and is saved as committed.
    ``replace(contents)`` puts in what the caller saves otherwise (the
    record's counters at the step boundary).  Returns ``{"states": ...,
    "metadata": ...}`` on rank 0, None elsewhere.

    Raises:
        ValueError: a sharded state is registered, or a state holds a value
            a weights-only load would refuse (named).
    """
    gathered = gather_library_states("a Lightning checkpoint",
                                     lambda running: running.current_step if stepped else None, loader)
    if gathered is None:
        return None
    contents, metadata = gathered
    replace(contents)
    validate_states(contents)
    metadata["time"] = time.time()
    return {"states": contents, "metadata": json.loads(json.dumps(metadata))}


def _run_and_step(checkpoint: Checkpoint | None, record_name: str,
                  global_step: Callable[[dict[str, Any]], int]) -> tuple[str | None, int | None]:
    """The run id and Lightning global step the strategy's record holds in ``checkpoint`` ((None, None) without)."""
    if checkpoint is None or record_name not in checkpoint.names():
        return None, None
    saved = checkpoint.load(record_name)
    counters = json.loads(saved["counters"]) if saved.get("counters") else None
    return (str(saved["run"]) if saved.get("run") else None), (global_step(counters) if counters else None)


def choose_embedded(path: str | os.PathLike[str], embedded: Any, record_name: str,
                    global_step: Callable[[dict[str, Any]], int]) -> MemoryCheckpoint | None:
    """The library state ``fit(ckpt_path=path)`` resumes from; None: the library's own newest checkpoint.

    * a process joining a running live job: the members' state (None).
    * the state in ``path`` (``embedded``), exactly, unless the library's
      own newest checkpoint continues the same run (same run id in the
      strategy's record) at the same or a later global step: then the job
      was stopped after ``path`` was written and relaunched with the same
      command, and the library's checkpoint wins, so that nothing is
      trained twice.

    Raises:
        ValueError: ``path`` holds no library state (not written by
            AdaptiveStrategy, written with ``save_weights_only=True`` or in
            the middle of an accumulated step), or one a weights-only load
            would refuse.
    """
    own = states.resumed_checkpoint()  # (live: joins the job first)
    if membership.is_live() and membership.is_awaiting_admission():
        logger.info("ckpt_path=%s: this process joins a running live job, and takes the state of its members "
                    "instead", path)
        return None
    if not isinstance(embedded, dict) or not isinstance(embedded.get("states"), dict):
        raise ValueError(f"ckpt_path={os.fspath(path)!r} holds no library state ({EMBEDDED_KEY!r}): it was not written "
                         "by AdaptiveStrategy during fit (or with save_weights_only=True, or in the middle of an "
                         "accumulated step), and its data position cannot be restored exactly")
    validate_states(embedded["states"])
    checkpoint = embedded_checkpoint(path, embedded["states"], dict(embedded.get("metadata") or {}))
    run, step = _run_and_step(checkpoint, record_name, global_step)
    own_run, own_step = _run_and_step(own, record_name, global_step)
    if run is not None and run == own_run and own_step is not None and step is not None and own_step >= step:
        if env.rank() == 0:
            logger.info("ckpt_path=%s (global step %d): the library's checkpoint %d of the same run is at global step "
                        "%d, and wins (a relaunch resumes where the job stopped; remove the library's checkpoint "
                        "folder to roll back on purpose)", path, step, own.info.seq if own else -1, own_step)
        return None
    return checkpoint


def resume_from_embedded(checkpoint: MemoryCheckpoint) -> None:
    """Resume every library state from ``checkpoint``, as a relaunch resumes from the library's checkpoint.

    States made already are restored now, the others as they are made.

    Raises:
        RuntimeError: called inside the epoch loop or a loader loop.
    """
    resume_library_states(checkpoint, "ckpt_path")
