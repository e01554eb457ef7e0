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

Only one process (rank 0) may write to a root; any number may read. A
store given a :class:`~adaptive.checkpoint.generation.Generation` publishes
only while that generation is the newest of the root (guarantee G6, see
:mod:`.generation`): :meth:`~CheckpointStore.reserve` refuses a stale writer
before it creates anything, and the rename that publishes happens under the
generation lock after a last check.

**Sharded states.** A checkpoint may also hold a *sharded part*: one
``torch.distributed.checkpoint`` directory ``sharded/`` that every rank
writes its own shards into (see :mod:`._dcp_io`). For that, the save is
split: rank 0 reserves (:meth:`~CheckpointStore.reserve`) the sequence number and
the temporary directory, every rank writes and hashes its shards there,
and rank 0 publishes (:meth:`~CheckpointStore.publish`): small states, a manifest
listing the shard files too, fsync, rename. ``latest()`` hashes the shard
files like the state files, and :meth:`Checkpoint.read_sharded` reads a
sharded state safely and locally, resharding it to the caller's targets.

Cost: ``save`` serialises each state once, hashing the chunks torch hands
over as they are written (no second pass, no copy). ``latest()`` streams
every file of the chosen checkpoint through SHA-256 with a reused 8 MiB
buffer; ``load()`` reads its file into memory once and hashes those bytes
again instead of trusting a cached (size, mtime, inode) match, because
only then are the bytes given to ``torch.load`` provably the ones in the
manifest. That second hash costs about as much as reading the file, once
per restart; see benchmarks/bench_checkpoint.py.

