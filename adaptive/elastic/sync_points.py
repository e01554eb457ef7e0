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

What each replica says is a :class:`~adaptive.elastic.step_flags.StepFlags`
record (a stop, a due checkpoint, the spacing, the resumed checkpoint, the
checkpoint folder's generation, and in live mode joins, leaves and
drains); the agreed stop itself, and the signals that ask for it, are
:mod:`adaptive.elastic.stopping`.  If a peer died, the agreement itself
fails: this replica then exits at once *without* writing, so the last
complete checkpoint stays the newest.  Once a newer incarnation has taken
the checkpoint folder, every replica of this one stops at the same boundary
and writes nothing (:func:`adaptive.elastic.stopping.exit_stale`).

In live mode (``adaptive-run --live``, :mod:`adaptive.elastic.live`) the
agreement also carries the join and drain requests rank 0 saw, whether a
member leaves (SIGTERM makes a member leave rather than stop the job); a
change is made at the boundary where it was
agreed, after the old generation acted on what it had agreed.  A lost peer
at a loader's boundary is recorded on the step instead of ending the
process, and the loader re-forms the members that are left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

from adaptive.checkpoint import fencing, states
from adaptive.elastic import live, stopping
from adaptive.elastic.step_flags import StepFlags
from adaptive.elastic.stopping import (GRACEFUL_EXIT_CODE, PEER_FAILED_EXIT_CODE, STALE_GENERATION_EXIT_CODE,
                                       STOP_FAILED_EXIT_CODE, install_signal_handlers, request_stop, stop_requested)
from adaptive.runtime import collectives, env, membership, peer_failure
from adaptive.runtime import step as step_records
from adaptive.runtime.job import current_job

__all__ = [
    "GRACEFUL_EXIT_CODE",
    "STOP_FAILED_EXIT_CODE",
    "PEER_FAILED_EXIT_CODE",
    "STALE_GENERATION_EXIT_CODE",
    "install_signal_handlers",
    "request_stop",
    "stop_requested",
    "step_boundary",
    "make_agreed_change",
    "settle",
    "restart_spacing",
    "final_boundary",
    "forget_decisions",
    "last_position",
]

logger = logging.getLogger(__name__)

#: Seconds between agreements with several replicas (at least one step apart).
AGREEMENT_INTERVAL = 0.1
#: The most step boundaries between two agreements.
MAX_SPACING = 1000

#: The position of the loop in progress, for a checkpoint's manifest (epoch, step, loader, ...).
Metadata = Callable[[], dict[str, Any]]
#: The agreed fields that wait, once agreed, until they are acted on (a stop and a due checkpoint at the next
#: agreement boundary, a membership change there too).
_CARRIED = ("stop", "checkpoint_due", "joins", "leave", "drains")


@dataclasses.dataclass
class Agreement:
    """The per-step agreement between replicas: its record on the job context."""

    pending: tuple[collectives.Waitable, int] | None = None  # the agreement in flight, saves done when issued
    decided: StepFlags = dataclasses.field(default_factory=StepFlags)  # agreed, not acted on yet (_CARRIED)
    spacing: int = 1  # step boundaries from one agreement to the next (agreed by all replicas)
    countdown: int = 0  # step boundaries left until the next agreement
    agreed_at: float | None = None  # when the last agreement started (monotonic)
    metadata: Metadata = dict  # describes the position of the loop in progress


def _agreement() -> Agreement:
    """This job's agreement record (see :mod:`adaptive.runtime.job`)."""
    return current_job().part(Agreement)


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


def _local_flags() -> StepFlags:
    """What this replica says at the agreement it issues now."""
    folder_generation, newer = _folder_generations()
    return StepFlags(stop=stop_requested(), checkpoint_due=_checkpoint_due(), spacing=_proposed_spacing(),
                     resumed_seq=states.resumed_seq(), folder_generation=folder_generation,
                     newer_folder_generation=newer, joins=live.joins_seen(), leave=live.leave_requested(),
                     drains=live.drains_seen())


def _folder_generations() -> tuple[int, int]:
    """Rank 0's generation of the checkpoint folder and, once it is stale, the newer one (checked at most every
    second)."""
    stale = fencing.stale_generation()
    if stale is not None:
        return stale.mine, stale.newest_number or stale.mine + 1
    generation = fencing.generation()
    return (0 if generation is None else generation.number), 0


def _issue() -> tuple[collectives.Waitable, int]:
    """Start an agreement on this replica's flags now."""
    return collectives.allreduce_max_async(_local_flags().encode()), states.save_count()


