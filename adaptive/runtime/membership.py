"""Live membership: which processes form the job now, agreed through the launchers' TCPStore.

Used in live mode only (``adaptive-run --live``, which names its store in
:data:`STORE_VAR`); without it nothing here runs and the job's members are
torchrun's.  The job passes through *generations*: each is a fixed list of
members (worker processes), numbered 1, 2, ... in the store, with a process
group of its own (a ``PrefixStore`` per generation on the launchers' store,
so a new group never meets an old one's keys).  A process becomes a member
in one of two ways (:func:`join`):

* **formation**: no generation is running (the job starts, or every member of
  the last one was lost).  The first candidate closes the round once
  ``ADAPTIVE_LIVE_MIN`` candidates registered and either ``ADAPTIVE_LIVE_MAX``
  did or :data:`LAST_CALL` seconds passed; the members then restore from the
  checkpoint on disk, as a restart does;
* **admission**: a generation is running.  The process builds its objects
  first (on a group of one), then posts a join request, renewed while it
  waits; the running members notice it at their next agreement boundary
  (:func:`pending_joins`), close their generation with the joiners added
  (:func:`close_generation`), wait for them to arrive
  (:func:`await_arrivals`, else :func:`abandon_admission`) and hand them
  the training state over the new group (:mod:`adaptive.checkpoint.peer_state`).

After a lost member the others agree on the next generation here, without a
process group (:func:`reform_after_loss`): each says it is alive, and a
member is dead when its launcher said so (:func:`dead_key`), when its
launcher's sign of life (:func:`agent_key`) grew old, when its own sign of
life stopped for the hang timeout (:mod:`adaptive.runtime.liveness`: a
stopped or hung process, which a member waiting for it takes out of the job,
:func:`loss_reported`), or after a timeout.

Before the members of a generation build its process group they meet on
the store (:func:`meet`): a member that died or hung after the generation
was agreed is found there, within seconds, instead of leaving the others
in the group's rendezvous until the collective timeout.

A generation ends as ``running`` -> ``closed`` (it became the next one),
``failed`` (a member saw a peer die and the restart path took over:
:func:`mark_failed`), or ``ended`` (training finished or every member
stopped); a process waiting for admission into one that failed or ended
forms the next one instead.

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
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

from adaptive.runtime import env, liveness
from adaptive.runtime.job import current_job

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["STORE_VAR", "MIN_VAR", "MAX_VAR", "NODE_VAR", "LAST_CALL", "Membership", "Generation", "is_live", "is_member",
           "membership", "generation_number", "join", "pending_joins", "close_generation", "enter", "mark_failed",
           "mark_ended", "on_regroup", "notify_regroup", "generation_store", "members_env", "await_arrivals", "abandon_admission",
           "reform_after_loss", "report_loss", "loss_reported", "meet", "group_formed", "beat_key", "MEET_TIMEOUT", "HUNG", "worker_of_key", "dead_key", "job_store", "agent_key", "AGENTS_KEY"]

logger = logging.getLogger(__name__)

#: ``host:port`` of the launchers' TCPStore; set by ``adaptive-run --live``.
STORE_VAR = "ADAPTIVE_LIVE_STORE"
#: The fewest and the most members of a generation formed from disk.
MIN_VAR, MAX_VAR = "ADAPTIVE_LIVE_MIN", "ADAPTIVE_LIVE_MAX"
#: The launcher (node) a worker belongs to: a number the launcher took from the store.
NODE_VAR = "ADAPTIVE_LIVE_NODE"
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
#: Seconds rank 0 waits for the admitted joiners to arrive before it continues without them.
ADMISSION_TIMEOUT = 5.0
#: Seconds the members of a new generation wait for each other before they build its group (:func:`meet`),
#: and the longest its group's rendezvous may take once they met.
MEET_TIMEOUT = 10.0
#: Seconds between a waiting member's looks at the others' signs of life (:func:`loss_reported`).
HANG_CHECK_INTERVAL = 0.5
#: What :func:`dead_key` holds for a member the others took out as hung (its launcher kills it).
HUNG = b"hung"

_RUNNING, _CLOSED, _FAILED, _ENDED = "running", "closed", "failed", "ended"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generation of the job: its number and its members in rank order (``{"wid", "node", "local"}``)."""

    number: int
    members: tuple[dict[str, int], ...]
    joiners: tuple[int, ...] = ()  # worker ids admitted from a running generation (they take the state)

    def rank_of(self, wid: int) -> int | None:
        """The rank of worker ``wid`` in this generation, None when it is not a member."""
        for rank, member in enumerate(self.members):
            if member["wid"] == wid:
                return rank
        return None

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "joiners": list(self.joiners)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        data = json.loads(text)
        return cls(int(data["number"]), tuple(data["members"]), tuple(data.get("joiners", ())))


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
    hang_checked_at: float = 0.0  # monotonic: when loss_reported last looked at the others' signs of life
    group_client: torch.distributed.Store | None = None  # the connection the generation's groups rendezvous on


