"""Atomic JSON files, and making a rename durable.

One writer for every small JSON file the project rewrites in place: a
job's ``hints.json`` (:func:`adaptive.goodput.hints.write_hints`), the scheduler
supervisor's state and the executor's status. The document goes to a
temporary file in the same folder, is flushed and fsync'ed, then renamed
over the target with ``os.replace`` (atomic on POSIX and Windows); the
folder is fsync'ed afterwards where the platform allows, so the rename
survives a crash. A failed write removes its temporary file and leaves
the previous content in place.

:func:`fsync_dir` is the one way the library syncs a folder: best effort
for these JSON files, strict for checkpoints (:mod:`adaptive.checkpoint.store`),
which must not claim durability they do not have.

The scheduler uses :func:`write_json_atomic` and :func:`read_json` by their
public names in :mod:`adaptive.goodput` (the face of what a job and the
scheduler share); this module stays the one implementation, on the ground
floor, because the checkpoint store syncs its folders with :func:`fsync_dir`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_json_atomic", "read_json", "fsync_dir"]


def write_json_atomic(path: str | os.PathLike[str], data: object, *, indent: int | None = 1,
                      sort_keys: bool = True, allow_nan: bool = True) -> Path:
    """Write ``data`` as JSON to ``path`` atomically; returns ``Path(path)``.

    Creates the parent folder if needed. ``indent``, ``sort_keys`` and
    ``allow_nan`` are passed to :func:`json.dump` (``allow_nan=False``
    raises ``ValueError`` on NaN or infinity, before anything is renamed).
    """
    target = Path(os.path.abspath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(target.parent, strict=False)
    return Path(path)


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse the JSON file at ``path``; ``ValueError`` naming the file if it is not JSON."""
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def fsync_dir(directory: str | os.PathLike[str], *, strict: bool) -> None:
    """Make entries created or renamed in folder ``directory`` durable.

    Args:
        directory: the folder whose entries changed.
        strict: True raises the ``OSError`` when the folder cannot be opened
            or synced (checkpoints need durability); False ignores it (best
            effort: not every platform can open a folder).
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)
