"""Live mode after a loss: notice it, say it, and agree on the members that are left, on the store.

When a member of a live generation is lost, the collective in flight fails
on the others, or never ends for a member waiting on data that one which
saw the loss first will never send.  Every wait of the library's
collectives therefore asks :func:`loss_reported` between slices: a member
said so (:func:`report_loss`), a member's launcher reported it dead, or it
gave no sign of life for the hang timeout (a stopped or hung process,
:mod:`adaptive.runtime.liveness`; it is then taken out of the job, and its
launcher kills it).

The members that are left then agree on the next generation without a
process group (:func:`reform_after_loss`): each says it is alive, a member
is dead when :func:`adaptive.runtime.membership.is_dead` says so or after a
timeout, and the first proposal written wins.  Before the members of a new
generation build its group they meet on the store (:func:`meet`), so that a
member lost after the generation was agreed is found within seconds instead
of leaving the others in the group's rendezvous.

With a secret every record read here is verified
(:mod:`adaptive.runtime.signed_records`): a forged ``lost``, ``dead``,
``alive``, ``here`` or proposal is ignored and changes nothing.
"""

from __future__ import annotations

import logging
import time

from adaptive.runtime import env
from adaptive.runtime.live_protocol import CURRENT_KEY, HUNG, Generation, GenerationKeys, GenerationState, Member, dead_key
from adaptive.runtime.membership import MEET_TIMEOUT, Poll, is_dead, membership, publish, read, silent_for

__all__ = ["HANG_CHECK_INTERVAL", "reform_after_loss", "meet", "report_loss", "loss_reported"]

logger = logging.getLogger(__name__)

#: Seconds between a waiting member's looks at the others' deaths and signs of life (:func:`loss_reported`).
HANG_CHECK_INTERVAL = 0.5


def report_loss() -> None:
    """Say on the store that this generation lost a member (a member that noticed, before re-forming)."""
    record = membership()
    if record.store is not None and record.generation is not None:
        record.store.set(record.generation.keys.lost, "1")


def loss_reported(number: int | None = None) -> bool:
    """Whether generation ``number`` (default: this one) lost a member: one still waiting in a collective with
    a member that stopped sending after the loss gives up on it.

    A member said so (one store read); or, looked at every :data:`HANG_CHECK_INTERVAL`
    seconds, a member's launcher reported it dead, or it gave no sign of life for the hang
    timeout (it is then taken out of the job: its launcher kills it).  Either way the loss is
    said on the store for the others.
    """
    record = membership()
    if number is None:
        number = record.generation.number if record.generation is not None else None
    if record.store is None or number is None:
        return False
    generation = record.generation
    if record.store.check([GenerationKeys(number).lost]):
        return True
    now = time.monotonic()
    if generation is None or generation.number != number or now - record.hang_checked_at < HANG_CHECK_INTERVAL:
        return False
    record.hang_checked_at = now
    others = [member for member in generation.members if member.wid != record.wid]
    dead = [member.wid for member in others if record.store.check([dead_key(member.wid)])]
    hung = [(member, silent) for member, silent in _silent(others) if member.wid not in dead]
    for member, silent in hung:
        record.store.set(dead_key(member.wid), HUNG)
        logger.warning("worker %d (rank %s of generation %d, node %d) gave no sign of life for %.1f s: stopped or "
                       "hung; taking it out of the job (ADAPTIVE_LIVE_HANG_TIMEOUT=%g)", member.wid,
                       generation.rank_of(member.wid), number, member.node, silent, env.live_hang_timeout())
    if dead:
        logger.warning("worker(s) %s of generation %d died (reported by their launcher); giving up the "
                       "collectives in flight", ", ".join(map(str, dead)), number)
    if hung or dead:
        report_loss()
    return bool(hung or dead)


def _silent(members: list[Member]) -> list[tuple[Member, float]]:
    """The ``members`` whose sign of life has not changed for the hang timeout, with the seconds."""
    timeout = env.live_hang_timeout()
    silences = [(member, silent_for(member)) for member in members]
    return [(member, seconds) for member, seconds in silences if seconds >= timeout]


def reform_after_loss(timeout: float) -> Generation | None:
    """After a lost peer: the generation of the members that are left, agreed on the store without a group.

    Each member that noticed the loss says it is alive; a member is dead
    when :func:`adaptive.runtime.membership.is_dead` says so (its launcher
    reported it, its node is lost, or it hung), or when it said nothing
    within ``timeout`` seconds.  The first proposal written wins.  Returns
    None when this process is not in it (it was taken for dead).
    """
    record = membership()
    assert record.store is not None and record.generation is not None and record.wid is not None
    store, current = record.store, record.generation
    keys = current.keys
    store.set(keys.alive(record.wid), "1")
    deadline = time.monotonic() + timeout
    poll = Poll()
    while True:
        alive = [m for m in current.members if store.check([keys.alive(m.wid)])
                 and not store.check([dead_key(m.wid)])]  # one taken out as hung that woke is still out
        undecided = [m for m in current.members if m not in alive and not is_dead(m)]
        if not undecided or time.monotonic() > deadline:
            break
        poll.sleep()
    # A change may have planned the next generation already (the loss came during it): the numbers go on.  Never
    # below this one's: an older number written back on the store (it verifies: the job wrote it) must not make
    # the members reuse a generation's keys.
    proposal = Generation(max(int(read(store, CURRENT_KEY) or 0), current.number) + 1, tuple(alive))
    agreed = Generation.from_json(store.compare_set(keys.after_loss, "", proposal.to_json()))
    planned = read(store, keys.next)
    if planned is not None and Generation.from_json(planned).number != agreed.number:
        store.set(Generation.from_json(planned).keys.state, GenerationState.FAILED.value)  # its joiners ask again
    store.compare_set(keys.next, "", agreed.to_json())  # joiners waiting on it ask again
    if agreed.rank_of(record.wid) is None:
        # Taken for dead: the others may have moved on from ``agreed`` already; publishing it again would
        # make it the job's current generation once more, and joiners would ask a closed one forever.
        return None
    publish(store, agreed)  # its members only: none of them can have closed it yet, they regroup first
    store.set(keys.state, GenerationState.CLOSED.value)
    return agreed


def meet(following: Generation, timeout: float = MEET_TIMEOUT) -> list[int]:
    """Before building ``following``'s group: say this member is here and wait for the others.

    Returns the worker ids of the members that will not come: dead (their
    launcher said so, or their node is lost), hung (no sign of life for the
    hang timeout), or not there within ``timeout`` seconds; empty once every
    member is here.  Every member that gets a non-empty answer gives the
    group up (the members that are left re-form without the missing ones).
    """
    record = membership()
    assert record.store is not None and record.wid is not None
    store, keys = record.store, following.keys
    store.set(keys.here(record.wid), "1")
    deadline = time.monotonic() + timeout
    poll = Poll()
    while True:
        missing = [m for m in following.members if not store.check([keys.here(m.wid)])]
        if not missing:
            return []
        gone = [m.wid for m in missing if is_dead(m)]
        if gone or time.monotonic() > deadline:
            waited = gone or [m.wid for m in missing]
            logger.warning("worker(s) %s did not come to build generation %d's group (%s); the members that are "
                           "left re-form without them", ", ".join(map(str, waited)), following.number,
                           "dead or hung" if gone else f"not there within {timeout:.0f} s")
            return waited
        poll.sleep()