def _settle(pending: tuple[collectives.Waitable, int], recoverable: bool = False) -> StepFlags:
    """Wait for an agreement and carry what it decided (``_agreement().decided``) until it is acted on.

    A lost peer ends the process, unless ``recoverable`` in live mode: then
    the error is raised for the loader to re-form the members.
    """
    waitable, saves_then = pending
    try:
        agreed = StepFlags.decode(waitable.result())
    except collectives.CollectiveError as error:
        if recoverable and membership.is_live():
            raise
        peer_failure.report(error)
        raise SystemExit(PEER_FAILED_EXIT_CODE) from error
    if "resumed_seq" in agreed.mismatches:
        lowest, highest = agreed.mismatches["resumed_seq"]
        raise states.CheckpointError(
            f"replicas resumed from different checkpoints (sequence numbers {lowest} to {highest}; -1 is none): "
            f"every node must see the same ADAPTIVE_CHECKPOINT_PATH ({env.checkpoint_path()}) on shared storage"
        )
    if agreed.newer_folder_generation > 0:
        stopping.exit_stale(agreed.folder_generation, agreed.newer_folder_generation)
    if saves_then != states.save_count():  # a flag raised before the last save is already served
        agreed.checkpoint_due = False
    agreement = _agreement()
    agreement.decided = agreement.decided.merged(agreed, *_CARRIED)
    return agreed


def _act(metadata: Metadata) -> None:
    """Act on what all replicas agreed: stop (checkpoint, exit 143) or checkpoint."""
    decided = _agreement().decided
    stop, due = decided.stop, decided.checkpoint_due
    decided.stop = decided.checkpoint_due = False
    if stop:
        stopping.stop_and_exit(dict(metadata(), reason="stop"))
    # A save agreed before another checkpoint was written (the finished one, between the agreement and its
    # settling) would repeat it, after it: skipped, the same way on every replica (each counts the same steps
    # since the last save; a live joiner takes the members' count with the state).
    if due and step_records.stream().steps_committed != states.steps_at_last_save():
        stopping.save_or_exit(dict(metadata(), reason="periodic"),
                              blocking=not states.periodic_saves_asynchronous())  # ADAPTIVE_ASYNC_CHECKPOINT


def _change_agreed() -> bool:
    """Live mode: whether a membership change was agreed (someone joins, leaves or is drained)."""
    decided = _agreement().decided
    return bool(decided.joins or decided.leave or decided.drains)


def last_position() -> dict[str, Any]:
    """How the loop that last reached a boundary describes its position (for a manifest)."""
    return dict(_agreement().metadata())


def restart_spacing() -> None:
    """Agree at the next boundary and measure the spacing afresh (a new loop, a new batch size)."""
    agreement = _agreement()
    agreement.spacing, agreement.countdown, agreement.agreed_at = 1, 0, None


def step_boundary(metadata: Metadata, *, loop_ends: bool = False) -> None:
    """Call between two steps on every replica; may checkpoint or exit.

    At an agreement boundary, acts on the flags agreed at the previous one
    (and on any decision carried from a finished loop) and starts agreeing
    on this one's; other boundaries return at once.  ``metadata`` describes
    the position for the checkpoint's manifest (epoch, step, ...).  In live
    mode a lost peer is recorded on the step
    (:func:`adaptive.runtime.step.record_fault`) for the loader to act on.
    ``loop_ends``: the step before this boundary was its loop's last; a
    membership change agreed here is carried to the next loop's first
    boundary (:func:`make_agreed_change`), since a joiner admitted here
    would enter a loop with no step left, and its loop body would not run.
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
            agreement.spacing = max(1, agreed.spacing)
    except collectives.CollectiveError as error:
        _record_loss(error)
        return
    _act(metadata)
    agreement.countdown = agreement.spacing
    if _change_agreed() and not loop_ends:
        _change_membership(metadata)


def make_agreed_change(metadata: Metadata) -> bool:
    """Live mode, at a first boundary (of a loop, of a new membership), after :func:`settle`: make a membership
    change agreed there, or agreed after the last loop's last step and carried; whether one was made.  Every
    member calls it at the same agreement."""
    if not _change_agreed() or step_records.faulted():
        return False
    _change_membership(metadata)
    return True


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
    agreement.decided = StepFlags()
    restart_spacing()


def _change_membership(metadata: Metadata) -> None:
    """Act on an agreed live membership change (see :mod:`adaptive.elastic.live`); every member calls it.

    The agreement issued at this boundary is settled first: every member of
    the old generation issued it, and its group is about to go.
    """
    agreement = _agreement()
    pending, agreement.pending = agreement.pending, None
    if pending is not None:
        _settle(pending)
        _act(metadata)  # what the old generation agreed is done by it: a joiner knows nothing of it
    decided = agreement.decided
    joins, drains = decided.joins, decided.drains
    decided.joins, decided.leave, decided.drains = 0, False, 0
    try:
        outcome = live.change(joins, dict(metadata()), drains=drains)
    except collectives.CollectiveError as error:  # a member (or a joiner) was lost during the change
        _record_loss(error)
        return
    restart_spacing()
    if outcome is live.Outcome.STOP:
        stopping.stop_and_exit(dict(metadata(), reason="stop"))
    if outcome is live.Outcome.LEAVE:
        stopping.leave_and_exit()


def settle(metadata: Metadata | None = None, *, recoverable: bool = False) -> None:
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


def final_boundary(metadata: Metadata) -> None:
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
