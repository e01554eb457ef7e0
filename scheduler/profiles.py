"""Measured job profiles that drive the trace simulator.

A profile holds what was measured for one model (see
``scheduler/data/pollux/README.md``):

* step time and gradient-synchronisation time by *placement* (GPUs used on
  each node) and local batch size (``placements.csv``), plus coarser
  measurements over (nodes, replicas, local batch) up to 64 replicas
  (``scalability.csv``);
* gradient statistics (``grad_sqr``, ``grad_var``) and cumulative progress
  per epoch for runs at several total batch sizes (``validation-<B>.csv``).

Where a configuration was not measured it is interpolated: the exact
placement first (linear in the local batch size), otherwise linearly over
the number of nodes, then replicas, then local batch size.
"""

from __future__ import annotations

import csv
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

#: Directory of the Pollux reference data shipped inside the package.
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pollux")
DEFAULT_TRACES_DIR = os.path.join(DEFAULT_DATA_DIR, "traces")
DEFAULT_WORKLOADS_DIR = os.path.join(DEFAULT_DATA_DIR, "workloads")

Placement = tuple[int, ...]


@dataclass(frozen=True)
class ModelSettings:
    """Per-model conventions that are not in the measurements themselves.

    ``max_epochs`` is the fixed number of epochs after which a job is done;
    ``max_local_bsz`` caps the per-replica micro-batch (device memory).
    ``None`` means "derive from the data": the smallest validated batch
    size for the initial batch, the number of validation rows for epochs,
    the measured local batch range for the bounds.
    """

    init_batch_size: int | None = None
    max_epochs: int | None = None
    max_local_bsz: int | None = None


#: Conventions of the reference simulator (data README; yolov3's micro-batch
#: is capped at 8 there because larger ones exceed device memory).
POLLUX_MODELS: dict[str, ModelSettings] = {
    "bert": ModelSettings(init_batch_size=12, max_epochs=2),
    "cifar10": ModelSettings(init_batch_size=128, max_epochs=100),
    "deepspeech2": ModelSettings(init_batch_size=20, max_epochs=80),
    "imagenet": ModelSettings(init_batch_size=200, max_epochs=90),
    "ncf": ModelSettings(init_batch_size=256, max_epochs=10),
    "yolov3": ModelSettings(init_batch_size=8, max_epochs=50, max_local_bsz=8),
}


def canonical_placement(placement: Iterable[int]) -> Placement:
    """Drop empty nodes and rotate to the lexicographically smallest form.

    Measurements of a ring of nodes do not depend on where the ring starts,
    so ``(4, 2)`` and ``(2, 4)`` name the same measured placement.
    """
    counts = tuple(int(c) for c in placement if int(c) > 0)
    if not counts:
        raise ValueError("placement must use at least one GPU")
    return min(counts[i:] + counts[:i] for i in range(len(counts)))


class _Curve:
    """Step and sync time as a piecewise-linear function of local batch size.

    Outside the measured range the end segments are extended (times grow
    roughly linearly with the batch), never below half the nearest
    measurement.
    """

    def __init__(self, bsz: Sequence[float], step: Sequence[float], sync: Sequence[float]):
        order = np.argsort(bsz)
        self.bsz = np.asarray(bsz, dtype=float)[order]
        self.step = np.asarray(step, dtype=float)[order]
        self.sync = np.asarray(sync, dtype=float)[order]

    @property
    def min_bsz(self) -> float:
        return float(self.bsz[0])

    @property
    def max_bsz(self) -> float:
        return float(self.bsz[-1])

    def __call__(self, local_bsz: float) -> tuple[float, float]:
        return self._at(self.step, local_bsz), self._at(self.sync, local_bsz)

    def _at(self, values: np.ndarray, x: float) -> float:
        xs = self.bsz
        if len(xs) == 1:
            return float(values[0])
        if xs[0] <= x <= xs[-1]:
            return float(np.interp(x, xs, values))
        i, j = (0, 1) if x < xs[0] else (-2, -1)
        slope = (values[j] - values[i]) / (xs[j] - xs[i])
        end = i if x < xs[0] else j
        value = values[end] + slope * (x - xs[end])
        return float(max(value, 0.5 * values[end]))


