"""Format versions of saved state, and the one way to read an older one.

Every checkpointed object says which format its ``state_dict()`` has (a
``version`` number, raised whenever a key is added, removed or changes
meaning) and how to bring each older format one version forward.  Reading
goes through :func:`upgrade`: an older format is migrated explicitly, step
by step; a newer one (written by a later release) is a clear error.
Nothing is filled in silently.

Checkpoints written by release 0.1 carry no versions: their states are in
version :data:`UNVERSIONED` of each format.  Pure Python (no torch), so the
goodput model and the hints can use it too.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["UNVERSIONED", "Migrations", "StateFormatError", "upgrade"]

#: The version of a state saved before formats were versioned (release 0.1).
UNVERSIONED = 1

#: ``{v: f}``: ``f`` turns a version-``v`` state into a version ``v + 1`` one.
Migrations = Mapping[int, Callable[[Any], Any]]


class StateFormatError(ValueError):
    """A saved state has a format this release cannot read."""


def upgrade(what: str, state: Any, saved: int, current: int, migrations: Migrations | None = None) -> Any:
    """``state``, saved in format ``saved``, brought to format ``current``.

    Args:
        what: names the state in errors (for example ``"adaptive.epoch"``).
        state: the saved content.
        saved: its format version.
        current: the version this release writes.
        migrations: one step per older version still readable.

    Raises:
        StateFormatError: ``saved`` is newer than ``current``, or there is no
            migration from some version on the way.
    """
    if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
        raise StateFormatError(f"{what}: format version must be an integer >= 1, got {saved!r}")
    if saved > current:
        raise StateFormatError(f"{what} was saved in format version {saved}, but this release reads up to "
                               f"version {current}: resume it with the release that wrote it or a later one")
    steps = migrations or {}
    for version in range(saved, current):
        if version not in steps:
            raise StateFormatError(f"{what}: no migration from format version {version} to {version + 1}; "
                                   f"this release reads versions {min(steps, default=current)}..{current}")
        state = steps[version](state)
    return state
