"""Reading one checkpoint: the summary of its manifest, verification, and the safe loads of its states.

:func:`verified` checks a checkpoint directory (manifest, then the size
and SHA-256 of every state file and of every file of the sharded part) and
returns a :class:`Checkpoint`, whose :meth:`~Checkpoint.load` and
:meth:`~Checkpoint.read_sharded` re-verify the exact bytes they
deserialise. Public through :mod:`adaptive.checkpoint.store`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from adaptive._utils.types import JSON, StateDict
from adaptive.checkpoint import _format, _safe_load


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, found, verified or safely loaded."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """Summary of one checkpoint, read from its manifest.

    Attributes:
        seq: Sequence number; larger means newer.
        path: The checkpoint directory.
        created: Creation time, seconds since the Unix epoch.
        metadata: The JSON metadata given to :meth:`CheckpointStore.save`.
        size: Total size in bytes of the state files and of the sharded part.
    """

    seq: int
    path: Path
    created: float
    metadata: JSON
    size: int


def info_of(manifest: _format.Manifest, path: Path) -> CheckpointInfo:
    """The public summary of the checkpoint at ``path`` with ``manifest``."""
    return CheckpointInfo(seq=manifest.seq, path=path, created=manifest.created,
                          metadata=manifest.metadata, size=manifest.size)


class Checkpoint:
    """One verified checkpoint; load its states by name.

    Obtained from :meth:`CheckpointStore.latest` or
    :meth:`CheckpointStore.open`. Each :meth:`load` re-reads
    and re-verifies its file, so the object stays safe to use even if the
    directory is modified (or pruned) afterwards: it then raises
    :class:`CheckpointError` rather than returning wrong data.
    """

    def __init__(self, info: CheckpointInfo, entries: tuple[_format.StateEntry, ...],
                 sharded: _format.ShardedPart | None = None) -> None:
        self._info = info
        self._entries = {entry.name: entry for entry in entries}
        self._sharded = sharded

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
            data = _format.read_verified(path, entry)
        except _format.InvalidCheckpoint as exc:
            raise CheckpointError(
                f"cannot load state {name!r} of checkpoint {self._info.seq}: {exc}"
            ) from None
        try:
            return _safe_load.deserialise(data, name, path)
        except _safe_load.NotLoadable as exc:
            raise CheckpointError(str(exc)) from None

    def sharded_names(self) -> list[str]:
        """Names of the states whose sharded part this checkpoint holds."""
        return [] if self._sharded is None else list(self._sharded.states)

    def read_sharded(self, name: str, target: StateDict) -> StateDict:
        """Fill ``target`` with the saved shards of sharded state ``name``; return it.

        ``target`` is a nested dict shaped like what ``sharded_state_dict()``
        returned, with freshly allocated tensors or DTensors in the *current*
        sharding (another world size or mesh is fine: the saved shards are
        resharded). Non-tensor leaves are replaced by the saved values.
        Reads only files the manifest lists, verifying each one's SHA-256
        on the bytes it uses, and deserialises weights-only; it is local
        to this process (no collective).

        Raises:
            KeyError: the checkpoint holds no sharded part for ``name``.
            CheckpointError: a file is missing, damaged or hostile, or a key
                or shape of ``target`` does not match what was saved.
        """
        if self._sharded is None or name not in self.sharded_names():
            raise KeyError(
                f"checkpoint {self._info.seq} at {self._info.path} has no sharded state named {name!r}; "
                f"it has: {', '.join(map(repr, self.sharded_names())) or 'none'}"
            )
        from adaptive.checkpoint import _dcp_io

        try:
            return _dcp_io.read_shards(self._info.path / _format.SHARDED_DIR, self._sharded, name, target)
        except (_dcp_io.ShardError, _safe_load.NotLoadable) as exc:
            raise CheckpointError(f"cannot load sharded state {name!r} of checkpoint {self._info.seq}: {exc}") \
                from None


def verified(directory: Path, seq: int) -> Checkpoint:
    """Check the manifest and hash every file of one checkpoint directory."""
    manifest = _format.read_manifest(directory, seq)
    for entry in manifest.states:
        _format.verify_file(directory / entry.file, entry)
    if manifest.sharded is not None:
        sharded = directory / _format.SHARDED_DIR
        if sharded.is_symlink() or not sharded.is_dir():
            raise _format.InvalidCheckpoint(f"{_format.SHARDED_DIR}/ is missing or not a directory")
        for file in manifest.sharded.files:
            _format.verify_file(sharded / file.file, file)
    return Checkpoint(info_of(manifest, directory), manifest.states, manifest.sharded)


class MemoryCheckpoint(Checkpoint):
    """States already in memory (sent by a live job's members, or carried in a front-end's own checkpoint file),
    read like a checkpoint on disk, so that every state restores from them by the one path it restores by.

    Args:
        info: its summary (``path`` says where the states came from).
        contents: state name -> state, as :meth:`Checkpoint.load` would return it (checked by the caller).
        source: what the states are, for the error of a missing name.
    """

    def __init__(self, info: CheckpointInfo, contents: dict[str, Any], source: str) -> None:
        super().__init__(info, ())
        self._contents = contents
        self._source = source

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seq={self.info.seq}, path={str(self.info.path)!r}, states={len(self._contents)})"

    def names(self) -> list[str]:
        return list(self._contents)

    def __contains__(self, name: object) -> bool:
        return name in self._contents

    def load(self, name: str) -> Any:
        if name not in self._contents:
            raise KeyError(f"{self._source} has no state named {name!r}; it has: "
                           f"{', '.join(map(repr, self._contents)) or 'none'}")
        return self._contents[name]
