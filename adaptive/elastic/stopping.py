"""A graceful stop: the signals that ask for it, and the agreed stop that checkpoints and exits.

SIGTERM or SIGINT (or :func:`request_stop` from code) only raise a flag on
this replica; the replicas agree on it at a step boundary
(:mod:`adaptive.elastic.sync_points`) and all stop after the same step.
There :func:`stop_and_exit` waits for an asynchronous checkpoint still in
flight, saves a checkpoint and exits with code 143, inside torchrun's 30 s
shutdown window.  If that checkpoint cannot be written the process says why
and exits with code 1, and ``adaptive-run`` reports the failure instead of
a clean stop.  A second SIGINT interrupts at once.

In live mode (``adaptive-run --live``) a signal makes this member leave the
job at the next agreed boundary while the others go on
(:func:`adaptive.elastic.live.request_leave`); a process still joining holds
nothing to save and exits at once.

Once a newer incarnation has taken the checkpoint folder, every replica of
this one stops at the same boundary, writes nothing, tells ``adaptive-run``
(which ends the whole incarnation) and exits with
:data:`STALE_GENERATION_EXIT_CODE` (:func:`exit_stale`).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from types import FrameType
from typing import Callable, Mapping

from adaptive.checkpoint import states
from adaptive.checkpoint.generation import StaleGenerationError
from adaptive.elastic import live
from adaptive.runtime import env, launch_status, membership, peer_failure
from adaptive.runtime.job import Job, current_job, on_reset

__all__ = ["GRACEFUL_EXIT_CODE", "STOP_FAILED_EXIT_CODE", "PEER_FAILED_EXIT_CODE", "STALE_GENERATION_EXIT_CODE",
           "install_signal_handlers", "request_stop", "stop_requested", "save_or_exit", "stop_and_exit",
           "exit_stale"]

logger = logging.getLogger(__name__)

#: Exit status after a graceful stop (128 + SIGTERM), as torchrun expects.
GRACEFUL_EXIT_CODE = 143
#: Exit status when a stop was asked for but its checkpoint could not be written.
STOP_FAILED_EXIT_CODE = 1
#: Exit status of a replica whose peer failed (nothing is written; torchrun restarts the group).
PEER_FAILED_EXIT_CODE = 1
#: Exit status of an incarnation that a newer generation of the job fenced off.
STALE_GENERATION_EXIT_CODE = launch_status.STALE_GENERATION_EXIT_CODE

SignalHandler = Callable[[int, FrameType | None], object] | int | None


@dataclasses.dataclass
class StopRequest:
    """Whether this replica was asked to stop, and the signal handlers that ask: its record on the job."""

    requested: bool = False
    signum: int | None = None
    handlers_installed: bool = False
    previous_handlers: dict[int, SignalHandler] = dataclasses.field(default_factory=dict)


def _request() -> StopRequest:
    return current_job().part(StopRequest)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    request = _request()
    if (request.requested or live.leave_requested()) and signum == signal.SIGINT:
        raise KeyboardInterrupt
    if membership.is_live():  # one member stopped: it leaves, the others go on
        if not membership.is_member():  # still joining (or waiting to be admitted): it holds nothing to save
            logger.warning("received %s while joining the live job; leaving it (nothing to save)",
                           signal.Signals(signum).name)
            current_job().exiting = True
            raise SystemExit(GRACEFUL_EXIT_CODE)
        if live.leave_requested():
            return
        live.request_leave()
        logger.warning("received %s: leaving the live job at the next agreed step; the other members continue",
                       signal.Signals(signum).name)
        return
    request.requested, request.signum = True, signum
    logger.warning("received %s: asking every replica to stop at the same step, checkpoint and exit",
                   signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGINT into a graceful, agreed stop (main thread only)."""
    request = _request()
    if request.handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        request.previous_handlers[signum] = signal.signal(signum, _on_signal)
    request.handlers_installed = True
    launch_status.clear_earlier_reports()
    peer_failure.install()


def request_stop() -> None:
    """Ask for a graceful stop from code, as SIGTERM would."""
    _request().requested = True


def stop_requested() -> bool:
    """Whether this replica was asked to stop (not yet agreed with the others)."""
    return _request().requested


def save_or_exit(info: Mapping[str, object], *, blocking: bool = True) -> int:
    """The library's own saves: :func:`~adaptive.checkpoint.states.save_all_states`, and if a newer
    generation fenced this incarnation, the agreed stop of a stale incarnation instead of an error."""
    try:
        return states.save_all_states(dict(info), blocking=blocking)
    except StaleGenerationError as error:
        exit_stale(error.mine, error.newest_number or error.mine + 1)
        raise  # not reached


def exit_stale(mine: int, newest: int) -> None:
    """Stop this stale incarnation: say so once per rank, tell adaptive-run, write nothing, exit."""
    message = (f"folder generation {mine} of this job is stale: folder generation {newest} took over the "
               f"checkpoint folder {env.checkpoint_path()} (a relaunch, or the same job launched twice); this "
               f"incarnation publishes nothing and exits with {STALE_GENERATION_EXIT_CODE}")
    logger.error("%s", message)
    launch_status.report_stale(mine, newest, message)
    current_job().exiting = True
    raise SystemExit(STALE_GENERATION_EXIT_CODE)


def stop_and_exit(info: Mapping[str, object]) -> None:
    """The agreed stop: save its checkpoint and exit, 143 when it is durable, 1 (saying why) when not.

    An asynchronous save still in flight is finished first (its failure is
    logged; the stop's own checkpoint is written either way).
    """
    states.wait_for_pending_save()
    try:
        seq = save_or_exit(info)
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
        if peer_failure.is_peer_failure(error):
            peer_failure.report(error)
            launch_status.confirm_stop(ok=False, reason=f"a peer replica failed ({reason})")
            raise SystemExit(PEER_FAILED_EXIT_CODE) from error
        logger.error("the stop could not write its checkpoint (%s); the job will resume from the last complete "
                     "checkpoint in %s; exiting with %d", reason, env.checkpoint_path(), STOP_FAILED_EXIT_CODE)
        launch_status.confirm_stop(ok=False, reason=reason)
        current_job().exiting = True
        raise SystemExit(STOP_FAILED_EXIT_CODE) from error
    launch_status.confirm_stop(ok=True, seq=seq)
    current_job().exiting = True
    logger.log(logging.INFO if env.rank() == 0 else logging.DEBUG,
               "stopped gracefully at epoch %s, step %s (checkpoint %s); exiting with %d",
               info.get("epoch"), info.get("step"), seq, GRACEFUL_EXIT_CODE)
    raise SystemExit(GRACEFUL_EXIT_CODE)


def leave_and_exit() -> None:
    """Live mode: this member left the job (the others go on); nothing is lost, exit 143."""
    launch_status.confirm_stop(ok=True, seq=None, left=True)
    current_job().exiting = True
    raise SystemExit(GRACEFUL_EXIT_CODE)


def _restore_signal_handlers(job: Job) -> None:
    """Give back the signal handlers a reset job had installed (see :func:`adaptive.runtime.job.reset_job`)."""
    if not job.has_part(StopRequest):
        return
    request = job.part(StopRequest)
    if request.handlers_installed and threading.current_thread() is threading.main_thread():
        for signum, handler in request.previous_handlers.items():
            signal.signal(signum, handler)
        request.handlers_installed = False


on_reset(_restore_signal_handlers)
