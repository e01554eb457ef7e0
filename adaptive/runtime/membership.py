"""Live membership: which processes form the job now, agreed through the launchers' TCPStore.

Used in live mode only (``adaptive-run --live``, which names its store in
``ADAPTIVE_LIVE_STORE``); without it nothing here runs and the job's members are
torchrun's.  The job passes through *generations*
(:class:`~adaptive.runtime.live_protocol.Generation`): each is a fixed list
of members (worker processes), numbered 1, 2, ... in the store, with a
process group of its own (a ``PrefixStore`` per generation on the launchers'
store, so a new group never meets an old one's keys).  What is written on
the store, and under which key, is defined in :mod:`adaptive.runtime.live_protocol`.
A process becomes a member in one of two ways (:func:`join`):

* **formation**: no generation is running (the job starts, or every member of
  the last one was lost).  The first candidate closes the round once
  ``ADAPTIVE_LIVE_MIN`` candidates registered and either ``ADAPTIVE_LIVE_MAX``
  did or :data:`LAST_CALL` seconds passed; the members then restore from the
  checkpoint on disk, as a restart does.  Workers that start in it and
  workers that built their objects already (they waited for admission into a
  generation that ended) are never members of one formation together
  (:class:`~adaptive.runtime.live_protocol.Candidate`): the first kind is
  taken, and the second asks the new generation to admit it;
* **admission**: a generation is running.  The process builds its objects
  first (on a group of one), then posts a join request at its admission
  point (:mod:`adaptive.checkpoint.admission`), renewed while it waits; the
  running members admit it at an agreement boundary
  (:mod:`adaptive.runtime.admitting`) and hand it the training state over
  the new group (:mod:`adaptive.checkpoint.peer_state`).

After a lost member the others re-form without it
(:mod:`adaptive.runtime.reforming`).  A member is dead (:func:`is_dead`)
when its launcher said so, when its launcher's sign of life grew old (a
lost node), or when its own sign of life stopped for the hang timeout
(:mod:`adaptive.runtime.liveness`: a stopped or hung process).

A generation is :class:`~adaptive.runtime.live_protocol.GenerationState`
``running``, then ``closed`` (it became the next one), ``failed`` (a member
saw a peer die and the restart path took over: :func:`mark_failed`), or
``ended`` (training finished or every member stopped); a process waiting for
admission into one that failed or ended forms the next one instead.

When the job has a secret (``ADAPTIVE_LIVE_SECRET``), every record is
signed and verified (:func:`job_store`, :mod:`adaptive.runtime.signed_records`):
a forged one is ignored.  Counters cannot be signed; each use of one here
decides on signed records only (worker ids are claimed, a formation's
members are written once, a launcher's stale sign of life must also stay
unchanged while a process looks).

The process group of a generation is built by
:func:`adaptive.runtime.collectives.init_process_group` (formation and
admission) and :func:`adaptive.runtime.collectives.regroup` (survivors).
Whatever holds a process group of its own (the model wrappers) registers
with :func:`on_regroup` and is told when the group changed.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Callable

from adaptive.runtime import env, liveness
from adaptive.runtime.job import Job, current_job, on_reset
from adaptive.runtime.live_protocol import (CURRENT_KEY, FINISHED_KEY, HUNG, WORKERS_KEY, Candidate, Generation,
                                            GenerationKeys, GenerationState, Member, WorkerOf, agent_key, beat_key,
                                            dead_key, job_prefix, worker_claim_key, worker_of_key)

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["LAST_CALL", "AGENT_STALE", "MEET_TIMEOUT", "Membership", "is_live", "is_awaiting_admission", "is_member",
           "membership", "generation_number", "join", "enter", "mark_failed", "mark_ended", "mark_finished",
           "on_regroup", "notify_regroup", "generation_store", "group_formed", "members_env", "job_store", "read",
           "publish", "is_dead", "silent_for", "Poll", "connect", "agents_store", "AGENT_UNCHANGED", "CLAIM_ATTEMPTS"]

logger = logging.getLogger(__name__)

#: Seconds a formation waits for more candidates once the minimum registered.
LAST_CALL = 1.0
#: Seconds between looks at the store while waiting: the first look after :data:`FIRST_POLL`, then a quarter
#: of the time waited so far, at most :data:`POLL` (a short wait ends soon after what it waits for, a long one
#: does not load the store).
FIRST_POLL, POLL = 0.001, 0.01
#: A joiner that has not said it is waiting for this many seconds is not admitted (it died while waiting).
JOINER_STALE = 2.0
#: A launcher whose sign of life is older than this many seconds is taken for lost, with its workers.
AGENT_STALE = 5.0
#: In a signed job, seconds a launcher's stale sign of life must stay unchanged, while a process looks, before
#: its node is taken for lost (:func:`is_dead`).
AGENT_UNCHANGED = 1.0
#: Ids (worker or node numbers) a process tries to claim before it gives up (a counter being set back).
CLAIM_ATTEMPTS = 100
#: Seconds the members of a new generation wait for each other before they build its group
#: (:func:`adaptive.runtime.reforming.meet`), and the longest its group's rendezvous may take once they met.
MEET_TIMEOUT = 10.0


@dataclasses.dataclass
class Membership:
    """This process's place in the live job: its record on the job context (:mod:`adaptive.runtime.job`)."""

    store: torch.distributed.Store | None = None  # the job's keys on the launchers' store
    agents: torch.distributed.Store | None = None  # the launchers' store itself (their signs of life)
    wid: int | None = None  # this worker's id, unique in the job's store
    generation: Generation | None = None  # the generation this process is a member of
    took_state_from_peers: bool = False  # admitted into a running generation: its state comes over the group
    awaiting_admission: bool = False  # found a running generation; asks to join once its objects are built
    listeners: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    changes: int = 0  # generations this process went through after its first
    beat: liveness.Beat | None = None  # this worker's sign of life
    watch: liveness.Watch = dataclasses.field(default_factory=liveness.Watch)  # the others' signs of life
    hang_checked_at: float = 0.0  # monotonic: when the others' signs of life were last looked at
    group_client: torch.distributed.Store | None = None  # the connection the generation's groups rendezvous on

    def me(self) -> Member:
        """This worker as a member record."""
        assert self.wid is not None, "join() first"
        return Member(self.wid, env.live_node(), env.local_rank())


