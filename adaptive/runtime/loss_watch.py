"""Live mode: asynchronous collectives that end once a member reports a lost peer, not at the timeout.

After a member of a live job dies, the members that noticed discard the step
and send nothing more on the old group.  In a group of three or more, a
member can then wait in a collective for data that one of them will never
send (gloo's ring algorithms pass data on from neighbour to neighbour), and
would only learn of the loss at the collective timeout, after the others
had taken it for dead.  Every member that re-forms says so on the store
first (:func:`adaptive.runtime.reforming.report_loss`).  Collectives waited
for on the calling thread look at that between slices of their wait
(:func:`adaptive.runtime.collectives.wait`); a future that torch waits for
itself (the gradient all-reduce of DDP's communication hook) is handed to
:func:`release_on_loss`, and one watcher thread, which looks at the store
every :data:`INTERVAL` seconds while such a future is pending, completes it
with its fallback when a loss was reported.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

import torch

from adaptive.runtime import reforming

__all__ = ["release_on_loss", "complete_once", "INTERVAL"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between the watcher's looks at the store while a future is pending.
INTERVAL = 0.1

_lock = threading.Condition()
#: id(future) -> completes that future with its fallback (unless it has completed meanwhile).
_pending: dict[int, Callable[[], bool]] = {}
_watcher: list[threading.Thread] = []


def complete_once(future: torch.futures.Future[T], value: T) -> bool:
    """Set ``future``'s result unless it has one already (the collective and the watcher may both try)."""
    with _lock:
        _pending.pop(id(future), None)
        if future.done():
            return False
        future.set_result(value)
        return True


def release_on_loss(future: torch.futures.Future[T], fallback: Callable[[], T]) -> None:
    """Complete ``future`` with ``fallback()`` if a member reports a lost peer before it completes otherwise.

    The caller completes it the ordinary way with :func:`complete_once`.
    """
    with _lock:
        if future.done():
            return
        _pending[id(future)] = lambda: complete_once(future, fallback())
        if not _watcher or not _watcher[0].is_alive():
            _watcher[:] = [threading.Thread(target=_watch, name="adaptive-loss-watch", daemon=True)]
            _watcher[0].start()
        _lock.notify()


def _watch() -> None:
    while True:
        with _lock:
            while not _pending:
                _lock.wait()
        time.sleep(INTERVAL)
        with _lock:
            if not _pending:
                continue
        try:
            lost = reforming.loss_reported()
        except (RuntimeError, OSError):  # the store is gone: the collectives end on their own timeout
            logger.debug("cannot read the live job's store", exc_info=True)
            continue
        if lost:
            _release_all()


def _release_all() -> None:
    with _lock:
        released = list(_pending.values())
        _pending.clear()
    for release in released:
        release()
    if released:
        logger.warning("a member reported a lost peer: %d collective(s) in flight were given up", len(released))
