"""Metrics summed over all replicas, exact across restarts.

::

    stats = adaptive.Accumulator()
    for x, y in loader:
        ...
        stats["loss_sum"] += loss.item() * len(x)   # local, no communication
        stats["n"] += len(x)
    with stats.synchronized():                        # one collective
        print(stats["loss_sum"] / stats["n"])         # totals of all replicas
        stats.clear()

Outside ``synchronized()`` the accumulator is in *accumulation mode*: reads
give this replica's pending (not yet synchronized) increments and writes
record increments, so ``acc[k] += v`` works for numbers, numpy arrays and CPU
tensors.  ``synchronized()`` adds every replica's increments into the totals;
inside it, reads and writes see the totals.

Replay (guarantee G5): results of a ``synchronized()`` block that ran outside
a loader loop are kept per epoch; when a restart replays that block, it gets
the saved result and no communication happens.

Naming: an accumulator created inside an epoch (the usual ``stats =
Accumulator()`` at the top of a ``train()`` called every epoch) is named by
the epoch and its creation order within it, so after a restart the same
line in the same epoch finds the same totals, and an old epoch's totals
never leak into a new epoch's accumulator.  It is checkpointed until its
epoch ends.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import logging
import math
import numbers
from typing import Any, Iterator

import numpy as np
import torch

from adaptive.checkpoint import admission, naming, states
from adaptive.runtime import collectives, membership
from adaptive.runtime.step import loop_running
from adaptive.elastic import epoch, sync_points
from adaptive.observe import metrics

__all__ = ["Accumulator"]

logger = logging.getLogger(__name__)


def _check_value(key: Any, value: Any) -> None:
    if isinstance(value, (numbers.Number, np.ndarray, np.number)) and not isinstance(value, bool):
        return
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"Accumulator[{key!r}]: tensors must be on the CPU (got {value.device}); use .cpu()")
        return
    raise TypeError(
        f"Accumulator[{key!r}] = {type(value).__name__}: values must be numbers, numpy arrays or CPU tensors"
    )


def _add(a: Any, b: Any) -> Any:
    return b if a is None else a + b


def _merge(totals: dict[Any, Any], updates: dict[Any, Any]) -> dict[Any, Any]:
    merged = dict(totals)
    for key, value in updates.items():
        merged[key] = _add(merged.get(key), value)
    return merged


def _encode(values: dict[Any, Any]) -> dict[Any, Any]:
    """Numpy arrays are stored as tensors so that checkpoints load with weights_only."""
    out: dict[Any, Any] = {}
    for key, value in values.items():
        if isinstance(value, np.ndarray):
            out[key] = {"__ndarray__": torch.from_numpy(np.ascontiguousarray(value))}
        elif isinstance(value, np.number):
            out[key] = {"__npscalar__": value.item(), "dtype": str(value.dtype)}
        else:
            out[key] = value
    return out


def _decode(values: dict[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and "__ndarray__" in value:
            out[key] = value["__ndarray__"].numpy()
        elif isinstance(value, dict) and "__npscalar__" in value:
            out[key] = np.dtype(value["dtype"]).type(value["__npscalar__"])
        else:
            out[key] = value
    return out


class _AccumulatorState(states.State):
    """Totals, this replica's pending increments, and saved results per epoch."""

    def __init__(self, name: str, initial: dict[Any, Any], scope: int | None) -> None:
        super().__init__(name, scope=scope)
        self.results: dict[Any, Any] = dict(initial)
        self.updates: dict[Any, Any] = {}
        self.results_history: dict[int | None, list[dict[Any, Any]]] = {}
        #: Live mode: the last sync, as (the live generation it ran in, its number in that generation); it
        #: tells whether a lost member's published increments came after the last sync (they were not folded
        #: in yet) or before it (they were).
        self.syncs: tuple[int | None, int] = (None, 0)

    def sync(self) -> None:
        """Fold every replica's pending increments into the totals."""
        gathered = collectives.allgather_object(self.updates)
        for updates in gathered:
            self.results = _merge(self.results, updates)
        self.updates = {}
        generation = membership.generation_number()
        self.syncs = (generation, self._syncs_in(generation) + 1)

    def _syncs_in(self, generation: int | None) -> int:
        return self.syncs[1] if self.syncs[0] == generation else 0

    def state_dict(self) -> dict[str, Any]:
        history = [[key, [_encode(r) for r in results]] for key, results in self.results_history.items()]
        return {"results": _encode(self.results), "history": history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.results = _decode(state["results"])
        self.results_history = {key: [_decode(r) for r in results] for key, results in state["history"]}
        self.updates = {}

    def live_copy(self) -> dict[str, Any]:
        """Live mode: the totals and this replica's pending increments (the step in flight's are undone)."""
        return copy.deepcopy({"results": self.results, "updates": self.updates, "history": self.results_history,
                              "syncs": self.syncs})

    def restore_live_copy(self, saved: object) -> None:
        assert isinstance(saved, dict)
        saved = copy.deepcopy(saved)
        self.results, self.updates, self.results_history = saved["results"], saved["updates"], saved["history"]
        self.syncs = saved["syncs"]

    def private_part(self) -> dict[str, Any] | None:
        """Live mode: this replica's increments not synchronized yet, with the generation and the number of
        syncs in it so far (which date them against the syncs of the member that adopts them)."""
        if not self.updates:
            return None
        generation = membership.generation_number()
        return {"generation": generation, "syncs": self._syncs_in(generation), "updates": _encode(self.updates)}

    def _synced_since(self, generation: int | None, syncs: int) -> bool:
        """Whether this replica synced after the ``syncs``-th sync of ``generation`` (syncs are collective: a
        member that was there synced too; one joined later synced from its first generation on, whose changes
        sync before it joins)."""
        last_generation, count = self.syncs
        if last_generation is None or generation is None:
            return last_generation is not None and generation is None
        return last_generation > generation or (last_generation == generation and count > syncs)

    def adopt_private_part(self, part: object, worker: int) -> None:
        """Add a lost member's increments to this replica's pending ones (the next sync counts them once),
        unless this replica synced since they were published: that sync folded them in already."""
        assert isinstance(part, dict)
        if self._synced_since(part["generation"], int(part["syncs"])):
            logger.info("%s: worker %d's last published increments came before the last synchronized(), which "
                        "counted them", self.name, worker)
            return
        self.updates = _merge(self.updates, _decode(part["updates"]))


def _record_totals(name: str, current: int | None, results: dict[Any, Any]) -> None:
    """Rank 0 writes the numeric totals of a synchronized block to the metrics file (``adaptive report``
    draws them: losses and accuracies are the first thing users look at)."""
    values = {str(key): float(value) for key, value in results.items()
              if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)}
    if values:
        short = name[len("adaptive.accumulator."):] if name.startswith("adaptive.accumulator.") else name
        position = sync_points.last_position()
        metrics.MetricsWriter().event("totals", accumulator=short.split("@")[0], epoch=current,
                                      step=position.get("step"), values=values)


