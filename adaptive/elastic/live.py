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
it on the step instead of raising (:func:`adaptive.runtime.step.record_fault`).
Before a wrapped optimizer applies a step, the members agree on the store
whether every one of them completed it (:mod:`adaptive.runtime.step_commit`),
so the update is applied on every member or on none, and the weights and
optimizer state of the members that are left are always equal.  At the
next boundary they call :func:`recover`: they re-form on the store without
the lost member (:func:`adaptive.runtime.reforming.reform_after_loss`;
again, when another member is lost while they re-form) and each state goes
back to its copy of the last committed step (:func:`keep_commit_point`:
small copies, without the weights and the optimizer state, taken after
every step), so only the step in flight is trained again, and only when no
member applied it.
A sharded model (HSDP): after a loss the members that are left join a
whole copy of their own shards (each as the last committed step left it)
on the new rank 0 (:func:`adaptive.checkpoint.handover.recover_sharded_states`)
and shard it anew for themselves.  When the lost members held every copy of
some shard (1-D FSDP) every member restarts from the checkpoint on disk,
resharded for the replicas there are.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from adaptive.checkpoint import fencing, handover, private_parts, states
from adaptive.checkpoint.peer_shards import ShardsLost
from adaptive.runtime import (admitting, collectives, draining, env, fault_tolerant_group, membership, reforming,
                              step_commit)
from adaptive.runtime.live_protocol import Generation, private_key
from adaptive.runtime import step as step_records
from adaptive.runtime.job import current_job

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["Outcome", "request_leave", "leave_requested", "joins_seen", "drains_seen", "change",
           "keep_commit_point", "recover"]

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


def _wid() -> int:
    wid = membership.membership().wid
    assert wid is not None, "a member of a live generation has a worker id"
    return wid


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
    wid = _wid()
    _leave_if_drained(drains)
    leaving = collectives.allgather_object((wid, leave_requested()))
    survivors = [wid for wid, leaves in leaving if not leaves]
    if not survivors:
        return Outcome.STOP
    for state in states.registered_states():
        state.sync()
    keep_commit_point()  # what was folded in by the syncs stays, should a member be lost during the change
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


# ---------------------------------------------------------------- a lost member: back to the last committed step
#: Seconds the members that are left wait for the others to say whether they live.
REFORM_TIMEOUT = 30.0
#: How many times the members that are left re-form when more members are lost while they re-form.
REFORM_ATTEMPTS = 3


@dataclasses.dataclass
class _CommitPoint:
    """Every state's live copy at this member's last committed step (its record on the job context)."""

    where: tuple[Any, ...] | None = None  # the loop it was taken in: (epoch, loader, loop)
    copies: dict[str, object] = dataclasses.field(default_factory=dict)  # state name -> State.live_copy()
    published: bool = False  # whether the record this member last put on the store holds private parts


def keep_commit_point(where: tuple[Any, ...] | None = None) -> None:
    """Keep every state's live copy (:meth:`adaptive.checkpoint.states.State.live_copy`); no communication.

    Called after each step the loader committed in loop ``where`` and at the
    loop's first boundary (of a pass, or of a new generation), in a live
    generation with other members (alone, no member can be lost), and in a
    change after the states' ``sync()`` (``where`` None: the same loop).  The
    weights and optimizer state are not copied: every member applies a step
    or none does (:mod:`adaptive.runtime.step_commit`).
    """
    generation = membership.membership().generation
    if (not membership.is_live() or generation is None or len(generation.members) < 2
            or env.live_recovery() != "memory"):
        return
    point = current_job().part(_CommitPoint)
    registered = states.registered_states()
    point.copies = {state.name: state.live_copy() for state in registered}
    if where is not None:
        point.where = where
    _publish_private_parts(point, generation.number, registered)


def _publish_private_parts(point: _CommitPoint, generation: int, registered: list[states.State]) -> None:
    """Put what this member alone holds (:meth:`adaptive.checkpoint.states.State.private_part`) on the job's
    store, with the steps committed so far, so that a loss does not take it away (one write; none while this
    member holds nothing private and its last record said so)."""
    parts = {state.name: part for state in registered if (part := state.private_part()) is not None}
    if not parts and not point.published:
        return
    packed = private_parts.pack(parts, generation, step_commit.commits(generation))
    try:
        _job_store().set(private_key(_wid()), packed)  # type: ignore[arg-type]  # (bytes: the stub says str)
    except (RuntimeError, OSError) as error:  # the store is gone: a loss now takes the restart path anyway
        logger.warning("cannot put this member's private state on the live job's store (%s)", type(error).__name__)
        return
    point.published = bool(parts)