def is_live() -> bool:
    """Whether this process runs under ``adaptive-run --live``."""
    return bool(os.environ.get(STORE_VAR))


def membership() -> Membership:
    """This job's membership record."""
    return current_job().part(Membership)


def is_member() -> bool:
    """Whether this process is a member of a generation of the live job (not still joining, or waiting to be
    admitted)."""
    record = membership()
    return record.generation is not None and not record.awaiting_admission


def generation_number() -> int | None:
    """The live generation this process is a member of (None outside live mode)."""
    generation = membership().generation
    return None if generation is None else generation.number


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name) or ""
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def _client(timeout: float) -> torch.distributed.Store:
    """A new connection to the launchers' store, whose blocking calls give up after ``timeout`` seconds."""
    import torch.distributed as dist

    host, _, port = os.environ[STORE_VAR].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"environment variable {STORE_VAR}={os.environ[STORE_VAR]!r} must be host:port")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def _connect(timeout: float) -> torch.distributed.Store:
    store = membership().agents = _client(timeout)
    return job_store(store, env.job_id())


def beat_key(wid: int) -> str:
    """The key (in the job's keys) of worker ``wid``'s sign of life: a counter (:mod:`.liveness`)."""
    return f"beat/{wid}"


def _start_beating(wid: int) -> None:
    record = membership()
    if record.beat is None:
        record.beat = liveness.Beat(lambda: job_store(_client(liveness.BEAT_INTERVAL * 4), env.job_id()),
                                    beat_key(wid))
        record.beat.start()
        atexit.register(record.beat.stop)  # before the interpreter's teardown, not inside a store call


#: The launchers' counter of agents, which numbers their nodes (on the launchers' store, outside every job's keys).
AGENTS_KEY = "adaptive/live-agents/count"


def agent_key(node: int) -> str:
    """The key (on the launchers' store) of agent ``node``'s sign of life: a time, or ``done``."""
    return f"adaptive/live-agents/{node}"


def job_store(store: torch.distributed.Store, job_id: str) -> torch.distributed.Store:
    """The keys of job ``job_id`` on the launchers' ``store`` (the workers' and the launchers' view alike)."""
    import torch.distributed as dist

    return dist.PrefixStore(f"adaptive/live/{job_id}", store)


def _get(store: torch.distributed.Store, key: str) -> str | None:
    """The value of ``key``, None when absent (never blocks)."""
    if not store.check([key]):
        return None
    return store.get(key).decode()


