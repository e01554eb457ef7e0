"""Crash-safe, verified on-disk checkpoint store (guarantees G3 and G4).

A checkpoint is a directory ``checkpoint-<seq>`` under a root directory. It
holds one ``torch.save`` file per named state and a JSON manifest listing
every file with its size and SHA-256. The layout makes three promises:

* **Atomic.** A checkpoint is assembled in a temporary directory (a name
  starting with ``.tmp-``, which readers ignore). Every file is fsync'ed,
  the manifest is written last, and only then is the directory renamed to
  its final name and the root fsync'ed. A writer killed at any point leaves
  either the previous checkpoint as the newest or the new, complete one.
* **Verified.** :meth:`CheckpointStore.latest` returns the newest
  checkpoint whose manifest parses and whose files all have the recorded
  size and hash. A damaged one is skipped with a warning naming it and the
  reason, in favour of the previous one. :meth:`Checkpoint.load` hashes the
  exact bytes it deserialises again, so a file changed after ``latest()``
  is caught too.
* **Safe to load.** States are deserialised with
  ``torch.load(weights_only=True)``, which refuses any Python global
  outside PyTorch's allow-list, so loading never runs code from the file.
  ``save`` checks up front that a state contains only values that such a
  load accepts, so the store never writes a checkpoint it cannot read.

Only one process (rank 0) may write to a root; any number may read.

Cost: ``save`` serialises each state once, hashing the chunks torch hands
over as they are written (no second pass, no copy). ``latest()`` streams
every file of the chosen checkpoint through SHA-256 with a reused 8 MiB
buffer; ``load()`` reads its file into memory once and hashes those bytes
again instead of trusting a cached (size, mtime, inode) match, because
only then are the bytes given to ``torch.load`` provably the ones in the
manifest. That second hash costs about as much as reading the file, once
per restart; see benchmarks/bench_checkpoint.py.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

logger = logging.getLogger(__name__)

FORMAT_NAME = "adaptive-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

_DIR_PREFIX = "checkpoint-"
_DIR_PATTERN = re.compile(r"checkpoint-(\d+)")
_SEQ_WIDTH = 8
_TEMP_PREFIX = ".tmp-"
_TEMP_PATTERN = re.compile(r"\.tmp-(?P<host>[A-Za-z0-9_-]*)-(?P<pid>\d+)-[0-9a-f]+")
_SAFE_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

_READ_CHUNK = 8 << 20          # streaming hash buffer; large to amortise syscalls
_WRITE_BUFFER = 1 << 20        # batches torch's many small header writes
_MAX_MANIFEST_BYTES = 16 << 20  # refuse to parse anything larger as a manifest
_STALE_TEMP_AGE_S = 3600.0     # a temp dir untouched this long is abandoned
_NAME_STEM_LEN = 48


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, verified or safely loaded."""


