"""Step boundaries where all replicas agree to stop and/or checkpoint.

Replicas learn about a stop at different moments: torchrun forwards SIGTERM
to each worker separately, a scale-up restarts the workers one by one, and
the periodic-checkpoint clock runs on rank 0 only.  To keep every replica at
the same step, each replica contributes its flags to a tiny all-reduce (max)
at an *agreement* boundary and acts on the agreed result at the next one (the
all-reduce overlaps with the steps in between).  Every replica therefore
stops, or checkpoints, after the same step.

With several replicas an agreement still costs about a millisecond of CPU
(a round trip through the backend's threads), which is several percent of a
short step.  So the replicas agree at most every ``AGREEMENT_INTERVAL``
seconds: each agreement also settles, from every replica's step rate, how
many step boundaries pass until the next one.  A stop or a due checkpoint is
acted on within about two intervals.  A single replica agrees at every
boundary (it has nobody to wait for).

A graceful stop (SIGTERM or SIGINT) saves a checkpoint and exits with code
143, inside torchrun's 30 s shutdown window.  A second SIGINT interrupts at
once.  If a peer died, the agreement itself fails: this replica then exits
at once *without* writing, so the last complete checkpoint stays the newest.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable

from adaptive import checkpoint, collectives, env

__all__ = [
    "GRACEFUL_EXIT_CODE",
    "install_signal_handlers",
    "request_stop",
    "stop_requested",
    "step_boundary",
    "final_boundary",
]

logger = logging.getLogger(__name__)

#: Exit status after a graceful stop (128 + SIGTERM), as torchrun expects.
GRACEFUL_EXIT_CODE = 143

#: Seconds between agreements with several replicas (at least one step apart).
AGREEMENT_INTERVAL = 0.1
#: The most step boundaries between two agreements.
MAX_SPACING = 1000

_STOP, _CHECKPOINT, _SPACING = 0, 1, 2

_stop_requested = False
_stop_signal: int | None = None
_handlers_installed = False
_previous_handlers: dict[int, Any] = {}
_pending: Any = None
_started = time.monotonic()
_spacing = 1  # step boundaries from one agreement to the next (agreed by all replicas)
_countdown = 0  # step boundaries left until the next agreement
_agreed_at: float | None = None  # when the last agreement started (monotonic)


def _on_signal(signum: int, frame: Any) -> None:
    global _stop_requested, _stop_signal
    if _stop_requested and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _stop_requested = True
    _stop_signal = signum
    logger.warning(
        "received %s: all replicas will stop after the same step, checkpoint and exit",
        signal.Signals(signum).name,
    )


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGINT into a graceful, agreed stop (main thread only)."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        _previous_handlers[signum] = signal.signal(signum, _on_signal)
    _handlers_installed = True


def request_stop() -> None:
    """Ask for a graceful stop from code, as SIGTERM would."""
    global _stop_requested
    _stop_requested = True


def stop_requested() -> bool:
    """Whether this replica was asked to stop (not yet agreed with the others)."""
    return _stop_requested


def _checkpoint_due() -> bool:
    interval = env.checkpoint_interval()
    if interval <= 0 or env.rank() != 0:
        return False
    since = checkpoint.seconds_since_last_save()
    elapsed = time.monotonic() - _started if since is None else since
    return elapsed >= interval


def _proposed_spacing() -> int:
    """Step boundaries that take about AGREEMENT_INTERVAL at this replica's recent pace."""
    if _agreed_at is None or env.num_replicas() == 1:
        return 1
    per_boundary = (time.monotonic() - _agreed_at) / _spacing
    if per_boundary <= 0:
        return MAX_SPACING
    return max(1, min(MAX_SPACING, round(AGREEMENT_INTERVAL / per_boundary)))


def _local_flags() -> list[float]:
    # The max over replicas of minus the spacing is minus the smallest spacing proposed.
    return [float(_stop_requested), float(_checkpoint_due()), -float(_proposed_spacing())]


def _act(agreed: list[float], metadata: Callable[[], dict]) -> None:
    if agreed[_STOP] > 0:
        info = dict(metadata(), reason="stop")
        checkpoint.save_all_states(info)
        logger.log(logging.INFO if env.rank() == 0 else logging.DEBUG, "stopped gracefully at epoch %s, step %s; exiting with %d",
                    info.get("epoch"), info.get("step"), GRACEFUL_EXIT_CODE)
        raise SystemExit(GRACEFUL_EXIT_CODE)
    if agreed[_CHECKPOINT] > 0:
        checkpoint.save_all_states(dict(metadata(), reason="periodic"))


def _agreed(pending: Any) -> list[float]:
    try:
        return pending.result()
    except collectives.CollectiveError:
        logger.error(
            "a peer replica failed; exiting without writing a checkpoint so that the last "
            "complete one (in %s) stays the newest",
            env.checkpoint_path(),
        )
        raise


def step_boundary(metadata: Callable[[], dict]) -> None:
    """Call between two steps on every replica; may checkpoint or exit.

    At an agreement boundary, acts on the flags agreed at the previous one
    and starts agreeing on this one's; other boundaries return at once.
    ``metadata`` describes the position for the checkpoint's manifest
    (epoch, step, ...).
    """
    global _pending, _countdown, _spacing, _agreed_at
    if _countdown > 1:
        _countdown -= 1
        return
    flags = _local_flags()
    previous, _pending = _pending, collectives.allreduce_max_async(flags)
    _agreed_at = time.monotonic()
    if previous is not None:
        agreed = _agreed(previous)
        _spacing = max(1, int(-agreed[_SPACING]))
        _act(agreed, metadata)
    _countdown = _spacing


def final_boundary(metadata: Callable[[], dict]) -> None:
    """Call on every replica at the end of a loop: settle all agreements now."""
    global _pending, _countdown
    previous, _pending, _countdown = _pending, None, 0
    if previous is not None:
        _act(_agreed(previous), metadata)
    _act(_agreed(collectives.allreduce_max_async(_local_flags())), metadata)


def _reset_for_tests() -> None:
    global _stop_requested, _stop_signal, _pending, _started, _handlers_installed, _spacing, _countdown, _agreed_at
    if _handlers_installed and threading.current_thread() is threading.main_thread():
        for signum, handler in _previous_handlers.items():
            signal.signal(signum, handler)
        _handlers_installed = False
    _stop_requested = False
    _stop_signal = None
    _pending = None
    _started = time.monotonic()
    _spacing, _countdown, _agreed_at = 1, 0, None
