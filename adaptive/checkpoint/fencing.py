"""The job's checkpoint store, held under the generation this incarnation took (guarantee G6).

Every incarnation of a job (a launch, each torchrun restart round, and in
live mode each membership change) takes the job's next *generation* in the
checkpoint folder (:mod:`adaptive.checkpoint.generation`), and publishes
checkpoints only while that generation is the newest.  This module holds the
job's side of that: rank 0 takes the generation when the job's store is first
used (:func:`checkpoint_store`, before :func:`adaptive.checkpoint.states.resumed_checkpoint`
looks for the checkpoint to resume, so that a checkpoint is either published
before the new incarnation looked, or never), :func:`stale_generation` tells
the per-step agreement (:mod:`adaptive.elastic.sync_points`) cheaply once a
newer incarnation took over, and :func:`renew_generation` takes a new one
after a live membership change.

It is kept apart from the states (:mod:`adaptive.checkpoint.states`) because
it is a different record of the job: which store, which generation, and
since when it is stale, whatever states the job holds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import NoReturn

from adaptive.checkpoint.generation import CheckpointFolderError, Generation, StaleGenerationError, newest_generation
from adaptive.checkpoint.store import CheckpointError, CheckpointStore
from adaptive.runtime import env, launch_status
from adaptive.runtime.job import current_job

__all__ = ["GENERATION_CHECK_INTERVAL", "CONFIG_ERROR_EXIT_CODE", "checkpoint_store", "generation",
           "stale_generation", "renew_generation"]

logger = logging.getLogger(__name__)

#: Seconds between rank 0's reads of the newest generation (:func:`stale_generation`).
GENERATION_CHECK_INTERVAL = 1.0
#: Exit status of a worker whose checkpoint folder cannot be created: a configuration error, which a restart
#: cannot fix, so its launcher ends the node with it (``adaptive.elastic.launcher.CONFIG_ERROR_EXIT_CODE``).
CONFIG_ERROR_EXIT_CODE = 2


@dataclasses.dataclass
class Fencing:
    """The job's store and its generation: this module's record on the job context (:mod:`adaptive.runtime.job`)."""

    store: CheckpointStore | None = None
    store_root: str | None = None
    generation: Generation | None = None  # rank 0: the Generation this incarnation took in store_root
    checked_at: float | None = None  # monotonic, when rank 0 last read the newest generation
    stale: StaleGenerationError | None = None  # rank 0: the error once a newer generation was seen


def _fencing() -> Fencing:
    return current_job().part(Fencing)


def checkpoint_store() -> CheckpointStore:
    """The job's store; on rank 0 it holds this incarnation's generation, taken on first use."""
    root = env.checkpoint_path()
    fencing = _fencing()
    if fencing.store is None or fencing.store_root != root:
        fencing.generation = None
        if env.rank() == 0:
            fencing.generation = _take_generation(root)
        else:
            _check_folder(root)
        fencing.checked_at, fencing.stale = time.monotonic(), None
        fencing.store = CheckpointStore(root, keep=env.checkpoint_keep(), generation=fencing.generation)
        fencing.store_root = root
    return fencing.store


def _take_generation(root: str) -> Generation:
    """Take this incarnation's generation, unless its launcher's incarnation was already fenced.

    A torchrun restart round of a fenced incarnation must not take over from
    the incarnation that fenced it: adaptive-run ends such an incarnation, and
    a round that starts before it does refuses here.

    A folder that cannot be created (or written in) ends the worker with
    :data:`CONFIG_ERROR_EXIT_CODE` and one error line naming it and why, no
    traceback: every restart would fail the same way, and its launcher ends
    the node at once on that status instead of spending its restarts.
    """
    fenced = launch_status.stale_report()
    if fenced is not None:
        raise StaleGenerationError(root, int(fenced.get("generation") or 0), newest_generation(root))
    try:
        taken = Generation.take(root)
    except CheckpointFolderError as error:
        _exit_on_config_error(error)
    logger.debug("this incarnation is generation %d of the job's checkpoint folder %s", taken.number, root)
    return taken


def _check_folder(root: str) -> None:
    """On the ranks that do not take the generation (nor create the folder): end as rank 0 does when the folder
    cannot be used (a path under a file, no permission), rather than with a traceback."""
    try:
        os.listdir(root)
    except FileNotFoundError:
        pass  # rank 0 creates it
    except OSError as error:
        if error.errno in CheckpointFolderError.ERRNOS:
            _exit_on_config_error(CheckpointFolderError.from_os_error(root, error, "read"))


def _exit_on_config_error(error: CheckpointFolderError) -> NoReturn:
    """End this worker with :data:`CONFIG_ERROR_EXIT_CODE` and one line saying why (no traceback)."""
    logger.error("%s (ADAPTIVE_CHECKPOINT_PATH): a configuration error that a restart cannot fix; exiting with %d",
                 error, CONFIG_ERROR_EXIT_CODE)
    raise SystemExit(CONFIG_ERROR_EXIT_CODE) from None


def generation() -> Generation | None:
    """The generation this incarnation took (rank 0, once the store was used; None elsewhere)."""
    return _fencing().generation


def stale_generation(now: float | None = None) -> StaleGenerationError | None:
    """On rank 0: the error to stop with once a newer generation took over (None while this one is newest).

    Reads the newest generation at most every :data:`GENERATION_CHECK_INTERVAL`
    seconds; other ranks, and a job that has not used its store yet, get None.
    """
    fencing = _fencing()
    if fencing.generation is None:
        return None
    if fencing.stale is None:
        now = time.monotonic() if now is None else now
        if fencing.checked_at is None or now - fencing.checked_at >= GENERATION_CHECK_INTERVAL:
            fencing.checked_at = now
            try:
                fencing.generation.check()
            except StaleGenerationError as error:
                fencing.stale = error
            except CheckpointError as error:  # unreadable record: the next publication decides
                logger.warning("could not check this incarnation's generation: %s", error)
    return fencing.stale


def renew_generation() -> None:
    """The membership changed: the new rank 0 takes a new generation of the checkpoint folder (G6).

    Checkpoints of the old generation's rank 0 are fenced from then on.
    """
    fencing = _fencing()
    fencing.store = fencing.store_root = None
    fencing.generation = fencing.stale = None
    if env.rank() == 0:
        checkpoint_store()