This module is the public API and the order of a save; the parts live in
``_format`` (names, manifest, verification), ``_writing`` (state files),
``_safe_load`` (allowed contents, the weights-only load), ``_dcp_io`` (the
sharded part), ``_pruning`` and ``_disk`` (every fsync, rename and removal:
where tests inject failures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from adaptive._utils.checks import check_int
from adaptive._utils.text import format_bytes
from adaptive._utils.types import JSON
from adaptive.checkpoint import _disk, _format, _pruning, _safe_load, _writing
from adaptive.checkpoint._reading import Checkpoint, CheckpointError, CheckpointInfo, info_of, verified
from adaptive.checkpoint.generation import Generation

__all__ = ["Checkpoint", "CheckpointError", "CheckpointInfo", "CheckpointStore", "Reservation"]

# torch.distributed.checkpoint is imported by the first sharded read (``_dcp_io``): plain
# checkpoints do not pay for it.

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Reservation:
    """A save in progress: its sequence number and the temporary directory it is assembled in.

    Attributes:
        seq: The sequence number the checkpoint will have.
        temp: The temporary directory (ignored by readers until published).
    """

    seq: int
    temp: Path

    @property
    def sharded_dir(self) -> Path:
        """Where the ranks write the sharded part (created by :meth:`CheckpointStore.reserve`)."""
        return self.temp / _format.SHARDED_DIR


class CheckpointStore:
    """Atomic, verified checkpoints under one root directory.

    Args:
        root: Directory holding the checkpoints; created on the first save.
            Files in it that do not look like checkpoints are left alone.
        keep: How many complete checkpoints to keep (at least 1). Older ones
            are deleted after each successful save.
        generation: The writer's generation in ``root``; when given, nothing
            is published once a newer generation was taken
            (:class:`~adaptive.checkpoint.generation.StaleGenerationError`).

    Raises:
        TypeError, ValueError: ``keep`` is not an int >= 1.
        CheckpointError: ``root`` exists and is not a directory.
    """

    def __init__(self, root: str | os.PathLike[str], keep: int = 2, generation: Generation | None = None) -> None:
        self._keep = check_int("keep", keep, minimum=1, hint=" (the number of checkpoints to retain)")
        self._root = Path(root)
        if generation is not None and (not isinstance(generation, Generation)
                                       or os.path.abspath(generation.root) != os.path.abspath(self._root)):
            raise ValueError(f"generation must be a Generation taken in {self._root}, got {generation!r}")
        self._generation = generation
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

    @property
    def generation(self) -> Generation | None:
        """The writer's generation, if this store is fenced by one."""
        return self._generation

    # ------------------------------------------------------------------ save

    def save(
        self,
        states: Mapping[str, object],
        metadata: Mapping[str, object] | None = None,
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
        items = _safe_load.validate_states(states)
        meta = _safe_load.validate_metadata(metadata)
        return self._publish(self.reserve(), items, meta, None)

    def reserve(self, sharded: bool = False) -> Reservation:
        """Start a save: pick its sequence number and create its temporary directory.

        With ``sharded``, the directory for the sharded part is created too
        (its path is :attr:`Reservation.sharded_dir`), for every rank to
        write its shards into. Finish with :meth:`publish` or :meth:`abandon`.

        Raises:
            StaleGenerationError: a newer generation was taken (nothing is created).
            CheckpointError: the root or the directories cannot be created.
        """
        if self._generation is not None:
            self._generation.check()
        self._ensure_root()
        seq = self._next_seq()
        temp = self._root / _format.temp_name()
        try:
            _disk.make_dir(temp)
            if sharded:
                _disk.make_dir(temp / _format.SHARDED_DIR)
        except OSError as exc:
            _discard_temp(temp)
            raise CheckpointError(f"could not start checkpoint {seq} under {self._root}: {exc}") from exc
        return Reservation(seq=seq, temp=temp)

    def publish(
        self,
        reservation: Reservation,
        states: Mapping[str, object],
        metadata: Mapping[str, object] | None = None,
        sharded: _format.ShardedPart | None = None,
    ) -> CheckpointInfo:
        """Write ``states`` and the manifest into a reserved save, rename it into place, prune.

        ``sharded`` lists the sharded states and the files every rank wrote
        into :attr:`Reservation.sharded_dir` (each with its size and SHA-256;
        they are fsync'ed by their writers). Arguments as for :meth:`save`.
        On failure the temporary directory is removed and nothing is published.

        Raises:
            TypeError, ValueError: as for :meth:`save` (the reservation is abandoned).
            CheckpointError: writing failed.
        """
        try:
            items = _safe_load.validate_states(states)
            meta = _safe_load.validate_metadata(metadata)
        except Exception:
            self.abandon(reservation)
            raise
        return self._publish(reservation, items, meta, sharded)

    def abandon(self, reservation: Reservation) -> None:
        """Give up a reserved save: remove its temporary directory (best effort; pruned later otherwise)."""
        _discard_temp(reservation.temp)

    def _publish(
        self, reservation: Reservation, items: list[tuple[str, object]], meta: JSON,
        sharded: _format.ShardedPart | None,
    ) -> CheckpointInfo:
        started = time.perf_counter()
        seq = reservation.seq
        final = self._root / _format.dir_name(seq)
        manifest = self._write_and_publish(reservation, items, meta, final, sharded)
        info = info_of(manifest, final)
        elapsed = time.perf_counter() - started
        # DEBUG: the job-level INFO line is adaptive.checkpoint.states' "checkpoint N saved (...)"
        logger.debug(
            "saved checkpoint %d to %s: %d state(s), %s in %.3f s (%s/s)",
            seq, final, len(items), format_bytes(info.size), elapsed,
            format_bytes(info.size / max(elapsed, 1e-9)),
        )
        try:
            self._prune(newest=seq)
        except Exception as exc:  # the new checkpoint is durable; do not fail the job
            logger.warning("could not prune old checkpoints under %s: %s", self._root, exc)
        return info

    def _write_and_publish(
        self, reservation: Reservation, items: list[tuple[str, object]], metadata: JSON, final: Path,
        sharded: _format.ShardedPart | None,
    ) -> _format.Manifest:
        """Build the checkpoint in its temp dir, then rename it to ``final``.

        On any failure the temp dir is removed (best effort) and the error
        re-raised as CheckpointError; nothing appears under a final name.
        """
        seq, temp = reservation.seq, reservation.temp
        try:
            if sharded is not None:
                _check_sharded(reservation, sharded, {name for name, _ in items})
            entries = tuple(
                _writing.write_state(temp, index, name, value)
                for index, (name, value) in enumerate(items)
            )
            manifest = _format.Manifest(seq=seq, created=time.time(), metadata=metadata,
                                        states=entries, sharded=sharded)
            if sharded is not None:
                _disk.fsync_dir(reservation.sharded_dir)
            _writing.write_manifest(temp, _format.encode_manifest(manifest))  # last: completeness
            _disk.fsync_dir(temp)
            with self._publishing():
                _publish(temp, final)
                _sync_published(self._root, seq)
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
                infos.append(info_of(_format.read_manifest(path, seq), path))
            except _format.InvalidCheckpoint as exc:
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
                checkpoint = verified(path, seq)
            except _format.InvalidCheckpoint as exc:
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
        seq = check_int("seq", seq, minimum=1, hint=" (checkpoint sequence numbers start at 1)")
        paths = [path for found, path in self._scan() if found == seq]
        if not paths:
            raise CheckpointError(f"checkpoint {seq} does not exist under {self._root}")
        try:
            return verified(paths[0], seq)
        except _format.InvalidCheckpoint as exc:
            raise CheckpointError(f"checkpoint {seq} at {paths[0]} cannot be used: {exc}") from None

    # ------------------------------------------------------------- internals

    def _publishing(self) -> contextlib.AbstractContextManager[None]:
        """The guard around the rename that publishes: the generation lock and check, if fenced."""
        return contextlib.nullcontext() if self._generation is None else self._generation.publishing()

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
            _disk.fsync_dir(self._root.parent)
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
            match = _format.DIR_PATTERN.fullmatch(name)
            if match:
                yield int(match.group(1)), self._root / name

    def _next_seq(self) -> int:
        """One more than the largest sequence number in use (1 if none)."""
        return max((seq for seq, _ in self._scan()), default=0) + 1

    def _prune(self, newest: int) -> None:
        """Delete old checkpoints, damaged leftovers and abandoned temp dirs (see :mod:`._pruning`)."""
        _pruning.prune(self._root, self._keep, newest, list(self._scan()))



def _check_sharded(reservation: Reservation, sharded: _format.ShardedPart, names: set[str]) -> None:
    """The sharded part lists exactly the files in the sharded directory, for states that are saved."""
    missing = set(sharded.states) - names
    if missing:
        raise CheckpointError(f"sharded states {sorted(missing)} have no small state_dict() part")
    on_disk = set(os.listdir(reservation.sharded_dir))
    listed = {entry.file for entry in sharded.files}
    if on_disk != listed or _format.DCP_METADATA not in listed:
        raise CheckpointError(
            f"the sharded part of checkpoint {reservation.seq} is incomplete or has extra files: "
            f"listed {sorted(listed)}, found {sorted(on_disk)}"
        )


def _publish(temp: Path, final: Path) -> None:
    """Atomically move a finished checkpoint to its final name."""
    try:
        _disk.rename(temp, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) or final.exists():
            raise CheckpointError(
                f"{final} already exists: another process is writing checkpoints to "
                f"{final.parent}; only one writer (rank 0) per directory is supported"
            ) from exc
        raise


def _sync_published(root: Path, seq: int) -> None:
    """Make the rename that published checkpoint ``seq`` durable."""
    try:
        _disk.fsync_dir(root)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint {seq} was renamed into place but syncing {root} failed "
            f"({exc}); it may not survive a power loss"
        ) from exc


def _discard_temp(temp: Path) -> None:
    """Best-effort removal of a failed save's temp dir (pruned later if it stays)."""
    try:
        if temp.exists():
            _disk.remove_tree(temp)
    except Exception as exc:
        logger.warning("could not remove temporary directory %s: %s", temp, exc)
