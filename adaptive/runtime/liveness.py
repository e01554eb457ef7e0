"""Live mode: each worker's sign of life on the job's store, and the members that stopped giving one.

A worker killed outright is reported by its launcher, which reaps it; a
worker that is stopped (SIGSTOP, a debugger, a host swapping to death) or
whose process hangs keeps its sockets open, so no collective fails and its
launcher sees nothing.  Each worker of a live job therefore runs a
:class:`Beat`: a daemon thread that adds one to its own counter on the
store every :data:`BEAT_INTERVAL` seconds, over a store connection of its
own.  A stopped process stops counting.

Another member that waits for it keeps a :class:`Watch`: when it last saw
each counter change, by its own clock (so clocks of different machines are
never compared).  A counter that has not changed for the hang timeout
(``ADAPTIVE_LIVE_HANG_TIMEOUT``, default 10 s) while this member looked
belongs to a hung member: :mod:`adaptive.runtime.membership` then takes it
out of the job like a lost one.  A process whose beating thread still runs
while its main thread is deadlocked is not detected this way.

The counters cannot be signed (the store adds in place).  Whoever adds to
one (a forged increment) makes its member look alive: that can only delay
the finding of a hung member, until the collective timeout ends the wait.
Only a counter that stops moving takes a member out, and an add cannot
make it stop (whoever can *overwrite* it, again and again, can: see
``docs/live.md``, "Who can write to the job's store").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["BEAT_INTERVAL", "Beat", "Watch"]

logger = logging.getLogger(__name__)

#: Seconds between a worker's signs of life.
BEAT_INTERVAL = 0.5


class Beat:
    """Adds one to ``key`` on the store every :data:`BEAT_INTERVAL` seconds, from a daemon thread.

    Args:
        connect: opens the thread's own connection to the job's store (the
            main thread's connection is not shared between threads).
        key: this worker's counter.
    """

    def __init__(self, connect: Callable[[], torch.distributed.Store], key: str) -> None:
        self._connect = connect
        self.key = key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adaptive-live-beat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop beating (at the process's end, before torch's teardown)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        store = None
        failing = False
        while not self._stop.is_set():
            try:
                store = store or self._connect()
                store.add(self.key, 1)
                failing = False
            except Exception as error:  # the store's host may be gone; the members learn it otherwise
                store = None
                if not failing:
                    logger.debug("could not give this worker's sign of life on the job's store: %s", error)
                failing = True
            self._stop.wait(BEAT_INTERVAL)


class Watch:
    """When this process last saw each member's counter (or a launcher's sign of life) change, by its own
    monotonic clock."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Hashable, float]] = {}
        self._lock = threading.Lock()

    def silent_for(self, key: str, value: Hashable, now: float | None = None) -> float:
        """Record that ``key`` reads ``value``; seconds it has read that since this process saw it change
        (0 on the first look)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            last = self._seen.get(key)
            if last is None or last[0] != value:
                self._seen[key] = (value, now)
                return 0.0
            return now - last[1]