def _read_csv(path: str, columns: Sequence[str], allow_empty: bool = False) -> list[dict[str, str]]:
    """Rows of a CSV file that must have ``columns`` (and rows unless ``allow_empty``)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {list(columns)}")
        rows = list(reader)
    if not rows and not allow_empty:
        raise ValueError(f"{path}: no data rows")
    return rows


@dataclass(frozen=True)
class _Validation:
    """One validation run at a fixed total batch size: per-epoch arrays."""

    progress: np.ndarray
    grad_sqr: np.ndarray
    grad_var: np.ndarray


class ModelProfile:
    """Everything measured for one model, with interpolation.

    Args:
        name: model name (the trace folder name, e.g. ``"cifar10"``).
        trace_dir: folder with ``placements.csv``, ``scalability.csv`` and
            ``validation-<B>.csv`` files.
        settings: conventions not present in the data (epochs, batch caps).
    """

    def __init__(self, name: str, trace_dir: str, settings: ModelSettings | None = None):
        settings = settings or ModelSettings()
        self.name = name
        self._step_cache: dict[tuple[Placement, float], tuple[float, float]] = {}
        self._placements = self._load_placements(os.path.join(trace_dir, "placements.csv"))
        self._grid = self._build_grid(os.path.join(trace_dir, "scalability.csv"))
        self._validation = self._load_validation(trace_dir)
        batches = sorted(self._validation)
        self._batches = np.array(batches, dtype=float)
        self.init_batch_size = int(settings.init_batch_size or batches[0])
        self.max_batch_size = int(batches[-1])
        measured = self._placements[(1,)]
        self.min_local_bsz = int(measured.min_bsz)
        self.max_local_bsz = int(settings.max_local_bsz or measured.max_bsz)
        rows = min(len(v.progress) for v in self._validation.values())
        self.max_epochs = int(settings.max_epochs or rows)
        if self.max_epochs > rows:
            raise ValueError(
                f"{name}: max_epochs={self.max_epochs} exceeds the {rows} epochs in the validation data")
        self._progress = np.concatenate(
            [[0.0], np.min([v.progress[:rows] for v in self._validation.values()], axis=0)])

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _load_placements(path: str) -> dict[Placement, _Curve]:
        rows = _read_csv(path, ("placement", "local_bsz", "step_time", "sync_time"))
        grouped: dict[Placement, list[tuple[float, float, float]]] = {}
        for row in rows:
            key = canonical_placement(int(c) for c in row["placement"].strip())
            grouped.setdefault(key, []).append(
                (float(row["local_bsz"]), float(row["step_time"]), float(row["sync_time"])))
        if (1,) not in grouped:
            raise ValueError(f"{path}: no measurement for a single GPU (placement 1)")
        return {k: _Curve(*zip(*v)) for k, v in grouped.items()}

    def _build_grid(self, path: str) -> dict[tuple[int, int], _Curve]:
        """Curves by (nodes, replicas): placements averaged, plus scalability rows."""
        points: dict[tuple[int, int], dict[float, list[tuple[float, float]]]] = {}
        for placement, curve in self._placements.items():
            key = (len(placement), sum(placement))
            for b, s, y in zip(curve.bsz, curve.step, curve.sync):
                points.setdefault(key, {}).setdefault(float(b), []).append((s, y))
        if os.path.exists(path):
            rows = _read_csv(path, ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"),
                             allow_empty=True)
            for row in rows:
                key = (int(row["num_nodes"]), int(row["num_replicas"]))
                points.setdefault(key, {}).setdefault(float(row["local_bsz"]), []).append(
                    (float(row["step_time"]), float(row["sync_time"])))
        grid = {}
        for key, by_bsz in points.items():
            bsz = sorted(by_bsz)
            step = [float(np.mean([p[0] for p in by_bsz[b]])) for b in bsz]
            sync = [float(np.mean([p[1] for p in by_bsz[b]])) for b in bsz]
            grid[key] = _Curve(bsz, step, sync)
        return grid

    @staticmethod
    def _load_validation(trace_dir: str) -> dict[int, _Validation]:
        pattern = re.compile(r"^validation-(\d+)\.csv$")
        runs = {}
        for fname in sorted(os.listdir(trace_dir)):
            match = pattern.match(fname)
            if not match:
                continue
            path = os.path.join(trace_dir, fname)
            rows = _read_csv(path, ("progress", "grad_sqr", "grad_var"))
            runs[int(match.group(1))] = _Validation(
                progress=np.array([float(r["progress"]) for r in rows]),
                grad_sqr=np.array([float(r["grad_sqr"]) for r in rows]),
                grad_var=np.array([float(r["grad_var"]) for r in rows]))
        if not runs:
            raise ValueError(f"{trace_dir}: no validation-<batch>.csv files")
        return runs

    # --------------------------------------------------------------- throughput
    def step_time(self, placement: Placement, local_bsz: float) -> tuple[float, float]:
        """Seconds per optimizer step (one micro-batch) and its sync part.

        Args:
            placement: GPUs used on each node, in ring order (e.g. ``(4, 2)``).
            local_bsz: samples per replica per micro-batch.
        """
        key = canonical_placement(placement)
        cached = self._step_cache.get((key, local_bsz))
        if cached is None:
            curve = self._placements.get(key)
            if curve is not None:
                cached = curve(local_bsz)
            else:
                cached = self._interpolate(len(key), sum(key), float(local_bsz))
            self._step_cache[key, local_bsz] = cached
        return cached

    def profile_points(self, num_nodes: int, num_replicas: int) -> list[tuple[int, float, float]]:
        """``(local_bsz, step_time, sync_time)`` a job would measure on
        ``num_replicas`` replicas over ``num_nodes`` nodes, at the measured
        local batch sizes within the model's bounds (interpolated where that
        (nodes, replicas) pair was not measured)."""
        curve = self._grid.get((num_nodes, num_replicas))
        if curve is not None:
            sizes = [b for b in curve.bsz if self.min_local_bsz <= b <= self.max_local_bsz]
        else:
            sizes = [b for b in self._placements[(1,)].bsz if self.min_local_bsz <= b <= self.max_local_bsz]
        points = []
        for b in sizes:
            step, sync = curve(b) if curve is not None else self._interpolate(num_nodes, num_replicas, float(b))
            points.append((int(b), step, sync))
        return points

    def _interpolate(self, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float]:
        node_counts = sorted({n for n, _ in self._grid})
        below = [n for n in node_counts if n <= num_nodes]
        above = [n for n in node_counts if n >= num_nodes]
        brackets = sorted({below[-1] if below else above[0], above[0] if above else below[-1]})
        values = []
        for n in brackets:
            value = self._at_nodes(n, num_replicas, local_bsz)
            if value is not None:
                values.append((n, value))
        if len(values) == 2:
            (n0, v0), (n1, v1) = values
            w = (num_nodes - n0) / (n1 - n0)
            # v0 and v1 have the same fixed length, which mypy cannot see through tuple() of a generator
            return tuple(float((1 - w) * a + w * b) for a, b in zip(v0, v1))  # type: ignore[return-value]
        if values:
            return values[0][1]
        # Outside every measured range: the nearest measured (nodes, replicas).
        nearest = min(self._grid, key=lambda k: (abs(k[0] - num_nodes) + abs(k[1] - num_replicas), k))
        return self._grid[nearest](local_bsz)

    def _at_nodes(self, num_nodes: int, num_replicas: int, local_bsz: float) -> tuple[float, float] | None:
        """Interpolate over replicas among measurements with ``num_nodes`` nodes."""
        reps = sorted(r for n, r in self._grid if n == num_nodes)
        if not reps or not reps[0] <= num_replicas <= reps[-1]:
            return None
        lo = max(r for r in reps if r <= num_replicas)
        hi = min(r for r in reps if r >= num_replicas)
        v0 = self._grid[num_nodes, lo](local_bsz)
        if hi == lo:
            return v0
        v1 = self._grid[num_nodes, hi](local_bsz)
        w = (num_replicas - lo) / (hi - lo)
        return ((1 - w) * v0[0] + w * v1[0], (1 - w) * v0[1] + w * v1[1])

    # -------------------------------------------------------- statistical side
    def progress_at_epoch(self, epoch: int) -> float:
        """Cumulative progress needed to finish ``epoch`` epochs (0 -> 0)."""
        if not 0 <= epoch <= self.max_epochs:
            raise ValueError(f"epoch must be in [0, {self.max_epochs}], got {epoch}")
        return float(self._progress[epoch])

    @property
    def total_progress(self) -> float:
        """Progress at which a job of this model is done."""
        return self.progress_at_epoch(self.max_epochs)

    def grad_stats(self, batch_size: float, epoch: int) -> tuple[float, float]:
        """Gradient (sqr, var) during ``epoch`` at total ``batch_size``.

        Linear between the two validated batch sizes around ``batch_size``
        (the nearest one outside their range); ``var`` is relative to the
        initial batch size.
        """
        epoch = min(max(int(epoch), 0), self.max_epochs - 1)
        sizes = self._batches
        b = float(min(max(batch_size, sizes[0]), sizes[-1]))
        hi = int(np.searchsorted(sizes, b, side="left"))
        lo = hi if sizes[hi] == b else hi - 1
        v_lo, v_hi = self._validation[int(sizes[lo])], self._validation[int(sizes[hi])]
        if lo == hi:
            return float(v_lo.grad_sqr[epoch]), float(v_lo.grad_var[epoch])
        w = (b - sizes[lo]) / (sizes[hi] - sizes[lo])
        sqr = (1 - w) * v_lo.grad_sqr[epoch] + w * v_hi.grad_sqr[epoch]
        var = (1 - w) * v_lo.grad_var[epoch] + w * v_hi.grad_var[epoch]
        return float(sqr), float(var)

    def gain(self, batch_size: float, epoch: int) -> float:
        """Progress per optimizer step at ``batch_size``: the trace's definition.

        ``gain = (var + sqr) / (var / scale + sqr)`` with
        ``scale = batch_size / init_batch_size`` (data README).
        """
        sqr, var = self.grad_stats(batch_size, epoch)
        scale = batch_size / self.init_batch_size
        denom = var / scale + sqr
        return float((var + sqr) / denom) if denom > 0 else 1.0

    def __repr__(self) -> str:
        return (f"ModelProfile({self.name!r}, init_batch_size={self.init_batch_size}, "
                f"max_batch_size={self.max_batch_size}, epochs={self.max_epochs})")


def load_profiles(traces_dir: str = DEFAULT_TRACES_DIR,
                  settings: Mapping[str, ModelSettings] | None = None) -> dict[str, ModelProfile]:
    """Load every model folder under ``traces_dir``.

    Args:
        traces_dir: folder with one sub-folder per model.
        settings: per-model conventions; defaults to :data:`POLLUX_MODELS`.
    """
    if not os.path.isdir(traces_dir):
        raise FileNotFoundError(f"traces directory not found: {traces_dir}")
    settings = POLLUX_MODELS if settings is None else settings
    profiles = {}
    for name in sorted(os.listdir(traces_dir)):
        path = os.path.join(traces_dir, name)
        if os.path.isfile(os.path.join(path, "placements.csv")):
            profiles[name] = ModelProfile(name, path, settings.get(name))
            logger.debug("loaded %r", profiles[name])
    if not profiles:
        raise ValueError(f"no model traces (folders with placements.csv) under {traces_dir}")
    return profiles
