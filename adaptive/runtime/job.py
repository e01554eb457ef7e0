"""The job context: everything one training process holds about its job, on one object.

A training process takes part in exactly one job.  What it knows about that
job lives on one :class:`Job`, reached through :func:`current_job`; modules
keep no mutable state of their own.  :func:`reset_job` forgets it all at
once, as if the process had restarted (tests use it between in-process
"restarts").

The job is typed and owes nothing to the layers above the runtime.  It holds
the runtime's own records (the process groups, whether the process is
exiting); every other layer defines its record in its own module (the
checkpoint session in :mod:`adaptive.checkpoint.states`, the stop agreement
in :mod:`adaptive.elastic.sync_points`, ...) and reaches it through
:meth:`Job.part`, which creates it on first use::

    @dataclasses.dataclass
    class EpochProgress:          # defined by the layer that owns it
        looping: bool = False

    current_job().part(EpochProgress).looping = True

so a layer reads and changes its own record only, and the job module needs
to know none of them.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING, Callable, TypeVar, cast

if TYPE_CHECKING:  # type names only: importing the job context imports no torch
    import concurrent.futures

    import torch.distributed

__all__ = ["Job", "ProcessGroups", "current_job", "on_reset", "reset_job"]

Record = TypeVar("Record")


@dataclasses.dataclass
class ProcessGroups:
    """The groups :mod:`adaptive.runtime.collectives` created (gloo, for control messages)."""

    control: torch.distributed.ProcessGroup | None = None  # object collectives and the agreements' flags
    asynchronous: torch.distributed.ProcessGroup | None = None  # operations issued from the background thread
    executor: concurrent.futures.ThreadPoolExecutor | None = None  # the thread that runs asynchronous operations
    owns_default_group: bool = False  # init_process_group created the default group
    timeout: float | None = None  # seconds a collective waits for its peers (init_process_group's)
    backend: str | None = None  # the default group's backend (live mode rebuilds it on each generation)
    teardown_registered: bool = False
    #: The stores the last live generations' groups were built on: a store written in Python lives on in torch
    #: only while Python holds it (:class:`adaptive.runtime.watched_store.LossWatchedStore`).
    rendezvous_stores: collections.deque[torch.distributed.Store] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=4))
    #: The last finished agreements' (work, tensor): released well after gloo's thread has let go of them.
    retained: collections.deque[tuple[object, object]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=4))


class Job:
    """One training process's view of its job; see the module docstring."""

    def __init__(self) -> None:
        #: When this job context was created (monotonic): the process start, or the last reset.
        self.started = time.monotonic()
        self.groups = ProcessGroups()
        #: The process is ending through an agreed stop or an error (no warning about a loop left early).
        self.exiting = False
        self._parts: dict[type, object] = {}

    def part(self, kind: type[Record]) -> Record:
        """This job's record of type ``kind``, created with ``kind()`` on first use."""
        found = self._parts.get(kind)
        if found is None:
            found = self._parts[kind] = kind()
        return cast(Record, found)

    def has_part(self, kind: type) -> bool:
        """Whether the record of type ``kind`` was created (a reset job's release hooks read only those)."""
        return kind in self._parts


_job = Job()
_on_reset: list[Callable[[Job], None]] = []


def current_job() -> Job:
    """This process's job."""
    return _job


def on_reset(release: Callable[[Job], None]) -> None:
    """Run ``release(old_job)`` when the job is reset (to give back what it holds: signal handlers, groups)."""
    _on_reset.append(release)


def reset_job() -> Job:
    """Forget the job, as if the process restarted; returns the new, empty one."""
    global _job
    old, _job = _job, Job()
    for release in _on_reset:
        release(old)
    return _job
