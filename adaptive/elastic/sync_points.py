"""Points where all replicas agree to stop and/or checkpoint.

Replicas learn about a stop at different moments: torchrun forwards SIGTERM
to each worker separately, a scale-up restarts the workers one by one, and
the periodic-checkpoint clock runs on rank 0 only.  To keep every replica at
the same step, each replica contributes its flags to a tiny all-reduce (max)
and all act on the agreed result at the same point.  Agreements happen at:

* **step boundaries** inside an ``AdaptiveDataLoader`` loop
  (:func:`step_boundary`): the all-reduce runs in the background during the
  following steps and is acted on at the next agreement boundary.  With
  several replicas the replicas agree at most every ``AGREEMENT_INTERVAL``
  seconds: each agreement also settles, from every replica's step rate, how
  many boundaries pass until the next one.  The spacing starts again at one
  step in every loop (:func:`restart_spacing`), because a validation loop's
  steps are much shorter than a training loop's;
* **settle points** (:func:`settle`), where the agreement blocks: the first
  boundary of every loop (a stop that arrived between loops is acted on
  before the loop's first step), the boundary before a loop's last step (a
  stop known then is acted on *before* that step, so a replay runs the last
  step again and variables set in the loop's body are bound), and the end
  of every epoch (:mod:`adaptive.elastic.epoch`).

A stop that arrives during a loop's last step is carried, agreed, to the
next settle point: the next loop's first boundary or the end of the epoch.
A stop or a due checkpoint is acted on within about two agreement intervals
(or two steps, whichever is longer) inside loader loops; plain code between
loops delays it by its own duration.

A graceful stop (SIGTERM or SIGINT) waits for an asynchronous checkpoint
still in flight, saves a checkpoint and exits with code 143, inside
torchrun's 30 s shutdown window.  Periodic checkpoints are written in the
background when ``ADAPTIVE_ASYNC_CHECKPOINT`` says so (see
:func:`adaptive.checkpoint.states.periodic_saves_asynchronous`).  If that checkpoint cannot be
written the process says why and exits with code 1, and ``adaptive-run``
reports the failure instead of a clean stop.  A second SIGINT interrupts at
once.  If a peer died, the agreement itself fails: this replica then exits
at once *without* writing, so the last complete checkpoint stays the newest.

Every agreement also carries rank 0's view of the job's generation (see
:mod:`adaptive.checkpoint.generation`): once a newer incarnation has taken
the checkpoint folder, every replica of this one stops at the same
boundary, writes nothing, tells ``adaptive-run`` (which ends the whole
incarnation) and exits with :data:`STALE_GENERATION_EXIT_CODE`.

In live mode (``adaptive-run --live``, :mod:`adaptive.elastic.live`) the
agreement also carries the join requests rank 0 saw, whether a member
leaves (SIGTERM makes a member leave rather than stop the job) and whether
an in-memory snapshot is due; a change is made at the boundary where it was
agreed, after the old generation acted on what it had agreed.  A lost peer
at a loader's boundary is recorded on the step instead of ending the
process, and the loader re-forms the members that are left.
"""

from __future__ import annotations

import logging
import dataclasses
import signal
import threading
import time
from types import FrameType
from typing import Any, Callable

from adaptive.checkpoint import states
from adaptive.checkpoint.generation import StaleGenerationError
from adaptive.elastic import live
from adaptive.runtime import collectives, env, launch_status, membership, peer_failure
from adaptive.runtime import step as step_records
from adaptive.runtime.job import Job, current_job, on_reset

__all__ = [
    "GRACEFUL_EXIT_CODE",
    "STOP_FAILED_EXIT_CODE",
    "STALE_GENERATION_EXIT_CODE",
    "install_signal_handlers",
    "request_stop",
    "stop_requested",
    "step_boundary",
    "settle",
    "restart_spacing",
    "final_boundary",
]

logger = logging.getLogger(__name__)

#: Exit status after a graceful stop (128 + SIGTERM), as torchrun expects.
GRACEFUL_EXIT_CODE = 143
#: Exit status when a stop was asked for but its checkpoint could not be written.
STOP_FAILED_EXIT_CODE = 1
#: Exit status of a replica whose peer failed (nothing is written; torchrun restarts the group).
PEER_FAILED_EXIT_CODE = 1
#: Exit status of an incarnation that a newer generation of the job fenced off.
STALE_GENERATION_EXIT_CODE = launch_status.STALE_GENERATION_EXIT_CODE

#: Seconds between agreements with several replicas (at least one step apart).
AGREEMENT_INTERVAL = 0.1
#: The most step boundaries between two agreements.
MAX_SPACING = 1000