class _Invalid(Exception):
    """Internal: a checkpoint directory failed verification (``reason``)."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """Summary of one checkpoint, read from its manifest.

    Attributes:
        seq: Sequence number; larger means newer.
        path: The checkpoint directory.
        created: Creation time, seconds since the Unix epoch.
        metadata: The JSON metadata given to :meth:`CheckpointStore.save`.
        size: Total size in bytes of the state files.
    """

    seq: int
    path: Path
    created: float
    metadata: dict[str, Any]
    size: int


@dataclasses.dataclass(frozen=True)
class _StateEntry:
    """Manifest record of one state file."""

    name: str
    file: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class _Manifest:
    """Parsed, validated manifest of one checkpoint."""

    seq: int
    created: float
    metadata: dict[str, Any]
    states: tuple[_StateEntry, ...]

    def info(self, path: Path) -> CheckpointInfo:
        return CheckpointInfo(
            seq=self.seq,
            path=path,
            created=self.created,
            metadata=self.metadata,
            size=sum(entry.size for entry in self.states),
        )


class Checkpoint:
    """One verified checkpoint; load its states by name.

    Obtained from :meth:`CheckpointStore.latest` or
    :meth:`CheckpointStore.open`. Each :meth:`load` re-reads
    and re-verifies its file, so the object stays safe to use even if the
    directory is modified (or pruned) afterwards: it then raises
    :class:`CheckpointError` rather than returning wrong data.
    """

    def __init__(self, info: CheckpointInfo, entries: tuple[_StateEntry, ...]) -> None:
        self._info = info
        self._entries = {entry.name: entry for entry in entries}

    def __repr__(self) -> str:
        return f"Checkpoint(seq={self._info.seq}, path={str(self._info.path)!r})"

    @property
    def info(self) -> CheckpointInfo:
        """The manifest summary of this checkpoint."""
        return self._info

    def names(self) -> list[str]:
        """State names in the order they were saved."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def load(self, name: str) -> Any:
        """Read, verify and safely deserialise the state called ``name``.

        Tensors are loaded onto the CPU.

        Raises:
            KeyError: the checkpoint has no state called ``name``.
            CheckpointError: the file is missing, changed since it was
                written, or needs a Python object outside the safe set.
        """
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(
                f"checkpoint {self._info.seq} at {self._info.path} has no state named "
                f"{name!r}; it has: {', '.join(map(repr, self._entries)) or 'none'}"
            )
        path = self._info.path / entry.file
        try:
            data = _read_verified(path, entry)
        except _Invalid as exc:
            raise CheckpointError(
                f"cannot load state {name!r} of checkpoint {self._info.seq}: {exc}"
            ) from None
        return _deserialise(data, name, path)


