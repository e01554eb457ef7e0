"""The live job's protocol on its store, as types: members, generations, their states, and every key.

Live mode (``adaptive-run --live``) agrees on its membership through the
launchers' TCPStore (:mod:`adaptive.runtime.membership` forms and admits,
:mod:`adaptive.runtime.reforming` re-forms after a loss).  What those
modules read and write is defined here, once:

* :class:`Member` (a worker: its id in the job, its node, its local rank),
  :class:`Candidate` (a worker registered for a generation formed from
  disk) and :class:`Generation` (a numbered list of members, the joiners
  it admitted), with their JSON form on the store;
* :class:`GenerationState`: running, then closed (it became the next one),
  failed (the restart path took over) or ended (training finished);
* :class:`GenerationKeys` and the job-wide key functions: every key's name
  is built here and nowhere else.  A job's keys live under
  :func:`job_prefix`; the launchers' own keys (their count and signs of
  life, :data:`AGENTS_KEY`, :func:`agent_key`) live outside every job's.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

__all__ = ["Member", "Candidate", "Generation", "GenerationState", "GenerationKeys", "CURRENT_KEY", "WORKERS_KEY",
           "AGENTS_KEY", "DRAINS_PENDING_KEY", "job_prefix", "agent_key", "worker_of_key", "dead_key",
           "beat_key", "drain_key", "HUNG", "WorkerOf", "worker_claim_key", "agent_claim_key"]


@dataclasses.dataclass(frozen=True)
class Member:
    """A worker of the live job: its id (unique in the job's store), its node (launcher) and local rank."""

    wid: int
    node: int
    local: int

    def to_dict(self) -> dict[str, int]:
        return {"wid": self.wid, "node": self.node, "local": self.local}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Member:
        return cls(int(data["wid"]), int(data["node"]), int(data["local"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> Member:
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What a worker registers for a generation formed from disk: itself, and whether it already built its
    objects on a group of one (it waited for admission into a generation that ended meanwhile).

    A generation's members must all build their model the same way (a worker that starts in it builds on the
    generation's group, one that built on its own rebinds and takes rank 0's weights), so a formation takes
    the workers that start in it, and those that built already only when no such worker came; the others
    are admitted into it as joiners.
    """

    member: Member
    built: bool

    def to_json(self) -> str:
        return json.dumps({**self.member.to_dict(), "built": self.built})

    @classmethod
    def from_json(cls, text: str | bytes) -> Candidate:
        data = json.loads(text)
        return cls(Member.from_dict(data), bool(data.get("built", False)))


class GenerationState(str, enum.Enum):
    """Where a generation is in its life (the value its state key holds)."""

    RUNNING = "running"  # its members train; it may admit joiners
    CLOSED = "closed"  # it became the next generation (a change, or a re-forming after a loss)
    FAILED = "failed"  # a member saw a peer die and the restart path took over; or an admission was abandoned
    ENDED = "ended"  # training finished, or every member stopped


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generation of the job: its number and its members in rank order."""

    number: int
    members: tuple[Member, ...]
    joiners: tuple[int, ...] = ()  # worker ids admitted from a running generation (they take the state)

    def rank_of(self, wid: int) -> int | None:
        """The rank of worker ``wid`` in this generation, None when it is not a member."""
        for rank, member in enumerate(self.members):
            if member.wid == wid:
                return rank
        return None

    @property
    def keys(self) -> GenerationKeys:
        return GenerationKeys(self.number)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": [member.to_dict() for member in self.members],
                           "joiners": list(self.joiners)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        data = json.loads(text)
        return cls(int(data["number"]), tuple(Member.from_dict(member) for member in data["members"]),
                   tuple(int(wid) for wid in data.get("joiners", ())))


#: The number of the job's current generation (0 or absent: none yet).
CURRENT_KEY = "gen"
#: Written once training finished (the finished checkpoint is on disk): a worker started after that (its launcher
#: restarted it) forms a generation at once, alone if need be, which finds nothing left to train.
FINISHED_KEY = "finished"
#: The counter that gives each worker its id.
WORKERS_KEY = "workers"
#: The launchers' counter, which numbers their nodes (on the launchers' store, outside every job's keys).
AGENTS_KEY = "adaptive/live-agents/count"
#: What :func:`dead_key` holds for a member the others took out as hung (its launcher then kills it).
HUNG = "hung"


def job_prefix(job_id: str) -> str:
    """The prefix of job ``job_id``'s keys on the launchers' store."""
    return f"adaptive/live/{job_id}"


def agent_key(node: int) -> str:
    """The key (on the launchers' store) of agent ``node``'s sign of life: a time, or ``done``."""
    return f"adaptive/live-agents/{node}"


def worker_of_key(node: int, local_rank: int) -> str:
    """The key (in the job's keys) that holds the worker id of a launcher's local rank (:class:`WorkerOf`)."""
    return f"worker_of/{node}/{local_rank}"


@dataclasses.dataclass(frozen=True)
class WorkerOf:
    """What :func:`worker_of_key` holds: the worker id a launcher's local rank took, and the PID of the process
    that took it (its launcher believes only a record of the process it runs now, not an older one)."""

    wid: int
    pid: int

    def to_json(self) -> str:
        return json.dumps({"wid": self.wid, "pid": self.pid})

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerOf:
        data = json.loads(text)
        return cls(int(data["wid"]), int(data["pid"]))


def worker_claim_key(wid: int) -> str:
    """The key (in the job's keys) by which a worker claims id ``wid`` (a signed job only: its counter cannot be
    signed, so two workers handed one id by a forged counter must not both take it)."""
    return f"worker/{wid}"


def agent_claim_key(node: int) -> str:
    """The key (on the launchers' store) by which a launcher claims node number ``node`` (a signed job only)."""
    return f"adaptive/live-agents/claim/{node}"


def dead_key(wid: int) -> str:
    """The key (in the job's keys) by which a launcher says that worker ``wid`` died (or the others that it hung)."""
    return f"dead/{wid}"


def private_key(wid: int) -> str:
    """The key (in the job's keys) of what worker ``wid`` alone holds of the states, at its last committed step
    (:mod:`adaptive.checkpoint.private_parts`)."""
    return f"private/{wid}"


#: The count of drain requests posted to the job and not served yet by its members (:mod:`.draining`).
DRAINS_PENDING_KEY = "drains/pending"


def drain_key(node: int) -> str:
    """The key (in the job's keys) that asks the members of node ``node`` to leave: when it was asked."""
    return f"drain/{node}"


def beat_key(wid: int) -> str:
    """The key (in the job's keys) of worker ``wid``'s sign of life: a counter (:mod:`.liveness`)."""
    return f"beat/{wid}"


@dataclasses.dataclass(frozen=True)
class GenerationKeys:
    """The keys of generation ``number`` (in the job's keys)."""

    number: int

    def _key(self, *parts: object) -> str:
        return "/".join(["gen", str(self.number), *map(str, parts)])

    # its record
    @property
    def members(self) -> str:
        return self._key("members")  # Generation.to_json()

    @property
    def state(self) -> str:
        return self._key("state")  # a GenerationState value

    @property
    def next(self) -> str:
        return self._key("next")  # the generation that follows it (to_json)

    @property
    def group_prefix(self) -> str:
        return self._key("group") + "/"  # its process group's rendezvous

    # formation from disk
    @property
    def candidates(self) -> str:
        return self._key("candidates")  # a counter

    def candidate(self, position: int) -> str:
        return self._key("candidate", position)  # Candidate.to_json()

    # admission into it while it runs
    @property
    def joins(self) -> str:
        return self._key("joins")  # a counter of join requests

    def join(self, position: int) -> str:
        return self._key("join", position)  # Member.to_json()

    def join_waiting(self, position: int) -> str:
        return self._key("join", position, "waiting")  # when the joiner last said it still waits (time.time())

    def arrived(self, wid: int) -> str:
        return self._key("arrived", wid)  # an admitted joiner is here

    @property
    def go(self) -> str:
        return self._key("go")  # rank 0: every joiner arrived, build the group

    # meeting before its group is built
    def here(self, wid: int) -> str:
        return self._key("here", wid)

    # after it lost a member
    @property
    def lost(self) -> str:
        return self._key("lost")  # a member said it lost a member

    def alive(self, wid: int) -> str:
        return self._key("alive", wid)  # a member that is left says it lives

    @property
    def after_loss(self) -> str:
        return self._key("after_loss")  # the first proposal of the members that are left (compare_set)

    # the step commit (:mod:`adaptive.runtime.step_commit`)
    @property
    def commit_votes(self) -> str:
        return self._key("commit", "votes")  # a counter: every member adds 1 per step it can apply

    def commit_vote(self, slot: int, wid: int) -> str:
        return self._key("commit", "vote", slot, wid)  # a signed job: the vote number a member cast (str)

    def commit_decision(self, slot: int) -> str:
        return self._key("commit", "decision", slot)  # "<vote>:commit" or "<vote>:abort" (compare_set)
