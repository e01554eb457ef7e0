"""Reading a job's metrics file and splitting it into the processes that wrote it.

The library's rank 0 appends step records and events to
``<ADAPTIVE_SHARE_PATH>/metrics.jsonl`` (see :mod:`adaptive.observe.metrics`).
A new ``pid`` in the records, or a ``start`` event, begins a new process
(a restart, whether graceful or after a crash): :func:`load_run` returns
the records grouped that way, as a :class:`Run` of :class:`ProcessSpan`.
Only plain records are read; nothing in the file is executed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable

from adaptive._utils.types import JSON
from adaptive.observe import metrics


@dataclass(frozen=True)
class ProcessSpan:
    """The records one training process (rank 0 of one launch) wrote.

    Attributes:
        pid: process id that wrote them.
        start_time: unix time of its first record (step record or event).
        end_time: unix time of its last record.
        steps: its step records, in file order.
        events: its events, in file order.
    """

    pid: int | None
    start_time: float
    end_time: float
    steps: tuple[JSON, ...]
    events: tuple[JSON, ...]

    @property
    def first_step(self) -> int | None:
        """Optimizer step of its first step record (None without step records)."""
        return self.steps[0].get("step") if self.steps else None

    @property
    def last_step(self) -> int | None:
        """Optimizer step of its last step record (None without step records)."""
        return self.steps[-1].get("step") if self.steps else None

    @property
    def start_event(self) -> JSON | None:
        """Its ``start`` event (what it resumed), None when it wrote none."""
        return next((event for event in self.events if event.get("event") == "start"), None)



@dataclass(frozen=True)
class Run:
    """A job's metrics, ready to summarise and draw.

    Attributes:
        path: the metrics file.
        processes: one :class:`ProcessSpan` per launch, in time order.
        loader: the loader whose records are shown when records name
            several loaders (the one with the most step records), else None.
    """

    path: str
    processes: tuple[ProcessSpan, ...]
    loader: str | None = None

    @property
    def steps(self) -> list[JSON]:
        """All step records, in time order."""
        return [record for process in self.processes for record in process.steps]

    @property
    def events(self) -> list[JSON]:
        """All events, in time order."""
        return [record for process in self.processes for record in process.events]



def find_metrics_file(run_dir: str) -> str:
    """The metrics file of a run: ``run_dir`` itself, or ``metrics.jsonl`` in it or in its ``share/``.

    Accepts the job's ``ADAPTIVE_SHARE_PATH``, the folder above it (for
    example ``runs/demo`` when the share path is ``runs/demo/share``, or
    ``.adaptive/<job id>``), or the file.
    """
    if os.path.isfile(run_dir):
        return run_dir
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"RUN_DIR {run_dir!r} does not exist; pass the job's ADAPTIVE_SHARE_PATH "
                                "(default ./.adaptive/<job id>/share) or the folder above it")
    candidates = [os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "share", "metrics.jsonl")]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"no metrics file in {run_dir!r} (looked for {', '.join(candidates)}); pass the "
                            "job's ADAPTIVE_SHARE_PATH (default ./.adaptive/<job id>/share)")


def load_run(run_dir: str) -> Run:
    """Read a run's metrics (see :func:`find_metrics_file`) and split them into processes."""
    path = find_metrics_file(run_dir)
    steps, events = metrics.read_metrics(path)
    steps, loader = _training_loader_records(steps)
    return Run(path=path, processes=tuple(_split_processes(steps, events)), loader=loader)


def _training_loader_records(steps: list[JSON]) -> tuple[list[JSON], str | None]:
    """Keep the records of one loader when records name several (the one with the most records)."""
    names = [record["loader"] for record in steps if record.get("loader") is not None]
    if len(set(names)) <= 1:
        return steps, None
    chosen = max(set(names), key=lambda name: (names.count(name), name))
    return [record for record in steps if record.get("loader") in (None, chosen)], chosen


@dataclass
class _OpenSpan:
    """The records of the process being read, until the next one starts."""

    pid: int | None
    start: float
    end: float
    steps: list[JSON] = field(default_factory=list)
    events: list[JSON] = field(default_factory=list)


def _split_processes(steps: Iterable[JSON], events: Iterable[JSON]) -> list[ProcessSpan]:
    """Group records by writing process: a new pid, or a ``start`` event, starts a new one."""
    ordered = sorted([(record_time(r), False, r) for r in steps] + [(record_time(r), True, r) for r in events],
                     key=lambda item: item[0])
    spans: list[ProcessSpan] = []
    current: _OpenSpan | None = None
    for when, is_event, record in ordered:
        restarted = current is not None and (record.get("pid") != current.pid
                                             or (is_event and record.get("event") == "start"))
        if current is None or restarted:
            if current is not None:
                spans.append(_close(current))
            current = _OpenSpan(pid=record.get("pid"), start=when, end=when)
        current.end = when
        (current.events if is_event else current.steps).append(record)
    if current is not None:
        spans.append(_close(current))
    return spans


def record_time(record: JSON) -> float:
    """A record's unix time (0 when missing or malformed, so such a record sorts first)."""
    value = finite_number(record.get("time"))
    return 0.0 if value is None else value


def _close(current: _OpenSpan) -> ProcessSpan:
    return ProcessSpan(pid=current.pid, start_time=float(current.start), end_time=float(current.end),
                       steps=tuple(current.steps), events=tuple(current.events))


def finite_number(value: object) -> float | None:
    """A record field as a float; None when it is missing, not a number, or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def finite_int(value: object) -> int | None:
    """A record field as an int (see :func:`finite_number`)."""
    as_float = finite_number(value)
    return None if as_float is None else int(as_float)