class _Poll:
    """The pauses between looks at the store of one wait: short at first, then growing to :data:`POLL`."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def sleep(self) -> None:
        time.sleep(min(POLL, max(FIRST_POLL, (time.monotonic() - self.started) / 4)))


def generation_store(number: int) -> torch.distributed.Store:
    """The store the process group of generation ``number`` rendezvouses on.

    A connection of its own whose waits end after :data:`MEET_TIMEOUT`: the
    members met on the store first (:func:`meet`), so a rendezvous that takes
    longer waits for a member lost since, and fails instead of waiting for
    the collective timeout.  Once the group exists, :func:`group_formed`
    lets the groups built later on it (side groups, meshes) wait as long as
    a collective may.
    """
    import torch.distributed as dist

    record = membership()
    assert record.store is not None, "join() first"
    record.group_client = _client(MEET_TIMEOUT)
    return dist.PrefixStore(f"gen/{number}/group/", job_store(record.group_client, env.job_id()))


def group_formed(timeout: float) -> None:
    """The generation's group was built on :func:`generation_store`: its later waits may last ``timeout`` s."""
    client = membership().group_client
    if client is not None:
        client.set_timeout(datetime.timedelta(seconds=timeout))


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
        record.store = _connect(timeout)
        record.wid = int(record.store.add("workers", 1))
        _start_beating(record.wid)
        # so that this worker's launcher can say which worker died (worker_of_key)
        record.store.set(worker_of_key(_int_env(NODE_VAR, 0), env.local_rank()), str(record.wid))
    store, wid = record.store, record.wid
    assert wid is not None
    me = {"wid": wid, "node": _int_env(NODE_VAR, 0), "local": env.local_rank()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = int(_get(store, "gen") or 0)
        running = current > 0 and _lives(store, current)
        if running and not admit_now:
            record.awaiting_admission = True
            return None
        if running:
            joined = _admission(store, current, me, deadline)
        else:
            joined = _formation(store, current + 1, me, deadline)
        if joined is not None:
            record.generation, record.awaiting_admission = joined, False
            record.took_state_from_peers = wid in joined.joiners
            logger.info("worker %d is rank %d of %d in generation %d of the live job%s", wid,
                        joined.rank_of(wid), len(joined.members), joined.number,
                        " (its state comes from its peers)" if record.took_state_from_peers else "")
            return joined
    raise TimeoutError(f"no generation of the live job took worker {wid} within {timeout:.0f} s")


def _formation(store: torch.distributed.Store, number: int, me: dict[str, int], deadline: float) -> Generation | None:
    """Register for generation ``number`` formed from disk; the generation, or None when another one started."""
    position = int(store.add(f"gen/{number}/candidates", 1))
    store.set(f"gen/{number}/candidate/{position}", json.dumps(me))
    if position == 1:  # the first candidate closes the round
        _close_formation(store, number, deadline)
    members_key = f"gen/{number}/members"
    poll = _Poll()
    while time.monotonic() < deadline:
        text = _get(store, members_key)
        if text is not None:
            formed = Generation.from_json(text)
            return formed if formed.rank_of(me["wid"]) is not None else None  # late: join it running
        poll.sleep()
    return None


def _close_formation(store: torch.distributed.Store, number: int, deadline: float) -> None:
    smallest = max(1, _int_env(MIN_VAR, 1))
    largest = max(smallest, _int_env(MAX_VAR, smallest))
    count_key = f"gen/{number}/candidates"
    reached: float | None = None
    poll = _Poll()
    while time.monotonic() < deadline:
        count = int(store.add(count_key, 0))
        now = time.monotonic()
        if count >= smallest and reached is None:
            reached = now
        if count >= largest or (reached is not None and now - reached >= LAST_CALL):
            break
        poll.sleep()
    count = min(int(store.add(count_key, 0)), largest)
    members = sorted((json.loads(store.get(f"gen/{number}/candidate/{i}")) for i in range(1, count + 1)),
                     key=lambda m: (m["node"], m["local"], m["wid"]))
    formed = Generation(number, tuple(members))
    _publish(store, formed)
    logger.debug("formed generation %d with %d members from disk", number, len(members))


def _publish(store: torch.distributed.Store, generation: Generation) -> None:
    """Make ``generation`` the running one: its members, then its state, then the job's current number
    (in that order, so that whoever reads the number finds the rest)."""
    store.set(f"gen/{generation.number}/members", generation.to_json())
    store.set(f"gen/{generation.number}/state", _RUNNING)
    store.set("gen", str(generation.number))


def _admission(store: torch.distributed.Store, number: int, me: dict[str, int], deadline: float) -> Generation | None:
    """Ask running generation ``number`` to admit this process; the next generation, or None to look again."""
    position = int(store.add(f"gen/{number}/joins", 1))
    store.set(f"gen/{number}/join/{position}/waiting", repr(time.time()))
    store.set(f"gen/{number}/join/{position}", json.dumps(me))
    logger.info("worker %d asks the running generation %d to admit it", me["wid"], number)
    said = time.monotonic()
    poll = _Poll()
    while time.monotonic() < deadline:
        if time.monotonic() - said > JOINER_STALE / 4:  # still waiting (and alive)
            store.set(f"gen/{number}/join/{position}/waiting", repr(time.time()))
            said = time.monotonic()
        text = _get(store, f"gen/{number}/next")
        if text is not None:
            following = Generation.from_json(text)
            if following.rank_of(me["wid"]) is None:
                return None  # not admitted this time: ask the next generation
            return _arrive(store, following, me["wid"], deadline)
        if not _lives(store, number):
            return None
        poll.sleep()
    return None


def _lives(store: torch.distributed.Store, number: int) -> bool:
    """Whether generation ``number`` may still admit: not ended, and (when a member reported a loss) some
    member is not known dead, for the others may be re-forming without the lost one."""
    state = _get(store, f"gen/{number}/state")
    if state in (_RUNNING, _CLOSED):
        return True
    if state != _FAILED:
        return False
    members = _get(store, f"gen/{number}/members")
    if members is None:
        return False
    return not all(_is_dead(member, AGENT_STALE) for member in Generation.from_json(members).members)


def _arrive(store: torch.distributed.Store, following: Generation, wid: int, deadline: float) -> Generation | None:
    """An admitted joiner says it is here and waits for rank 0's go; None when the admission was abandoned."""
    store.set(f"gen/{following.number}/arrived/{wid}", "1")
    poll = _Poll()
    while time.monotonic() < deadline:
        if store.check([f"gen/{following.number}/go"]):
            return following
        if _get(store, f"gen/{following.number}/state") == _FAILED:
            return None  # another joiner did not arrive: ask again
        poll.sleep()
    return None


def await_arrivals(following: Generation, timeout: float) -> bool:
    """On rank 0, after :func:`close_generation`: whether every joiner of ``following`` arrived in time.

    When they did, they are told to go on and build the new group; when one
    did not (it died after asking to join), the caller abandons the
    admission (:func:`abandon_admission`) rather than wait for it in the
    group's rendezvous.
    """
    record = membership()
    assert record.store is not None
    keys = [f"gen/{following.number}/arrived/{wid}" for wid in following.joiners]
    deadline = time.monotonic() + timeout
    poll = _Poll()
    while not record.store.check(keys):
        dead = [wid for wid in following.joiners if record.store.check([dead_key(wid)])]
        if dead:  # its launcher reaped it: waiting on would cost the members the whole admission timeout
            logger.warning("joiner %s of generation %d died before it arrived; continuing without the joiners",
                           ", ".join(map(str, dead)), following.number)
            return False
        if time.monotonic() > deadline:
            logger.warning("joiner(s) %s of generation %d did not arrive within %.0f s", ", ".join(
                str(wid) for wid, key in zip(following.joiners, keys) if not record.store.check([key])),
                following.number, timeout)
            return False
        poll.sleep()
    record.store.set(f"gen/{following.number}/go", "1")
    return True


def abandon_admission(following: Generation) -> Generation:
    """On rank 0: a joiner of ``following`` never arrived; the generation after it keeps the old members only.

    The joiners that did arrive see ``following`` fail and ask the new one
    to admit them.
    """
    record = membership()
    assert record.store is not None
    store = record.store
    kept = tuple(member for member in following.members if member["wid"] not in set(following.joiners))
    instead = Generation(following.number + 1, kept)
    _publish(store, instead)
    store.set(f"gen/{following.number}/next", instead.to_json())
    store.set(f"gen/{following.number}/state", _FAILED)
    logger.warning("generation %d continues without the joiners admitted into generation %d", instead.number,
                   following.number)
    return instead


def worker_of_key(node: int, local_rank: int) -> str:
    """The key (in the job's keys) that holds the worker id of a launcher's local rank."""
    return f"worker_of/{node}/{local_rank}"


def dead_key(wid: int) -> str:
    """The key (in the job's keys) by which a launcher says that worker ``wid`` died."""
    return f"dead/{wid}"


def reform_after_loss(timeout: float, agent_stale: float = AGENT_STALE) -> Generation | None:
    """After a lost peer: the generation of the members that are left, agreed on the store without a group.

    Each member that noticed the loss says it is alive; a member is dead
    when its launcher said so (:func:`dead_key`), when its launcher stopped
    renewing its sign of life for ``agent_stale`` seconds (a lost node), or
    when it said nothing within ``timeout`` seconds.  The first proposal
    written wins.  Returns None when this process is not in it (it was
    taken for dead).
    """
    record = membership()
    assert record.store is not None and record.generation is not None and record.wid is not None
    store, current = record.store, record.generation
    store.set(f"gen/{current.number}/alive/{record.wid}", "1")
    deadline = time.monotonic() + timeout
    poll = _Poll()
    while True:
        alive = [m for m in current.members if store.check([f"gen/{current.number}/alive/{m['wid']}"])
                 and not store.check([dead_key(m["wid"])])]  # one taken out as hung that woke is still out
        undecided = [m for m in current.members if m not in alive and not _is_dead(m, agent_stale)]
        if not undecided or time.monotonic() > deadline:
            break
        poll.sleep()
    # A change may have planned the next generation already (the loss came during it): the numbers go on.
    proposal = Generation(int(_get(store, "gen") or current.number) + 1, tuple(alive))
    agreed = Generation.from_json(store.compare_set(f"gen/{current.number}/after_loss", "", proposal.to_json()))
    planned = _get(store, f"gen/{current.number}/next")
    if planned is not None and Generation.from_json(planned).number != agreed.number:
        store.set(f"gen/{Generation.from_json(planned).number}/state", _FAILED)  # its joiners ask again
    store.compare_set(f"gen/{current.number}/next", "", agreed.to_json())  # joiners waiting on it ask again
    if agreed.rank_of(record.wid) is None:
        # Taken for dead: the others may have moved on from ``agreed`` already; publishing it again would
        # make it the job's current generation once more, and joiners would ask a closed one forever.
        return None
    _publish(store, agreed)  # its members only: none of them can have closed it yet, they regroup first
    store.set(f"gen/{current.number}/state", _CLOSED)
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
    store = record.store
    store.set(f"gen/{following.number}/here/{record.wid}", "1")
    deadline = time.monotonic() + timeout
    poll = _Poll()
    while True:
        missing = [m for m in following.members if not store.check([f"gen/{following.number}/here/{m['wid']}"])]
        if not missing:
            return []
        gone = [m["wid"] for m in missing if _is_dead(m, AGENT_STALE)]
        if gone or time.monotonic() > deadline:
            waited = gone or [m["wid"] for m in missing]
            logger.warning("worker(s) %s did not come to build generation %d's group (%s); the members that are "
                           "left re-form without them", ", ".join(map(str, waited)), following.number,
                           "dead or hung" if gone else f"not there within {timeout:.0f} s")
            return waited
        poll.sleep()


def report_loss() -> None:
    """Say on the store that this generation lost a member (a member that noticed, before re-forming)."""
    record = membership()
    if record.store is not None and record.generation is not None:
        record.store.set(f"gen/{record.generation.number}/lost", "1")


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
    if record.store.check([f"gen/{number}/lost"]):
        return True
    now = time.monotonic()
    if record.generation is None or record.generation.number != number or now - record.hang_checked_at < \
            HANG_CHECK_INTERVAL:
        return False
    record.hang_checked_at = now
    others = [member for member in record.generation.members if member["wid"] != record.wid]
    dead = [member["wid"] for member in others if record.store.check([dead_key(member["wid"])])]
    hung = [(member, silent) for member, silent in _silent_members(record.generation)
            if member["wid"] != record.wid and member["wid"] not in dead]
    for member, silent in hung:
        record.store.set(dead_key(member["wid"]), HUNG)
        logger.warning("worker %d (rank %s of generation %d, node %d) gave no sign of life for %.1f s: stopped or "
                       "hung; taking it out of the job (ADAPTIVE_LIVE_HANG_TIMEOUT=%g)", member["wid"],
                       record.generation.rank_of(member["wid"]), number, member["node"], silent,
                       env.live_hang_timeout())
    if dead:
        logger.warning("worker(s) %s of generation %d died (reported by their launcher); giving up the "
                       "collectives in flight", ", ".join(map(str, dead)), number)
    if hung or dead:
        report_loss()
    return bool(hung or dead)


def _silent_members(generation: Generation) -> list[tuple[dict[str, int], float]]:
    """The members of ``generation`` whose sign of life has not changed for the hang timeout, with the seconds."""
    record = membership()
    assert record.store is not None
    timeout = env.live_hang_timeout()
    silent = []
    for member in generation.members:
        key = beat_key(member["wid"])
        seconds = record.watch.silent_for(key, int(record.store.add(key, 0)))
        if seconds >= timeout:
            silent.append((member, seconds))
    return silent


def _is_dead(member: dict[str, int], agent_stale: float) -> bool:
    record = membership()
    assert record.store is not None
    if record.store.check([dead_key(member["wid"])]):
        return True
    key = beat_key(member["wid"])
    if member["wid"] != record.wid and \
            record.watch.silent_for(key, int(record.store.add(key, 0))) >= env.live_hang_timeout():
        return True
    agents = record.agents
    key = agent_key(member["node"])
    if agents is None or not agents.check([key]):
        return False
    said = agents.get(key).decode()
    return said == "done" or time.time() - float(said) > agent_stale


def pending_joins() -> int:
    """How many processes asked the running generation to admit them (one store read)."""
    record = membership()
    if record.store is None or record.generation is None:
        return 0
    return int(record.store.add(f"gen/{record.generation.number}/joins", 0))


def close_generation(survivors: list[int], joins: int) -> Generation:
    """On the generation's rank 0: publish the next generation (``survivors`` by worker id, then the first
    ``joins`` joiners) and close this one.  The other members learn it from rank 0."""
    record = membership()
    assert record.store is not None and record.generation is not None
    store, current = record.store, record.generation
    kept = [member for member in current.members if member["wid"] in set(survivors)]
    joiners = [json.loads(store.get(f"gen/{current.number}/join/{i}")) for i in range(1, joins + 1)
               if _still_waiting(store, current.number, i)]
    following = Generation(current.number + 1, tuple(kept + joiners), tuple(m["wid"] for m in joiners))
    _publish(store, following)
    store.set(f"gen/{current.number}/next", following.to_json())
    store.set(f"gen/{current.number}/state", _CLOSED)
    return following


def _still_waiting(store: torch.distributed.Store, number: int, position: int) -> bool:
    """Whether join request ``position`` of generation ``number`` was renewed lately (its process lives)."""
    said = _get(store, f"gen/{number}/join/{position}/waiting")
    if said is None or time.time() - float(said) > JOINER_STALE:
        logger.warning("not admitting join request %d: its process stopped waiting (it died?)", position)
        return False
    asked = _get(store, f"gen/{number}/join/{position}")
    if asked is not None and store.check([dead_key(int(json.loads(asked)["wid"]))]):
        logger.warning("not admitting join request %d: its launcher reported its process dead", position)
        return False
    return True


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
    _mark(_FAILED)


def mark_ended() -> None:
    """Training finished, or every member stopped: nobody will admit a joiner into this generation."""
    _mark(_ENDED)


def _mark(state: str) -> None:
    record = membership()
    if record.store is None or record.generation is None:
        return
    try:
        record.store.set(f"gen/{record.generation.number}/state", state)
    except Exception as error:  # the store may be gone with its launcher: nothing left to tell
        logger.debug("could not mark generation %d %s: %s", record.generation.number, state, error)


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
    nodes = sorted({member["node"] for member in generation.members})
    node = generation.members[rank]["node"]
    local = [member for member in generation.members if member["node"] == node]
    return {"RANK": str(rank), "WORLD_SIZE": str(len(generation.members)), "GROUP_RANK": str(nodes.index(node)),
            "GROUP_WORLD_SIZE": str(len(nodes)), "LOCAL_WORLD_SIZE": str(len(local))}
