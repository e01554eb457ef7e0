"""The library's checkpoint inside a front-end's own save folder (``save_state(dir)``, ``checkpoint-N``).

Private to :mod:`adaptive.integrations`.  A front-end that saves its own
folder (Accelerate's ``save_state``, the Trainer's ``checkpoint-N``) gets
every state the library checkpoints (loader positions, epoch, random
generators, accumulators, the model wrapper with its optimizer and
scheduler) as a verified library checkpoint in ``<folder>/adaptive``,
written atomically by rank 0 and loaded weights-only (guarantees G3 and
G4), so that resuming from that folder is as exact as a relaunch.
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path
from typing import Any, Callable

from adaptive.checkpoint import states
from adaptive.checkpoint.store import Checkpoint, CheckpointStore
from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.elastic import epoch
from adaptive.runtime import collectives, env
from adaptive.runtime.step import stream

__all__ = ["LIBRARY_STATE_DIR", "committed_loader_state", "gather_library_states", "library_checkpoint",
           "resume_library_states", "save_library_checkpoint"]

logger = logging.getLogger(__name__)

#: The folder, inside a front-end's save folder, that holds the library's checkpoint.
LIBRARY_STATE_DIR = "adaptive"


def committed_loader_state(loader: AdaptiveDataLoader, step: Any) -> Any:
    """The running loader's state as it will be once it commits ``step`` (trained, its optimizer step taken).

    A front-end saves in the loop body, usually right after
    ``optimizer.step()``; the loader commits the step only when the loop goes
    on.  Saved as it stood, the step would be trained again after a resume.
    The loader's own commit rule is applied to a copy.
    """
    state = loader._state  # the loader's checkpointed position (adaptive.data._loader_state)
    copy = types.SimpleNamespace(**state.state_dict())
    loader._batching.commit(copy, step)
    copy.step += 1
    return dict(vars(copy))


def gather_library_states(purpose: str, uncommitted_step: Callable[[AdaptiveDataLoader], Any | None],
                          loader: AdaptiveDataLoader | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Every state of the library as a checkpoint holds it, and the checkpoint's metadata; collective.

    ``purpose`` names the front-end's save in errors and the metadata;
    ``uncommitted_step(loader)`` is the step of the running ``loader``
    (default: the one iterating now) whose optimizer step was taken and which
    the loader has not committed yet (saved as committed), or None.  Returns
    ``(contents, metadata)`` on rank 0, None elsewhere.

    Raises:
        ValueError: a sharded state is registered (its shards are saved by DCP, not with a front-end's save).
    """
    registered = states.registered_states()
    sharded = [state.name for state in registered if isinstance(state, states.ShardedState)]
    if sharded:
        raise ValueError(f"{purpose}: the sharded states {sharded} cannot be saved with the front-end's checkpoint")
    for state in registered:
        state.sync()  # collective: accumulators add up their replicas' increments, every rank's generators
    if env.rank() != 0:
        return None
    contents = {state.name: state.state_dict() for state in registered}
    loader = current_dataloader() if loader is None else loader
    step = None if loader is None else uncommitted_step(loader)
    if loader is not None and step is not None:
        contents[loader._state.name] = committed_loader_state(loader, step)
    metadata = {"reason": purpose, "epoch": epoch.current_epoch(),
                "loader_steps": {name: int(value["step"]) for name, value in contents.items()
                                 if name.startswith("adaptive.dataloader.")}}
    return contents, states.manifest_info(registered, metadata)


def save_library_checkpoint(folder: str | os.PathLike[str], purpose: str,
                            uncommitted_step: Callable[[AdaptiveDataLoader], Any | None]) -> Path:
    """Checkpoint every state of the library under ``folder/adaptive``; collective.  Returns that folder.

    ``purpose`` and ``uncommitted_step``: as for :func:`gather_library_states`.

    Raises:
        ValueError: a sharded state is registered (its shards are saved by DCP, not here).
        RuntimeError: on every process, when rank 0 could not write the checkpoint.
    """
    root = Path(folder) / LIBRARY_STATE_DIR
    gathered = gather_library_states(purpose, uncommitted_step)
    error = None
    if gathered is not None:
        try:
            info = CheckpointStore(root, keep=1).save(*gathered)
            logger.info("%s: the library's state (loader positions, epoch, random generators, model, optimizer, "
                        "LR scheduler) is in %s", purpose, info.path)
        except Exception as failure:  # every process raises, not only rank 0
            error = f"{type(failure).__name__}: {failure}"
    error = collectives.broadcast_object(error)
    if error is not None:
        raise RuntimeError(f"{purpose}: the library's state could not be written to {root}: {error}")
    return root


def library_checkpoint(folder: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest complete library checkpoint under ``folder/adaptive``, or None."""
    root = Path(folder) / LIBRARY_STATE_DIR
    return CheckpointStore(root).latest() if root.is_dir() else None


def resume_library_states(checkpoint: Checkpoint, purpose: str) -> None:
    """Resume every library state from ``checkpoint`` (a front-end's own checkpoint), as a relaunch resumes from
    the library's: the states made already are restored now, the others as they are made.

    Raises:
        RuntimeError: called inside the epoch loop or a loader loop (``purpose`` names the front-end's argument).
    """
    if current_dataloader() is not None or epoch.current_epoch() is not None:
        raise RuntimeError(f"{purpose}: the library's state can only be restored before training starts")
    states.resume_from(checkpoint, steps_at_save=stream().steps_committed)
    for state in states.registered_states():
        if state.name in checkpoint.names():
            state.restore_on_admission()  # made before: restored now, as at its creation
    meta = checkpoint.info.metadata or {}
    if env.rank() == 0:
        logger.info("%s: restoring the library's state from %s (epoch %s, loader steps %s, saved by %s processes; "
                    "now %d)", purpose, checkpoint.info.path, meta.get("epoch"), meta.get("loader_steps"),
                    meta.get("replicas"), env.num_replicas())