# Positions in the flag vector: stop, checkpoint due, minus the proposed spacing, the resumed
# checkpoint's sequence number and its negation (max and -min: all must be equal), rank 0's
# generation and the newer one that fenced it (0 on the other ranks, and when not fenced), and in
# live mode the join requests rank 0 saw, whether a member leaves and whether a snapshot is due.
_STOP, _CHECKPOINT, _SPACING, _SEQ, _NEG_SEQ, _GENERATION, _NEWER, _JOINS, _LEAVE, _SNAPSHOT = range(10)


SignalHandler = Callable[[int, FrameType | None], Any] | int | None


@dataclasses.dataclass
class Agreement:
    """The stop and checkpoint agreement between replicas: its record on the job context."""

    stop_requested: bool = False
    stop_signal: int | None = None
    handlers_installed: bool = False
    previous_handlers: dict[int, SignalHandler] = dataclasses.field(default_factory=dict)
    pending: tuple[collectives.Waitable, int] | None = None  # the agreement in flight, saves done when issued
    decided: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # (stop, checkpoint) to act on
    membership: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0])  # (joins, leave) agreed
    snapshot: bool = False  # live mode: an in-memory snapshot was agreed (the loader takes it)
    spacing: int = 1  # step boundaries from one agreement to the next (agreed by all replicas)
    countdown: int = 0  # step boundaries left until the next agreement
    agreed_at: float | None = None  # when the last agreement started (monotonic)
    metadata: Callable[[], dict[str, Any]] = dict  # describes the position of the loop in progress


def _agreement() -> Agreement:
    """This job's agreement record (see :mod:`adaptive.runtime.job`)."""
    return current_job().part(Agreement)


