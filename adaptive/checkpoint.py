"""Named pieces of job state that are saved together and restored on restart.

A :class:`State` is anything with ``state_dict()`` / ``load_state_dict()`` and a
unique name: the model and optimizer (:class:`~adaptive.AdaptiveDataParallel`),
each data loader's position, the epoch counter, accumulators.  A state
restores itself from the job's newest complete checkpoint when it is created
(:func:`load_state`), and :func:`save_all_states` writes all of them at a step
boundary that every replica agreed on (guarantee G3).

Rules that keep restarts exact:

* every replica creates the same states in the same order;
* ``sync()`` is collective: each replica's state is made whole there (for
  example, accumulators add up their replicas' pending updates), and only
  then does rank 0 write;
* the write is atomic (see :mod:`adaptive.checkpoint_store`), so a crash
  during a save leaves the previous checkpoint as the newest complete one.

A job is *resuming* exactly when a complete checkpoint exists; see
:func:`resumed_checkpoint`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from adaptive import collectives, env, metrics
from adaptive.checkpoint_store import Checkpoint, CheckpointError, CheckpointStore

__all__ = [
    "State",
    "save_all_states",
    "load_state",
    "resumed_checkpoint",
    "registered_states",
    "CheckpointError",
]

logger = logging.getLogger(__name__)

_registry: dict[str, "State"] = {}
_store: CheckpointStore | None = None
_store_root: str | None = None
_resumed: Checkpoint | None = None
_resumed_looked_up = False
_last_save_time: float | None = None


class State:
    """Base class of every piece of checkpointed job state.

    Subclasses implement :meth:`state_dict` and :meth:`load_state_dict` with
    the usual PyTorch meaning: plain containers of tensors, numbers and
    strings (what ``torch.load(weights_only=True)`` accepts), and may override
    :meth:`sync` to gather what replicas hold privately before a save.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"State name must be a non-empty string, got {name!r}")
        if name in _registry:
            raise ValueError(
                f"a State named {name!r} already exists; give each checkpointed object a unique name "
                "(for example name= on AdaptiveDataLoader)"
            )
        self.name = name
        _registry[name] = self

    def state_dict(self) -> Any:
        """This state's content as plain, safely loadable data."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_dict()")

    def load_state_dict(self, state: Any) -> None:
        """Restore from what :meth:`state_dict` returned."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_state_dict()")

    def sync(self) -> None:
        """Collective hook called on every replica just before a save."""

    def unregister(self) -> None:
        """Remove this state from the checkpoint (the object will no longer be saved)."""
        if _registry.get(self.name) is self:
            del _registry[self.name]


def registered_states() -> list[State]:
    """The states that the next checkpoint will contain, in creation order."""
    return list(_registry.values())


def _checkpoint_store() -> CheckpointStore:
    global _store, _store_root
    root = env.checkpoint_path()
    if _store is None or _store_root != root:
        _store = CheckpointStore(root, keep=env.checkpoint_keep())
        _store_root = root
    return _store


def resumed_checkpoint() -> Checkpoint | None:
    """The checkpoint this process resumed from, or None for a fresh start.

    Rank 0 chooses the newest checkpoint that verifies and every replica opens
    the same one, so all replicas restore the same step.
    """
    global _resumed, _resumed_looked_up
    if _resumed_looked_up:
        return _resumed
    store = _checkpoint_store()
    chosen: int | None = None
    error: str | None = None
    if env.rank() == 0:
        try:
            latest = store.latest()
            chosen = None if latest is None else latest.info.seq
        except CheckpointError as exc:
            error = str(exc)
    chosen, error = collectives.broadcast_object((chosen, error))
    if error is not None:
        raise CheckpointError(error)
    _resumed = None if chosen is None else store.open(chosen)
    _resumed_looked_up = True
    meta = {} if _resumed is None else dict(_resumed.info.metadata or {})
    metrics.MetricsWriter().event("start", replicas=env.num_replicas(), nodes=env.num_nodes(),
                                  resumed=chosen, epoch=meta.get("epoch"), step=meta.get("step"),
                                  replicas_before=meta.get("replicas"))
    if _resumed is not None and env.rank() == 0:
        meta = _resumed.info.metadata or {}
        logger.info(
            "resuming from checkpoint %d in %s (saved at epoch %s, step %s, with %s replicas; now %d replicas)",
            _resumed.info.seq,
            store.root,
            meta.get("epoch"),
            meta.get("step"),
            meta.get("replicas"),
            env.num_replicas(),
        )
    return _resumed


def load_state(state: State) -> bool:
    """Restore ``state`` from the resumed checkpoint; True if it was there."""
    checkpoint = resumed_checkpoint()
    if checkpoint is None or state.name not in checkpoint.names():
        return False
    state.load_state_dict(checkpoint.load(state.name))
    return True


def save_all_states(metadata: dict[str, Any] | None = None) -> None:
    """Checkpoint every registered state; collective, call on every replica.

    All replicas run each state's ``sync()``, agree that they hold the same
    set of states, and then rank 0 writes the checkpoint.  If a peer died,
    a collective fails here and nothing is written, so the last complete
    checkpoint stays the newest.
    """
    global _last_save_time
    states = registered_states()
    for state in states:
        state.sync()
    names = sorted(state.name for state in states)
    all_names = collectives.allgather_object(names)
    if any(other != names for other in all_names):
        raise RuntimeError(
            "replicas hold different checkpointed objects; every replica must create the same "
            f"AdaptiveDataLoader/Accumulator/AdaptiveDataParallel objects in the same order: {all_names}"
        )
    if env.rank() == 0:
        info = dict(metadata or {})
        info.setdefault("replicas", env.num_replicas())
        info.setdefault("nodes", env.num_nodes())
        start = time.monotonic()
        saved = _checkpoint_store().save({state.name: state.state_dict() for state in states}, metadata=info)
        seconds = time.monotonic() - start
        logger.info("checkpoint %d saved (%s, %.1f MB in %.2f s)", saved.seq, info.get("reason", "requested"),
                    saved.size / 1e6, seconds)
        metrics.MetricsWriter().event("checkpoint", seq=saved.seq, bytes=saved.size, seconds=seconds,
                                      reason=info.get("reason"), step=info.get("step"), epoch=info.get("epoch"))
    _last_save_time = time.monotonic()


def seconds_since_last_save(now: float | None = None) -> float | None:
    """Seconds since this process last took part in a save, None if never."""
    if _last_save_time is None:
        return None
    return (time.monotonic() if now is None else now) - _last_save_time


def _reset_for_tests() -> None:
    """Forget registered states and the resumed checkpoint (tests run many jobs in one process)."""
    global _store, _store_root, _resumed, _resumed_looked_up, _last_save_time
    _registry.clear()
    _store = None
    _store_root = None
    _resumed = None
    _resumed_looked_up = False
    _last_save_time = None
