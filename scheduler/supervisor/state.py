"""The supervisor's state: registered jobs, their latest hints, allocations.

Thread-safe and, when given a path, persisted atomically (JSON, temp file +
``os.replace``) after every change, so a restarted supervisor continues
where it stopped. Attained service and restarts are tracked here, from the
allocation history, for the policy.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from adaptive.checkpoint.versions import Format, StateFormatError
from adaptive.goodput import read_json, write_json_atomic
from scheduler.cluster import Allocation, make_allocation

logger = logging.getLogger(__name__)

#: The state file's format (version 1: the jobs with their limits, hints and allocations).
_FORMAT = Format("supervisor state", version=1)
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_job_id(job_id: object) -> str:
    """Return ``job_id`` if it is a safe name (letters, digits, ``._-``, <= 128 chars)."""
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise ValueError(f"job_id must match {_JOB_ID.pattern} (letters, digits, '._-', at most 128), "
                         f"got {job_id!r}")
    return job_id


def _int_field(data: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass
class JobRecord:
    """A registered job: its limits and what the supervisor learned about it."""

    job_id: str
    min_replicas: int = 0
    max_replicas: int = 1
    preemptible: bool = True
    submission_time: float = 0.0
    hints: dict[str, Any] | None = None
    allocation: Allocation = ()
    attained_service: float = 0.0
    num_restarts: int = 0
    starts: int = 0

    SPEC_KEYS = ("min_replicas", "max_replicas", "preemptible", "submission_time")

    @classmethod
    def from_spec(cls, job_id: str, spec: Mapping[str, Any], now: float) -> "JobRecord":
        """Validate a registration body ``{min_replicas, max_replicas, preemptible, submission_time}``."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"job spec must be a JSON object, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(cls.SPEC_KEYS))
        if unknown:
            raise ValueError(f"unknown job spec field(s) {unknown}; allowed: {list(cls.SPEC_KEYS)}")
        low = _int_field(spec, "min_replicas", 0, 0)
        high = _int_field(spec, "max_replicas", max(low, 1), max(low, 1))
        preemptible = spec.get("preemptible", True)
        if not isinstance(preemptible, bool):
            raise ValueError(f"preemptible must be true or false, got {preemptible!r}")
        submitted = spec.get("submission_time", now)
        if isinstance(submitted, bool) or not isinstance(submitted, (int, float)) or not math.isfinite(submitted):
            raise ValueError(f"submission_time must be a finite number, got {submitted!r}")
        return cls(validate_job_id(job_id), low, high, preemptible, float(submitted))

    def public(self) -> dict[str, Any]:
        """JSON view (what ``GET /v1/jobs`` shows)."""
        out = asdict(self)
        out["allocation"] = list(self.allocation)
        return out


@dataclass
class _Snapshot:
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    version: int = 0
    updated: float = 0.0


