"""Atomic JSON files: a reader sees the old content or the new, never half.

One writer for every small JSON file the project rewrites in place: a
job's ``hints.json`` (:func:`adaptive.batchsize.hints.write_hints`), the scheduler
supervisor's state and the executor's status. The document goes to a
temporary file in the same folder, is flushed and fsync'ed, then renamed
over the target with ``os.replace`` (atomic on POSIX and Windows); the
folder is fsync'ed afterwards where the platform allows, so the rename
survives a crash. A failed write removes its temporary file and leaves
the previous content in place.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["write_json_atomic", "read_json"]


def write_json_atomic(path: Union[str, os.PathLike], data: Any, *, indent: Optional[int] = 1,
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
    _fsync_dir(target.parent)
    return Path(path)


def read_json(path: Union[str, os.PathLike]) -> Any:
    """Parse the JSON file at ``path``; ``ValueError`` naming the file if it is not JSON."""
    with open(path, encoding="utf-8") as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every platform can open a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
