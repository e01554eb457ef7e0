"""Live mode: a step's update is applied on every member or on none, decided on the job's store.

When a member of a live job is lost while a step is in flight, the step's
gradient reduction may complete on some of the others and fail on the rest
(gloo's ring algorithms pass data on from neighbour to neighbour).  Were each
member to apply the step when its own reduction completed, the members that
are left would hold different weights.  Before a wrapped optimizer applies a
step, the members therefore vote on the job's store, which outlives a broken
process group (:func:`agree`):

* a member whose collectives of the step all completed adds 1 to the
  generation's vote counter; the member whose vote completes the count
  (members x votes so far) writes the decision ``commit``;
* a member that recorded a fault on the step
  (:func:`adaptive.runtime.step.faulted`) writes ``abort``, and so does a
  member waiting for the decision that learns of a lost member
  (:func:`adaptive.runtime.reforming.loss_reported`: a member said so, a
  launcher reported a death, or a member gave no sign of life for the hang
  timeout);
* the decision is written with ``compare_set``, so the first one written
  stands, and every member acts on it.

So the weights and optimizer state of the members that are left are those
of the last step that committed, on every one of them: no copy of them is
kept in memory, and after a loss only the step in flight is trained again
(:func:`adaptive.elastic.live.recover`).

A job with a secret (:mod:`adaptive.runtime.signed_records`) signs the
decision, but a counter cannot be signed: there each member also writes a
signed record of its vote before it adds, and a count that reaches the
total commits only once every member's record is read (a forged increment
cannot commit a step that a member has not voted for).

Two decision slots alternate (vote ``k`` decides in slot ``k % 2``).  The
member that completes vote ``k`` first removes the other slot, vote
``k - 1``'s, which every member has read (each voted ``k`` after reading
it), then writes its own; so a generation leaves three keys behind,
whatever its length.

Cost per step and member: an ``add``, then a ``wait`` for the decision and a
``get`` (the member that completes the count: a ``delete_key`` and a
``compare_set`` instead), on a connection of the process's own; the wait
gives up after :data:`SLICE` seconds, so that a waiting member looks for a
lost member between slices.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
import time
from typing import TYPE_CHECKING

from adaptive.runtime import env, membership, reforming, signed_records
from adaptive.runtime import step as step_records
from adaptive.runtime.errors import CollectiveError
from adaptive.runtime.job import current_job
from adaptive.runtime.live_protocol import GenerationKeys

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["StepNotCommitted", "SLICE", "agree", "is_voting", "commits"]

logger = logging.getLogger(__name__)

#: Seconds a wait for the decision lasts before this member looks for a lost member again.
SLICE = 0.1
#: Seconds any other call on the votes' connection may take (the store answers in well under a millisecond;
#: a store that is gone fails at once).
CALL_TIMEOUT = 30.0
#: Seconds past the hang timeout after which a decision that never came is taken as ``abort``
#: (a member that neither votes nor is found lost: the store lost its writes).
GRACE = 10.0

COMMIT, ABORT = "commit", "abort"


class StepNotCommitted(CollectiveError):
    """The members did not all complete the step: none applies it (a member was lost)."""


@dataclasses.dataclass
class _Votes:
    """This member's votes in its generation (its record on the job context)."""

    generation: int | None = None  # the generation the counts below belong to
    cast: int = 0  # votes this member cast in it
    committed: int = 0  # of those, the steps every member applied
    client: torch.distributed.Store | None = None  # its own connection to the store


def _votes() -> _Votes:
    return current_job().part(_Votes)


def commits(generation: int) -> int:
    """How many steps every member of ``generation`` applied, as this member knows (0 for another generation
    than its last): the same on every member at the same step, so the count dates a member's record."""
    votes = _votes()
    return votes.committed if votes.generation == generation else 0


def is_voting() -> bool:
    """Whether an optimizer step now needs the members' agreement: live mode, a member of a generation with
    other members, inside a loader loop (outside one a lost member takes the restart path), unless a loss
    restarts every member anyway (``ADAPTIVE_LIVE_RECOVERY=restart``)."""
    record = membership.membership()
    return (membership.is_live() and record.generation is not None and not record.awaiting_admission
            and len(record.generation.members) > 1 and step_records.current_step() is not None
            and env.live_recovery() == "memory")


