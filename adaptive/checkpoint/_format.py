"""The on-disk format of checkpoints, and checking a directory against it.

A checkpoint is a directory ``checkpoint-<seq>`` (``seq`` zero-padded to
8 digits) holding one file per state and ``manifest.json``: the format
name and version, the sequence number, the creation time, the caller's
metadata and, for every state, its file name, size and SHA-256, sealed by
a checksum over all of it. Format version 2 adds the *sharded part*: the
names of the states whose shards every rank wrote through
``torch.distributed.checkpoint`` into the subdirectory ``sharded/``, and
every file there (DCP's ``.metadata`` and one ``__<rank>_<n>.distcp`` per
writing rank) with its size and SHA-256. Version 1 manifests (no sharded
part) are still read: :data:`MANIFEST_FORMAT` migrates them. This module
writes and parses that manifest (:func:`encode_manifest`,
:func:`read_manifest`) and checks state files against their records
(:func:`verify_file` streams a file through SHA-256; :func:`read_verified`
returns the exact bytes it checked, so what is deserialised is provably
what the manifest lists).

A checkpoint is assembled in a directory named ``.tmp-<host>-<pid>-<random>``
(:func:`temp_name`), which readers ignore and which records who writes it,
so that pruning can tell a live writer's from an abandoned one.

Anything that does not match raises :class:`InvalidCheckpoint` with the
reason; :mod:`adaptive.checkpoint.store` decides what the user sees.
Files are opened without following symlinks, and file names in a manifest
must be plain names, so a manifest cannot point outside its directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import re
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

import torch

from adaptive._utils.types import JSON
from adaptive.checkpoint.versions import Format

FORMAT_NAME = "adaptive-checkpoint"


def _without_sharded_part(body: JSON) -> JSON:
    """Version 1 -> 2: a version 1 manifest has no sharded part (any ``"sharded"`` key in it means nothing)."""
    return dict(body, sharded=None)


#: The manifest's format: 2 adds the sharded part; version 1 manifests are still read.
MANIFEST_FORMAT = Format("checkpoint manifest", version=2, migrations={1: _without_sharded_part})
FORMAT_VERSION = MANIFEST_FORMAT.version  # what encode_manifest writes
READABLE_VERSIONS = MANIFEST_FORMAT.readable  # (1, 2)
MANIFEST_NAME = "manifest.json"
SHARDED_DIR = "sharded"  # the DCP checkpoint of a checkpoint's sharded states
#: The only file names DCP's FileSystemWriter produces with one file per rank.
SHARD_FILE = re.compile(r"\.metadata|__\d{1,7}_\d{1,7}\.distcp")
DCP_METADATA = ".metadata"

DIR_PREFIX = "checkpoint-"
DIR_PATTERN = re.compile(r"checkpoint-(\d+)")
SAFE_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TEMP_PREFIX = ".tmp-"
TEMP_PATTERN = re.compile(r"\.tmp-(?P<host>[A-Za-z0-9_-]*)-(?P<pid>\d+)-[0-9a-f]+")

_SEQ_WIDTH = 8
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_READ_CHUNK = 8 << 20           # streaming hash buffer; large to amortise syscalls
_MAX_MANIFEST_BYTES = 16 << 20  # refuse to parse anything larger as a manifest


class InvalidCheckpoint(Exception):
    """A checkpoint directory or one of its files failed verification (the message says why)."""


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """Manifest record of one state file."""

    name: str
    file: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """Manifest record of one file of the sharded part (a name in ``sharded/``)."""

    file: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ShardedPart:
    """The sharded states of a checkpoint and the DCP files that hold them."""

    states: tuple[str, ...]
    files: tuple[FileEntry, ...]

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.files)

    def entry(self, file: str) -> FileEntry | None:
        """The record of ``file``, None if the manifest does not list it."""
        return next((entry for entry in self.files if entry.file == file), None)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Parsed, validated manifest of one checkpoint."""

    seq: int
    created: float
    metadata: JSON
    states: tuple[StateEntry, ...]
    sharded: ShardedPart | None = None

    @property
    def size(self) -> int:
        """Total size in bytes of the state files and of the sharded part."""
        return sum(entry.size for entry in self.states) + (self.sharded.size if self.sharded else 0)