class CheckpointStore:
    """Atomic, verified checkpoints under one root directory.

    Args:
        root: Directory holding the checkpoints; created on the first save.
            Files in it that do not look like checkpoints are left alone.
        keep: How many complete checkpoints to keep (at least 1). Older ones
            are deleted after each successful save.

    Raises:
        TypeError, ValueError: ``keep`` is not an int >= 1.
        CheckpointError: ``root`` exists and is not a directory.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise TypeError(f"keep must be an int >= 1, got {keep!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the number of checkpoints to retain), got {keep}")
        self._root = Path(root)
        self._keep = keep
        self._check_root()

    def __repr__(self) -> str:
        return f"CheckpointStore(root={str(self._root)!r}, keep={self._keep})"

    @property
    def root(self) -> Path:
        """The checkpoint root directory."""
        return self._root

    @property
    def keep(self) -> int:
        """How many complete checkpoints are retained."""
        return self._keep

    # ------------------------------------------------------------------ save

    def save(
        self,
        states: Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write ``states`` as a new checkpoint, atomically, then prune.

        Args:
            states: State name -> state dict. Names are any strings; values
                may contain tensors, numbers, strings, bools, None,
                torch.dtype/device/Size and lists, tuples, sets and dicts of
                those (a subset of what ``torch.load(weights_only=True)``
                reads back).
            metadata: Optional JSON-serialisable mapping with string keys,
                stored in the manifest and returned in :class:`CheckpointInfo`
                (tuples come back as lists).

        Returns:
            The summary of the new checkpoint.

        Raises:
            TypeError, ValueError: ``states`` or ``metadata`` hold values
                that cannot be stored; the message names the offending path.
            CheckpointError: writing failed. No partial checkpoint is left
                behind as the newest one.
        """
        items = _validate_states(states)
        meta = _validate_metadata(metadata)
        started = time.perf_counter()
        self._ensure_root()
        seq = self._next_seq()
        final = self._root / _dir_name(seq)
        manifest = self._write_and_publish(seq, items, meta, final)
        try:
            _fsync_dir(self._root)
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint {seq} was renamed into place but syncing {self._root} failed "
                f"({exc}); it may not survive a power loss"
            ) from exc
        info = manifest.info(final)
        elapsed = time.perf_counter() - started
        logger.info(
            "saved checkpoint %d to %s: %d state(s), %s in %.3f s (%s/s)",
            seq, final, len(items), _format_bytes(info.size), elapsed,
            _format_bytes(info.size / max(elapsed, 1e-9)),
        )
        try:
            self._prune(newest=seq)
        except Exception as exc:  # the new checkpoint is durable; do not fail the job
            logger.warning("could not prune old checkpoints under %s: %s", self._root, exc)
        return info

    def _write_and_publish(
        self, seq: int, items: list[tuple[str, Any]], metadata: dict[str, Any], final: Path
    ) -> _Manifest:
        """Build the checkpoint in a temp dir, then rename it to ``final``.

        On any failure the temp dir is removed (best effort) and the error
        re-raised as CheckpointError; nothing appears under a final name.
        """
        temp = self._root / _temp_name()
        try:
            _make_dir(temp)
            entries = tuple(
                _write_state(temp, index, name, value) for index, (name, value) in enumerate(items)
            )
            manifest = _Manifest(seq=seq, created=time.time(), metadata=metadata, states=entries)
            _write_manifest(temp, _encode_manifest(manifest))  # last: marks completeness
            _fsync_dir(temp)
            _publish(temp, final)
        except BaseException as exc:
            _discard_temp(temp)
            if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
                raise CheckpointError(
                    f"could not save checkpoint {seq} under {self._root}: {exc}"
                ) from exc
            raise
        return manifest

    # ------------------------------------------------------------------ read

    def list(self) -> list[CheckpointInfo]:
        """Checkpoints whose manifest is valid, oldest first.

        Files are not hashed here; use :meth:`latest` for a verified one.
        """
        infos = []
        for seq, path in sorted(self._scan()):
            try:
                infos.append(_read_manifest(path, seq).info(path))
            except _Invalid as exc:
                logger.debug("not listing %s: %s", path, exc)
        return infos

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None if there is none.

        Damaged, half-written or foreign checkpoints are skipped with a
        warning naming them and the reason.

        Raises:
            CheckpointError: checkpoints exist but none of them verifies.
        """
        candidates = sorted(self._scan(), reverse=True)
        problems: list[str] = []
        for seq, path in candidates:
            try:
                checkpoint = _verified(path, seq)
            except _Invalid as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
                problems.append(f"  {path}: {exc}")
                continue
            if problems:
                logger.warning("falling back to checkpoint %d at %s", seq, path)
            return checkpoint
        if not candidates:
            return None
        raise CheckpointError(
            f"none of the {len(candidates)} checkpoint(s) under {self._root} can be used:\n"
            + "\n".join(problems)
            + "\nRemove these directories to start from scratch, or point "
            "ADAPTIVE_CHECKPOINT_PATH at another directory."
        )

    def open(self, seq: int) -> Checkpoint:
        """The checkpoint with sequence number ``seq``, verified like :meth:`latest`.

        Lets every replica open exactly the checkpoint that rank 0 chose.

        Raises:
            TypeError, ValueError: ``seq`` is not an int >= 1.
            CheckpointError: it does not exist or does not verify.
        """
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int (a checkpoint sequence number), got {seq!r}")
        if seq < 1:
            raise ValueError(f"seq must be >= 1 (sequence numbers start at 1), got {seq}")
        paths = [path for found, path in self._scan() if found == seq]
        if not paths:
            raise CheckpointError(f"checkpoint {seq} does not exist under {self._root}")
        try:
            return _verified(paths[0], seq)
        except _Invalid as exc:
            raise CheckpointError(f"checkpoint {seq} at {paths[0]} cannot be used: {exc}") from None

    # ------------------------------------------------------------- internals

    def _check_root(self) -> None:
        """Raise if the root exists but is not a directory."""
        if self._root.exists() and not self._root.is_dir():
            raise CheckpointError(
                f"checkpoint root {self._root} exists and is not a directory; "
                "point ADAPTIVE_CHECKPOINT_PATH at a directory"
            )

    def _ensure_root(self) -> None:
        """Create the root (durably) if it does not exist yet."""
        self._check_root()
        if self._root.is_dir():
            return
        try:
            self._root.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self._root.parent)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint root {self._root}: {exc}") from exc

    def _scan(self) -> Iterator[tuple[int, Path]]:
        """Yield (seq, path) for every entry named like a checkpoint."""
        self._check_root()
        try:
            names = os.listdir(self._root)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CheckpointError(f"cannot list checkpoint root {self._root}: {exc}") from exc
        for name in names:
            match = _DIR_PATTERN.fullmatch(name)
            if match:
                yield int(match.group(1)), self._root / name

    def _next_seq(self) -> int:
        """One more than the largest sequence number in use (1 if none)."""
        return max((seq for seq, _ in self._scan()), default=0) + 1

    def _prune(self, newest: int) -> None:
        """Delete old checkpoints, damaged leftovers and abandoned temp dirs.

        Keeps the ``keep`` newest checkpoints with a valid manifest; removes
        older valid ones and invalid ones older than ``newest``. Never
        touches anything newer than ``newest`` (a concurrent writer's).
        """
        valid, invalid = [], []
        for seq, path in sorted(self._scan(), reverse=True):
            if seq > newest:
                continue
            try:
                _read_manifest(path, seq)
                valid.append(path)
            except _Invalid:
                if seq < newest:
                    invalid.append(path)
        for path in valid[self._keep:] + invalid:
            logger.info("removing old checkpoint %s", path)
            self._remove_atomically(path)
        for path in self._stale_temps():
            logger.info("removing abandoned temporary directory %s", path)
            _remove_tree(path)

    def _remove_atomically(self, path: Path) -> None:
        """Rename ``path`` out of the checkpoint namespace, then delete it.

        Readers thus never see a half-deleted checkpoint; if deletion is
        interrupted, the leftover is an abandoned temp dir pruned later.
        """
        if path.is_symlink() or not path.is_dir():
            logger.warning("leaving %s alone: named like a checkpoint but not a directory", path)
            return
        doomed = self._root / _temp_name()
        _rename(path, doomed)
        _remove_tree(doomed)

    def _stale_temps(self) -> list[Path]:
        """Temp dirs not owned by a live local writer, or untouched for long."""
        stale = []
        host = _host_tag()
        for name in os.listdir(self._root):
            match = _TEMP_PATTERN.fullmatch(name)
            if not match:
                continue
            path = self._root / name
            try:
                age = time.time() - path.lstat().st_mtime
            except FileNotFoundError:
                continue
            pid = int(match.group("pid"))
            live_writer = (
                match.group("host") == host and pid != os.getpid() and _pid_alive(pid)
            )
            if not live_writer or age > _STALE_TEMP_AGE_S:
                stale.append(path)
        return stale


# ---------------------------------------------------------------- validation


# bytes are deliberately absent: torch pickles b"" through a global that
# weights-only loading refuses. Store binary blobs as uint8 tensors instead.
# What ``torch.load(weights_only=True)`` reads back (its allow-list of globals plus the
# types pickle handles natively), and no more: tensors, plain scalars, and the
# containers torch's own state dicts use (``MultiStepLR`` keeps a Counter).
_SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray,
                 torch.dtype, torch.device, torch.Size, torch.layout)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_CONTAINER_TYPES = (list, tuple, set, dict, collections.OrderedDict, collections.Counter)


def _validate_states(states: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Check ``states`` maps str names to weights-only-loadable values."""
    if not isinstance(states, Mapping):
        raise TypeError(
            f"states must be a mapping of name -> state dict, got {type(states).__name__}"
        )
    items = list(states.items())
    for name, value in items:
        if not isinstance(name, str):
            raise TypeError(f"state names must be str, got {name!r} ({type(name).__name__})")
        _validate_value(value, f"states[{name!r}]")
    return items


def _validate_value(value: Any, where: str) -> None:
    """Walk ``value`` and raise TypeError at the first unsupported object.

    The allowed set is a subset of what ``torch.load(weights_only=True)``
    accepts, so a state that passes loads back safely. Python attributes
    set on tensors and OrderedDicts are pickled too, so they are walked
    as well (``Module.state_dict()`` sets ``_metadata`` on its result).
    """
    stack = [(value, where)]
    seen: set[int] = set()
    while stack:
        obj, path = stack.pop()
        kind = type(obj)
        if kind in _SCALAR_TYPES:
            continue
        if kind in _TENSOR_TYPES:
            stack.extend((item, f"{path}.{attr}") for attr, item in vars(obj).items())
            continue
        if kind not in _CONTAINER_TYPES:
            raise TypeError(
                f"{path} is a {kind.__module__}.{kind.__qualname__}, which cannot be loaded "
                "safely; checkpoint states may contain only tensors, None, bool, int, float, "
                "complex, str, bytes, torch.dtype/device/Size and list/tuple/set/dict/"
                "OrderedDict/Counter of those "
                "(convert numpy values with torch.from_numpy() or .item())"
            )
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, collections.OrderedDict):
            stack.extend((item, f"{path}.{attr}") for attr, item in vars(obj).items())
        if isinstance(obj, dict):
            for key, item in obj.items():
                stack.append((key, f"{path} key {key!r}"))
                stack.append((item, f"{path}[{key!r}]"))
        else:
            stack.extend((item, f"{path}[{index}]") for index, item in enumerate(obj))


