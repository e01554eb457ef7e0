"""Workload files: which jobs arrive when, as replayed by the simulator.

A workload is a CSV with the columns ``name,time,application,num_replicas,
batch_size``: job name, submission second, model (a trace folder name), and
the tuned fixed configuration that a non-adaptive scheduler would run.
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


@dataclass(frozen=True)
class WorkloadJob:
    """One row of a workload file."""

    name: str
    submission_time: float
    application: str
    num_replicas: int
    batch_size: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("job name must be a non-empty string")
        if self.submission_time < 0:
            raise ValueError(f"job {self.name!r}: time must be >= 0, got {self.submission_time}")
        if self.num_replicas < 1:
            raise ValueError(f"job {self.name!r}: num_replicas must be >= 1, got {self.num_replicas}")
        if self.batch_size < 1:
            raise ValueError(f"job {self.name!r}: batch_size must be >= 1, got {self.batch_size}")


def load_workload(path: str, applications: Iterable[str] | None = None) -> list[WorkloadJob]:
    """Read a workload CSV, sorted by submission time (stable).

    Args:
        path: the CSV file.
        applications: if given, the known model names; other names are an error.

    Raises:
        ValueError: on missing columns, bad values, duplicate names or unknown models.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {list(COLUMNS)}")
        jobs = []
        for lineno, row in enumerate(reader, start=2):
            try:
                jobs.append(WorkloadJob(
                    name=row["name"].strip(),
                    submission_time=float(row["time"]),
                    application=row["application"].strip(),
                    num_replicas=int(row["num_replicas"]),
                    batch_size=int(row["batch_size"])))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    if not jobs:
        raise ValueError(f"{path}: no jobs")
    dupes = sorted(n for n, c in Counter(j.name for j in jobs).items() if c > 1)
    if dupes:
        raise ValueError(f"{path}: duplicate job names {dupes}")
    if applications is not None:
        known = set(applications)
        unknown = sorted({j.application for j in jobs} - known)
        if unknown:
            raise ValueError(f"{path}: unknown application(s) {unknown}; known: {sorted(known)}")
    logger.debug("loaded %d jobs from %s", len(jobs), path)
    return sorted(jobs, key=lambda j: j.submission_time)
