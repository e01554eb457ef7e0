"""Deleting what a checkpoint root no longer needs: old checkpoints and abandoned temp dirs.

Run by :meth:`adaptive.checkpoint.store.CheckpointStore.save` after each
successful save. A checkpoint is first renamed out of the ``checkpoint-*``
namespace and only then deleted, so a reader never sees one half removed;
a removal cut short leaves a temporary directory, removed by a later prune.
Nothing newer than the checkpoint just written is touched (it would belong
to another writer), nor a temporary directory a live local process is
still filling.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from adaptive.checkpoint import _disk, _format

logger = logging.getLogger(__name__)

STALE_TEMP_AGE_S = 3600.0  # a temp dir untouched this long is abandoned


def prune(root: Path, keep: int, newest: int, checkpoints: list[tuple[int, Path]]) -> None:
    """Delete old checkpoints, damaged leftovers and abandoned temp dirs under ``root``.

    Args:
        root: the checkpoint root.
        keep: how many checkpoints with a valid manifest to keep.
        newest: the sequence number just written; anything newer is left alone.
        checkpoints: (seq, path) of every entry named like a checkpoint.

    Keeps the ``keep`` newest checkpoints with a valid manifest; removes
    older valid ones and invalid ones older than ``newest``.
    """
    valid, invalid = [], []
    for seq, path in sorted(checkpoints, reverse=True):
        if seq > newest:
            continue
        try:
            _format.read_manifest(path, seq)
            valid.append(path)
        except _format.InvalidCheckpoint:
            if seq < newest:
                invalid.append(path)
    for path in valid[keep:] + invalid:
        logger.debug("removing old checkpoint %s", path)  # routine: the save's INFO line is enough
        _remove_atomically(root, path)
    for path in _stale_temps(root):
        logger.info("removing abandoned temporary directory %s", path)
        _disk.remove_tree(path)


def _remove_atomically(root: Path, path: Path) -> None:
    """Rename ``path`` out of the checkpoint namespace, then delete it.

    Readers thus never see a half-deleted checkpoint; if deletion is
    interrupted, the leftover is an abandoned temp dir pruned later.
    """
    if path.is_symlink() or not path.is_dir():
        logger.warning("leaving %s alone: named like a checkpoint but not a directory", path)
        return
    doomed = root / _format.temp_name()
    _disk.rename(path, doomed)
    _disk.remove_tree(doomed)


def _stale_temps(root: Path) -> list[Path]:
    """Temp dirs not owned by a live local writer, or untouched for long."""
    stale = []
    host = _format.host_tag()
    for name in os.listdir(root):
        match = _format.TEMP_PATTERN.fullmatch(name)
        if not match:
            continue
        path = root / name
        try:
            age = time.time() - path.lstat().st_mtime
        except FileNotFoundError:
            continue
        pid = int(match.group("pid"))
        live_writer = (
            match.group("host") == host and pid != os.getpid() and _pid_alive(pid)
        )
        if not live_writer or age > STALE_TEMP_AGE_S:
            stale.append(path)
    return stale


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
