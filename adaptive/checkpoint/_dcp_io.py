"""Sharded states through ``torch.distributed.checkpoint`` (DCP): writing shards, reading them safely.

The sharded part of a checkpoint is one DCP checkpoint (directory
``sharded/``) holding every :class:`~adaptive.checkpoint.states.ShardedState`
under its state name. Each rank writes only its own shards
(:func:`write_shards`, collective: DCP agrees on a global plan and rank 0
writes ``.metadata``) and returns the size and SHA-256 of the files it
wrote, for the manifest.

The nested dicts are flattened here, not by DCP: a leaf's key is the JSON
list of its path (``["adaptive.model", "model", "layers.0.weight"]``), so
keys never collide whatever the state names and dict keys contain, and
loading needs none of DCP's private flattening helpers. Dicts are walked,
lists and tuples only when they hold a tensor; everything else is a leaf:
a tensor or DTensor, or a plain value that ``torch.load(weights_only=True)``
reads back (DCP pickles it as a "bytes" item).

Reading (:func:`read_shards`) runs no code from the files (guarantee G4).
Stock DCP would: ``FileSystemReader.read_metadata`` unpickles ``.metadata``
with plain :mod:`pickle`, and ``DefaultLoadPlanner.load_bytes`` reads bytes
items with ``torch.load(weights_only=False)``. Instead:

* ``.metadata`` is read once, checked against its manifest record, and
  unpickled by :class:`_MetadataUnpickler`, which resolves only DCP's
  metadata classes, ``torch.Size``, dtypes and layouts (builtin containers
  need no globals); every storage record must then name a file the manifest
  lists, with no stream transforms;
* each shard file is read whole, checked against its record (so what is
  deserialised is provably what was written), and every item in it, tensor
  or bytes, is loaded with ``torch.load(weights_only=True)``.

Loading is local (``dcp.load(no_dist=True)``): each rank reads, from the
files the manifest lists, the pieces of the saved tensors that its target
(allocated with the *current* sharding) covers, so a checkpoint written by
N ranks loads on M ranks or on another mesh, with no communication.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from pathlib import Path
import os
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, WriteResult

from adaptive._utils import torch_internals
from adaptive._utils.types import StateDict
from adaptive.checkpoint import _disk, _format, _safe_load

if TYPE_CHECKING:
    from adaptive._utils.torch_internals import DcpStorageInfo


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta")
}
_METADATA_CLASSES.update(torch_internals.dcp_metadata_private_globals())  # DCP's private names
_METADATA_CLASSES[("torch", "Size")] = torch.Size
_STORAGE_INFO = torch_internals.dcp_storage_info_class()  # DCP's record of where an item lies in a file


class ShardError(Exception):
    """The sharded part could not be written or read safely (the message says why)."""


#: What DCP raises: its CheckpointException (a BaseException: it collects every rank's failure) or an Exception.
DCP_ERRORS = (Exception, CheckpointException)


# ----------------------------------------------------------------- flattening


def flatten(states: StateDict) -> StateDict:
    """``{state name: nested dict}`` as ``{json path: leaf}``; raises TypeError on a bad leaf."""
    flat: StateDict = {}
    for path, leaf in _leaves(states, ()):
        if not isinstance(leaf, torch.Tensor):
            _safe_load.validate_value(leaf, _where(path))
        elif leaf.is_meta or leaf.layout != torch.strided:
            raise TypeError(f"{_where(path)} is a {leaf.layout} tensor on {leaf.device}; sharded states "
                            "hold dense tensors with data")
        flat[json.dumps(path)] = leaf
    return flat


def _leaves(node: object, path: tuple) -> Iterator[tuple[tuple, object]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                raise TypeError(f"{_where(path)} has a key {key!r}; sharded state dict keys must be str or int")
            yield from _leaves(value, (*path, key))
    elif isinstance(node, (list, tuple)) and _holds_tensor(node):
        for index, value in enumerate(node):
            yield from _leaves(value, (*path, index))
    else:
        yield path, node


def _holds_tensor(node: object) -> bool:
    if isinstance(node, torch.Tensor):
        return True
    if isinstance(node, dict):
        return any(_holds_tensor(value) for value in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensor(value) for value in node)
    return False


def _where(path: tuple) -> str:
    return "sharded state " + "".join(f"[{key!r}]" for key in path) if path else "a sharded state"


def _fill(node: object, path: tuple, loaded: StateDict) -> object:
    """``node`` with its non-tensor leaves replaced by the loaded values (tensors were filled in place)."""
    if isinstance(node, dict):
        for key in list(node):
            node[key] = _fill(node[key], (*path, key), loaded)
        return node
    if isinstance(node, (list, tuple)) and _holds_tensor(node):
        items = [_fill(value, (*path, index), loaded) for index, value in enumerate(node)]
        if isinstance(node, list):
            node[:] = items
            return node
        kind: Callable[..., object] = type(node)  # a named tuple takes its fields one by one
        return kind(items) if type(node) is tuple else kind(*items)
    if isinstance(node, torch.Tensor):
        return node
    return loaded[json.dumps(path)]


# ---------------------------------------------------------------------- write


class _ShardWriter(FileSystemWriter):
    """DCP's file writer, one file per rank, fsync'ed; records which files this rank wrote.

    The storage metadata it adds to ``.metadata`` leaves out the directory
    path (a ``pathlib`` object, which the safe reader would refuse, and a
    temporary name that the rename makes wrong anyway).
    """

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.written: set[str] = set()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        self.written.update(result.storage_data.relative_path for result in future.wait())
        return future

    def storage_meta(self) -> dcp_metadata.StorageMeta | None:
        return dcp_metadata.StorageMeta(checkpoint_id=None, save_id=self.save_id)


def write_shards(directory: Path, flat: StateDict, group: dist.ProcessGroup | None,
                 coordinator: bool) -> list[_format.FileEntry]:
    """Write this rank's shards of ``flat`` into ``directory`` (collective over ``group``).

    ``group`` is None without torch.distributed (one process). Returns the
    records (size, SHA-256) of the files this rank wrote, ``.metadata``
    included on the coordinator (rank 0 of ``group``), after syncing the
    directory so that their entries are durable too.
    """
    writer = _ShardWriter(directory)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(flat, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False),
                 process_group=group, no_dist=group is None)
    files = sorted(writer.written) + ([_format.DCP_METADATA] if coordinator else [])
    records = []
    for name in files:
        if not _format.SHARD_FILE.fullmatch(name):
            raise ShardError(f"DCP wrote a file named {name!r}, which this library does not expect")
        size, digest = _format.hash_file(directory / name)
        records.append(_format.FileEntry(file=name, size=size, sha256=digest))
    _disk.fsync_dir(directory)
    return records


# ----------------------------------------------------------------------- read


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: no other global resolves."""

    def find_class(self, module: str, name: str) -> object:
        found = _METADATA_CLASSES.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"it needs the Python object {module}.{name}, which is not allowed")
        return found


