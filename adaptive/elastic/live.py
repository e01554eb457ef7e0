"""Live membership changes at a step boundary (``adaptive-run --live``), without restarting anyone.

The members of a generation (:mod:`adaptive.runtime.membership`) learn
about a change through the per-step agreement
(:mod:`adaptive.elastic.sync_points`): rank 0 adds how many processes asked
to join and how many nodes were asked to drain
(:mod:`adaptive.runtime.draining`), each member whether it was asked to
leave (SIGTERM in live mode).
At the boundary where the change was agreed every member calls
:func:`change`, which:

1. waits for a background checkpoint still in flight (it belongs to the old
   generation) and gathers who leaves;
2. runs every state's ``sync()`` on the old group, so that the leavers'
   private contributions (accumulators, random generators) are folded in;
3. has rank 0 publish the next generation (the members that stay, in their
   old order, then the joiners) and tells the others;
4. lets the leavers go (they exit 143 with nothing lost) and rebuilds the
   process groups of the others in place
   (:func:`adaptive.runtime.collectives.regroup`); the new rank 0 takes a
   new generation of the checkpoint folder (guarantee G6);
5. hands the joiners the whole training state over the new group
   (:func:`adaptive.checkpoint.handover.share_with_joiners`).  A sharded
   model (FSDP2, HSDP) was gathered whole on the next rank 0 before the
   regroup and is sharded anew for the new members from that copy
   (:mod:`adaptive.checkpoint.peer_shards`).

The loader then re-plans the rest of the epoch from the committed position
for the new replica count, and the batch-size controller chooses anew, as
after a restart with another replica count.  When every member leaves at
once, the change is a stop: the job checkpoints and exits, as without
live mode.

When a member is lost, the step in flight fails on the others; they record
it on the step instead of raising (:func:`adaptive.runtime.step.record_fault`),
skip its optimizer step, and at the next boundary call :func:`recover`:
they re-form on the store without the lost member
(:func:`adaptive.runtime.reforming.reform_after_loss`; again, when another
member is lost while they re-form) and go back to the
last in-memory snapshot of every state (:func:`take_snapshot`, taken at
agreed boundaries every ``ADAPTIVE_LIVE_SNAPSHOT_INTERVAL`` seconds and at
each loop's first boundary), so the steps since then are trained again.
A sharded model (FSDP2, HSDP) snapshots each rank's own shards; after a
loss the members that are left join a whole copy from them on the new
rank 0 (:func:`adaptive.checkpoint.handover.recover_sharded_states`) and shard
it anew for themselves, as at a change.  Its mesh's collectives record the
loss instead of raising (:mod:`adaptive.runtime.fault_tolerant_group`, gloo
only).  With HSDP every replica group holds every shard, so losing any
replica group's members is recovered in memory; when the lost members held
every copy of some shard (1-D FSDP, or a whole shard index across replica
groups), or the mesh is on NCCL, every member restarts from the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from adaptive.checkpoint import fencing, handover, states
from adaptive.elastic import random_state
from adaptive.checkpoint.peer_shards import ShardsLost
from adaptive.runtime import (admitting, collectives, draining, env, fault_tolerant_group, membership, peer_failure,
                              reforming)
from adaptive.runtime import step as step_records
from adaptive.runtime.job import current_job

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["Outcome", "request_leave", "leave_requested", "joins_seen", "drains_seen", "change", "snapshot_due",
           "take_snapshot", "recover"]

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """What a member does after :func:`change`."""

    CONTINUE = "continue"  # a member of the next generation
    LEAVE = "leave"  # this member left; the others continue
    STOP = "stop"  # every member leaves: the job stops, with its checkpoint


@dataclasses.dataclass
class _Leaving:
    """Whether this member was asked to leave (its record on the job context)."""

    requested: bool = False


def request_leave() -> None:
    """Leave the live job at the next agreed boundary (what SIGTERM does in live mode)."""
    current_job().part(_Leaving).requested = True


def leave_requested() -> bool:
    """Whether this member was asked to leave and has not left yet."""
    return current_job().part(_Leaving).requested


def joins_seen() -> int:
    """On rank 0 of a live job: how many processes asked to join (0 elsewhere; one store read).

    When the store cannot be read (its launcher is gone), training goes on
    and no one is admitted.
    """
    return _rank0_count(admitting.pending_joins, "no process can join")


def drains_seen() -> int:
    """On rank 0 of a live job: how many drain requests wait (:mod:`adaptive.runtime.draining`; 0 elsewhere;
    one store read)."""
    return _rank0_count(lambda: draining.pending_drains(_job_store()), "no node can be drained")


def _rank0_count(read: Callable[[], int], until_then: str) -> int:
    """A count of requests on the live job's store, read by rank 0 for the agreement (0 elsewhere, and when the
    store cannot be read: training goes on)."""
    if not membership.is_live() or env.rank() != 0:
        return 0
    try:
        return read()
    except (RuntimeError, OSError) as error:
        logger.warning("cannot read the live job's store (%s); %s until it answers", error, until_then)
        return 0


def _job_store() -> torch.distributed.Store:
    store = membership.membership().store
    assert store is not None, "a member of a live job has its store"
    return store


def _leave_if_drained(drains: int) -> None:
    """Leave at this change if this member's node was asked to drain (read only when a drain was agreed)."""
    if drains and draining.is_drained(_job_store(), env.live_node()):
        request_leave()
        logger.warning("node %d was asked to drain: leaving the live job at this step; the other members continue",
                       env.live_node())


