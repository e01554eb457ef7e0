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
"""

from __future__ import annotations

import logging
from typing import Iterator

from adaptive import checkpoint, env, sync_points

__all__ = ["remaining_epochs_until", "current_epoch", "finished_epochs"]

logger = logging.getLogger(__name__)


class _EpochState(checkpoint.State):
    """The epoch in progress and how many epochs are finished."""

    def __init__(self) -> None:
        super().__init__("adaptive.epoch")
        self.current: int | None = None
        self.finished = 0

    def state_dict(self) -> dict:
        return {"current": self.current, "finished": self.finished}

    def load_state_dict(self, state: dict) -> None:
        self.current = state["current"]
        self.finished = int(state["finished"])


_state: _EpochState | None = None
_looping = False


def _epoch_state() -> _EpochState:
    global _state
    if _state is None or checkpoint.registered_states().count(_state) == 0:
        _state = _EpochState()
        checkpoint.load_state(_state)
    return _state


def current_epoch() -> int | None:
    """The epoch being trained, or None outside :func:`remaining_epochs_until`."""
    return _epoch_state().current if _looping else None


def finished_epochs() -> int:
    """How many epochs are complete, counting those before any restart."""
    return _epoch_state().finished


def remaining_epochs_until(epoch: int) -> Iterator[int]:
    """Yield the epochs from the first unfinished one up to ``epoch - 1``.

    Args:
        epoch: the number of epochs to train in total (an epoch index bound,
            like ``range(epoch)``).
    """
    global _looping
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"remaining_epochs_until(epoch) needs a non-negative int, got {epoch!r}")
    if _looping:
        raise RuntimeError("remaining_epochs_until loops cannot be nested")
    state = _epoch_state()
    sync_points.install_signal_handlers()
    if state.finished >= epoch:
        logger.info("all %d epochs already finished (%d done); nothing left to train", epoch, state.finished)
    _looping = True
    try:
        while state.finished < epoch:
            state.current = state.finished
            checkpoint.begin_epoch(state.current)
            yield state.current
            state.finished = state.current + 1
            state.current = None
            checkpoint.end_epoch()
            if state.finished == epoch:
                _save_finished(state)
            sync_points.settle(lambda: _epoch_metadata(state))
    finally:
        _looping = False
        checkpoint.end_epoch()


def _save_finished(state: _EpochState) -> None:
    """Checkpoint the finished job (before the last agreement, which a due checkpoint then skips)."""
    checkpoint.save_all_states(dict(_epoch_metadata(state), reason="finished"))
    logger.log(logging.INFO if env.rank() == 0 else logging.DEBUG,
               "all %d epochs finished; checkpointed so that a relaunch trains nothing", state.finished)


def _epoch_metadata(state: _EpochState) -> dict:
    """The position at an epoch boundary: the last loop's step, and the next epoch to run."""
    return dict(sync_points.last_position(), epoch=state.finished, epoch_finished=True)


def _reset_for_tests() -> None:
    global _state, _looping
    _state = None
    _looping = False
