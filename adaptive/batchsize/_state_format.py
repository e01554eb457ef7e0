"""Reading the versioned states of the batch-size layer (torch-free).

Every state here is a mapping with a ``"version"`` key beside its named
fields.  :func:`read_state` checks that it is a mapping, takes the version
off and brings the fields to the current format through
:func:`adaptive.checkpoint.versions.upgrade` (older: explicit migrations;
newer: a clear error).

Some of these formats were written without a version by release 0.1 (the
goodput model's parameters, the scaling rules' counters): for them a state
without the key is in format :data:`~adaptive.checkpoint.versions.UNVERSIONED`,
which the caller says by passing ``unversioned``.  For the others a missing
version is an error.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from adaptive.checkpoint.versions import Migrations, StateFormatError, upgrade

__all__ = ["read_state", "check_fields"]


def read_state(what: str, state: Any, current: int, migrations: Migrations | None = None, *,
               unversioned: int | None = None) -> dict[str, Any]:
    """The fields of ``state`` (without ``"version"``) in format ``current``.

    Args:
        what: names the state in errors.
        state: the saved mapping.
        current: the format this release writes.
        migrations: one step per older format still readable.
        unversioned: the format of a state saved without a ``"version"``
            key; None when such a state cannot be read.

    Raises:
        StateFormatError: not a mapping, no version where one is needed, a
            newer format, or an older one without a migration.
    """
    if not isinstance(state, Mapping):
        raise StateFormatError(f"{what} state must be a mapping (dict), got {type(state).__name__}")
    if "version" in state:
        saved = state["version"]
    elif unversioned is not None:
        saved = unversioned
    else:
        raise StateFormatError(f"{what} state has no 'version' key (format version {current} expected)")
    fields = {key: value for key, value in state.items() if key != "version"}
    return upgrade(what, fields, saved, current, migrations)


def check_fields(what: str, fields: Mapping[str, Any], required: Sequence[str],
                 optional: Sequence[str] = ()) -> None:
    """StateFormatError unless ``fields`` has every ``required`` key and no key
    outside ``required`` and ``optional``."""
    missing = [key for key in required if key not in fields]
    unknown = [key for key in fields if key not in required and key not in optional]
    if missing:
        raise StateFormatError(f"{what} is missing {missing}; required keys are {list(required)}")
    if unknown:
        raise StateFormatError(f"{what} has unknown keys {unknown}; allowed keys are "
                               f"{list(required) + list(optional)}")