def is_live() -> bool:
    """Whether this process runs under ``adaptive-run --live``."""
    return env.live_store() is not None


def membership() -> Membership:
    """This job's membership record."""
    return current_job().part(Membership)


def is_awaiting_admission() -> bool:
    """Whether this process found the live job running and has not been admitted into it yet."""
    return membership().awaiting_admission


def is_member() -> bool:
    """Whether this process is a member of a generation of the live job (not still joining, or waiting to be
    admitted)."""
    record = membership()
    return record.generation is not None and not record.awaiting_admission


def generation_number() -> int | None:
    """The live generation this process is a member of (None outside live mode)."""
    generation = membership().generation
    return None if generation is None else generation.number


# ---------------------------------------------------------------- the store
def connect(timeout: float) -> torch.distributed.Store:
    """A new connection to the launchers' store, whose blocking calls give up after ``timeout`` seconds."""
    import torch.distributed as dist

    address = env.live_store()
    assert address is not None, "live mode only"
    return dist.TCPStore(address[0], address[1], is_master=False, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def job_store(store: torch.distributed.Store, job_id: str, *, signed: bool = True) -> torch.distributed.Store:
    """The keys of job ``job_id`` on the launchers' ``store`` (the workers' and the launchers' view alike).

    When the job has a secret their records are signed and verified
    (:mod:`adaptive.runtime.signed_records`), unless ``signed=False``: the
    process groups' rendezvous, whose keys torch writes.
    """
    import torch.distributed as dist

    from adaptive.runtime import signed_records

    keys = dist.PrefixStore(job_prefix(job_id), store)
    return signed_records.wrap(keys, job_prefix(job_id)) if signed else keys


def agents_store(store: torch.distributed.Store) -> torch.distributed.Store:
    """The launchers' own records on their ``store`` (their signs of life), signed like the job's."""
    from adaptive.runtime import signed_records

    return signed_records.wrap(store)


def read(store: torch.distributed.Store, key: str) -> str | None:
    """The value of ``key``, None when absent, or when it fails authentication on a signed store (never
    blocks)."""
    from adaptive.runtime import signed_records

    return signed_records.read(store, key)


class Poll:
    """The pauses between looks at the store of one wait: short at first, then growing to :data:`POLL`."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def sleep(self) -> None:
        time.sleep(min(POLL, max(FIRST_POLL, (time.monotonic() - self.started) / 4)))


def generation_store(number: int) -> torch.distributed.Store:
    """The store the process group of generation ``number`` rendezvouses on.

    A connection of its own, whose default timeout is :data:`MEET_TIMEOUT`
    until the group exists; :func:`group_formed` then lets the groups built
    later on it (side groups, meshes) wait as long as a collective may.  gloo
    passes its own timeout to the rendezvous' waits: what ends them early
    when a member is lost is the wrapper they run through
    (:class:`adaptive.runtime.watched_store.LossWatchedStore`).
    """
    import torch.distributed as dist

    record = membership()
    assert record.store is not None, "join() first"
    record.group_client = connect(MEET_TIMEOUT)
    return dist.PrefixStore(GenerationKeys(number).group_prefix,
                            job_store(record.group_client, env.job_id(), signed=False))


def group_formed(timeout: float) -> None:
    """The generation's group was built on :func:`generation_store`: its later waits may last ``timeout`` s."""
    client = membership().group_client
    if client is not None:
        client.set_timeout(datetime.timedelta(seconds=timeout))


def publish(store: torch.distributed.Store, generation: Generation) -> None:
    """Make ``generation`` the running one: its members, then its state, then the job's current number
    (in that order, so that whoever reads the number finds the rest)."""
    store.set(generation.keys.members, generation.to_json())
    store.set(generation.keys.state, GenerationState.RUNNING.value)
    store.set(CURRENT_KEY, str(generation.number))


def silent_for(member: Member) -> float:
    """Seconds ``member``'s sign of life has not moved while this process looked (0 at the first look)."""
    record = membership()
    assert record.store is not None
    key = beat_key(member.wid)
    return record.watch.silent_for(key, int(record.store.add(key, 0)))


def is_dead(member: Member, agent_stale: float = AGENT_STALE) -> bool:
    """Whether ``member`` is known dead: its launcher said so (or the others took it out as hung), its node's
    launcher stopped renewing its sign of life for ``agent_stale`` seconds, or its own sign of life has not
    moved for the hang timeout while this process looked."""
    record = membership()
    assert record.store is not None
    if record.store.check([dead_key(member.wid)]):
        return True
    if member.wid != record.wid and silent_for(member) >= env.live_hang_timeout():
        return True
    agents = record.agents
    said = None if agents is None else read(agents, agent_key(member.node))
    if agents is None or said is None:
        return False
    if said == "done":
        return True
    if time.time() - float(said) <= agent_stale:
        return False
    return _unchanged(agents, agent_key(member.node), said)


def _unchanged(agents: torch.distributed.Store, key: str, said: str) -> bool:
    """Whether a launcher's stale sign of life ``said`` stayed as it is while this process looked, for
    :data:`AGENT_UNCHANGED` seconds (a signed job only; else at once).

    A signed sign of life cannot be forged, but an old one of the same
    launcher can be written back by whoever reads the store: a launcher
    that lives overwrites it within half a second.
    """
    from adaptive.runtime import signed_records

    if not signed_records.is_signed(agents):
        return True
    return membership().watch.silent_for(key, said) >= AGENT_UNCHANGED


# ---------------------------------------------------------------- becoming a member
def join(timeout: float, *, admit_now: bool = True) -> Generation | None:
    """Become a member: form a generation or be admitted into the running one (see the module docstring).

    Blocks until this process is a member, at most ``timeout`` seconds.
    With ``admit_now=False`` a process that finds a generation running does
    not ask to join yet: it returns None and marks itself
    ``awaiting_admission``, so that it can build its model and loaders
    first (the running members do not wait for that); it joins with a
    second call.

    Raises:
        TimeoutError: no generation took this process in time.
    """
    record = membership()
    if record.generation is not None:
        return record.generation
    if record.store is None:
        client = connect(timeout)
        record.agents, record.store = agents_store(client), job_store(client, env.job_id())
        record.wid = _worker_id(record.store)
        _start_beating(record.wid)
        # so that this worker's launcher can say which worker died (worker_of_key)
        record.store.set(worker_of_key(env.live_node(), env.local_rank()),
                         WorkerOf(record.wid, os.getpid()).to_json())
    store, me = record.store, record.me()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = int(read(store, CURRENT_KEY) or 0)
        running = current > 0 and _lives(store, current)
        if running and not admit_now:
            record.awaiting_admission = True
            return None
        joined = _ask(store, current, me, deadline) if running else \
            _formation(store, current + 1, Candidate(me, built=record.awaiting_admission), deadline)
        if joined is not None:
            record.generation, record.awaiting_admission = joined, False
            record.took_state_from_peers = me.wid in joined.joiners
            logger.info("worker %d is rank %d of %d in generation %d of the live job%s", me.wid,
                        joined.rank_of(me.wid), len(joined.members), joined.number,
                        " (its state comes from its peers)" if record.took_state_from_peers else "")
            return joined
    raise TimeoutError(f"no generation of the live job took worker {me.wid} within {timeout:.0f} s")


def _worker_id(store: torch.distributed.Store) -> int:
    """A new worker id: the next of the job's counter.  On a signed store the id is also claimed with a signed
    record, and one that another worker claimed is skipped: the counter cannot be signed, and one set back by
    someone without the secret would otherwise hand an id out twice.

    Raises:
        RuntimeError: :data:`CLAIM_ATTEMPTS` ids in a row were claimed already.
    """
    from adaptive.runtime import signed_records

    if not signed_records.is_signed(store):
        return int(store.add(WORKERS_KEY, 1))
    token = f"{os.getpid()}/{secrets.token_hex(8)}"
    for _ in range(CLAIM_ATTEMPTS):
        wid = int(store.add(WORKERS_KEY, 1))
        if store.compare_set(worker_claim_key(wid), "", token).decode() == token:
            return wid
    raise RuntimeError(f"no free worker id after {CLAIM_ATTEMPTS} tries: the live job's counter {WORKERS_KEY!r} "
                       "keeps handing out ids that other workers hold (it is being set back)")


def _start_beating(wid: int) -> None:
    record = membership()
    if record.beat is None:
        record.beat = liveness.Beat(lambda: job_store(connect(liveness.BEAT_INTERVAL * 4), env.job_id()),
                                    beat_key(wid))
        record.beat.start()
        atexit.register(record.beat.stop)  # before the interpreter's teardown, not inside a store call


def _stop_beating(job: Job) -> None:
    """A reset job (the tests' in-process restarts) stops giving the old worker's sign of life."""
    beat = job.part(Membership).beat if job.has_part(Membership) else None
    if beat is not None:
        beat.stop()


on_reset(_stop_beating)


def _formation(store: torch.distributed.Store, number: int, me: Candidate, deadline: float) -> Generation | None:
    """Register for generation ``number`` formed from disk; the generation, or None when it started without
    this worker (it came late, or it had built already and workers that start in it came)."""
    keys = GenerationKeys(number)
    position = int(store.add(keys.candidates, 1))
    store.set(keys.candidate(position), me.to_json())
    if position == 1:  # the first candidate closes the round
        _close_formation(store, keys, deadline)
    poll = Poll()
    while time.monotonic() < deadline:
        text = read(store, keys.members)
        if text is not None:
            formed = Generation.from_json(text)
            return formed if formed.rank_of(me.member.wid) is not None else None  # left out: join it running
        poll.sleep()
    return None


def _close_formation(store: torch.distributed.Store, keys: GenerationKeys, deadline: float) -> None:
    smallest, largest = env.live_size_bounds()
    reached: float | None = None
    poll = Poll()
    while time.monotonic() < deadline:
        count = int(store.add(keys.candidates, 0))
        now = time.monotonic()
        if count >= smallest and reached is None:
            reached = now
        if count >= largest or (reached is not None and now - reached >= LAST_CALL):
            break
        if count >= 1 and read(store, FINISHED_KEY) is not None:
            break  # training finished: the candidates there only find that out from the checkpoint
        poll.sleep()
    registered = _candidates(store, keys, int(store.add(keys.candidates, 0)))
    starting = [candidate.member for candidate in registered if not candidate.built]
    chosen = (starting or [candidate.member for candidate in registered])[:largest]
    members = sorted(chosen, key=lambda m: (m.node, m.local, m.wid))
    formed = Generation(keys.number, tuple(members))
    if not _first_to_close(store, formed):
        return
    publish(store, formed)
    logger.debug("formed generation %d with %d members from disk (%s)", keys.number, len(members),
                 "workers that start in it" if starting else "workers that built their objects already")


def _candidates(store: torch.distributed.Store, keys: GenerationKeys, count: int) -> list[Candidate]:
    """The candidates registered at positions 1 to ``count``.

    On a signed store each is read without blocking, waiting at most
    :data:`MEET_TIMEOUT` in all for records not written yet: a position
    whose record never passes authentication (the counter was raised by
    someone without the secret) is left out rather than waited for.
    """
    from adaptive.runtime import signed_records

    if not signed_records.is_signed(store):
        return [Candidate.from_json(store.get(keys.candidate(i))) for i in range(1, count + 1)]
    found, until = [], time.monotonic() + MEET_TIMEOUT
    for position in range(1, count + 1):
        text, poll = read(store, keys.candidate(position)), Poll()
        while text is None and time.monotonic() < until:
            poll.sleep()
            text = read(store, keys.candidate(position))
        if text is not None:
            found.append(Candidate.from_json(text))
    return found


def _first_to_close(store: torch.distributed.Store, formed: Generation) -> bool:
    """Whether this candidate's ``formed`` generation stands (a signed store: the first written wins, in case a
    counter set back gave two candidates the first position); always on an unsigned one."""
    from adaptive.runtime import signed_records

    if not signed_records.is_signed(store):
        return True
    return store.compare_set(formed.keys.members, "", formed.to_json()).decode() == formed.to_json()


def _ask(store: torch.distributed.Store, number: int, me: Member, deadline: float) -> Generation | None:
    """Ask running generation ``number`` to admit this process; the next generation, or None to look again."""
    keys = GenerationKeys(number)
    position = int(store.add(keys.joins, 1))
    store.set(keys.join(position), me.to_json())  # before it says it waits: rank 0 reads them in that order
    store.set(keys.join_waiting(position), repr(time.time()))
    logger.info("worker %d asks the running generation %d to admit it", me.wid, number)
    said = time.monotonic()
    poll = Poll()
    while time.monotonic() < deadline:
        if time.monotonic() - said > JOINER_STALE / 4:  # still waiting (and alive)
            store.set(keys.join_waiting(position), repr(time.time()))
            said = time.monotonic()
        text = read(store, keys.next)
        if text is not None:
            following = Generation.from_json(text)
            if following.rank_of(me.wid) is None:
                return None  # not admitted this time: ask the next generation
            return _arrive(store, following, me.wid, deadline)
        if not _lives(store, number):
            return None
        poll.sleep()
    return None


def _lives(store: torch.distributed.Store, number: int) -> bool:
    """Whether generation ``number`` may still admit: training has not finished, the generation has not ended,
    and some member is not known dead (after a loss the others may be re-forming without the lost one; when
    every member was lost, killed before it could say so, no one is left to answer)."""
    if read(store, FINISHED_KEY) is not None:
        return False  # training finished: a worker started now forms a generation at once, which trains nothing
    keys = GenerationKeys(number)
    state = read(store, keys.state)
    if state not in (GenerationState.RUNNING.value, GenerationState.CLOSED.value, GenerationState.FAILED.value):
        return False
    members = read(store, keys.members)
    if members is None:
        return state != GenerationState.FAILED.value
    generation = Generation.from_json(members)
    if not all(is_dead(member) for member in generation.members):
        return True
    _take_out_silent(store, generation)
    return False


def _take_out_silent(store: torch.distributed.Store, generation: Generation) -> None:
    """Generation ``generation`` is taken for lost: mark its members that no launcher reported dead (they went
    silent: stopped, hung, or on a lost node) as hung, so that their launchers, if any, kill them and start
    them again (a stopped process must not wake up into a job that went on without it)."""
    for member in generation.members:
        if not store.check([dead_key(member.wid)]):
            store.set(dead_key(member.wid), HUNG)
            logger.warning("worker %d of generation %d gave no sign of life (stopped, hung, or its node lost) while "
                           "this worker waited to join it; taking it out of the job", member.wid, generation.number)


def _arrive(store: torch.distributed.Store, following: Generation, wid: int, deadline: float) -> Generation | None:
    """An admitted joiner says it is here and waits for rank 0's go; None when the admission was abandoned."""
    store.set(following.keys.arrived(wid), "1")
    poll = Poll()
    while time.monotonic() < deadline:
        if store.check([following.keys.go]):
            return following
        if read(store, following.keys.state) == GenerationState.FAILED.value:
            return None  # another joiner did not arrive: ask again
        poll.sleep()
    return None


# ---------------------------------------------------------------- moving between generations
def enter(following: Generation) -> int | None:
    """This process moves to generation ``following``; its rank there, None when it is not a member."""
    record = membership()
    assert record.wid is not None
    record.generation = following
    record.took_state_from_peers = record.wid in following.joiners
    record.changes += 1
    return following.rank_of(record.wid)


def mark_failed() -> None:
    """A member saw a peer die: its generation is over (those waiting to join form the next one)."""
    _mark(GenerationState.FAILED)


def mark_finished() -> None:
    """Training finished and its checkpoint is on disk: a worker started from now on need not wait for others to
    form a generation (on rank 0, in live mode; nothing elsewhere)."""
    record = membership()
    if record.store is None or env.rank() != 0:
        return
    try:
        record.store.set(FINISHED_KEY, "1")
    except Exception as error:  # the store may be gone with its launcher: nothing left to tell
        logger.debug("could not mark the live job finished: %s", error)


def mark_ended() -> None:
    """Training finished, or every member stopped: nobody will admit a joiner into this generation."""
    _mark(GenerationState.ENDED)


def _mark(state: GenerationState) -> None:
    record = membership()
    if record.store is None or record.generation is None:
        return
    try:
        record.store.set(record.generation.keys.state, state.value)
    except Exception as error:  # the store may be gone with its launcher: nothing left to tell
        logger.debug("could not mark generation %d %s: %s", record.generation.number, state.value, error)


def on_regroup(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after every change of this process's group (a wrapper rebinds its reducer)."""
    membership().listeners.append(listener)


def notify_regroup() -> None:
    """Tell every listener that the process group changed (called by :func:`adaptive.runtime.collectives.regroup`)."""
    for listener in list(membership().listeners):
        listener()


def members_env(generation: Generation, wid: int) -> dict[str, str]:
    """torchrun's variables for worker ``wid`` in ``generation`` (the library reads them through :mod:`.env`).

    ``LOCAL_RANK`` stays the launcher's: it names the worker's device, which does not move.
    """
    rank = generation.rank_of(wid)
    assert rank is not None
    nodes = sorted({member.node for member in generation.members})
    node = generation.members[rank].node
    local = [member for member in generation.members if member.node == node]
    return {"RANK": str(rank), "WORLD_SIZE": str(len(generation.members)), "GROUP_RANK": str(nodes.index(node)),
            "GROUP_WORLD_SIZE": str(len(nodes)), "LOCAL_WORLD_SIZE": str(len(local))}
