"""Live mode, the running members' side of a join: notice the requests, close the generation, await the joiners.

A process that found the live job running asks to join at its admission
point (:func:`adaptive.runtime.membership.join`, called through
:mod:`adaptive.checkpoint.admission`): it posts a join request to the
running generation and renews it while it waits.  The members learn of it
at an agreement boundary (rank 0 reads :func:`pending_joins` into the
per-step agreement), where rank 0 closes their generation with the joiners
added (:func:`close_generation`), waits for them to arrive
(:func:`await_arrivals`) or, when one is dead or late, publishes a
generation without the joiners instead (:func:`abandon_admission`).  The
members then regroup and hand the joiners the training state
(:func:`adaptive.elastic.live.change`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from adaptive.runtime.live_protocol import Generation, GenerationState, Member, dead_key
from adaptive.runtime.membership import JOINER_STALE, Poll, membership, publish, read

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["ADMISSION_TIMEOUT", "JOIN_WINDOW", "pending_joins", "close_generation", "await_arrivals",
           "abandon_admission"]

logger = logging.getLogger(__name__)

#: Seconds rank 0 waits for the admitted joiners to arrive before it continues without them.
ADMISSION_TIMEOUT = 5.0
#: On a signed store: how many of the newest join requests rank 0 reads (a counter raised by someone without
#: the job's secret costs it at most that many reads per agreement).
JOIN_WINDOW = 64


def pending_joins() -> int:
    """How many processes asked the running generation to admit them (one store read: the requests' counter).

    On a signed store the counter is a hint only (anyone can add to it):
    when it is not 0, the requests it points to are read, and only those
    that pass authentication and still wait count.
    """
    from adaptive.runtime import signed_records

    record = membership()
    if record.store is None or record.generation is None:
        return 0
    count = int(record.store.add(record.generation.keys.joins, 0))
    if count == 0 or not signed_records.is_signed(record.store):
        return count
    return len(_requests(record.store, record.generation, count, say=False))


def close_generation(survivors: list[int], joins: int) -> Generation:
    """On the generation's rank 0: publish the next generation (``survivors`` by worker id, then the first
    ``joins`` joiners still waiting) and close this one.  The other members learn it from rank 0."""
    from adaptive.runtime import signed_records

    record = membership()
    assert record.store is not None and record.generation is not None
    store, current = record.store, record.generation
    kept = [member for member in current.members if member.wid in set(survivors)]
    count = int(store.add(current.keys.joins, 0)) if signed_records.is_signed(store) else joins
    joiners = _requests(store, current, count)[:joins]
    following = Generation(current.number + 1, tuple(kept + joiners), tuple(m.wid for m in joiners))
    publish(store, following)
    store.set(current.keys.next, following.to_json())
    store.set(current.keys.state, GenerationState.CLOSED.value)
    return following


def _requests(store: torch.distributed.Store, current: Generation, count: int, *, say: bool = True) -> list[Member]:
    """The joiners of ``current``'s join requests 1 to ``count`` (on a signed store: the :data:`JOIN_WINDOW`
    newest) that still wait; ``say``: log why a request is not admitted."""
    from adaptive.runtime import signed_records

    first = max(1, count - JOIN_WINDOW + 1) if signed_records.is_signed(store) else 1
    found = (_waiting_joiner(store, current, position, say) for position in range(first, count + 1))
    return [joiner for joiner in found if joiner is not None]


def _waiting_joiner(store: torch.distributed.Store, current: Generation, position: int, say: bool) -> Member | None:
    """The joiner of request ``position`` when it renewed its request lately and was not reported dead; else
    None (a request that fails authentication is absent: :mod:`adaptive.runtime.signed_records` says so)."""
    said = read(store, current.keys.join_waiting(position))
    asked = None if said is None else read(store, current.keys.join(position))
    if said is None or asked is None or time.time() - float(said) > JOINER_STALE:
        if say:
            logger.warning("not admitting join request %d: its process stopped waiting (it died?)", position)
        return None
    joiner = Member.from_json(asked)
    if store.check([dead_key(joiner.wid)]):
        if say:
            logger.warning("not admitting join request %d: its launcher reported its process dead", position)
        return None
    return joiner


def await_arrivals(following: Generation, timeout: float = ADMISSION_TIMEOUT) -> bool:
    """On rank 0, after :func:`close_generation`: whether every joiner of ``following`` arrived in time.

    When they did, they are told to go on and build the new group; when one
    did not (it died after asking to join: at once when its launcher reported
    it, else after ``timeout`` seconds), the caller abandons the admission
    (:func:`abandon_admission`) rather than wait for it in the group's
    rendezvous.
    """
    record = membership()
    assert record.store is not None
    store = record.store
    keys = [following.keys.arrived(wid) for wid in following.joiners]
    deadline = time.monotonic() + timeout
    poll = Poll()
    while not store.check(keys):
        dead = [wid for wid in following.joiners if store.check([dead_key(wid)])]
        if dead:  # its launcher reaped it: waiting on would cost the members the whole admission timeout
            logger.warning("joiner %s of generation %d died before it arrived; continuing without the joiners",
                           ", ".join(map(str, dead)), following.number)
            return False
        if time.monotonic() > deadline:
            late = [wid for wid, key in zip(following.joiners, keys) if not store.check([key])]
            logger.warning("joiner(s) %s of generation %d did not arrive within %.0f s",
                           ", ".join(map(str, late)), following.number, timeout)
            return False
        poll.sleep()
    store.set(following.keys.go, "1")
    return True


def abandon_admission(following: Generation) -> Generation:
    """On rank 0: a joiner of ``following`` never arrived; the generation after it keeps the old members only.

    The joiners that did arrive see ``following`` fail and ask the new one
    to admit them.
    """
    record = membership()
    assert record.store is not None
    store = record.store
    kept = tuple(member for member in following.members if member.wid not in set(following.joiners))
    instead = Generation(following.number + 1, kept)
    publish(store, instead)
    store.set(following.keys.next, instead.to_json())
    store.set(following.keys.state, GenerationState.FAILED.value)
    logger.warning("generation %d continues without the joiners admitted into generation %d", instead.number,
                   following.number)
    return instead
