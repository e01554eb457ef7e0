"""Writing the files of one checkpoint: each state, hashed as it is written, then the manifest.

``torch.save`` streams a state through :class:`HashingWriter`, which hashes
every chunk on its way to the file, so the SHA-256 recorded in the manifest
costs no second pass and no copy. Every file is fsync'ed before the
manifest, the last file, is written (see :mod:`adaptive.checkpoint.store`
for the order of a whole save).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

import torch

from adaptive.checkpoint import _disk
from adaptive.checkpoint._format import MANIFEST_NAME, StateEntry

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

WRITE_BUFFER = 1 << 20  # batches torch's many small header writes
_NAME_STEM_LEN = 48


class HashingWriter:
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

    def write(self, data: ReadableBuffer) -> int:
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


def write_state(directory: Path, index: int, name: str, value: object) -> StateEntry:
    """Serialise one state into ``directory`` durably; return its manifest record."""
    file_name = state_file_name(index, name)
    with open(directory / file_name, "xb", buffering=WRITE_BUFFER) as file:
        writer = HashingWriter(file)
        try:
            torch.save(value, cast(BinaryIO, writer))  # a duck-typed file: torch.save only writes to it
        except Exception as exc:
            # torch wraps errors from write() in a RuntimeError; surface ours.
            if writer.error is not None and writer.error is not exc:
                raise writer.error from exc
            raise
        writer.flush()
        _disk.fsync_fd(file.fileno())
    return StateEntry(name=name, file=file_name, size=writer.size, sha256=writer.hexdigest())


def state_file_name(index: int, name: str) -> str:
    """A unique, portable file name for state ``name`` at position ``index``."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:_NAME_STEM_LEN].strip("._-") or "state"
    return f"{index:03d}-{stem}.pt"


def write_manifest(directory: Path, payload: bytes) -> None:
    """Write and fsync the manifest; it is the last file of a checkpoint."""
    with open(directory / MANIFEST_NAME, "xb") as file:
        file.write(payload)
        file.flush()
        _disk.fsync_fd(file.fileno())