def dir_name(seq: int) -> str:
    """The directory name of checkpoint ``seq``."""
    return f"{DIR_PREFIX}{seq:0{_SEQ_WIDTH}d}"


def temp_name() -> str:
    """A fresh name for the temporary directory of a save (or of a removal)."""
    return f"{TEMP_PREFIX}{host_tag()}-{os.getpid()}-{os.urandom(6).hex()}"


def host_tag() -> str:
    """This machine's name as it appears in temporary directory names."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64]


# ------------------------------------------------------------------ encoding


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest file's bytes, checksum included."""
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
        "sharded": None if manifest.sharded is None else {
            "states": list(manifest.sharded.states),
            "files": [{"file": e.file, "bytes": e.size, "sha256": e.sha256} for e in manifest.sharded.files],
        },
    }
    body["checksum"] = manifest_checksum(body)
    return json.dumps(body, indent=1, allow_nan=False).encode("utf-8")


def manifest_checksum(body: Mapping[str, object]) -> str:
    """SHA-256 of the canonical JSON of every manifest field but the checksum."""
    fields = {key: value for key, value in body.items() if key != "checksum"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------- parsing


def read_manifest(directory: Path, seq: int) -> Manifest:
    """Parse and validate the manifest of checkpoint directory ``directory``."""
    if directory.is_symlink() or not directory.is_dir():
        raise InvalidCheckpoint("not a directory")
    manifest_path = directory / MANIFEST_NAME
    if not os.path.lexists(manifest_path):
        raise InvalidCheckpoint(f"no {MANIFEST_NAME} (incomplete, or not a checkpoint)")
    raw = _read_small(manifest_path)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidCheckpoint(f"{MANIFEST_NAME} is not valid JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise InvalidCheckpoint(
            f"not an {FORMAT_NAME} manifest (format={found!r}); written by another tool?"
        )
    version = body.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE_VERSIONS:
        raise InvalidCheckpoint(
            f"unsupported format version {version!r} "
            f"(this library reads versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    if body.get("checksum") != _safe_checksum(body):
        raise InvalidCheckpoint(f"{MANIFEST_NAME} checksum mismatch (manifest damaged)")
    return _parse_manifest_body(MANIFEST_FORMAT.upgrade(body, version), seq)


def _safe_checksum(body: JSON) -> str | None:
    try:
        return manifest_checksum(body)
    except (TypeError, ValueError):
        return None


def _parse_manifest_body(body: JSON, seq: int) -> Manifest:
    """Type-check the fields of a checksummed manifest, brought to the current format."""
    if body.get("seq") != seq or isinstance(body.get("seq"), bool):
        raise InvalidCheckpoint(
            f"manifest sequence number {body.get('seq')!r} does not match directory ({seq})"
        )
    created, metadata, states = body.get("created"), body.get("metadata"), body.get("states")
    if isinstance(created, bool) or not isinstance(created, (int, float)) \
            or not math.isfinite(created):
        raise InvalidCheckpoint(f"bad creation time {created!r}")
    if not isinstance(metadata, dict) or not isinstance(states, list):
        raise InvalidCheckpoint("manifest lacks a metadata object or a states list")
    entries = tuple(_parse_entry(item) for item in states)
    names = [entry.name for entry in entries]
    files = [entry.file for entry in entries]
    if len(set(names)) != len(names) or len(set(files)) != len(files):
        raise InvalidCheckpoint("manifest lists a state name or file twice")
    sharded = _parse_sharded(body.get("sharded"))
    if sharded is not None and set(sharded.states) - set(names):
        raise InvalidCheckpoint("manifest lists a sharded state without its state file")
    return Manifest(seq=seq, created=float(created), metadata=metadata, states=entries, sharded=sharded)


def _parse_sharded(part: object) -> ShardedPart | None:
    """The sharded part of a manifest (None when the checkpoint has none)."""
    if part is None:
        return None
    if not isinstance(part, dict) or not isinstance(part.get("states"), list) \
            or not isinstance(part.get("files"), list):
        raise InvalidCheckpoint("bad sharded part in the manifest")
    names = part["states"]
    if not names or not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
        raise InvalidCheckpoint(f"bad sharded state names {names!r}")
    files = []
    for item in part["files"]:
        if not isinstance(item, dict) or not isinstance(item.get("file"), str) \
                or not SHARD_FILE.fullmatch(item["file"]):
            raise InvalidCheckpoint(f"bad or unsafe sharded file record {item!r}")
        _check_record(item["file"], item.get("bytes"), item.get("sha256"))
        files.append(FileEntry(file=item["file"], size=item["bytes"], sha256=item["sha256"]))
    listed = [entry.file for entry in files]
    if len(set(listed)) != len(listed) or DCP_METADATA not in listed:
        raise InvalidCheckpoint("the sharded part lists a file twice or has no .metadata")
    return ShardedPart(states=tuple(names), files=tuple(files))


def _check_record(what: str, size: object, digest: object) -> tuple[int, str]:
    """``(size, digest)``, checked."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidCheckpoint(f"{what!r} has a bad size {size!r}")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
        raise InvalidCheckpoint(f"{what!r} has a bad sha256 {digest!r}")
    return size, digest


def _parse_entry(item: object) -> StateEntry:
    if not isinstance(item, dict):
        raise InvalidCheckpoint(f"bad state record {item!r}")
    name, file = item.get("name"), item.get("file")
    size, digest = item.get("bytes"), item.get("sha256")
    if not isinstance(name, str):
        raise InvalidCheckpoint(f"bad state name {name!r}")
    if not isinstance(file, str) or not SAFE_FILE.fullmatch(file) or file == MANIFEST_NAME:
        raise InvalidCheckpoint(f"state {name!r} has an unsafe file name {file!r}")
    size, digest = _check_record(f"state {name}", size, digest)
    return StateEntry(name=name, file=file, size=size, sha256=digest)


# -------------------------------------------------------------- verification


def verify_file(path: Path, entry: StateEntry | FileEntry) -> None:
    """Stream ``path`` through SHA-256 (one pass, reused buffer) and compare with ``entry``."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        _check_size(path, size, entry)
        total, digest = _stream_hash(file, size)
    _check_content(path, total, digest, entry)


def hash_file(path: Path) -> tuple[int, str]:
    """(size, SHA-256) of the regular file ``path`` (a writer's record of what it wrote)."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        return _stream_hash(file, size)


def _stream_hash(file: io.RawIOBase, size: int) -> tuple[int, str]:
    sha = hashlib.sha256()
    buffer = memoryview(bytearray(min(_READ_CHUNK, max(size, 1))))
    total = 0
    while True:
        count = file.readinto(buffer)
        if not count:
            break
        sha.update(buffer[:count])
        total += count
    return total, sha.hexdigest()


def read_verified(path: Path, entry: StateEntry | FileEntry) -> bytes:
    """Read ``path`` in one go and check it against ``entry``; return the bytes."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        _check_size(path, size, entry)
        data = file.read()
    _check_content(path, len(data), hashlib.sha256(data).hexdigest(), entry)
    return data


def _open_regular(path: Path) -> tuple[int, int]:
    """Open ``path`` read-only without following symlinks; return (fd, size)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{path.name} is missing") from None
    except OSError as exc:
        raise InvalidCheckpoint(f"cannot open {path.name}: {exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise InvalidCheckpoint(f"{path.name} is not a regular file")
    return fd, info.st_size


def _read_small(path: Path) -> bytes:
    """Read a manifest-sized file; refuse anything implausibly large."""
    fd, size = _open_regular(path)
    with os.fdopen(fd, "rb", buffering=0) as file:
        if size > _MAX_MANIFEST_BYTES:
            raise InvalidCheckpoint(f"{path.name} is implausibly large ({size} bytes)")
        try:
            return file.read()
        except OSError as exc:
            raise InvalidCheckpoint(f"cannot read {path.name}: {exc}") from None


def _check_size(path: Path, size: int, entry: StateEntry | FileEntry) -> None:
    if size != entry.size:
        raise InvalidCheckpoint(
            f"{path.name} has {size} bytes, manifest says {entry.size} (truncated or replaced)"
        )


def _check_content(path: Path, size: int, digest: str, entry: StateEntry | FileEntry) -> None:
    if size != entry.size:
        raise InvalidCheckpoint(f"{path.name} changed size while being read")
    if digest != entry.sha256:
        raise InvalidCheckpoint(
            f"{path.name} does not match its sha256 in the manifest (corrupted or replaced)"
        )
