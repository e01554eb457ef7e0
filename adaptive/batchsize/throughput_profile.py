"""The bounded, checkpointable record of measured step times (numpy only).

The throughput model of :mod:`adaptive.goodput.model` is fitted
(:func:`adaptive.goodput.fit.fit_perf_params`) to the mean
times this profile keeps per configuration.  Its :meth:`~ThroughputProfile.state_dict`
(format version 1) travels in the autoscale controller's checkpoint.
"""

from __future__ import annotations

import logging
import math
from typing import Iterator, Mapping

import numpy as np

from adaptive._utils.checks import check_float, check_int
from adaptive._utils.types import StateDict
from adaptive.checkpoint.versions import StateFormatError, check_fields, read_state
from adaptive.goodput import PerfParams, fit_perf_params

__all__ = ["ThroughputProfile"]

logger = logging.getLogger(__name__)

_Key = tuple[int, int, int, int]
_TIMES = ("step_time", "compute_time", "sync_time", "data_time")


class ThroughputProfile:
    """Bounded record of measured times per configuration, for fitting.

    Each configuration ``(num_nodes, num_replicas, local_bsz, accum_steps)``
    keeps running means of its step, compute (one micro-batch), sync and
    data-wait times.  After ``window`` samples a mean becomes an
    exponential average with weight ``1/window``, so it follows slow drift.
    At most ``max_entries`` configurations are kept; recording a new one
    when full evicts the least recently updated.

    Args:
        max_entries: hard cap on configurations (>= 1).
        window: samples after which means turn into moving averages (>= 1).
    """

    #: Format of :meth:`state_dict` (1: the rows of every configuration).
    version = 1

    def __init__(self, max_entries: int = 256, window: int = 64) -> None:
        self._max_entries = check_int("max_entries", max_entries, 1)
        self._window = check_int("window", window, 1)
        self._entries: dict[_Key, dict[str, float]] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[_Key]:
        return iter(sorted(self._entries))

    @property
    def max_entries(self) -> int:
        return self._max_entries

    def record(self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int, *,
               step_time: float, compute_time: float | None = None, sync_time: float | None = None,
               data_time: float | None = None) -> None:
        """Add one optimizer step's measurements (seconds; None = not measured)."""
        key = (check_int("num_nodes", num_nodes, 1), check_int("num_replicas", num_replicas, 1),
               check_int("local_bsz", local_bsz, 1), check_int("accum_steps", accum_steps, 1))
        if key[0] > key[1]:
            raise ValueError(f"num_nodes must be <= num_replicas, got {key[0]} > {key[1]}")
        samples = {"step_time": step_time, "compute_time": compute_time,
                   "sync_time": sync_time, "data_time": data_time}
        check_float("step_time", step_time, 0.0, strict_minimum=True)
        for name, value in samples.items():
            if value is not None:
                check_float(name, value, 0.0)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self._max_entries:
                oldest = min(self._entries, key=lambda k: self._entries[k]["updated"])
                del self._entries[oldest]
            entry = {"updated": 0.0}
            for name in _TIMES:
                entry[name], entry[name + "_count"] = math.nan, 0.0
            self._entries[key] = entry
        self._clock += 1
        entry["updated"] = float(self._clock)
        for name, value in samples.items():
            if value is None:
                continue
            count = min(entry[name + "_count"] + 1.0, float(self._window))
            mean = entry[name]
            entry[name] = float(value) if math.isnan(mean) else mean + (float(value) - mean) / count
            entry[name + "_count"] = count

    def get(self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int) -> dict[str, float] | None:
        """Mean times of one configuration (NaN where never measured), or None."""
        entry = self._entries.get((num_nodes, num_replicas, local_bsz, accum_steps))
        return None if entry is None else {name: entry[name] for name in _TIMES}

    @property
    def max_replicas(self) -> int:
        """Largest replica count profiled (0 if empty)."""
        return max((k[1] for k in self._entries), default=0)

    @property
    def max_nodes(self) -> int:
        """Largest node count profiled (0 if empty)."""
        return max((k[0] for k in self._entries), default=0)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Observations as the keyword arguments of :func:`fit_perf_params`."""
        keys = sorted(self._entries)
        columns = {"num_nodes": [k[0] for k in keys], "num_replicas": [k[1] for k in keys],
                   "local_bsz": [k[2] for k in keys], "accum_steps": [k[3] for k in keys]}
        arrays = {name: np.asarray(values, dtype=np.int64) for name, values in columns.items()}
        for name in ("step_time", "compute_time", "sync_time"):
            arrays[name] = np.asarray([self._entries[k][name] for k in keys], dtype=float)
        return arrays

    def fit(self, initial: PerfParams | None = None) -> PerfParams | None:
        """:func:`fit_perf_params` on the profile (warm-started from
        ``initial`` if given), or None while it is empty."""
        if not self._entries:
            return None
        return fit_perf_params(**self.to_arrays(), initial=initial)

    def state_dict(self) -> StateDict:
        """Plain ints, floats and lists (safe to checkpoint and to JSON)."""
        rows = [list(key) + [entry["updated"]] + [entry[n] for n in _TIMES] + [entry[n + "_count"] for n in _TIMES]
                for key, entry in sorted(self._entries.items())]
        return {"version": self.version, "max_entries": self._max_entries, "window": self._window,
                "clock": self._clock, "entries": rows}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`; keeps this profile's own size limits."""
        fields = read_state("ThroughputProfile", state, self)
        check_fields("ThroughputProfile state", fields, ("max_entries", "window", "clock", "entries"))
        entries: dict[_Key, dict[str, float]] = {}
        width = 5 + 2 * len(_TIMES)
        for row in fields["entries"]:
            if len(row) != width:
                raise StateFormatError(f"ThroughputProfile state rows must have {width} values, got {len(row)}")
            key = tuple(check_int("profile key", int(v), 1) for v in row[:4])
            entry = {"updated": float(row[4])}
            for i, name in enumerate(_TIMES):
                entry[name] = float(row[5 + i])
                entry[name + "_count"] = float(row[5 + len(_TIMES) + i])
            entries[key] = entry  # type: ignore[index]
        newest = sorted(entries, key=lambda k: entries[k]["updated"])[-self._max_entries:]
        self._entries = {k: entries[k] for k in newest}
        self._clock = int(fields["clock"])
