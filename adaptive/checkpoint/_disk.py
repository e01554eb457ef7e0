"""The file-system calls that make a checkpoint durable, one function each.

Every directory creation, fsync, rename and tree removal of a save or a
prune goes through this module, looked up as ``_disk.<name>`` at call
time. That keeps the durability rules in one place (checkpoints sync
strictly: a failed fsync is an error, not a warning) and gives tests one
seam where a failure can be injected at each step of a save.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from adaptive._utils import files


def make_dir(path: Path) -> None:
    """Create directory ``path`` (its parent must exist; it must not)."""
    os.mkdir(path)


def fsync_fd(fd: int) -> None:
    """Flush an open file's data and metadata to the disk."""
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make entries created or renamed in directory ``path`` durable; raise ``OSError`` if that fails."""
    files.fsync_dir(path, strict=True)


def rename(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` atomically (fails if ``target`` is a non-empty directory)."""
    os.rename(source, target)


def remove_tree(path: Path) -> None:
    """Delete directory ``path`` and everything in it."""
    shutil.rmtree(path)
