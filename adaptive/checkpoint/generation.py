"""Generations: one incarnation of a job at a time may publish checkpoints (guarantee G6).

Every incarnation of a job (a launch, and each torchrun restart round) takes
a *generation* from the job's checkpoint folder when it starts: a number
one larger than any taken before, recorded durably beside the checkpoints
in ``generation.json``. A checkpoint is published only while its writer's
generation is still the newest; an older incarnation that wakes up (a
paused VM, a network partition, a node the scheduler gave up on, the same
job launched twice) publishes nothing and stops with
:class:`StaleGenerationError`, which names both generations.

Why a number in the folder: the folder is the one thing every incarnation
of a job shares, whatever launched it (``adaptive-run``, plain torchrun,
the scheduler's backends, a user launching twice). Taking a generation and
publishing a checkpoint both hold an exclusive ``flock`` on
``.generation.lock`` in the folder, so a publication either happens before
a newer incarnation took its generation (and that incarnation resumes from
it) or not at all. The lock is held for a file read and a rename; the
kernel releases it when its holder dies, even by SIGKILL. A holder frozen
with SIGSTOP while holding it delays the others by at most
:data:`LOCK_TIMEOUT` seconds, after which they fail with a clear error.
The folder must be on a file system whose locks are shared by every node
that writes to it (local disks, NFSv4, Lustre and GPFS are).

Between checkpoints an incarnation checks its generation cheaply (one small
file read, see :meth:`Generation.is_newest`); the stop agreement of
:mod:`adaptive.elastic.sync_points` makes every replica of a stale
incarnation stop together within a second or two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from adaptive._utils.files import fsync_dir, read_json, write_json_atomic
from adaptive._utils.types import JSON
from adaptive.checkpoint._reading import CheckpointError

__all__ = ["Generation", "GenerationRecord", "StaleGenerationError", "CheckpointFolderError", "GENERATION_FILE",
           "LOCK_FILE", "newest_generation"]

logger = logging.getLogger(__name__)

#: The record of the newest generation, beside the checkpoints.
GENERATION_FILE = "generation.json"
#: The lock file that orders generation takes and checkpoint publications.
LOCK_FILE = ".generation.lock"
#: Seconds to wait for the lock before giving up with an error.
LOCK_TIMEOUT = 60.0
_LOCK_POLL = 0.01


@dataclasses.dataclass(frozen=True)
class GenerationRecord:
    """Who took a generation: its number, when (Unix time), and the host and process that took it."""

    number: int
    taken_at: float
    host: str
    pid: int

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.taken_at))
        return f"generation {self.number} (taken at {when} by pid {self.pid} on {self.host})"


class CheckpointFolderError(CheckpointError):
    """The checkpoint folder cannot be created, or written in (a path under a file, no permission, a read-only
    file system): a configuration error, which a restart cannot fix."""

    #: errno values of a folder that cannot be created or written in whatever is tried again.
    ERRNOS = (errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG)

    def __init__(self, folder: str | os.PathLike[str], reason: str, action: str = "create") -> None:
        self.folder, self.reason = str(folder), reason
        super().__init__(f"cannot {action} the checkpoint folder {self.folder}: {reason}")

    @classmethod
    def from_os_error(cls, folder: str | os.PathLike[str], error: OSError,
                      action: str = "create") -> "CheckpointFolderError":
        """The error for ``error``, raised when trying to ``action`` (create, write in) ``folder``."""
        reason = error.strerror or str(error)
        if error.errno in (errno.ENOTDIR, errno.EEXIST):
            reason += " (a part of the path is a file)"
        return cls(folder, reason, action)


class StaleGenerationError(CheckpointError):
    """A newer incarnation of this job took over its checkpoint folder; this one must publish nothing and stop."""

    def __init__(self, root: str, mine: int, newest: GenerationRecord | None) -> None:
        self.root, self.mine, self.newest = str(root), int(mine), newest
        newer = "a newer generation" if newest is None else newest.describe()
        super().__init__(
            f"this incarnation holds generation {mine} of the checkpoint folder {root}, but {newer} is newer: "
            "another incarnation of this job started since (a relaunch, a restart round, or the same job "
            "launched twice). This one publishes no checkpoint and stops; the newer one goes on from the "
            "newest checkpoint")

    def fields(self) -> JSON:
        """Plain values that rebuild this error on another rank (:meth:`from_fields`)."""
        newest = None if self.newest is None else dataclasses.asdict(self.newest)
        return {"root": self.root, "mine": self.mine, "newest": newest}

    @classmethod
    def from_fields(cls, fields: JSON) -> "StaleGenerationError":
        newest = fields.get("newest")
        return cls(fields["root"], fields["mine"], None if newest is None else GenerationRecord(**newest))

    @property
    def newest_number(self) -> int | None:
        return None if self.newest is None else self.newest.number


def newest_generation(root: str | os.PathLike[str]) -> GenerationRecord | None:
    """The newest generation taken in ``root``, or None if none was (reads one small file, no lock).

    Raises:
        CheckpointError: the record exists but cannot be read.
    """
    path = Path(root) / GENERATION_FILE
    try:
        data = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read the job's generation record {path}: {error}") from error
    try:
        return GenerationRecord(number=int(data["number"]), taken_at=float(data["taken_at"]),
                                host=str(data["host"]), pid=int(data["pid"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"the job's generation record {path} is damaged ({error!r}): {data!r}; remove it "
                              "only if no incarnation of this job is running") from error


class Generation:
    """This incarnation's generation in one checkpoint folder (take one with :meth:`take`).

    Attributes:
        root: The checkpoint folder.
        record: The generation this incarnation took.
    """

    def __init__(self, root: str | os.PathLike[str], record: GenerationRecord) -> None:
        self.root = Path(root)
        self.record = record

    def __repr__(self) -> str:
        return f"Generation({self.number}, root={str(self.root)!r})"

    @property
    def number(self) -> int:
        return self.record.number

    @classmethod
    def take(cls, root: str | os.PathLike[str], timeout: float = LOCK_TIMEOUT) -> "Generation":
        """Take the next generation in ``root`` (created if missing): atomic, durable, monotonic.

        Raises:
            CheckpointError: the folder or the record cannot be written, or the
                lock was not free within ``timeout`` seconds.
        """
        root = Path(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if error.errno in CheckpointFolderError.ERRNOS:
                raise CheckpointFolderError.from_os_error(root, error) from error
            raise CheckpointError(f"cannot create the checkpoint folder {root}: {error}") from error
        with _locked(root, timeout):
            previous = newest_generation(root)
            record = GenerationRecord(number=1 if previous is None else previous.number + 1, taken_at=time.time(),
                                      host=socket.gethostname(), pid=os.getpid())
            try:
                write_json_atomic(root / GENERATION_FILE, dataclasses.asdict(record))
                fsync_dir(root, strict=True)
            except OSError as error:
                raise CheckpointError(f"cannot record generation {record.number} in {root}: {error}") from error
        logger.debug("took generation %d of %s", record.number, root)
        return cls(root, record)

    def newest(self) -> GenerationRecord | None:
        """The newest generation in the folder now (possibly this one)."""
        return newest_generation(self.root)

    def is_newest(self) -> bool:
        """Whether no newer generation was taken (a cheap read, no lock; for periodic checks)."""
        newest = self.newest()
        return newest is not None and newest.number == self.number

    def check(self) -> None:
        """Raise :class:`StaleGenerationError` if a newer generation was taken."""
        newest = self.newest()
        if newest is None or newest.number != self.number:
            raise StaleGenerationError(str(self.root), self.number, newest)

    @contextlib.contextmanager
    def publishing(self, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
        """Hold the lock while this generation is checked and a checkpoint renamed into place.

        Raises:
            StaleGenerationError: a newer generation was taken (nothing may be published).
            CheckpointError: the lock was not free within ``timeout`` seconds.
        """
        with _locked(self.root, timeout):
            self.check()
            yield


@contextlib.contextmanager
def _locked(root: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``root/.generation.lock`` (waiting at most ``timeout`` s)."""
    path = root / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        if error.errno in CheckpointFolderError.ERRNOS:
            raise CheckpointFolderError.from_os_error(root, error, "write in") from error
        raise CheckpointError(f"cannot open the generation lock {path}: {error}") from error
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise CheckpointError(f"cannot lock {path}: {error} (the checkpoint folder must be on a "
                                          "file system with working locks)") from error
                if time.monotonic() >= deadline:
                    raise CheckpointError(f"the generation lock {path} was held by another process for more than "
                                          f"{timeout:.0f} s (a frozen incarnation of this job?)") from None
                time.sleep(_LOCK_POLL)
        yield
    finally:
        os.close(fd)  # releases the lock
