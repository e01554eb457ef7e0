"""The scheduler hints format: what a training job tells the cluster scheduler about itself.

A job periodically summarises its throughput model, gradient statistics,
batch-size limits and how much of its declared training is done as a small
JSON document (format version 2)::

    {
      "version": 2,
      "job_id": "bert-7",
      "timestamp": 1767225600.0,
      "init_batch_size": 256,
      "max_batch_size": 4096,              # or null
      "local_bsz_bounds": [32, 512],       # or null
      "gradient_accumulation": true,
      "perf_params": {"alpha_c": ..., ..., "gamma": ...},   # or null until fitted
      "grad_params": {"sqr": ..., "var": ...},              # or null until measured
      "max_profiled_replicas": 4,
      "max_profiled_nodes": 1,
      "progress": 1234.5,                  # scale-invariant progress (sum of gains)
      "current": {"num_nodes": 1, "num_replicas": 4, "local_bsz": 128, "accum_steps": 1},  # or null
      "completed_fraction": 0.35           # or null: no declared epoch count
    }

``completed_fraction`` is the part of the job's declared training that is
done, in [0, 1]: finished epochs plus the position in the current one, over
the ``N`` of ``for epoch in remaining_epochs_until(N)``.  It is null when the
script declares no epoch count (it does not loop with
:func:`~adaptive.elastic.epoch.remaining_epochs_until`) or reports outside
that loop.  The scheduler uses it to estimate a job's remaining work.

The document is :meth:`Hints.state_dict` (read back with
:meth:`Hints.from_state_dict`, which refuses a newer format version).
Version 1 documents (written before ``completed_fraction`` existed) are
migrated explicitly and read with ``completed_fraction`` null.  Its nested
records carry no version of their own: the document's version covers
them.  It is written to ``hints.json`` in the checkpoint directory
(atomically, with :func:`adaptive.goodput.write_json_atomic`) and, when a scheduler
URL is configured, POSTed to it as ``application/json``
(:func:`adaptive.batchsize.hint_posting.post_hints`, the job's side only).
The scheduler rebuilds the job's :class:`adaptive.goodput.model.GoodputFunction`
from it.  This module is the format both sides share, torch-free.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from adaptive._utils.checks import check_bool, check_float, check_int
from adaptive._utils.files import write_json_atomic
from adaptive._utils.types import JSON, StateDict
from adaptive.checkpoint.versions import UNVERSIONED, Format, StateFormatError, check_fields, read_state
from adaptive.goodput.model import GoodputFunction, GradParams, PerfParams

__all__ = ["HINTS_VERSION", "HINTS_FILENAME", "CurrentConfig", "Hints", "write_hints", "read_hints"]

logger = logging.getLogger(__name__)

HINTS_FILENAME = "hints.json"

_CURRENT_FIELDS = ("num_nodes", "num_replicas", "local_bsz", "accum_steps")
_HINT_FIELDS = ("version", "job_id", "timestamp", "init_batch_size", "max_batch_size", "local_bsz_bounds",
                "gradient_accumulation", "perf_params", "grad_params", "max_profiled_replicas",
                "max_profiled_nodes", "progress", "current", "completed_fraction")


def _v1_to_v2(fields: StateDict) -> StateDict:
    """A version 1 document predates ``completed_fraction``: it reads as null (nothing declared)."""
    if "completed_fraction" in fields:
        raise StateFormatError(f"{_field('completed_fraction')} is not part of hints format version 1; "
                               f"a document with it must have version {HINTS_VERSION}")
    return dict(fields, completed_fraction=None)


#: The hints document's format (2 adds ``completed_fraction``; version 1 documents are migrated).
_FORMAT = Format("hints", version=2, migrations={1: _v1_to_v2})
#: The format version of the hints document this release writes.
HINTS_VERSION = _FORMAT.version


def _field(name: str) -> str:
    return f"hints field {name!r}"


def _check_keys(fields: Mapping[str, object]) -> None:
    """StateFormatError unless ``fields`` (a document without its version, in
    the current format) has exactly the hints fields."""
    unknown = sorted(k for k in fields if k not in _HINT_FIELDS)
    if unknown:
        raise StateFormatError(f"hints have unknown fields {unknown}; allowed fields are {list(_HINT_FIELDS)}")
    missing = [k for k in _HINT_FIELDS if k != "version" and k not in fields]
    if missing:
        raise StateFormatError(f"hints are missing fields {missing}")


def _nested(record: PerfParams | GradParams | CurrentConfig | None) -> StateDict | None:
    """A record as the hints document holds it: its fields without a version of
    their own (the document's ``version`` covers its parts, and every release's
    scheduler reads this layout)."""
    if record is None:
        return None
    fields = record.state_dict()
    del fields["version"]
    return fields


@dataclass(frozen=True)
class CurrentConfig:
    """The configuration a job runs now.  Also readable as a mapping
    (``current["num_replicas"]``), matching its JSON form."""

    #: Format of :meth:`state_dict` (1: the four counts; in hints without a version).
    version = 1

    num_nodes: int
    num_replicas: int
    local_bsz: int
    accum_steps: int

    def __post_init__(self) -> None:
        for name in _CURRENT_FIELDS:
            check_int(_field(f"current.{name}"), getattr(self, name), 1)
        if self.num_nodes > self.num_replicas:
            raise ValueError(f"hints field 'current' must have num_nodes <= num_replicas, "
                             f"got {self.num_nodes} > {self.num_replicas}")

    def __getitem__(self, key: str) -> int:
        if key not in _CURRENT_FIELDS:
            raise KeyError(key)
        return int(getattr(self, key))

    def __iter__(self) -> Iterator[str]:
        return iter(_CURRENT_FIELDS)

    def __len__(self) -> int:
        return len(_CURRENT_FIELDS)

    def keys(self) -> tuple[str, ...]:
        return _CURRENT_FIELDS

    def state_dict(self) -> dict[str, int]:
        """The four counts and the format version."""
        return {"version": self.version, **{name: getattr(self, name) for name in _CURRENT_FIELDS}}

    @classmethod
    def from_state_dict(cls, state: object) -> CurrentConfig:
        """Validated inverse of :meth:`state_dict` (as in hints: without a version, read as version 1)."""
        fields = read_state(_field("current"), state, cls, unversioned=UNVERSIONED)
        check_fields(_field("current"), fields, _CURRENT_FIELDS)
        return cls(**{k: fields[k] for k in _CURRENT_FIELDS})


@dataclass(frozen=True)
class Hints:
    """Validated scheduler hints (see the module docstring for the format).

    Construct directly or with :meth:`from_state_dict`; every field is
    checked, and a bad one raises an error naming it (TypeError for a
    wrong type, ValueError for a bad value; :meth:`from_state_dict`
    reports everything wrong with a document as ValueError).
    """

    job_id: str
    timestamp: float
    init_batch_size: int
    max_batch_size: int | None
    local_bsz_bounds: tuple[int, int] | None
    gradient_accumulation: bool
    perf_params: PerfParams | None
    grad_params: GradParams | None
    max_profiled_replicas: int
    max_profiled_nodes: int
    progress: float
    current: CurrentConfig | None
    version: int = HINTS_VERSION
    completed_fraction: float | None = None  # last, with a default: constructors without it keep working

    def __post_init__(self) -> None:
        if self.version != HINTS_VERSION:
            raise ValueError(f"{_field('version')} must be {HINTS_VERSION}, got {self.version!r}")
        if not isinstance(self.job_id, str):
            raise TypeError(f"{_field('job_id')} must be a non-empty string, got {self.job_id!r}")
        if not self.job_id:
            raise ValueError(f"{_field('job_id')} must be a non-empty string, got {self.job_id!r}")
        object.__setattr__(self, "timestamp", check_float(_field("timestamp"), self.timestamp, 0.0))
        check_int(_field("init_batch_size"), self.init_batch_size, 1)
        if self.max_batch_size is not None:
            check_int(_field("max_batch_size"), self.max_batch_size, self.init_batch_size)
        self._check_bounds()
        check_bool(_field("gradient_accumulation"), self.gradient_accumulation)
        for name, kind in (("perf_params", PerfParams), ("grad_params", GradParams), ("current", CurrentConfig)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{_field(name)} must be a {kind.__name__} or None, got {value!r}")
        check_int(_field("max_profiled_replicas"), self.max_profiled_replicas, 0)
        check_int(_field("max_profiled_nodes"), self.max_profiled_nodes, 0)
        if self.max_profiled_nodes > max(self.max_profiled_replicas, 0):
            raise ValueError("hints field 'max_profiled_nodes' must be <= max_profiled_replicas, got "
                             f"{self.max_profiled_nodes} > {self.max_profiled_replicas}")
        object.__setattr__(self, "progress", check_float(_field("progress"), self.progress, 0.0))
        if self.completed_fraction is not None:
            object.__setattr__(self, "completed_fraction",
                               check_float(_field("completed_fraction"), self.completed_fraction, 0.0, 1.0))

    def _check_bounds(self) -> None:
        bounds = self.local_bsz_bounds
        if bounds is None:
            return
        if not isinstance(bounds, (tuple, list)):
            raise TypeError(f"{_field('local_bsz_bounds')} must be [lo, hi] or null, got {bounds!r}")
        if len(bounds) != 2:
            raise ValueError(f"{_field('local_bsz_bounds')} must be [lo, hi] or null, got {bounds!r}")
        lo = check_int(_field("local_bsz_bounds[0]"), bounds[0], 1)
        hi = check_int(_field("local_bsz_bounds[1]"), bounds[1], lo)
        object.__setattr__(self, "local_bsz_bounds", (lo, hi))

    # ------------------------------------------------------------ conversion
    @classmethod
    def from_state_dict(cls, state: Mapping[str, object]) -> Hints:
        """Parse and validate the JSON form; unknown keys are rejected.

        An older format version is migrated explicitly (a version 1
        document reads with ``completed_fraction=None``); a newer one is
        refused.  Every problem is a ValueError (a :class:`StateFormatError`
        for the format itself), so that a reader of posted or written hints
        can refuse a bad document without guarding against other errors.
        """
        if not isinstance(state, Mapping):
            raise StateFormatError(f"hints must be a JSON object, got {type(state).__name__}")
        values = _FORMAT.read(state)
        _check_keys(values)
        for name, parse in (("perf_params", PerfParams.from_state_dict),
                            ("grad_params", GradParams.from_state_dict),
                            ("current", CurrentConfig.from_state_dict)):
            if values[name] is not None:
                try:
                    values[name] = parse(values[name])
                except (TypeError, ValueError) as exc:
                    raise StateFormatError(f"hints field {name!r} is invalid: {exc}") from None
        bounds = values["local_bsz_bounds"]
        if isinstance(bounds, list):
            values["local_bsz_bounds"] = tuple(bounds)
        try:
            return cls(**values)
        except TypeError as exc:  # a wrong type in a document is a bad document
            raise StateFormatError(str(exc)) from None

    def state_dict(self) -> JSON:
        """The JSON form (plain dicts, lists and numbers), format :data:`HINTS_VERSION`."""
        return {
            "version": self.version,
            "job_id": self.job_id,
            "timestamp": self.timestamp,
            "init_batch_size": self.init_batch_size,
            "max_batch_size": self.max_batch_size,
            "local_bsz_bounds": list(self.local_bsz_bounds) if self.local_bsz_bounds is not None else None,
            "gradient_accumulation": self.gradient_accumulation,
            "perf_params": _nested(self.perf_params),
            "grad_params": _nested(self.grad_params),
            "max_profiled_replicas": self.max_profiled_replicas,
            "max_profiled_nodes": self.max_profiled_nodes,
            "progress": self.progress,
            "current": _nested(self.current),
            "completed_fraction": self.completed_fraction,
        }

    def to_json(self) -> str:
        """:meth:`state_dict` as JSON text (what :func:`write_hints` writes and
        :func:`~adaptive.batchsize.hint_posting.post_hints` sends)."""
        return json.dumps(self.state_dict(), sort_keys=False, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Hints:
        """:meth:`from_state_dict` of JSON text."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StateFormatError(f"hints are not valid JSON: {exc}") from None
        return cls.from_state_dict(data)

    def goodput_function(self) -> GoodputFunction | None:
        """The job's goodput model, or None until both parts are known."""
        if self.perf_params is None or self.grad_params is None:
            return None
        return GoodputFunction(self.perf_params, self.grad_params, self.init_batch_size)


def _hints_path(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    return path / HINTS_FILENAME if path.is_dir() else path


def write_hints(hints: Hints, directory: str | os.PathLike[str]) -> Path:
    """Atomically write ``hints`` to ``directory/hints.json``; returns the path."""
    if not isinstance(hints, Hints):
        raise TypeError(f"hints must be a Hints, got {type(hints).__name__}")
    directory = Path(directory)
    target = directory / HINTS_FILENAME
    # The same bytes as ``hints.to_json()`` (what post_hints sends).
    write_json_atomic(target, hints.state_dict(), indent=None, sort_keys=False, allow_nan=False)
    return target


def read_hints(path: str | os.PathLike[str]) -> Hints:
    """Read hints from a ``hints.json`` file or the directory holding it."""
    with open(_hints_path(path), "rb") as handle:
        return Hints.from_json(handle.read())

