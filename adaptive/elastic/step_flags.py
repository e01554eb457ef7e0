"""What each replica says at a per-step agreement, and how the replicas' words combine.

At an agreement boundary (:mod:`adaptive.elastic.sync_points`) every replica
contributes one :class:`StepFlags` record to a single all-reduce (max) of a
short vector of floats, and all replicas act on the same combined record.
Each field declares how the replicas' values combine:

* ``ANY``: the largest value wins (a flag any replica raised, or rank 0's
  count where the others say 0);
* ``SMALLEST``: the smallest value wins (sent negated);
* ``SAME``: every replica must say the same (sent as the value and its
  negation, so the combined record knows the lowest and the highest).

A new event is one new field here (with its combination) and one handler
where the agreement is acted on: the encoding, the all-reduce and the
decoding follow from the field list.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar, Iterator

__all__ = ["Combine", "StepFlags"]


class Combine(enum.Enum):
    """How the replicas' values of one field become the agreed value."""

    ANY = "any"  # the largest value
    SMALLEST = "smallest"  # the smallest value
    SAME = "same"  # every replica says the same; the spread is kept to report a mismatch


def _combine(how: Combine) -> dict[str, Combine]:
    return {"combine": how}


@dataclasses.dataclass
class StepFlags:
    """One replica's flags at an agreement, or the combined flags every replica acts on.

    Integers and booleans only: the vector travels as float64, exact for
    integers up to 2**53.
    """

    #: A graceful stop was asked for (SIGTERM outside live mode, or :func:`~adaptive.request_stop`).
    stop: bool = dataclasses.field(default=False, metadata=_combine(Combine.ANY))
    #: A periodic checkpoint is due (rank 0's clock).
    checkpoint_due: bool = dataclasses.field(default=False, metadata=_combine(Combine.ANY))
    #: Step boundaries until the next agreement at this replica's pace; the smallest proposal wins.
    spacing: int = dataclasses.field(default=1, metadata=_combine(Combine.SMALLEST))
    #: The sequence number of the checkpoint this replica resumed from (-1: none); all must be equal.
    resumed_seq: int = dataclasses.field(default=-1, metadata=_combine(Combine.SAME))
    #: Rank 0's generation of the checkpoint folder (0 elsewhere).
    folder_generation: int = dataclasses.field(default=0, metadata=_combine(Combine.ANY))
    #: The newer folder generation that fenced rank 0's off (0 while not fenced).
    newer_folder_generation: int = dataclasses.field(default=0, metadata=_combine(Combine.ANY))
    #: Live mode: the join requests rank 0 saw.
    joins: int = dataclasses.field(default=0, metadata=_combine(Combine.ANY))
    #: Live mode: this member leaves (SIGTERM in live mode).
    leave: bool = dataclasses.field(default=False, metadata=_combine(Combine.ANY))
    #: Live mode: the drain requests rank 0 saw (nodes asked to leave before a planned stop).
    drains: int = dataclasses.field(default=0, metadata=_combine(Combine.ANY))

    #: After :meth:`decode`: the ``SAME`` fields whose replicas disagreed, as (lowest, highest).
    mismatches: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    _WIDTH: ClassVar[dict[Combine, int]] = {Combine.ANY: 1, Combine.SMALLEST: 1, Combine.SAME: 2}

    @classmethod
    def _agreed_fields(cls) -> Iterator[tuple[dataclasses.Field[object], Combine]]:
        for field in dataclasses.fields(cls):
            if "combine" in field.metadata:
                yield field, field.metadata["combine"]

    @classmethod
    def width(cls) -> int:
        """The length of the encoded vector."""
        return sum(cls._WIDTH[how] for _, how in cls._agreed_fields())

    def encode(self) -> list[float]:
        """This replica's flags as the vector whose element-wise max over replicas is the agreement."""
        vector: list[float] = []
        for field, how in self._agreed_fields():
            value = float(getattr(self, field.name))
            vector.extend({Combine.ANY: [value], Combine.SMALLEST: [-value], Combine.SAME: [value, -value]}[how])
        return vector

    @classmethod
    def decode(cls, vector: list[float]) -> StepFlags:
        """The combined flags from the element-wise max of every replica's :meth:`encode`."""
        if len(vector) != cls.width():
            raise ValueError(f"an agreement vector of {len(vector)} values, expected {cls.width()}")
        values: dict[str, object] = {}
        mismatches: dict[str, tuple[int, int]] = {}
        position = 0
        for field, how in cls._agreed_fields():
            kind = bool if field.type in ("bool", bool) else int
            if how is Combine.ANY:
                values[field.name] = kind(vector[position])
            elif how is Combine.SMALLEST:
                values[field.name] = kind(-vector[position])
            else:
                highest, lowest = int(vector[position]), int(-vector[position + 1])
                values[field.name] = highest
                if highest != lowest:
                    mismatches[field.name] = (lowest, highest)
            position += cls._WIDTH[how]
        return cls(**values, mismatches=mismatches)  # type: ignore[arg-type]

    def merged(self, later: StepFlags, *names: str) -> StepFlags:
        """These flags with ``names`` combined with ``later``'s (decisions carried until acted on)."""
        changes: dict[str, object] = {}
        for field, how in self._agreed_fields():
            if field.name in names:
                mine, theirs = getattr(self, field.name), getattr(later, field.name)
                changes[field.name] = min(mine, theirs) if how is Combine.SMALLEST else max(mine, theirs)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