def _validate_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a JSON round-tripped copy of ``metadata`` (or {})."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"metadata must be a mapping with str keys or None, got {type(metadata).__name__}"
        )
    bad = [key for key in metadata if not isinstance(key, str)]
    if bad:
        raise TypeError(f"metadata keys must be str, got {bad[0]!r}")
    try:
        return json.loads(json.dumps(dict(metadata), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable without NaN/inf: {exc}") from exc


# ------------------------------------------------------------------- writing


class _HashingWriter:
    """Write-only file object for ``torch.save``: hashes while it writes.

    ``torch.save`` hands over memoryviews of tensor storage, so the data is
    neither copied nor serialised twice: each chunk is hashed and passed to
    a buffered file (chunks larger than the buffer bypass it). Hashing on a
    helper thread, overlapped with the write, was tried and measured slower
    (busy 2-core host), so hashing stays inline.
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._sha = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data)
            self._sha.update(view)
            self._file.write(view)
        except BaseException as exc:
            self.error = self.error or exc
            raise
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        try:
            self._file.flush()
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _write_state(directory: Path, index: int, name: str, value: Any) -> _StateEntry:
    """Serialise one state into ``directory`` durably; return its record."""
    file_name = _state_file_name(index, name)
    with open(directory / file_name, "xb", buffering=_WRITE_BUFFER) as file:
        writer = _HashingWriter(file)
        try:
            torch.save(value, writer)
        except Exception as exc:
            # torch wraps errors from write() in a RuntimeError; surface ours.
            if writer.error is not None and writer.error is not exc:
                raise writer.error from exc
            raise
        writer.flush()
        _fsync_fd(file.fileno())
    return _StateEntry(name=name, file=file_name, size=writer.size, sha256=writer.hexdigest())


def _state_file_name(index: int, name: str) -> str:
    """A unique, portable file name for state ``name`` at position ``index``."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:_NAME_STEM_LEN].strip("._-") or "state"
    return f"{index:03d}-{stem}.pt"


def _write_manifest(directory: Path, payload: bytes) -> None:
    """Write and fsync the manifest; it is the last file of a checkpoint."""
    with open(directory / MANIFEST_NAME, "xb") as file:
        file.write(payload)
        file.flush()
        _fsync_fd(file.fileno())


def _encode_manifest(manifest: _Manifest) -> bytes:
    body = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "seq": manifest.seq,
        "created": manifest.created,
        "torch_version": torch.__version__,  # for diagnostics only
        "metadata": manifest.metadata,
        "states": [
            {"name": e.name, "file": e.file, "bytes": e.size, "sha256": e.sha256}
            for e in manifest.states
        ],
    }
    body["checksum"] = _manifest_checksum(body)
    return json.dumps(body, indent=1, allow_nan=False).encode("utf-8")


def _manifest_checksum(body: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of every manifest field but the checksum."""
    fields = {key: value for key, value in body.items() if key != "checksum"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _make_dir(path: Path) -> None:
    os.mkdir(path)


def _fsync_fd(fd: int) -> None:
    os.fsync(fd)


def _fsync_dir(path: Path) -> None:
    """Make entries created or renamed in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(source: Path, target: Path) -> None:
    os.rename(source, target)


def _publish(temp: Path, final: Path) -> None:
    """Atomically move a finished checkpoint to its final name."""
    try:
        _rename(temp, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) or final.exists():
            raise CheckpointError(
                f"{final} already exists: another process is writing checkpoints to "
                f"{final.parent}; only one writer (rank 0) per directory is supported"
            ) from exc
        raise


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path)


def _discard_temp(temp: Path) -> None:
    """Best-effort removal of a failed save's temp dir (pruned later if it stays)."""
    try:
        if temp.exists():
            _remove_tree(temp)
    except Exception as exc:
        logger.warning("could not remove temporary directory %s: %s", temp, exc)


def _temp_name() -> str:
    return f"{_TEMP_PREFIX}{_host_tag()}-{os.getpid()}-{os.urandom(6).hex()}"


def _dir_name(seq: int) -> str:
    return f"{_DIR_PREFIX}{seq:0{_SEQ_WIDTH}d}"


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64]


