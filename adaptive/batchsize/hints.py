"""Scheduler hints: what a training job tells the cluster scheduler about itself.

A job periodically summarises its throughput model, gradient statistics
and batch-size limits as a small JSON document (format version 1)::

    {
      "version": 1,
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
      "current": {"num_nodes": 1, "num_replicas": 4, "local_bsz": 128, "accum_steps": 1}   # or null
    }

The document is written to ``hints.json`` in the checkpoint directory
(atomically, with :func:`adaptive._utils.files.write_json_atomic`) and, when a scheduler
URL is configured, POSTed to it as ``application/json``.  The scheduler
rebuilds the job's :class:`adaptive.batchsize.goodput.GoodputFunction` from it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

from adaptive._utils.files import write_json_atomic
from adaptive.batchsize.goodput import GoodputFunction, GradParams, PerfParams

__all__ = ["HINTS_VERSION", "HINTS_FILENAME", "CurrentConfig", "Hints", "write_hints", "read_hints", "post_hints"]

logger = logging.getLogger(__name__)

HINTS_VERSION = 1
HINTS_FILENAME = "hints.json"

_CURRENT_FIELDS = ("num_nodes", "num_replicas", "local_bsz", "accum_steps")
_HINT_FIELDS = ("version", "job_id", "timestamp", "init_batch_size", "max_batch_size", "local_bsz_bounds",
                "gradient_accumulation", "perf_params", "grad_params", "max_profiled_replicas",
                "max_profiled_nodes", "progress", "current")


def _field_error(field: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"hints field {field!r} must be {expected}, got {value!r}")


def _int(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field_error(field, f"an integer >= {minimum}", value)
    return value


def _float(value: Any, field: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise _field_error(field, f"a finite number >= {minimum}", value)
    return float(value)


@dataclass(frozen=True)
class CurrentConfig:
    """The configuration a job runs now.  Also readable as a mapping
    (``current["num_replicas"]``), matching its JSON form."""

    num_nodes: int
    num_replicas: int
    local_bsz: int
    accum_steps: int

    def __post_init__(self) -> None:
        for name in _CURRENT_FIELDS:
            _int(getattr(self, name), f"current.{name}", 1)
        if self.num_nodes > self.num_replicas:
            raise ValueError(f"hints field 'current' must have num_nodes <= num_replicas, "
                             f"got {self.num_nodes} > {self.num_replicas}")

    def __getitem__(self, key: str) -> int:
        if key not in _CURRENT_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_CURRENT_FIELDS)

    def __len__(self) -> int:
        return len(_CURRENT_FIELDS)

    def keys(self) -> Tuple[str, ...]:
        return _CURRENT_FIELDS

    def to_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in _CURRENT_FIELDS}

    @classmethod
    def from_dict(cls, data: Any) -> "CurrentConfig":
        if not isinstance(data, Mapping):
            raise _field_error("current", f"an object with keys {list(_CURRENT_FIELDS)} or null", data)
        missing = [k for k in _CURRENT_FIELDS if k not in data]
        unknown = [k for k in data if k not in _CURRENT_FIELDS]
        if missing or unknown:
            raise ValueError(f"hints field 'current' must have exactly the keys {list(_CURRENT_FIELDS)}; "
                             f"missing {missing}, unknown {unknown}")
        return cls(**{k: data[k] for k in _CURRENT_FIELDS})


@dataclass(frozen=True)
class Hints:
    """Validated scheduler hints (see the module docstring for the format).

    Construct directly or with :meth:`from_dict`; every field is checked
    and a bad one raises ValueError naming it.
    """

    job_id: str
    timestamp: float
    init_batch_size: int
    max_batch_size: Optional[int]
    local_bsz_bounds: Optional[Tuple[int, int]]
    gradient_accumulation: bool
    perf_params: Optional[PerfParams]
    grad_params: Optional[GradParams]
    max_profiled_replicas: int
    max_profiled_nodes: int
    progress: float
    current: Optional[CurrentConfig]
    version: int = HINTS_VERSION

    def __post_init__(self) -> None:
        if self.version != HINTS_VERSION:
            raise _field_error("version", str(HINTS_VERSION), self.version)
        if not isinstance(self.job_id, str) or not self.job_id:
            raise _field_error("job_id", "a non-empty string", self.job_id)
        object.__setattr__(self, "timestamp", _float(self.timestamp, "timestamp", 0.0))
        _int(self.init_batch_size, "init_batch_size", 1)
        if self.max_batch_size is not None:
            _int(self.max_batch_size, "max_batch_size", self.init_batch_size)
        self._check_bounds()
        if not isinstance(self.gradient_accumulation, bool):
            raise _field_error("gradient_accumulation", "true or false", self.gradient_accumulation)
        if self.perf_params is not None and not isinstance(self.perf_params, PerfParams):
            raise _field_error("perf_params", "PerfParams or null", self.perf_params)
        if self.grad_params is not None and not isinstance(self.grad_params, GradParams):
            raise _field_error("grad_params", "GradParams or null", self.grad_params)
        _int(self.max_profiled_replicas, "max_profiled_replicas", 0)
        _int(self.max_profiled_nodes, "max_profiled_nodes", 0)
        if self.max_profiled_nodes > max(self.max_profiled_replicas, 0):
            raise ValueError("hints field 'max_profiled_nodes' must be <= max_profiled_replicas, got "
                             f"{self.max_profiled_nodes} > {self.max_profiled_replicas}")
        object.__setattr__(self, "progress", _float(self.progress, "progress", 0.0))
        if self.current is not None and not isinstance(self.current, CurrentConfig):
            raise _field_error("current", "CurrentConfig or null", self.current)

    def _check_bounds(self) -> None:
        bounds = self.local_bsz_bounds
        if bounds is None:
            return
        if not isinstance(bounds, (tuple, list)) or len(bounds) != 2:
            raise _field_error("local_bsz_bounds", "[lo, hi] or null", bounds)
        lo = _int(bounds[0], "local_bsz_bounds[0]", 1)
        hi = _int(bounds[1], "local_bsz_bounds[1]", lo)
        object.__setattr__(self, "local_bsz_bounds", (lo, hi))

    # ------------------------------------------------------------ conversion
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Hints":
        """Parse and validate the JSON form; unknown keys are rejected."""
        if not isinstance(data, Mapping):
            raise ValueError(f"hints must be a JSON object, got {type(data).__name__}")
        unknown = sorted(k for k in data if k not in _HINT_FIELDS)
        if unknown:
            raise ValueError(f"hints have unknown fields {unknown}; allowed fields are {list(_HINT_FIELDS)}")
        missing = [k for k in _HINT_FIELDS if k not in data]
        if missing:
            raise ValueError(f"hints are missing fields {missing}")
        values = dict(data)
        for name, parse in (("perf_params", PerfParams.from_dict), ("grad_params", GradParams.from_dict),
                            ("current", CurrentConfig.from_dict)):
            if values[name] is not None:
                try:
                    values[name] = parse(values[name])
                except ValueError as exc:
                    raise ValueError(f"hints field {name!r} is invalid: {exc}") from None
        bounds = values["local_bsz_bounds"]
        if isinstance(bounds, list):
            values["local_bsz_bounds"] = tuple(bounds)
        return cls(**values)

    def to_dict(self) -> Dict[str, Any]:
        """The JSON form (plain dicts, lists and numbers)."""
        return {
            "version": self.version,
            "job_id": self.job_id,
            "timestamp": self.timestamp,
            "init_batch_size": self.init_batch_size,
            "max_batch_size": self.max_batch_size,
            "local_bsz_bounds": list(self.local_bsz_bounds) if self.local_bsz_bounds is not None else None,
            "gradient_accumulation": self.gradient_accumulation,
            "perf_params": self.perf_params.to_dict() if self.perf_params is not None else None,
            "grad_params": self.grad_params.to_dict() if self.grad_params is not None else None,
            "max_profiled_replicas": self.max_profiled_replicas,
            "max_profiled_nodes": self.max_profiled_nodes,
            "progress": self.progress,
            "current": self.current.to_dict() if self.current is not None else None,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False, allow_nan=False)

    @classmethod
    def from_json(cls, text: Union[str, bytes]) -> "Hints":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"hints are not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def goodput_function(self) -> Optional[GoodputFunction]:
        """The job's goodput model, or None until both parts are known."""
        if self.perf_params is None or self.grad_params is None:
            return None
        return GoodputFunction(self.perf_params, self.grad_params, self.init_batch_size)