def recover(where: tuple[Any, ...], *, loop_untrained: bool = False) -> bool:
    """A member was lost during the step in flight: re-form without it and go back to the last committed step.

    Called on every member that is left, at the boundary after the failed
    step.  The members agreed whether the step's update was applied
    (:mod:`adaptive.runtime.step_commit`): when it was, the step counts as
    trained; when it was not, it is trained again.  Either way each state
    goes back to its copy of the last commit point (:func:`keep_commit_point`),
    which undoes what the step in flight changed besides its update.
    ``loop_untrained``: the loss came at the first boundary of loop
    ``where``, before it trained a step; the states are then those the
    previous loop ended with, the same on every member, and are kept as
    they are.  Returns False when recovery cannot be done in memory (no copy
    of this loop; this member was taken for dead; one optimizer of the step
    applied its update and another did not): the caller then ends the
    process and the restart path takes over.
    """
    point = current_job().part(_CommitPoint)
    steps = step_records.stream()
    error = steps.fault
    # Sharded models' shards are copied while their mesh's groups are still registered (not when the restart
    # path is taken anyway).
    shards = _copy_shards() if _may_recover_in_memory(steps, error) else None
    _give_up_on_the_group()
    states.abandon_pending_save()  # a background save in flight ran on the broken group
    if shards is None:
        return False
    at_loop_start = loop_untrained and point.where != where and bool(point.copies)
    if not at_loop_start and (point.where != where or not point.copies):
        logger.error("lost a member (%s) with no copy of this loop's states to go back to; restarting from the "
                     "checkpoint", error)
        return False
    started = time.perf_counter()
    before = env.num_replicas()
    lost_in = membership.membership().generation
    points = _reform(where, at_loop_start)
    if points is None:
        return False
    if len(set(points)) != 1:  # e.g. one member finished the loop's last step while another lost it
        logger.error("lost a member (%s), and the members that are left stopped at different points %s; "
                     "restarting from the checkpoint", error, sorted(set(points), key=repr))
        return False
    if not at_loop_start:
        for state in states.registered_states():
            if state.name in point.copies:
                state.restore_live_copy(point.copies[state.name])
    assert lost_in is not None, "a member of a live generation"
    if env.rank() == 0:
        _adopt_private_parts(lost_in)
    steps.fault = None
    if not _recover_shards(shards, error):
        return False
    fencing.renew_generation()
    # What the states hold now (the restored copies, and the lost members' private parts adopted) is the new
    # generation's commit point: a member lost before its first step must not take the adopted parts away.
    keep_commit_point(where)
    back_to = ("the start of this loop" if at_loop_start else
               "after the step in flight, which every member applied" if steps.step_committed else
               "before the step in flight, which no member applied: it is trained again")
    logger.warning("lost a member (%s): %d -> %d replicas, generation %d, back to %s; re-formed in %.3f s",
                   type(error).__name__ if error else "?", before, env.num_replicas(), membership.generation_number(),
                   back_to, time.perf_counter() - started)
    return True


def _may_recover_in_memory(steps: step_records.StepStream, error: BaseException | None) -> bool:
    """Whether nothing rules out recovery in memory before the members re-form: the job asked for the restart
    path (``ADAPTIVE_LIVE_RECOVERY=restart``), or one optimizer of the step applied its update and another not."""
    if env.live_recovery() != "memory":
        logger.error("lost a member (%s); restarting every member from the checkpoint "
                     "(ADAPTIVE_LIVE_RECOVERY=%s)", error, env.live_recovery())
        return False
    if steps.step_committed and steps.step_aborted:
        logger.error("lost a member (%s) between the updates of two optimizers of one step (one was applied, the "
                     "other not); restarting from the checkpoint", error)
        return False
    return True


def _copy_shards() -> dict[str, Any] | None:
    """Each sharded state's local shards, copied to the host (no communication); None when they cannot be.

    Every member holds its shards as the last committed step left them (the
    step commit applies an update on every member or on none), so these
    copies are that step's state, whatever the step in flight did after it.
    """
    try:
        return handover.copy_local_shards()
    except RuntimeError as error:
        logger.error("lost a member, and this member's shards cannot be copied (%s); restarting from the checkpoint",
                     error)
        return None


def _recover_shards(shards: dict[str, Any], error: BaseException | None) -> bool:
    """Sharded models (HSDP): the members that are left shard anew from their ``shards`` (each its own, as the
    last committed step left them); False when the lost members held every copy of some shard (1-D FSDP)."""
    if not shards:
        return True
    try:
        handover.recover_sharded_states(shards)
    except ShardsLost as lost:
        logger.error("lost a member (%s) and %s; restarting every member from the checkpoint", error, lost)
        return False
    return True


def _adopt_private_parts(lost_in: Generation) -> None:
    """On the new rank 0: fold in what the members lost from generation ``lost_in`` published as theirs alone."""
    store, following = _job_store(), membership.membership().generation
    assert following is not None
    staying = {member.wid for member in following.members}
    records = {}
    for member in lost_in.members:
        key = private_key(member.wid)
        if member.wid not in staying and store.check([key]):
            records[member.wid] = store.get(key)
    if records:
        private_parts.adopt(records, lost_in.number, step_commit.commits(lost_in.number))


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