def change(joins: int, metadata: dict[str, Any], *, drains: int = 0) -> Outcome:
    """Move every member of this generation to the next one; collective on the old group.

    Args:
        joins: the number of join requests agreed (rank 0's count when the
            agreement was issued); that many joiners are admitted.
        metadata: the position, as the checkpoint's manifest describes it.
        drains: the number of drain requests agreed; the members of drained
            nodes leave, and rank 0 counts the requests served.
    """
    started = time.perf_counter()
    states.wait_for_pending_save()
    wid = membership.membership().wid
    assert wid is not None, "a member of a live generation has a worker id"
    _leave_if_drained(drains)
    leaving = collectives.allgather_object((wid, leave_requested()))
    survivors = [wid for wid, leaves in leaving if not leaves]
    if not survivors:
        return Outcome.STOP
    for state in states.registered_states():
        state.sync()
    following = None
    if env.rank() == 0:
        draining.mark_served(_job_store(), drains)
        following = admitting.close_generation(survivors, joins)
        if following.joiners and not admitting.await_arrivals(following):
            following = admitting.abandon_admission(following)
    following = collectives.broadcast_object(following)
    assert following is not None
    before = env.num_replicas()
    old_order = [wid for wid, _ in leaving]
    same = [m.wid for m in following.members] == old_order
    # Sharded states (FSDP2) are gathered whole on the next rank 0 while the old group, leavers included, holds them.
    gathered = {} if same else handover.gather_sharded_states(old_order.index(following.members[0].wid))
    if leave_requested():
        logger.info("left the live job at %s; generation %d continues with %d members", _where(metadata),
                    following.number, len(following.members))
        return Outcome.LEAVE
    if same:  # nobody left or joined (an admission was abandoned): the groups stay, the generation moves on
        membership.enter(following)
    else:
        collectives.regroup(following)
    fencing.renew_generation()
    regrouped = time.perf_counter()
    if following.joiners:
        handover.share_with_joiners(dict(metadata, live_generation=following.number))
    if not same:
        handover.reshard_sharded_states(gathered)
    logger.log(logging.INFO if env.rank() == 0 else logging.DEBUG,
               "live membership change at %s: %d -> %d replicas (%d joined, %d left), generation %d; "
               "regrouped in %.3f s, state handed over in %.3f s", _where(metadata), before, env.num_replicas(),
               len(following.joiners), before - len(survivors), following.number, regrouped - started,
               time.perf_counter() - regrouped)
    return Outcome.CONTINUE


def _where(metadata: dict[str, Any]) -> str:
    return f"epoch {metadata.get('epoch')}, step {metadata.get('step')}"


# ---------------------------------------------------------------- a lost member: back to the last snapshot
#: Seconds the members that are left wait for the others to say whether they live.
REFORM_TIMEOUT = 30.0
#: How many times the members that are left re-form when more members are lost while they re-form.
REFORM_ATTEMPTS = 3


@dataclasses.dataclass
class _Snapshot:
    """The job's states at the last snapshot point, in memory (its record on the job context)."""

    where: tuple[Any, ...] | None = None  # the loop it was taken in: (epoch, loader, loop)
    contents: dict[str, Any] = dataclasses.field(default_factory=dict)
    shards: dict[str, Any] = dataclasses.field(default_factory=dict)  # sharded states: this rank's shards
    generators: dict[str, Any] | None = None  # this process's random generators (random_state.capture_local)
    taken_at: float | None = None  # monotonic


def snapshot_due() -> bool:
    """On rank 0 of a live job: whether the next snapshot is due (the per-step agreement carries it)."""
    if not membership.is_live() or env.rank() != 0 or env.live_snapshot_interval() <= 0:
        return False
    taken_at = current_job().part(_Snapshot).taken_at
    return taken_at is None or time.monotonic() - taken_at >= env.live_snapshot_interval()


