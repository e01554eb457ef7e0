"""The names of checkpointed objects, and the states that an epoch owns.

A restart finds each object's state again by its name, so a name must come
out the same when the restart replays the code that created the object.
An object given no name (an accumulator, a loader) is named by its creation
order among the objects of its kind (:func:`default_name`).

States of objects created inside an epoch of ``remaining_epochs_until``
(accumulators and loaders built in a ``train()`` called every epoch) belong
to that epoch: their default names count creations within the epoch, their
checkpoint names carry the epoch (the ``scope`` of
:class:`~adaptive.checkpoint.states.State`), and they leave the checkpoint
when the epoch ends.  A replay of the epoch creates them in the same order
and finds them again; another epoch's objects never pick them up.
:mod:`adaptive.elastic.epoch` opens and closes the epochs
(:func:`begin_epoch`, :func:`end_epoch`).
"""

from __future__ import annotations

import collections
import dataclasses

from adaptive.checkpoint import states
from adaptive.runtime.job import current_job

__all__ = ["epoch_scope", "default_name", "begin_epoch", "end_epoch"]


@dataclasses.dataclass
class Naming:
    """The epoch in progress and the objects named so far: this module's record on the job context."""

    epoch: int | None = None  # the epoch in progress, owner of the states created now
    # (kind, epoch) -> objects of that kind created so far in that epoch (None: outside epochs)
    counts: collections.Counter[tuple[str, int | None]] = dataclasses.field(default_factory=collections.Counter)


def _naming() -> Naming:
    return current_job().part(Naming)


def epoch_scope() -> int | None:
    """The epoch whose objects are being created now (None outside ``remaining_epochs_until``)."""
    return _naming().epoch


def default_name(kind: str) -> str:
    """The default name of the next ``kind`` object (an accumulator, a loader).

    Its creation order among the ``kind`` objects created in the same epoch
    (``"e3.0"``, ``"e3.1"``, ...), or outside epochs (``"0"``, ``"1"``, ...):
    the same object gets the same name when a restart replays its code.
    """
    naming = _naming()
    key = (kind, naming.epoch)
    count = naming.counts[key]
    naming.counts[key] += 1
    return str(count) if naming.epoch is None else f"e{naming.epoch}.{count}"


def begin_epoch(epoch: int) -> None:
    """Objects created from now on belong to ``epoch`` (called by ``remaining_epochs_until``)."""
    naming = _naming()
    naming.epoch = epoch
    for key in [key for key in naming.counts if key[1] == epoch]:
        del naming.counts[key]


def end_epoch() -> None:
    """The epoch is over: its objects leave the checkpoint, and objects are global again."""
    naming = _naming()
    if naming.epoch is not None:
        for state in states.registered_states():
            if state.scope == naming.epoch:
                state.unregister()
    naming.epoch = None
