"""Epoch counting that survives restarts.

``for epoch in remaining_epochs_until(30):`` yields the epochs that are not
finished yet: after a restart in the middle of epoch 7 it starts again at 7,
and the data loaders of epoch 7 pick up where they stopped.

Replay rule (guarantee G5): after a restart, the code *before* the epoch loop
runs again, and so does the code inside the current epoch up to the loader
loop that was interrupted.  Keep that code idempotent (build the model,
optimizer and loaders, log); loader loops that already finished in the
current epoch are skipped, and ``Accumulator.synchronized()`` blocks that
already ran return their saved results.

At the end of every epoch the replicas agree (blocking, once per epoch) on
whether to stop or checkpoint, so a stop that arrives in code between loops
is acted on there at the latest.  When the last epoch is finished the loop
saves a checkpoint (reason ``"finished"``): relaunching a finished job
trains nothing.

A script that ends training early (a ``--max-steps`` limit) calls
:func:`finish_training` before it leaves the loop with ``break``: a plain
``break`` cannot be told apart from an exception unwinding the loop, and a
crash must never be checkpointed as finished.

While the loop runs it remembers the declared epoch count, so that
:func:`completed_fraction` can tell the scheduler (through the hints, see
:mod:`adaptive.goodput.hints`) how much of the training is done.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Any, Iterator

from adaptive._utils.checks import check_float
from adaptive.checkpoint import admission, naming, states
from adaptive.runtime import env, membership
from adaptive.runtime.step import loop_running
from adaptive.runtime.job import Job, current_job, on_reset
from adaptive.elastic import random_state, stopping, sync_points

__all__ = ["remaining_epochs_until", "current_epoch", "finished_epochs", "finish_training", "training_finished",
           "completed_fraction"]

logger = logging.getLogger(__name__)


class _EpochState(states.State):
    """The epoch in progress, how many epochs are finished, and whether training was ended early."""

    def __init__(self) -> None:
        super().__init__("adaptive.epoch")
        self.current: int | None = None
        self.finished = 0
        self.ended = False  # finish_training() was called

    version = 2  # 2 adds "ended" (finish_training)
    migrations = {1: lambda state: dict(state, ended=False)}

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current, "finished": self.finished, "ended": self.ended}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current = state["current"]
        self.finished = int(state["finished"])
        self.ended = bool(state["ended"])


@dataclasses.dataclass
class EpochProgress:
    """The epoch loop: its record on the job context (:mod:`adaptive.runtime.job`)."""

    state: _EpochState | None = None  # the checkpointed epoch counter
    looping: bool = False
    total: int | None = None  # the epoch count the running loop declared (remaining_epochs_until(total))
    finish_pending: bool = False  # finish_training() inside a loader step: the loader saves after the step
    left_early: str | None = None  # the warning about an epoch loop left without finish_training(), until the end
    left_early_hooked: bool = False  # the end of the process logs it (warn_if_left_early)


def _progress() -> EpochProgress:
    """This job's epoch loop record."""
    return current_job().part(EpochProgress)


def _epoch_state() -> _EpochState:
    progress = _progress()
    if progress.state is None or not progress.state.is_registered():  # asked every loader step: O(1)
        progress.state = _EpochState()
        states.load_state(progress.state)
    return progress.state


def current_epoch() -> int | None:
    """The epoch being trained, or None outside :func:`remaining_epochs_until`."""
    return _epoch_state().current if _progress().looping else None


def finished_epochs() -> int:
    """How many epochs are complete, counting those before any restart."""
    return _epoch_state().finished


def training_finished() -> bool:
    """True once :func:`finish_training` was called, in this run or before a restart."""
    return _epoch_state().ended


def completed_fraction(within_epoch: float) -> float | None:
    """The part of the declared training that is done, in [0, 1], or None when no total is known.

    ``(finished epochs + within_epoch) / N`` for the running
    ``remaining_epochs_until(N)`` loop, clipped to [0, 1]; 1 once
    :func:`finish_training` ended training.  None outside that loop, or when
    it declared no epochs (``N == 0``): the job's remaining work is unknown.

    Args:
        within_epoch: the position inside the current epoch, in [0, 1]
            (the loader's share of the epoch's samples already taken).
    """
    within_epoch = check_float("within_epoch", within_epoch, 0.0, 1.0)
    progress = _progress()
    if not progress.looping or not progress.total:
        return None
    state = _epoch_state()
    if state.ended:
        return 1.0
    return min(1.0, max(0.0, (state.finished + within_epoch) / progress.total))