def read_metadata(directory: Path, part: _format.ShardedPart) -> dcp_metadata.Metadata:
    """Verify and safely unpickle ``.metadata``; check that it refers only to listed files."""
    path = directory / _format.DCP_METADATA
    data = _verified_bytes(path, part, _format.DCP_METADATA)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise ShardError(f"refusing to load {path}: {exc}. DCP metadata may hold only DCP's metadata "
                         "records, sizes, dtypes and containers; anything else could run code") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise ShardError(f"{path} is not DCP checkpoint metadata")
    for index, info in metadata.storage_data.items():
        entry = part.entry(info.relative_path) if isinstance(info, _STORAGE_INFO) else None
        if entry is None or info.transform_descriptors or not _in_file(info, entry.size):
            raise ShardError(f"{path} has a storage record {index} -> {info} that is not a plain range "
                             "of a file the manifest lists")
    return metadata


def _in_file(info: DcpStorageInfo, size: int) -> bool:
    offset, length = info.offset, info.length
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)) \
        and offset + length <= size


def _verified_bytes(path: Path, part: _format.ShardedPart, name: str) -> bytes:
    entry = part.entry(name)
    if entry is None:
        raise ShardError(f"{path.parent} has no manifest record for {name}")
    try:
        return _format.read_verified(path, entry)
    except _format.InvalidCheckpoint as exc:
        raise ShardError(str(exc)) from None


class _SafeReader(StorageReader):
    """Serves DCP the verified metadata and, per file, the verified bytes; nothing is unpickled freely."""

    def __init__(self, directory: Path, part: _format.ShardedPart, metadata: dcp_metadata.Metadata) -> None:
        super().__init__()
        self._directory, self._part, self._metadata = directory, part, metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self) -> dcp_metadata.Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: object,
                              **kwargs: object) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._metadata.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(per_file.items()):
            path = self._directory / name
            data = memoryview(_verified_bytes(path, self._part, name))
            for item in items:
                info = self._metadata.storage_data[item.storage_index]
                stream = io.BytesIO(data[info.offset:info.offset + info.length])
                if item.type == LoadItemType.BYTE_IO:
                    if isinstance(planner, _SafePlanner):
                        planner.where = f"{path} item {item.storage_index.fqn}"
                    planner.load_bytes(item, stream)
                    continue
                saved = _safe_load.load_item(stream, f"{path} item {item.storage_index.fqn}")
                if not isinstance(saved, torch.Tensor):
                    raise ShardError(f"{path} item {item.storage_index.fqn} is not a tensor")
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    saved = saved.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                if target.shape != saved.shape:
                    raise ShardError(f"{path} item {item.storage_index.fqn} has shape {tuple(saved.shape)}, "
                                     f"the target needs {tuple(target.shape)}")
                target.copy_(saved)
                planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @property
    def checkpoint_id(self) -> str | os.PathLike[str] | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner on a flat dict, reading bytes items weights-only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.where = "a bytes item"  # set by _SafeReader: the file and item being read
        self.loaded: StateDict = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = _safe_load.load_item(value, self.where)


def read_shards(directory: Path, part: _format.ShardedPart, name: str, target: StateDict) -> StateDict:
    """Fill ``target`` (the current sharding) with state ``name``'s saved shards; return it.

    Local to this process. Raises ShardError on a damaged or hostile file,
    a missing key, or a shape that does not match.
    """
    metadata = read_metadata(directory, part)
    flat = flatten({name: target})
    planner = _SafePlanner()
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": loading is local on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=_SafeReader(directory, part, metadata), planner=planner, no_dist=True)
    except DCP_ERRORS as exc:
        inner = underlying(exc)
        if isinstance(inner, (ShardError, _safe_load.NotLoadable)):
            raise ShardError(str(inner)) from None
        raise ShardError(f"cannot load it from {directory}: {type(inner).__name__}: {inner}") from None
    states: StateDict = {name: target}
    _fill(states, (), planner.loaded)  # fills the dict in place
    return states[name]


def underlying(exc: BaseException) -> BaseException:
    """The first rank's original error inside DCP's CheckpointException (or ``exc`` itself)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return inner
    return exc
