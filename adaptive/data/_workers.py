"""DataLoader worker processes that a graceful stop does not kill.

torchrun stops a job by signalling each worker's whole process group, and
a terminal's Ctrl-C reaches the whole foreground group: both would kill the
DataLoader's worker processes before the trainer has checkpointed.  Each
worker therefore moves to a process group of its own as it starts, and the
trainer holds the stop signals back while it starts workers, so that a
signal sent in that window reaches the trainer and not a half-started
worker.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from adaptive.runtime.process_tree import bind_to_parent

__all__ = ["ShieldedWorkerInit", "signals_blocked"]

#: Signals that mean "stop the job": the main process handles them, data workers ignore them.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class ShieldedWorkerInit:
    """``worker_init_fn`` of the DataLoader workers: leave the trainer's process group, then run the user's.

    torchrun stops a worker by signalling its whole process group, which
    holds the DataLoader's worker processes too.  Killed by that SIGTERM they
    would make the main process fail ("DataLoader worker ... is killed by
    signal") before it could checkpoint.  The stop belongs to the trainer, so
    each data worker moves to a process group of its own: signals meant for
    the job (and a terminal's Ctrl-C) no longer reach it, while the main
    process still shuts it down as usual, and its watchdog ends it if the
    main process dies.  The main process blocks the stop signals while it
    starts workers (:class:`_signals_blocked`); one sent to the old group in
    that window is discarded here before they are unblocked.
    """

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn
        self.trainer = os.getpid()

    def __call__(self, worker_id: int) -> None:
        bind_to_parent(self.trainer)  # torch's watchdog polls every 5 s; the kernel acts at once
        os.setpgid(0, 0)
        while signal.sigpending() & _STOP_SIGNALS:  # sent to the trainer's group before we left it
            signal.sigwait(_STOP_SIGNALS)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class signals_blocked:
    """Hold SIGTERM/SIGINT back while DataLoader workers are started (they inherit the mask)."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __enter__(self) -> None:
        if self.active:
            self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)

    def __exit__(self, *exc: Any) -> None:
        if self.active:  # a signal that arrived meanwhile is delivered to our handler now
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)