def take_snapshot(where: tuple[Any, ...]) -> None:
    """Copy every state in memory at an agreed boundary of loop ``where``; collective (each state's ``sync()``).

    Each process also keeps its own random generators, so that a step
    trained again after a loss draws the numbers it drew the first time (its
    dropout masks, its random augmentation in the training process).  A
    sharded state keeps this rank's shards
    (:func:`adaptive.checkpoint.handover.snapshot_sharded_states`).
    """
    if not membership.is_live() or env.live_snapshot_interval() <= 0:
        return
    registered = states.registered_states()
    try:
        for state in registered:
            state.sync()
    except collectives.CollectiveError as error:  # a member was lost: the last snapshot stays
        if not peer_failure.absorb_in_live_mode(error):
            raise
        return
    snapshot = current_job().part(_Snapshot)
    snapshot.contents = {state.name: copy.deepcopy(state.state_dict()) for state in registered
                         if state.name != random_state.NAME}
    snapshot.shards = handover.snapshot_sharded_states()
    snapshot.generators = random_state.capture_local()
    snapshot.where, snapshot.taken_at = where, time.monotonic()


def recover(where: tuple[Any, ...], *, loop_untrained: bool = False) -> bool:
    """A member was lost during the step in flight: re-form without it and go back to the last snapshot.

    Called on every member that is left, at the boundary after the failed
    step (which was not committed).  ``loop_untrained``: the loss came at the
    first boundary of loop ``where``, before it trained a step (a checkpoint
    or the agreement as the loop starts); the states are then those the
    previous loop ended with, the same on every member that took a snapshot
    before, and they are kept as they are.  Returns False when recovery
    cannot be done in memory (no snapshot of this loop, or none ever for a
    loss at a loop's start; this member was taken for dead): the caller then
    ends the process and the restart path takes over.
    """
    snapshot = current_job().part(_Snapshot)
    error = step_records.stream().fault
    _give_up_on_the_group()
    states.abandon_pending_save()  # a background save in flight ran on the broken group
    at_loop_start = loop_untrained and snapshot.where != where and bool(snapshot.contents)
    if not at_loop_start and (snapshot.where != where or not snapshot.contents):
        logger.error("lost a member (%s) with no snapshot of this loop to go back to; restarting from the "
                     "checkpoint", error)
        return False
    started = time.perf_counter()
    before = env.num_replicas()
    points = _reform(where, at_loop_start)
    if points is None:
        return False
    if len(set(points)) != 1:  # e.g. one member finished the loop's last step while another lost it
        logger.error("lost a member (%s), and the members that are left stopped at different points %s; "
                     "restarting from the checkpoint", error, sorted(set(points), key=repr))
        return False
    # The sharded states' own shards at the loop's start are what the previous loop ended with.
    shards = handover.snapshot_sharded_states() if at_loop_start else snapshot.shards
    if not at_loop_start:
        for state in states.registered_states():
            if state.name in snapshot.contents:
                state.load_state_dict(copy.deepcopy(snapshot.contents[state.name]))
        if snapshot.generators is not None:
            random_state.restore_local(snapshot.generators)
    step_records.stream().fault = None
    if shards:
        try:
            handover.recover_sharded_states(shards)
        except ShardsLost as lost:
            logger.error("lost a member (%s) and %s; restarting from the checkpoint", error, lost)
            return False
    fencing.renew_generation()
    back_to = ("the start of this loop" if at_loop_start else
               f"the snapshot of {time.monotonic() - (snapshot.taken_at or time.monotonic()):.1f} s ago")
    logger.warning("lost a member (%s): %d -> %d replicas, generation %d, back to %s; re-formed in %.3f s",
                   type(error).__name__ if error else "?", before, env.num_replicas(), membership.generation_number(),
                   back_to, time.perf_counter() - started)
    return True


def _give_up_on_the_group() -> None:
    """This generation lost a member: say so on the store, so that a member still waiting in a collective with
    one that stopped sending gives up and comes to re-form too, and close the mesh groups that record losses."""
    reforming.report_loss()
    fault_tolerant_group.close_all()


def _reform(where: tuple[Any, ...], at_loop_start: bool) -> list[Any] | None:
    """Re-form without the lost members and gather where each member stopped; None when this one cannot go on.

    A member lost while the others re-form (two kills a few milliseconds
    apart: the second one said it was alive, then died) does not come to
    build the new group, or breaks its first collective; nothing was
    restored yet, so the members that are left re-form again without it, up
    to :data:`REFORM_ATTEMPTS` times.
    """
    for attempt in range(1, REFORM_ATTEMPTS + 1):
        try:
            following = reforming.reform_after_loss(REFORM_TIMEOUT)
        except (RuntimeError, OSError) as error:  # DistNetworkError: the store went with the node that hosted it
            logger.error("the live job's store does not answer (%s: the node that hosted it was lost?); restarting "
                         "from the checkpoint", type(error).__name__)
            return None
        if following is None:
            logger.error("the members that are left took this one for dead; restarting it")
            return None
        try:
            collectives.regroup(following, broken=True)
            return collectives.allgather_object((where, at_loop_start))
        except collectives.CollectiveError as error:
            logger.warning("lost another member while re-forming (%s); re-forming again (attempt %d of %d)",
                           error, attempt, REFORM_ATTEMPTS)
            _give_up_on_the_group()
    logger.error("lost members each time the others re-formed (%d times); restarting from the checkpoint",
                 REFORM_ATTEMPTS)
    return None