def _hints_path(path: Union[str, os.PathLike]) -> Path:
    path = Path(path)
    return path / HINTS_FILENAME if path.is_dir() else path


def write_hints(hints: Hints, directory: Union[str, os.PathLike]) -> Path:
    """Atomically write ``hints`` to ``directory/hints.json``; returns the path."""
    if not isinstance(hints, Hints):
        raise ValueError(f"hints must be a Hints, got {type(hints).__name__}")
    directory = Path(directory)
    target = directory / HINTS_FILENAME
    # The same bytes as ``hints.to_json()`` (what post_hints sends).
    write_json_atomic(target, hints.to_dict(), indent=None, sort_keys=False, allow_nan=False)
    return target


def read_hints(path: Union[str, os.PathLike]) -> Hints:
    """Read hints from a ``hints.json`` file or the directory holding it."""
    with open(_hints_path(path), "rb") as handle:
        return Hints.from_json(handle.read())


def post_hints(url: str, hints: Hints, timeout: float = 5.0, token: Optional[str] = None) -> None:
    """POST ``hints.to_json()`` to ``url`` (``application/json``).

    For the project's supervisor the URL is
    ``<supervisor>/v1/jobs/<job_id>/hints`` and ``token`` its bearer token.

    Raises ``OSError`` (including ``urllib.error.URLError``) when the
    scheduler cannot be reached or answers with an error status; callers
    that must not fail on a missing scheduler catch and log it.
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must be an http(s) URL, got {url!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=hints.to_json().encode("utf-8"), method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (http(s) only)
        response.read()
    logger.debug("posted hints of job %s to %s", hints.job_id, url)
