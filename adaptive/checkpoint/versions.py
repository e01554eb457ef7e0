"""Format versions of saved state: how a format is declared, and the one reader.

Every saved format declares the same two things under the same two names:

* ``version``: the format this release writes, raised whenever a key is
  added, removed or changes meaning;
* ``migrations``: ``{v: f}``, where ``f`` turns a saved version-``v`` state
  into a version ``v + 1`` one, for every older version still readable
  (no ``migrations``: only the current version is read).

A class whose objects are saved declares them as class attributes (every
:class:`~adaptive.checkpoint.states.State`, ``PerfParams``,
``GradientNoiseScale``, ``ScalingRule``, ...).  A format that belongs to a
module rather than to a class (the hints document, the token plan, the
checkpoint manifest, the supervisor's state file) declares them in a
:class:`Format`, with the name its errors use.

Reading goes through :meth:`Format.upgrade`: an older format is migrated
explicitly, step by step; a newer one (written by a later release) is a clear
:class:`StateFormatError`.  Nothing is filled in silently.
:meth:`Format.read` (and :func:`read_state`, for a class's declaration)
serves the usual layout, a mapping that carries its version under a
``"version"`` key beside its fields; a whole checkpointed state, whose version
the manifest records, is upgraded directly.  :func:`check_fields` then checks
the fields' names.

Checkpoints written by release 0.1 carry no versions: their states are in
version :data:`UNVERSIONED` of each format (a :class:`Format` says whether a
state without a version can be read with ``unversioned``).  Pure Python (no
torch), and importing nothing else of the library but its type names
(:mod:`adaptive._utils.types`), so the goodput model, the hints and the
scheduler use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from adaptive._utils.types import StateDict

__all__ = ["UNVERSIONED", "Migrations", "Declares", "StateFormatError", "Format", "read_state", "check_fields"]

#: The version of a state saved before formats were versioned (release 0.1).
UNVERSIONED = 1

#: ``{v: f}``: ``f`` turns a version-``v`` state into a version ``v + 1`` one.
Migrations = Mapping[int, Callable[[StateDict], StateDict]]


class Declares(Protocol):
    """A class (or its instance) that declares its saved format: a ``version``, and ``migrations`` if any."""

    @property
    def version(self) -> int:
        """The format version this release writes."""


class StateFormatError(ValueError):
    """A saved state has a format this release cannot read."""


@dataclass(frozen=True)
class Format:
    """One saved format: its name, the version this release writes, and how older ones come forward.

    Args:
        what: names the state in errors (for example ``"hints"``).
        version: the format this release writes.
        migrations: ``{v: f}``, one step per older version still readable.
        unversioned: the version of a state saved without one (release 0.1
            wrote some formats without a version: :data:`UNVERSIONED`);
            None when such a state cannot be read.
    """

    what: str
    version: int
    migrations: Migrations = field(default_factory=dict)
    unversioned: int | None = None

    @classmethod
    def of(cls, declared: Declares, what: str, *, unversioned: int | None = None) -> Format:
        """The format a class (or its instance) declares with its ``version`` and ``migrations`` attributes."""
        return cls(what, declared.version, getattr(declared, "migrations", {}), unversioned)

    @property
    def readable(self) -> tuple[int, ...]:
        """The versions this release reads: the current one and those the migrations bring forward to it."""
        oldest = self.version
        while oldest - 1 in self.migrations:
            oldest -= 1
        return tuple(range(oldest, self.version + 1))

    def upgrade(self, state: StateDict, saved: int) -> StateDict:
        """``state``, saved in format version ``saved``, brought to :attr:`version`.

        Raises:
            StateFormatError: ``saved`` is not a version, is newer than this
                release reads, or there is no migration from some version on
                the way.
        """
        if isinstance(saved, bool) or not isinstance(saved, int) or saved < 1:
            raise StateFormatError(f"{self.what}: format version must be an integer >= 1, got {saved!r}")
        if saved > self.version:
            raise StateFormatError(f"{self.what} was saved in format version {saved}, but this release reads up "
                                   f"to version {self.version}: resume it with the release that wrote it or a "
                                   "later one")
        for version in range(saved, self.version):
            if version not in self.migrations:
                raise StateFormatError(f"{self.what}: no migration from format version {version} to "
                                       f"{version + 1}; this release reads versions {self.readable[0]}.."
                                       f"{self.version}")
            state = self.migrations[version](state)
        return state

    def read(self, state: object) -> StateDict:
        """The fields of ``state``, a mapping with a ``"version"`` key, in the current format (without the key).

        Raises:
            StateFormatError: not a mapping, no version where one is needed,
                a newer format, or an older one without a migration.
        """
        if not isinstance(state, Mapping):
            raise StateFormatError(f"{self.what}: saved state must be a mapping (dict), got {type(state).__name__}")
        if "version" in state:
            saved = state["version"]
        elif self.unversioned is not None:
            saved = self.unversioned
        else:
            raise StateFormatError(f"{self.what}: saved state has no 'version' key (format version "
                                   f"{self.version} expected)")
        fields = {key: value for key, value in state.items() if key != "version"}
        # The migrations of a mapping-of-fields format map a fields dict to a fields dict.
        return self.upgrade(fields, saved)


def read_state(what: str, state: object, declared: Declares, *,
               unversioned: int | None = None) -> StateDict:
    """:meth:`Format.read` for a class that declares ``version`` (and ``migrations``) itself.

    Args:
        what: names the state in errors.
        state: the saved mapping.
        declared: the class (or an instance) that declares the format.
        unversioned: the version of a state saved without a ``"version"``
            key; None when such a state cannot be read.
    """
    return Format.of(declared, what, unversioned=unversioned).read(state)


def check_fields(what: str, fields: Mapping[str, object], required: Sequence[str],
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