def _on_signal(signum: int, frame: Any) -> None:
    agreement = _agreement()
    if (agreement.stop_requested or live.leave_requested()) and signum == signal.SIGINT:
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
    agreement.stop_requested = True
    agreement.stop_signal = signum
    logger.warning("received %s: asking every replica to stop at the same step, checkpoint and exit",
                   signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Turn SIGTERM and SIGINT into a graceful, agreed stop (main thread only)."""
    agreement = _agreement()
    if agreement.handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        agreement.previous_handlers[signum] = signal.signal(signum, _on_signal)
    agreement.handlers_installed = True
    launch_status.clear_earlier_reports()
    peer_failure.install()


def request_stop() -> None:
    """Ask for a graceful stop from code, as SIGTERM would."""
    _agreement().stop_requested = True


def stop_requested() -> bool:
    """Whether this replica was asked to stop (not yet agreed with the others)."""
    return _agreement().stop_requested


def _checkpoint_due() -> bool:
    interval = env.checkpoint_interval()
    if interval <= 0 or env.rank() != 0:
        return False
    if step_records.stream().steps_committed == states.steps_at_last_save():
        return False  # nothing trained since the last save or the resume: the checkpoint would repeat it
    since = states.seconds_since_last_save()
    elapsed = time.monotonic() - current_job().started if since is None else since  # since the process began
    return elapsed >= interval


def _proposed_spacing() -> int:
    """Step boundaries that take about AGREEMENT_INTERVAL at this replica's recent pace."""
    agreement = _agreement()
    if agreement.agreed_at is None or env.num_replicas() == 1:
        return 1
    per_boundary = (time.monotonic() - agreement.agreed_at) / agreement.spacing
    if per_boundary <= 0:
        return MAX_SPACING
    return max(1, min(MAX_SPACING, round(AGREEMENT_INTERVAL / per_boundary)))


def _local_flags() -> list[float]:
    # The max over replicas of minus the spacing is minus the smallest spacing proposed.
    seq = float(states.resumed_seq())
    generation, newer = _generation_flags()
    return [float(_agreement().stop_requested), float(_checkpoint_due()), -float(_proposed_spacing()), seq, -seq,
            generation, newer, float(live.joins_seen()), float(live.leave_requested()), float(live.snapshot_due())]


def _generation_flags() -> tuple[float, float]:
    """Rank 0's generation and, once it is stale, the newer one (checked at most every second)."""
    stale = states.stale_generation()
    if stale is not None:
        return float(stale.mine), float(stale.newest_number or stale.mine + 1)
    generation = states.generation()
    return (0.0 if generation is None else float(generation.number)), 0.0


def _issue() -> tuple[Any, int]:
    """Start an agreement on this replica's flags now."""
    return collectives.allreduce_max_async(_local_flags()), states.save_count()


def _settle(pending: tuple[collectives.Waitable, int], recoverable: bool = False) -> list[float]:
    """Wait for an agreement and fold its decision into ``_agreement().decided``.

    A lost peer ends the process, unless ``recoverable`` in live mode: then
    the error is raised for the loader to re-form the members.
    """
    waitable, saves_then = pending
    try:
        agreed = waitable.result()
    except collectives.CollectiveError as error:
        if recoverable and membership.is_live():
            raise
        peer_failure.report(error)
        raise SystemExit(PEER_FAILED_EXIT_CODE) from error
    if agreed[_SEQ] != -agreed[_NEG_SEQ]:
        raise states.CheckpointError(
            "replicas resumed from different checkpoints (sequence numbers "
            f"{-agreed[_NEG_SEQ]:.0f} to {agreed[_SEQ]:.0f}; -1 is none): every node must see the same "
            f"ADAPTIVE_CHECKPOINT_PATH ({env.checkpoint_path()}) on shared storage"
        )
    if agreed[_NEWER] > 0:
        _exit_stale(int(agreed[_GENERATION]), int(agreed[_NEWER]))
    decided, change = _agreement().decided, _agreement().membership
    decided[0] = max(decided[0], agreed[_STOP])
    if saves_then == states.save_count():  # a flag raised before the last save is already served
        decided[1] = max(decided[1], agreed[_CHECKPOINT])
    change[0], change[1] = max(change[0], agreed[_JOINS]), max(change[1], agreed[_LEAVE])
    _agreement().snapshot = _agreement().snapshot or agreed[_SNAPSHOT] > 0
    return agreed


def _act(metadata: Callable[[], dict[str, Any]]) -> None:
    """Act on what all replicas agreed: stop (checkpoint, exit 143) or checkpoint."""
    stop, due = _agreement().decided
    _agreement().decided[:] = [0.0, 0.0]
    if stop > 0:
        _stop(dict(metadata(), reason="stop"))
    # A save agreed before another checkpoint was written (the finished one, between the agreement and its
    # settling) would repeat it, after it: skipped, the same way on every replica (each counts the same steps
    # since the last save; a live joiner takes the members' count with the state).
    if due > 0 and step_records.stream().steps_committed != states.steps_at_last_save():
        save_or_exit(dict(metadata(), reason="periodic"),
                     blocking=not states.periodic_saves_asynchronous())  # ADAPTIVE_ASYNC_CHECKPOINT


def save_or_exit(info: dict[str, Any], *, blocking: bool = True) -> int:
    """The library's own saves: :func:`~adaptive.checkpoint.states.save_all_states`, and if a newer
    generation fenced this incarnation, the agreed stop of a stale incarnation instead of an error."""
    try:
        return states.save_all_states(info, blocking=blocking)
    except StaleGenerationError as error:
        _exit_stale(error.mine, error.newest_number or error.mine + 1)
        raise  # not reached


def _exit_stale(mine: int, newest: int) -> None:
    """Stop this stale incarnation: say so once per rank, tell adaptive-run, write nothing, exit."""
    message = (f"generation {mine} of this job is stale: generation {newest} took over the checkpoint folder "
               f"{env.checkpoint_path()} (a relaunch, or the same job launched twice); this incarnation "
               f"publishes nothing and exits with {STALE_GENERATION_EXIT_CODE}")
    logger.error("%s", message)
    launch_status.report_stale(mine, newest, message)
    current_job().exiting = True
    raise SystemExit(STALE_GENERATION_EXIT_CODE)


def _stop(info: dict[str, Any]) -> None:
    """Save the stop's checkpoint and exit: 143 when it is durable, 1 (saying why) when not.

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


def last_position() -> dict[str, Any]:
    """How the loop that last reached a boundary describes its position (for a manifest)."""
    return dict(_agreement().metadata())


def restart_spacing() -> None:
    """Agree at the next boundary and measure the spacing afresh (a new loop, a new batch size)."""
    agreement = _agreement()
    agreement.spacing, agreement.countdown, agreement.agreed_at = 1, 0, None


def step_boundary(metadata: Callable[[], dict[str, Any]]) -> None:
    """Call between two steps on every replica; may checkpoint or exit.

    At an agreement boundary, acts on the flags agreed at the previous one
    (and on any decision carried from a finished loop) and starts agreeing
    on this one's; other boundaries return at once.  ``metadata`` describes
    the position for the checkpoint's manifest (epoch, step, ...).  In live
    mode a lost peer is recorded on the step
    (:func:`adaptive.runtime.step.record_fault`) for the loader to act on.
    """
    agreement = _agreement()
    agreement.metadata = metadata
    if step_records.faulted():  # live mode: the group is broken; the loader re-forms the members
        agreement.pending = None
        return
    if agreement.countdown > 1:
        agreement.countdown -= 1
        return
    try:
        previous, agreement.pending = agreement.pending, _issue()
        agreement.agreed_at = time.monotonic()
        if previous is not None:
            agreed = _settle(previous, recoverable=True)
            agreement.spacing = max(1, int(-agreed[_SPACING]))
    except collectives.CollectiveError as error:
        _record_loss(error)
        return
    _act(metadata)
    agreement.countdown = agreement.spacing
    if any(agreement.membership):
        _change_membership(metadata)


def _record_loss(error: collectives.CollectiveError) -> None:
    """Live mode: a lost peer broke the agreement; the loader re-forms the members (elsewhere: re-raised)."""
    if not peer_failure.absorb_in_live_mode(error):
        raise error
    _agreement().pending = None


def forget_decisions() -> None:
    """Live mode, after the members re-formed without a lost one: what the broken generation agreed is void.

    A stop asked for on this member is asked for again at the next
    agreement (``stop_requested`` stays), and a due checkpoint is due again.
    """
    agreement = _agreement()
    agreement.pending = None
    agreement.decided[:] = [0.0, 0.0]
    agreement.membership[:] = [0.0, 0.0]
    agreement.snapshot = False
    restart_spacing()


def snapshot_agreed() -> bool:
    """Live mode: whether the members agreed on an in-memory snapshot at this boundary (the flag is consumed)."""
    agreement = _agreement()
    agreed, agreement.snapshot = agreement.snapshot, False
    return agreed


def _change_membership(metadata: Callable[[], dict[str, Any]]) -> None:
    """Act on an agreed live membership change (see :mod:`adaptive.elastic.live`); every member calls it.

    The agreement issued at this boundary is settled first: every member of
    the old generation issued it, and its group is about to go.
    """
    agreement = _agreement()
    pending, agreement.pending = agreement.pending, None
    if pending is not None:
        _settle(pending)
        _act(metadata)  # what the old generation agreed is done by it: a joiner knows nothing of it
    joins = int(agreement.membership[0])
    agreement.membership[:] = [0.0, 0.0]
    agreement.snapshot = False
    try:
        outcome = live.change(joins, dict(metadata()))
    except collectives.CollectiveError as error:  # a member (or a joiner) was lost during the change
        _record_loss(error)
        return
    restart_spacing()
    if outcome is live.Outcome.STOP:
        _stop(dict(metadata(), reason="stop"))
    if outcome is live.Outcome.LEAVE:
        launch_status.confirm_stop(ok=True, seq=None, left=True)
        current_job().exiting = True
        raise SystemExit(GRACEFUL_EXIT_CODE)


def settle(metadata: Callable[[], dict[str, Any]] | None = None, *, recoverable: bool = False) -> None:
    """Agree now, blocking, on every replica, and act on the result.

    Used where a stop must not wait: before a loop's first and last steps
    and at the end of every epoch.  ``metadata`` defaults to the position the
    last loop described.  ``recoverable`` (the loader's boundaries): in live
    mode a lost peer is recorded on the step instead of ending the process.
    """
    agreement = _agreement()
    if recoverable and step_records.faulted():
        agreement.pending = None
        return
    previous, agreement.pending, agreement.countdown = agreement.pending, None, 0
    try:
        if previous is not None:
            _settle(previous, recoverable=recoverable)
        _settle(_issue(), recoverable=recoverable)
    except collectives.CollectiveError as error:
        if not recoverable:
            raise
        _record_loss(error)
        return
    _act(metadata or agreement.metadata)


def final_boundary(metadata: Callable[[], dict[str, Any]]) -> None:
    """Call on every replica when a loop has taken its last step (the loader, before the loop ends).

    The agreement in flight is settled, but a stop it carries is *not* acted
    on here: the loop is finished, and stopping now would skip the code after
    the loop on replay.  The decision waits for the next settle point.  In
    live mode a lost peer is recorded on the step, as at
    :func:`step_boundary`: the members re-form and train the loop's last
    steps again; elsewhere it ends the process.
    """
    agreement = _agreement()
    agreement.metadata = metadata
    previous, agreement.pending = agreement.pending, None
    if previous is not None and not step_records.faulted():
        try:
            _settle(previous, recoverable=True)
        except collectives.CollectiveError as error:
            _record_loss(error)
            return
    restart_spacing()


def _restore_signal_handlers(job: Job) -> None:
    """Give back the signal handlers a reset job had installed (see :func:`adaptive.runtime.job.reset_job`)."""
    if not job.has_part(Agreement):
        return
    agreement = job.part(Agreement)
    if agreement.handlers_installed and threading.current_thread() is threading.main_thread():
        for signum, handler in agreement.previous_handlers.items():
            signal.signal(signum, handler)
        agreement.handlers_installed = False


on_reset(_restore_signal_handlers)