def finish_training() -> None:
    """End training here: checkpoint it as finished, so that a relaunch trains nothing.

    Call it on every replica at the same point (it is collective, like a
    loader ``break``), typically just before leaving the epoch loop early::

        if loader.step >= max_steps:
            adaptive.finish_training()
            break

    Afterwards :func:`remaining_epochs_until` yields no further epoch and a
    loader loop in progress ends at its next step; after a relaunch the epoch
    loop yields nothing and the code after it runs again on the saved state.
    Calling it again does nothing.
    """
    state = _epoch_state()
    if state.ended:
        return
    state.ended = True
    if loop_running():
        _progress().finish_pending = True  # saved by the loader, after the step in progress counts as taken
    else:
        _save_finished(state)


def save_pending_finish() -> None:
    """Write the checkpoint of a :func:`finish_training` called inside a loader step (the loader calls this)."""
    progress = _progress()
    if progress.finish_pending:
        progress.finish_pending = False
        _save_finished(_epoch_state())


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from the first unfinished one up to ``epoch - 1``.

    Args:
        epoch: the number of epochs to train in total (an epoch index bound,
            like ``range(epoch)``).
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"remaining_epochs_until(epoch) needs a non-negative int, got {epoch!r}")
    progress = _progress()
    if progress.looping:
        raise RuntimeError("remaining_epochs_until loops cannot be nested")
    warn_if_left_early()  # the previous epoch loop was left by a break, since the script goes on
    admission.admit()  # live mode: a process that joins a running job becomes a member here, at the latest
    state = _epoch_state()
    generators = random_state.random_state()  # checkpointed with the epoch: replays draw the same numbers
    sync_points.install_signal_handlers()
    if state.ended:
        logger.info("training was ended by finish_training() after %d epochs; nothing left to train",
                    state.finished)
    elif state.finished >= epoch:
        logger.info("all %d epochs already finished (%d done); nothing left to train", epoch, state.finished)
    progress.looping, progress.total = True, epoch
    try:
        while state.finished < epoch and not state.ended:
            state.current = state.finished
            naming.begin_epoch(state.current)
            generators.restore("epoch")  # after a checkpoint at an epoch's end: the next epoch starts from it
            try:
                yield state.current
            except GeneratorExit:
                _left_early(state, epoch)
                raise
            if state.ended:  # finish_training() inside the epoch: it is saved, nothing more to agree on
                break
            state.finished = state.current + 1
            state.current = None
            naming.end_epoch()
            if state.finished == epoch:
                _save_finished(state)
            sync_points.settle(lambda: _epoch_metadata(state))
    finally:
        progress.looping, progress.total = False, None
        naming.end_epoch()


def _left_early(state: _EpochState, epoch: int) -> None:
    """The epoch loop was left (``break``, or an exception unwinding it): say what a relaunch will do.

    A generator cannot tell a ``break`` from an exception passing through its
    caller, so the warning waits until the job ends (the process exits, or the
    job is reset) or the next epoch loop starts: it is dropped when the
    process ends by an uncaught exception or by one of the library's agreed
    exits (a stop, a failed peer, a stale generation), which are not breaks.
    """
    if state.ended or env.rank() != 0 or current_job().exiting:
        return
    progress = _progress()
    progress.left_early = (
        f"the epoch loop was left in epoch {state.current} of {epoch} without finish_training(); no 'finished' "
        "checkpoint is written, so a relaunch resumes from the last checkpoint. If this was a deliberate break, "
        "call adaptive.finish_training() before it")
    if not progress.left_early_hooked:
        progress.left_early_hooked = True
        atexit.register(warn_if_left_early, current_job())


def warn_if_left_early(job: Job | None = None) -> None:
    """Log the warning :func:`_left_early` kept, unless the job ended by an error or an agreed exit."""
    job = job or current_job()
    if not job.has_part(EpochProgress):
        return
    progress = job.part(EpochProgress)
    message, progress.left_early = progress.left_early, None
    if message is not None and not job.exiting:
        logger.warning("%s", message)


def _save_finished(state: _EpochState) -> None:
    """Checkpoint the finished job (before the last agreement, which a due checkpoint then skips).

    Blocking: an asynchronous save still in flight is finished first, and the
    finished checkpoint is durable when this returns.
    """
    states.wait_for_pending_save()
    stopping.save_or_exit(dict(_epoch_metadata(state), reason="finished"))
    membership.mark_finished()  # live mode: a worker restarted from now on finds nothing to train, and needs no peers
    what = "training ended by finish_training()" if state.ended else f"all {state.finished} epochs finished"
    logger.log(logging.INFO if env.rank() == 0 else logging.DEBUG,
               "%s; checkpointed so that a relaunch trains nothing", what)


def _epoch_metadata(state: _EpochState) -> dict[str, Any]:
    """The position at an epoch boundary (the last loop's step, the next epoch to run), or where training ended."""
    if state.ended:
        epoch = state.current if state.current is not None else state.finished
        return dict(sync_points.last_position(), epoch=epoch, epoch_finished=False, training_ended=True)
    return dict(sync_points.last_position(), epoch=state.finished, epoch_finished=True)


on_reset(warn_if_left_early)  # a reset job (tests' in-process restarts) ends like a process