class SupervisorState:
    """Jobs, hints and allocations, shared by the HTTP handlers and the allocator.

    Args:
        path: JSON file to persist to (``None``: in memory only). Loaded if it
            exists; a corrupt file is an error rather than silently dropped.
        hints_parser: turns a hints dict into a validated object with
            ``state_dict()`` (default :meth:`adaptive.goodput.Hints.from_state_dict`).
        clock: time source (seconds).
    """

    def __init__(self, path: str | None = None, hints_parser: Callable[[Mapping[str, Any]], Any] | None = None,
                 clock: Callable[[], float] = time.time):
        self._hints_parser = hints_parser
        self._clock = clock
        self._path = path
        self._lock = threading.RLock()
        self._state = _Snapshot(updated=clock())
        if path and os.path.exists(path):
            self._load(path)

    def _parse_hints(self, data: Mapping[str, Any]) -> Any:
        if self._hints_parser is None:
            from adaptive.goodput import Hints  # the format jobs report; imported on first use

            self._hints_parser = Hints.from_state_dict
        return self._hints_parser(data)

    # ------------------------------------------------------------ persistence
    def _load(self, path: str) -> None:
        try:
            data = _FORMAT.read(read_json(path))
        except StateFormatError as error:
            raise ValueError(f"{path}: not a supervisor state file that this release reads ({error})") from None
        jobs = {}
        for job_id, raw in data.get("jobs", {}).items():
            record = JobRecord.from_spec(job_id, {k: raw[k] for k in JobRecord.SPEC_KEYS if k in raw}, 0.0)
            if raw.get("hints") is not None:
                record.hints = self._parse_hints(raw["hints"]).state_dict()
            record.allocation = make_allocation(raw.get("allocation", ()))
            record.attained_service = float(raw.get("attained_service", 0.0))
            record.num_restarts = int(raw.get("num_restarts", 0))
            record.starts = int(raw.get("starts", 0))
            jobs[job_id] = record
        self._state = _Snapshot(jobs, int(data.get("allocation_version", 0)),
                                float(data.get("updated", self._clock())))
        logger.info("loaded supervisor state with %d jobs from %s", len(jobs), path)

    def _save(self) -> None:
        if not self._path:
            return
        write_json_atomic(self._path, {
            "version": _FORMAT.version,
            "allocation_version": self._state.version,
            "updated": self._state.updated,
            "jobs": {k: v.public() for k, v in self._state.jobs.items()},
        })

    # ------------------------------------------------------------------- jobs
    def register_job(self, job_id: str, spec: Mapping[str, Any]) -> JobRecord:
        """Add a job (or update its limits, keeping what was learned)."""
        record = JobRecord.from_spec(job_id, spec, self._clock())
        with self._lock:
            old = self._state.jobs.get(job_id)
            if old is not None:
                record.hints, record.allocation = old.hints, old.allocation
                record.attained_service, record.num_restarts, record.starts = (
                    old.attained_service, old.num_restarts, old.starts)
                if "submission_time" not in spec:
                    record.submission_time = old.submission_time
            self._state.jobs[job_id] = record
            self._save()
        logger.info("registered job %s (replicas %d..%d)", job_id, record.min_replicas, record.max_replicas)
        return record

    def remove_job(self, job_id: str) -> None:
        """Forget a job (finished or cancelled)."""
        with self._lock:
            if self._state.jobs.pop(job_id, None) is None:
                raise KeyError(job_id)
            self._save()

    def jobs(self) -> dict[str, JobRecord]:
        """A copy of every job record."""
        with self._lock:
            return copy.deepcopy(self._state.jobs)

    def job(self, job_id: str) -> JobRecord:
        """A copy of one job record (``KeyError`` if unknown)."""
        with self._lock:
            return copy.deepcopy(self._state.jobs[job_id])

    # ------------------------------------------------------------------ hints
    def update_hints(self, job_id: str, hints: Mapping[str, Any]) -> None:
        """Validate and store a job's hints (``KeyError`` for unknown jobs)."""
        parsed = self._parse_hints(dict(hints))
        as_dict = parsed.state_dict()
        if as_dict.get("job_id") != job_id:
            raise ValueError(f"hints job_id {as_dict.get('job_id')!r} does not match job {job_id!r}")
        with self._lock:
            record = self._state.jobs[job_id]
            record.hints = as_dict
            self._save()

    def parsed_hints(self, job_id: str) -> Any:
        """The job's latest hints as a validated object, or ``None``."""
        with self._lock:
            raw = self._state.jobs[job_id].hints
        return None if raw is None else self._parse_hints(raw)

    # ------------------------------------------------------------ allocations
    def set_allocations(self, allocations: Mapping[str, Allocation], now: float | None = None) -> int:
        """Record the policy's decision; returns the new allocation version.

        Service since the last decision is credited at the old allocation;
        a changed non-empty allocation counts as a (re)start.
        """
        now = self._clock() if now is None else now
        with self._lock:
            unknown = sorted(set(allocations) - set(self._state.jobs))
            if unknown:
                raise KeyError(f"allocations for unknown jobs {unknown}")
            elapsed = max(now - self._state.updated, 0.0)
            for job_id, record in self._state.jobs.items():
                record.attained_service += elapsed * len(record.allocation)
                new = make_allocation(allocations.get(job_id, ()))
                if new and new != record.allocation:
                    record.starts += 1
                    record.num_restarts = max(record.starts - 1, 0)
                record.allocation = new
            self._state.version += 1
            self._state.updated = now
            self._save()
            return self._state.version

    def allocation(self, job_id: str) -> tuple[Allocation, int]:
        """``(allocation, version)`` of one job (``KeyError`` if unknown)."""
        with self._lock:
            return self._state.jobs[job_id].allocation, self._state.version

    def allocations(self) -> dict[str, Allocation]:
        """Current non-empty allocations by job."""
        with self._lock:
            return {k: v.allocation for k, v in self._state.jobs.items() if v.allocation}

    def job_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._state.jobs)