class Accumulator(collections.abc.MutableMapping[Any, Any]):
    """A dict of metrics that ``synchronized()`` sums over all replicas.

    Args:
        *args, **kwargs: initial totals, as for ``dict``.
        name: checkpoint name; default: the creation order, ``"0"``, ``"1"``,
            ... before the epoch loop and ``"e3.0"``, ``"e3.1"``, ... inside
            epoch 3, so create accumulators in the same order on every run.
    """

    def __init__(self, *args: Any, name: str | None = None, **kwargs: Any) -> None:
        if loop_running():
            raise RuntimeError(
                "Accumulator created inside an AdaptiveDataLoader loop; create it before the loop "
                "so that a restart finds the same object"
            )
        initial = dict(*args, **kwargs)
        for key, value in initial.items():
            _check_value(key, value)
        if name is None:
            name = naming.default_name("accumulator")
        elif not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self._state = _AccumulatorState(f"adaptive.accumulator.{name}", initial, naming.epoch_scope())
        states.load_state(self._state)
        self._synchronized: dict[Any, Any] | None = None
        self._sync_count: collections.Counter[int | None] = collections.Counter()  # synchronized() calls per epoch

    @contextlib.contextmanager
    def synchronized(self) -> Iterator["Accumulator"]:
        """Sum every replica's increments into the totals; read totals inside."""
        admission.admit()  # live mode: a process that joins a running job becomes a member here, at the latest
        if self._synchronized is not None:
            yield self
            return
        if loop_running():
            # Inside a loader loop: never replayed (the loop resumes mid-way), so never saved.
            self._state.sync()
        else:
            self._replay_or_sync(epoch.current_epoch())
        self._synchronized = self._state.results
        try:
            yield self
        finally:
            self._synchronized = None

    def _replay_or_sync(self, current: int | None) -> None:
        history = self._state.results_history
        for key in [k for k in history if k is not None and current is not None and k < current]:
            del history[key]  # finished epochs are never replayed
        count = self._sync_count[current]
        self._sync_count[current] += 1
        saved = history.setdefault(current, [])
        if count < len(saved):
            logger.debug("replaying synchronized() #%d of epoch %s from the checkpoint", count, current)
            self._state.results = copy.deepcopy(saved[count])
            self._state.updates = {}
        else:
            self._state.sync()
            saved.append(copy.deepcopy(self._state.results))
            _record_totals(self._state.name, current, self._state.results)

    def _target(self) -> dict[Any, Any]:
        return self._state.updates if self._synchronized is None else self._state.results

    def __getitem__(self, key: Any) -> Any:
        target = self._target()
        if key in target:
            return target[key]
        if self._synchronized is None:
            return 0  # so that ``acc[k] += v`` starts from zero
        raise KeyError(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_value(key, value)
        self._target()[key] = value

    def __delitem__(self, key: Any) -> None:
        if self._synchronized is None:
            raise RuntimeError("Accumulator: delete keys inside synchronized(), where the totals are visible")
        del self._state.results[key]
        self._state.updates.pop(key, None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._target())

    def __len__(self) -> int:
        return len(self._target())

    def clear(self) -> None:
        """Inside ``synchronized()``: reset the totals.  Outside: drop pending increments."""
        self._target().clear()

    def __repr__(self) -> str:
        mode = "totals" if self._synchronized is not None else "pending"
        return f"Accumulator({mode}={self._target()!r})"