def _pid_alive(pid: int) -> bool:
    """Whether a local process ``pid`` exists (signal 0 probes without killing)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------- reading


def _read_manifest(directory: Path, seq: int) -> _Manifest:
    """Parse and validate the manifest of checkpoint directory ``directory``."""
    if directory.is_symlink() or not directory.is_dir():
        raise _Invalid("not a directory")
    manifest_path = directory / MANIFEST_NAME
    if not os.path.lexists(manifest_path):
        raise _Invalid(f"no {MANIFEST_NAME} (incomplete, or not a checkpoint)")
    raw = _read_small(manifest_path)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Invalid(f"{MANIFEST_NAME} is not valid JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise _Invalid(
            f"not an {FORMAT_NAME} manifest (format={found!r}); written by another tool?"
        )
    if body.get("version") != FORMAT_VERSION:
        raise _Invalid(
            f"unsupported format version {body.get('version')!r} "
            f"(this library reads version {FORMAT_VERSION})"
        )
    if body.get("checksum") != _safe_checksum(body):
        raise _Invalid(f"{MANIFEST_NAME} checksum mismatch (manifest damaged)")
    return _parse_manifest_body(body, seq)


def _safe_checksum(body: dict[str, Any]) -> str | None:
    try:
        return _manifest_checksum(body)
    except (TypeError, ValueError):
        return None


def _parse_manifest_body(body: dict[str, Any], seq: int) -> _Manifest:
    """Type-check the fields of a checksummed manifest."""
    if body.get("seq") != seq or isinstance(body.get("seq"), bool):
        raise _Invalid(
            f"manifest sequence number {body.get('seq')!r} does not match directory ({seq})"
        )
    created, metadata, states = body.get("created"), body.get("metadata"), body.get("states")
    if isinstance(created, bool) or not isinstance(created, (int, float)) \
            or not math.isfinite(created):
        raise _Invalid(f"bad creation time {created!r}")
    if not isinstance(metadata, dict) or not isinstance(states, list):
        raise _Invalid("manifest lacks a metadata object or a states list")
    entries = tuple(_parse_entry(item) for item in states)
    names = [entry.name for entry in entries]
    files = [entry.file for entry in entries]
    if len(set(names)) != len(names) or len(set(files)) != len(files):
        raise _Invalid("manifest lists a state name or file twice")
    return _Manifest(seq=seq, created=float(created), metadata=metadata, states=entries)


def _parse_entry(item: Any) -> _StateEntry:
    if not isinstance(item, dict):
        raise _Invalid(f"bad state record {item!r}")
    name, file = item.get("name"), item.get("file")
    size, digest = item.get("bytes"), item.get("sha256")
    if not isinstance(name, str):
        raise _Invalid(f"bad state name {name!r}")
    if not isinstance(file, str) or not _SAFE_FILE.fullmatch(file) or file == MANIFEST_NAME:
        raise _Invalid(f"state {name!r} has an unsafe file name {file!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise _Invalid(f"state {name!r} has a bad size {size!r}")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise _Invalid(f"state {name!r} has a bad sha256 {digest!r}")
    return _StateEntry(name=name, file=file, size=size, sha256=digest)


def _verified(directory: Path, seq: int) -> Checkpoint:
    """Check the manifest and hash every file of one checkpoint directory."""
    manifest = _read_manifest(directory, seq)
    for entry in manifest.states:
        _verify_file(directory / entry.file, entry)
    return Checkpoint(manifest.info(directory), manifest.states)


def _open_regular(path: Path) -> tuple[int, int]:
    """Open ``path`` read-only without following symlinks; return (fd, size)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise _Invalid(f"{path.name} is missing") from None
    except OSError as exc:
        raise _Invalid(f"cannot open {path.name}: {exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _Invalid(f"{path.name} is not a regular file")
    return fd, info.st_size


def _read_small(path: Path) -> bytes:
    """Read a manifest-sized file; refuse anything implausibly large."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        if size > _MAX_MANIFEST_BYTES:
            raise _Invalid(f"{path.name} is implausibly large ({size} bytes)")
        try:
            return file.read()
        except OSError as exc:
            raise _Invalid(f"cannot read {path.name}: {exc}") from None


def _verify_file(path: Path, entry: _StateEntry) -> None:
    """Stream ``path`` through SHA-256 (one pass, reused buffer) and compare."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        _check_size(path, size, entry)
        sha = hashlib.sha256()
        buffer = memoryview(bytearray(min(_READ_CHUNK, max(size, 1))))
        total = 0
        while True:
            count = file.readinto(buffer)
            if not count:
                break
            sha.update(buffer[:count])
            total += count
    _check_content(path, total, sha.hexdigest(), entry)


def _read_verified(path: Path, entry: _StateEntry) -> bytes:
    """Read ``path`` in one go and check it against ``entry``; return the bytes."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        _check_size(path, size, entry)
        data = file.read()
    _check_content(path, len(data), hashlib.sha256(data).hexdigest(), entry)
    return data


def _check_size(path: Path, size: int, entry: _StateEntry) -> None:
    if size != entry.size:
        raise _Invalid(
            f"{path.name} has {size} bytes, manifest says {entry.size} (truncated or replaced)"
        )


def _check_content(path: Path, size: int, digest: str, entry: _StateEntry) -> None:
    if size != entry.size:
        raise _Invalid(f"{path.name} changed size while being read")
    if digest != entry.sha256:
        raise _Invalid(
            f"{path.name} does not match its sha256 in the manifest (corrupted or replaced)"
        )


def _deserialise(data: bytes, name: str, path: Path) -> Any:
    """``torch.load`` with the weights-only unpickler; clear errors on refusal."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"refusing to load state {name!r} from {path}: {_refusal_detail(str(exc))}. "
            "Only tensors, numbers, strings and containers of them load safely; anything "
            "else could run code from the file. Was it written by this library?"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"cannot deserialise state {name!r} from {path}: {exc}") from None


def _refusal_detail(message: str) -> str:
    """The useful part of torch's weights-only refusal, without its advice
    to disable the safety check."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return f"it needs the Python object {found.group(1)}, which is not allowed"
    found = re.search(r"WeightsUnpickler error:\s*(.+)", message)
    reason = found.group(1).strip() if found else "unknown"
    return f"its pickle data is not accepted by the safe unpickler ({reason})"


def _format_bytes(count: float) -> str:
    """Human-readable byte count for log lines."""
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"