def agree() -> bool:
    """Vote on applying the step in flight; whether every member applies it (collective on the store).

    Call on every member, at the same optimizer step.  A member that
    recorded a fault on the step votes against it; a False answer is
    recorded on the step as a fault (:class:`StepNotCommitted`) when the
    step had none, so that the loader discards it and the members re-form.
    """
    record = membership.membership()
    generation = record.generation
    assert generation is not None, "is_voting() first"
    votes = _votes()
    if votes.generation != generation.number:
        votes.generation, votes.cast, votes.committed = generation.number, 0, 0
    votes.cast += 1
    keys, vote = generation.keys, votes.cast
    try:
        decision = _decide(keys, vote, [member.wid for member in generation.members], ok=not step_records.faulted())
    except (RuntimeError, OSError) as error:  # the store does not answer: the restart path takes over
        decision = ABORT
        logger.error("cannot reach the live job's store to agree on step %d of generation %d (%s); the step is "
                     "not applied", vote, generation.number, type(error).__name__)
    applied = decision == COMMIT
    steps = step_records.stream()
    if applied:
        steps.step_committed = True
        votes.committed += 1
    else:
        steps.step_aborted = True
        step_records.record_fault(StepNotCommitted(
            f"step {vote} of live generation {generation.number} was not completed by every member"))
    return applied


def _decide(keys: GenerationKeys, vote: int, members: list[int], *, ok: bool) -> str:
    """This member's vote ``vote`` (``ok``: it can apply the step), and the decision that stands."""
    store = _client()
    slot = keys.commit_decision(vote % 2)
    if not ok:  # a member still waiting in a collective of the step with this one gives up on it too
        reforming.report_loss()
        return _write(store, slot, vote, ABORT)
    signed = signed_records.is_signed(store)
    if signed:
        store.set(keys.commit_vote(vote % 2, _me()), str(vote))
    count = store.add(keys.commit_votes, 1)
    total = len(members) * vote
    if (count == total and not signed) or (signed and count >= total and _every_vote_read(store, keys, vote, members)):
        store.delete_key(keys.commit_decision((vote + 1) % 2))  # vote - 1's, read by everyone
        return _write(store, slot, vote, COMMIT)
    return _await(store, slot, vote)


def _every_vote_read(store: torch.distributed.Store, keys: GenerationKeys, vote: int, members: list[int]) -> bool:
    """A signed job whose count reached the total (a forged increment can push it there early): whether every
    member's signed vote record says it voted ``vote``."""
    return all(signed_records.read(store, keys.commit_vote(vote % 2, wid)) == str(vote) for wid in members)


def _me() -> int:
    wid = membership.membership().wid
    assert wid is not None, "a member of a live generation has a worker id"
    return wid


def _write(store: torch.distributed.Store, slot: str, vote: int, decision: str) -> str:
    """Write ``decision`` for ``vote`` unless one stands already; the one that stands."""
    standing = store.compare_set(slot, "", f"{vote}:{decision}")
    return _parse(standing, vote)


def _parse(value: bytes | str, vote: int) -> str:
    text = value.decode() if isinstance(value, bytes) else value
    number, _, decision = text.partition(":")
    if number != str(vote) or decision not in (COMMIT, ABORT):
        raise RuntimeError(f"unexpected step decision {text!r} for vote {vote}")
    return decision


def _await(store: torch.distributed.Store, slot: str, vote: int) -> str:
    """Wait for vote ``vote``'s decision; abort it when a member was lost meanwhile (bounded: a member that
    neither votes nor is found lost within the hang timeout and :data:`GRACE` is taken as lost)."""
    deadline = time.monotonic() + env.live_hang_timeout() + GRACE
    slice_ = datetime.timedelta(seconds=SLICE)
    while True:
        try:
            signed_records.unsigned(store).wait([slot], slice_)
        except RuntimeError as error:
            if not _timed_out(error):
                raise
        else:
            decision = signed_records.read(store, slot)
            if decision is not None:
                return _parse(decision, vote)
            time.sleep(SLICE)  # a forged record stands there: the decision written in its place will verify
        if reforming.loss_reported():
            return _write(store, slot, vote, ABORT)
        if time.monotonic() > deadline:
            logger.error("no decision on step %d of generation %d after %.0f s, and no member was reported lost; "
                         "not applying it", vote, membership.generation_number(),
                         env.live_hang_timeout() + GRACE)
            reforming.report_loss()
            return _write(store, slot, vote, ABORT)


def _timed_out(error: RuntimeError) -> bool:
    """Whether a wait on the store ended at its timeout (rather than on a broken connection): torch raises a
    ``DistStoreError``, or on a loaded machine a ``DistNetworkError`` from the socket's own timeout."""
    import torch.distributed as dist

    if isinstance(error, dist.DistStoreError):
        return True
    return isinstance(error, dist.DistNetworkError) and re.search(r"time ?out|timed out", str(error)) is not None


def _client() -> torch.distributed.Store:
    """This process's connection for the votes: the job's keys (signed when the job has a secret)."""
    votes = _votes()
    if votes.client is None:
        votes.client = membership.job_store(membership.connect(CALL_TIMEOUT), env.job_id())
    return votes.client
