"""``adaptive report``: a picture and a short summary of one job's metrics.

The library's rank 0 appends step records and events to
``<ADAPTIVE_SHARE_PATH>/metrics.jsonl`` (see :mod:`adaptive.observe.metrics`).  This
module reads that file and

* splits it into *processes*: a new ``pid`` in the records, or a ``start``
  event, begins a new one (a restart, whether graceful or after a crash);
* summarises the run (:func:`summarize`): restarts, wall time lost between
  the last record of one process and the first of the next, replica-count
  changes (at the step the new process continued from), *progress lost*
  (a process that started from scratch although earlier ones had trained,
  or that resumed a checkpoint older than the step already reached:
  :func:`progress_losses`), initial and final batch size, and the mean
  goodput relative to the goodput measured at the initial batch size;
* draws one PNG (:func:`render_png`, needs the optional ``matplotlib``):
  global and local batch size, accumulation steps and replicas, noise scale,
  gain and LR factor, samples/s and goodput, against the optimizer step (left
  column) and the wall time (right column), with restarts and replica-count
  changes marked by vertical lines, and the steps trained again after a
  loss of progress shaded.

Only plain records are read; nothing in the file is executed.  The command
line is ``adaptive report RUN_DIR`` (:mod:`adaptive.observe.cli`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from adaptive.observe import metrics

__all__ = [
    "MissingDependencyError",
    "ProcessSpan",
    "ProgressLoss",
    "ReplicaChange",
    "Run",
    "RunSummary",
    "INSTALL_HINT",
    "find_metrics_file",
    "format_summary",
    "load_run",
    "progress_losses",
    "render_png",
    "replica_changes",
    "resumed_step",
    "summarize",
]

logger = logging.getLogger(__name__)

#: What to install for the PNG.
INSTALL_HINT = 'pip install "adaptive-elastic[report]" (in a source checkout: pip install -e ".[report]")'

#: Records at the initial batch size that define the baseline goodput.
_BASELINE_RECORDS = 3


class MissingDependencyError(ImportError):
    """An optional dependency (matplotlib for the PNG) is not installed."""


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
    steps: tuple[dict, ...]
    events: tuple[dict, ...]

    @property
    def first_step(self) -> int | None:
        """Optimizer step of its first step record (None without step records)."""
        return self.steps[0].get("step") if self.steps else None

    @property
    def last_step(self) -> int | None:
        """Optimizer step of its last step record (None without step records)."""
        return self.steps[-1].get("step") if self.steps else None

    @property
    def start_event(self) -> dict | None:
        """Its ``start`` event (what it resumed), None when it wrote none."""
        return next((event for event in self.events if event.get("event") == "start"), None)


@dataclass(frozen=True)
class ProgressLoss:
    """A process continued from behind the point earlier processes had trained to.

    Either it started from scratch (it resumed no checkpoint although earlier
    processes had trained: a missing, unreadable or never written
    checkpoint), or it resumed a checkpoint older than the step already
    reached (a crash rolls back to the last complete checkpoint).

    Attributes:
        process: index of the process in :attr:`Run.processes` (0 is the first).
        pid: its process id.
        time: unix time of its first record.
        from_scratch: True when its ``start`` event says it resumed no checkpoint.
        checkpoint: sequence number of the checkpoint it resumed (None from scratch or unknown).
        reached_step: the highest optimizer step earlier processes had reached.
        reached_epoch: the highest epoch earlier processes had been in (None if unknown).
        resumed_step: the step it continued from (0 from scratch; its first step
            record's when its start event does not say).
        resumed_epoch: the epoch it continued from (0 from scratch; None if unknown).
    """

    process: int
    pid: int | None
    time: float
    from_scratch: bool
    checkpoint: int | None
    reached_step: int
    reached_epoch: int | None
    resumed_step: int
    resumed_epoch: int | None

    @property
    def steps_lost(self) -> int:
        """Optimizer steps trained again (or to train again)."""
        return self.reached_step - self.resumed_step

    @property
    def epochs_lost(self) -> int | None:
        """Epochs gone back (the epoch in progress counts), None when an epoch is unknown."""
        if self.reached_epoch is None or self.resumed_epoch is None:
            return None
        return max(0, self.reached_epoch - self.resumed_epoch)

    def describe(self) -> str:
        """One sentence for ``adaptive report``."""
        where = f"step {self.reached_step}" + ("" if self.reached_epoch is None else f" (epoch {self.reached_epoch})")
        epochs = self.epochs_lost
        lost = f"{self.steps_lost} steps" + (f" and {epochs} epochs" if epochs else "")
        if self.from_scratch:
            return (f"PROGRESS LOST: process {self.process + 1} (pid {self.pid}) started from scratch although "
                    f"earlier processes had trained to {where}: {lost} lost. It resumed no checkpoint: read its "
                    "log for checkpoint errors, and check that every launch uses the same persistent "
                    "ADAPTIVE_CHECKPOINT_PATH")
        resumed = "a checkpoint" if self.checkpoint is None else f"checkpoint {self.checkpoint}"
        at = f"step {self.resumed_step}" + ("" if self.resumed_epoch is None else f" (epoch {self.resumed_epoch})")
        return (f"progress lost: process {self.process + 1} (pid {self.pid}) resumed {resumed} at {at} although "
                f"{where} had been reached: {lost} trained again (after a crash training rolls back to the last "
                "complete checkpoint; ADAPTIVE_CHECKPOINT_INTERVAL bounds how far)")


@dataclass(frozen=True)
class ReplicaChange:
    """The number of replicas differs from the previous step record."""

    time: float
    step: int | None
    before: int
    after: int


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
    def steps(self) -> list[dict]:
        """All step records, in time order."""
        return [record for process in self.processes for record in process.steps]

    @property
    def events(self) -> list[dict]:
        """All events, in time order."""
        return [record for process in self.processes for record in process.events]


@dataclass(frozen=True)
class RunSummary:
    """The numbers ``adaptive report`` prints (see :func:`summarize`)."""

    path: str
    step_records: int
    processes: int
    restarts: int
    time_lost: float
    wall_time: float
    first_step: int | None
    final_step: int | None
    replica_changes: tuple[ReplicaChange, ...]
    initial_replicas: int | None
    final_replicas: int | None
    initial_batch_size: int | None
    final_batch_size: int | None
    batch_size_decisions: int
    checkpoints: int
    baseline_goodput: float | None
    mean_goodput: float | None
    goodput_gain: float | None
    loader: str | None = None
    unit: str = "samples"
    notes: tuple[str, ...] = field(default=())
    progress_losses: tuple[ProgressLoss, ...] = field(default=())

    @property
    def restarts_from_scratch(self) -> int:
        """Processes that started from scratch although earlier ones had trained."""
        return sum(1 for loss in self.progress_losses if loss.from_scratch)

    @property
    def steps_lost(self) -> int:
        """Optimizer steps trained again over the whole run (see :class:`ProgressLoss`)."""
        return sum(loss.steps_lost for loss in self.progress_losses)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (for ``adaptive report --json``)."""
        out = {key: getattr(self, key) for key in self.__dataclass_fields__}
        out["replica_changes"] = [vars(change) for change in self.replica_changes]
        out["progress_losses"] = [dict(vars(loss), steps_lost=loss.steps_lost, epochs_lost=loss.epochs_lost)
                                  for loss in self.progress_losses]
        out["restarts_from_scratch"] = self.restarts_from_scratch
        out["steps_lost"] = self.steps_lost
        out["notes"] = list(self.notes)
        return out


# ---------------------------------------------------------------------- reading


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


def _training_loader_records(steps: list[dict]) -> tuple[list[dict], str | None]:
    """Keep the records of one loader when records name several (the one with the most records)."""
    names = [record["loader"] for record in steps if record.get("loader") is not None]
    if len(set(names)) <= 1:
        return steps, None
    chosen = max(set(names), key=lambda name: (names.count(name), name))
    return [record for record in steps if record.get("loader") in (None, chosen)], chosen


def _split_processes(steps: Iterable[dict], events: Iterable[dict]) -> list[ProcessSpan]:
    """Group records by writing process: a new pid, or a ``start`` event, starts a new one."""
    ordered = sorted([(_time(r), False, r) for r in steps] + [(_time(r), True, r) for r in events],
                     key=lambda item: item[0])
    spans: list[ProcessSpan] = []
    current: dict[str, Any] | None = None
    for when, is_event, record in ordered:
        restarted = current is not None and (record.get("pid") != current["pid"]
                                             or (is_event and record.get("event") == "start"))
        if current is None or restarted:
            if current is not None:
                spans.append(_close(current))
            current = {"pid": record.get("pid"), "start": when, "end": when, "steps": [], "events": []}
        current["end"] = when
        current["events" if is_event else "steps"].append(record)
    if current is not None:
        spans.append(_close(current))
    return spans


def _time(record: dict) -> float:
    """A record's unix time (0 when missing or malformed, so such a record sorts first)."""
    value = _number(record.get("time"))
    return 0.0 if value is None else value


def _close(current: dict[str, Any]) -> ProcessSpan:
    return ProcessSpan(pid=current["pid"], start_time=float(current["start"]), end_time=float(current["end"]),
                       steps=tuple(current["steps"]), events=tuple(current["events"]))


# ---------------------------------------------------------------------- summary


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def replica_changes(records: Sequence[dict], loader: str | None = None) -> list[ReplicaChange]:
    """Records (in time order) whose ``replicas`` differs from the previous record that has one.

    Step records always carry ``replicas``; events may (a ``start`` event
    does), which catches a change in a process that ended before its first
    step record.  A change seen at a ``start`` event is at the step that
    process continued from: the resumed checkpoint's step of ``loader`` (see
    :func:`resumed_step`), 0 after a start from scratch, None when the event
    does not say (:func:`summarize` then takes the next step record's).
    """
    changes, previous = [], None
    for record in records:
        replicas = record.get("replicas")
        if replicas is None:
            continue
        if previous is not None and replicas != previous:
            step = resumed_step(record, loader) if record.get("event") == "start" else _int(record.get("step"))
            changes.append(ReplicaChange(time=_time(record), step=step, before=int(previous), after=int(replicas)))
        previous = replicas
    return changes


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _started_from_scratch(start: dict) -> bool:
    """A ``start`` event that says its process resumed no checkpoint (``"resumed": null``)."""
    return "resumed" in start and start["resumed"] is None


def resumed_step(start: dict, loader: str | None = None) -> int | None:
    """The optimizer step of ``loader`` a process continued from, read from its ``start`` event.

    0 when it resumed no checkpoint.  Otherwise the step the checkpoint was
    saved at: from the event's ``loader_steps`` (every loader's step) when
    present, else its ``step`` when the event's ``loader`` (the loader whose
    step that is) is ``loader``.  An event that names no loader is only
    trusted when ``loader`` is None (records that name no loader either):
    the checkpoint may have been taken in another loader's loop, such as a
    validation loop.  None when unknown.
    """
    if _started_from_scratch(start):
        return 0
    steps = start.get("loader_steps")
    if isinstance(steps, dict) and steps:
        if loader is not None:
            return _int(steps.get(loader))
        named = start.get("loader")
        if named is not None:
            return _int(steps.get(named))
        return _int(next(iter(steps.values()))) if len(steps) == 1 else None
    named = start.get("loader")
    if loader is not None and (named is None or str(named) != loader):
        return None
    return _int(start.get("step"))


def _shown_loader(run: Run) -> str | None:
    """Name of the loader whose step records are shown (None when the records name none)."""
    if run.loader is not None:
        return run.loader
    names = {str(record["loader"]) for record in run.steps if record.get("loader") is not None}
    return names.pop() if len(names) == 1 else None


def progress_losses(run: Run) -> list[ProgressLoss]:
    """Processes that continued from behind where earlier processes had trained.

    A process started from scratch when its ``start`` event has
    ``"resumed": null`` although earlier processes reached a step above 0;
    it rolled back when it resumed a checkpoint older than the highest step
    already reached (read from the step records, which come every
    ``ADAPTIVE_METRICS_INTERVAL`` steps, so a roll-back of fewer steps may go
    unseen).  Without a ``start`` event its first step record is the
    point it continued from.  After a loss, later processes are compared
    with what was trained since, so each lost step is counted once.
    """
    loader = _shown_loader(run)
    losses: list[ProgressLoss] = []
    reached_step: int | None = None
    reached_epoch: int | None = None

    def reach(step: int | None, epoch: int | None) -> None:
        nonlocal reached_step, reached_epoch
        if step is not None:
            reached_step = step if reached_step is None else max(reached_step, step)
        if epoch is not None:
            reached_epoch = epoch if reached_epoch is None else max(reached_epoch, epoch)

    for index, process in enumerate(run.processes):
        start = process.start_event
        scratch = start is not None and _started_from_scratch(start)
        step = resumed_step(start, loader) if start is not None else None
        epoch = 0 if scratch else (_int(start.get("epoch")) if start is not None else None)
        if step is None and process.first_step is not None:  # the start event does not say: the first record
            step = _int(process.first_step)
            epoch = _int(process.steps[0].get("epoch")) if epoch is None else epoch
        if step is not None:
            if index and reached_step is not None and 0 < reached_step and step < reached_step:
                losses.append(ProgressLoss(
                    process=index, pid=process.pid, time=process.start_time, from_scratch=scratch,
                    checkpoint=None if start is None or scratch else _int(start.get("resumed")),
                    reached_step=reached_step, reached_epoch=reached_epoch, resumed_step=step,
                    resumed_epoch=epoch))
            # training goes on from here: what lay beyond is lost (and counted) once
            reached_step, reached_epoch = step, epoch
        for record in process.steps:
            reach(_int(record.get("step")), _int(record.get("epoch")))
    return losses


def _batch_size_of(record: dict) -> int | None:
    """Global batch size a record reports: a step record's, or a batch-size decision's new size."""
    if record.get("event") == "batch_size":
        return record.get("after")
    return record.get("batch_size")


def _baseline_goodput(steps: Sequence[dict]) -> tuple[float | None, list[str]]:
    """Mean goodput of the first records at the initial batch size (the run's starting point)."""
    notes: list[str] = []
    initial = next((r.get("batch_size") for r in steps if r.get("batch_size") is not None), None)
    measured = [r for r in steps if _number(r.get("goodput")) is not None]
    if not measured:
        return None, notes
    at_initial = [r for r in measured if r.get("batch_size") == initial]
    if not at_initial:
        at_initial = measured
        notes.append(f"no goodput was measured at the initial batch size {initial}; the baseline is the first "
                     f"goodput measured (batch size {measured[0].get('batch_size')})")
    chosen = at_initial[:_BASELINE_RECORDS]
    return sum(_number(r["goodput"]) for r in chosen) / len(chosen), notes


def summarize(run: Run) -> RunSummary:
    """Restarts, time lost, replica changes, batch sizes and goodput gain of a run.

    * ``restarts``: processes after the first.
    * ``time_lost``: seconds between the last record of each process and the
      first record of the next, summed.  Records come every
      ``ADAPTIVE_METRICS_INTERVAL`` steps, so this includes up to one interval
      of training on each side; steps redone after rolling back to an older
      checkpoint are not counted.
    * ``goodput_gain``: mean goodput over all step records divided by the
      mean goodput of the first few records at the initial batch size.
    * ``replica_changes``: at the step the new process continued from (see
      :func:`replica_changes`), else the first step record after the change.
    * ``progress_losses``: see :func:`progress_losses`.
    """
    steps, events = run.steps, run.events
    notes: list[str] = []
    spans = run.processes
    lost = sum(max(0.0, later.start_time - earlier.end_time) for earlier, later in zip(spans, spans[1:]))
    timeline = sorted(steps + events, key=_time)
    replicas = [r["replicas"] for r in timeline if r.get("replicas") is not None]
    batch_sizes = [size for size in map(_batch_size_of, timeline) if size is not None]
    goodputs = [g for g in (_number(r.get("goodput")) for r in steps) if g is not None]
    baseline, baseline_notes = _baseline_goodput(steps)
    notes.extend(baseline_notes)
    mean_goodput = sum(goodputs) / len(goodputs) if goodputs else None
    gain = mean_goodput / baseline if mean_goodput is not None and baseline else None
    if not goodputs and steps:
        notes.append("no goodput in the records (it needs AdaptiveDataParallel and a gradient noise-scale estimate)")
    changes = [change if change.step is not None else
               ReplicaChange(time=change.time, step=_first_step_after(steps, change.time), before=change.before,
                             after=change.after)
               for change in replica_changes(timeline, _shown_loader(run))]
    return RunSummary(
        path=run.path, step_records=len(steps), processes=len(spans), restarts=max(0, len(spans) - 1),
        time_lost=lost, wall_time=(spans[-1].end_time - spans[0].start_time) if spans else 0.0,
        first_step=steps[0].get("step") if steps else None, final_step=steps[-1].get("step") if steps else None,
        replica_changes=tuple(changes),
        initial_replicas=replicas[0] if replicas else None, final_replicas=replicas[-1] if replicas else None,
        initial_batch_size=batch_sizes[0] if batch_sizes else None,
        final_batch_size=batch_sizes[-1] if batch_sizes else None,
        batch_size_decisions=sum(1 for e in events if e.get("event") == "batch_size"),
        checkpoints=sum(1 for e in events if e.get("event") == "checkpoint"),
        baseline_goodput=baseline, mean_goodput=mean_goodput, goodput_gain=gain, loader=run.loader,
        unit=next((r["unit"] for r in steps if r.get("unit")), "samples"), notes=tuple(notes),
        progress_losses=tuple(progress_losses(run)))


def _first_step_after(steps: Sequence[dict], when: float) -> int | None:
    """The step of the first step record at or after ``when`` (None if none)."""
    return next((_int(r.get("step")) for r in steps if _time(r) >= when and _int(r.get("step")) is not None), None)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def format_summary(summary: RunSummary) -> str:
    """The summary as a few human-readable lines."""
    lines = [f"metrics: {summary.path} ({summary.step_records} step records, steps "
             f"{summary.first_step}..{summary.final_step}, {_duration(summary.wall_time)} wall time)"]
    if summary.loader is not None:
        lines.append(f"loader: {summary.loader} (records of other loaders are left out)")
    scratch = summary.restarts_from_scratch
    lines.append(f"restarts: {summary.restarts} (time lost between processes: {_duration(summary.time_lost)})"
                 + (f"; {scratch} started from scratch" if scratch else ""))
    for loss in summary.progress_losses:
        lines.append(loss.describe())
    scratch_times = {loss.time for loss in summary.progress_losses if loss.from_scratch}
    changes = ", ".join(f"{c.before}->{c.after} at " + ("an unknown step" if c.step is None else f"step {c.step}")
                        + (" (started from scratch)" if c.time in scratch_times else "")
                        for c in summary.replica_changes) or "none"
    lines.append(f"replicas: {summary.initial_replicas} at start, {summary.final_replicas} at the end; "
                 f"changes: {changes}")
    unit = "" if summary.unit == "samples" else f" {summary.unit}"
    lines.append(f"batch size: {summary.initial_batch_size}{unit} at start, final {summary.final_batch_size}{unit} "
                 f"({summary.batch_size_decisions} autoscale decisions)")
    if summary.goodput_gain is None:
        lines.append("goodput: not measured")
    else:
        cause = "" if summary.batch_size_decisions else \
            " (no batch-size decisions: the change is throughput, e.g. replicas or machine load)"
        lines.append(f"goodput: mean {summary.mean_goodput:.1f} vs {summary.baseline_goodput:.1f} at the initial "
                     f"batch size: gain x{summary.goodput_gain:.2f}{cause}")
    if summary.checkpoints:
        lines.append(f"checkpoints written: {summary.checkpoints}")
    lines.extend(f"note: {note}" for note in summary.notes)
    return "\n".join(lines)


# ---------------------------------------------------------------------- drawing

#: (panel title, [(record key, label, line style)], log scale allowed)
_PANELS = (
    ("batch size", [("batch_size", "global", "-"), ("local_bsz", "local (per replica, per micro-step)", "--")], True),
    ("accumulation steps and replicas", [("accum_steps", "accumulation steps", "-"),
                                         ("replicas", "replicas", "--")], False),
    ("gradient noise scale", [("noise_scale", "noise scale (samples)", "-")], True),
    ("gain and LR factor", [("gain", "gain", "-"), ("lr_factor", "LR factor (scaling rule)", "--"),
                            ("step_lr_factor", "LR factor (step's actual size)", ":")], False),
    ("throughput", [("samples_per_sec", "samples/s", "-"), ("goodput", "goodput", "--"),
                    ("tokens_per_sec", "tokens/s", ":")], False),
)

_RESTART_COLOR = "tab:red"
_REPLICA_COLOR = "tab:green"
_LOSS_COLOR = "tab:orange"


def _load_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise MissingDependencyError(f"drawing the report needs matplotlib: {INSTALL_HINT}") from error
    return Figure


def _time_axis(run: Run) -> tuple[float, float, str]:
    """(origin, divisor, unit) for the wall-time axis."""
    spans = run.processes
    origin = spans[0].start_time if spans else 0.0
    total = (spans[-1].end_time - origin) if spans else 0.0
    if total < 180:
        return origin, 1.0, "s"
    if total < 3 * 3600:
        return origin, 60.0, "min"
    return origin, 3600.0, "h"


def _series(records: Sequence[dict], key: str, x_of: Any) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        x, y = x_of(record), _number(record.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _draw_panel(ax: Any, run: Run, keys: Sequence[tuple[str, str, str]], x_of: Any, log_ok: bool) -> None:
    colors = ("tab:blue", "tab:orange", "tab:purple")
    positive = True
    for index, (key, label, style) in enumerate(keys):
        for process in run.processes:
            xs, ys = _series(process.steps, key, x_of)
            if not xs:
                continue
            positive = positive and min(ys) > 0
            ax.plot(xs, ys, style, color=colors[index % len(colors)], drawstyle="steps-post", linewidth=1.4,
                    marker="." if len(xs) < 3 else None, label=label)
    if log_ok and positive and ax.lines:
        low, high = ax.get_ylim()
        if low > 0 and high / low > 20:
            ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def _legend(ax: Any) -> None:
    """One legend entry per label (every process draws its own line)."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax.legend(list(unique.values()), list(unique.keys()), fontsize=8, loc="best")


def _mark_step_axis(ax: Any, run: Run, summary: RunSummary, label: bool) -> None:
    for number, process in enumerate(run.processes[1:]):
        if process.first_step is not None:
            ax.axvline(process.first_step, color=_RESTART_COLOR, linestyle="--", linewidth=1,
                       label="restart" if label and number == 0 else None)
    for number, change in enumerate(summary.replica_changes):
        if change.step is not None:
            ax.axvline(change.step, color=_REPLICA_COLOR, linestyle=":", linewidth=1.5,
                       label="replicas changed" if label and number == 0 else None)
    for number, loss in enumerate(summary.progress_losses):
        ax.axvspan(loss.resumed_step, loss.reached_step, color=_LOSS_COLOR, alpha=0.12, hatch="//", linewidth=0,
                   label="trained again (progress lost)" if label and number == 0 else None)


def _mark_time_axis(ax: Any, run: Run, summary: RunSummary, origin: float, unit: float) -> None:
    spans = run.processes
    for earlier, later in zip(spans, spans[1:]):
        ax.axvspan((earlier.end_time - origin) / unit, (later.start_time - origin) / unit,
                   color=_RESTART_COLOR, alpha=0.15, linewidth=0)
        ax.axvline((later.start_time - origin) / unit, color=_RESTART_COLOR, linestyle="--", linewidth=1)
    for change in summary.replica_changes:
        ax.axvline((change.time - origin) / unit, color=_REPLICA_COLOR, linestyle=":", linewidth=1.5)
    for loss in summary.progress_losses:
        ax.axvline((loss.time - origin) / unit, color=_LOSS_COLOR, linestyle="-", linewidth=2.5)


def _annotate_replicas(ax: Any, summary: RunSummary) -> None:
    for change in summary.replica_changes:
        if change.step is not None:
            ax.annotate(f"{change.before}->{change.after} replicas", xy=(change.step, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                        fontsize=8, color=_REPLICA_COLOR)


def _loss_label(loss: ProgressLoss) -> str:
    what = "started from scratch" if loss.from_scratch else "rolled back"
    return f"process {loss.process + 1} {what}: {loss.steps_lost} steps lost"


def _annotate_losses(ax: Any, summary: RunSummary, origin: float | None = None, unit: float = 1.0) -> None:
    """Label each loss of progress: at its steps on the step axis, at its time on the time axis."""
    for number, loss in enumerate(summary.progress_losses):
        on_time_axis = origin is not None
        x = (loss.time - origin) / unit if on_time_axis else loss.resumed_step
        # on the time axis the label sits left of the new process's start, over the gap before it
        ax.annotate(_loss_label(loss), xy=(x, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(-3 if on_time_axis else 3, -24 - 12 * number), textcoords="offset points",
                    ha="right" if on_time_axis else "left", fontsize=8, color=_LOSS_COLOR, fontweight="bold")


def _run_name(path: str) -> str:
    """The job's folder name: the metrics file's folder, or the one above a ``share`` folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(folder) == "share":
        folder = os.path.dirname(folder)
    return os.path.basename(folder) or path


def _title(run: Run, summary: RunSummary) -> str:
    gain = "n/a" if summary.goodput_gain is None else f"x{summary.goodput_gain:.2f}"
    title = (f"{_run_name(run.path)}: {summary.restarts} restart(s), {_duration(summary.time_lost)} lost, "
             f"final batch size {summary.final_batch_size}, goodput gain {gain}")
    if summary.progress_losses:
        scratch = summary.restarts_from_scratch
        title += (f"\nPROGRESS LOST: {summary.steps_lost} steps trained again"
                  + (f" ({scratch} restart(s) from scratch)" if scratch else ""))
    return title


def render_png(run: Run, output: str, summary: RunSummary | None = None, *, dpi: int = 100) -> str:
    """Draw the run's metrics into a PNG at ``output``; returns the path written.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        ValueError: the run has no step records to draw.
    """
    if not run.steps:
        raise ValueError(f"{run.path} has no step records to draw: rank 0 writes one every "
                         "ADAPTIVE_METRICS_INTERVAL optimizer steps (default 10; 0 turns them off)")
    Figure = _load_matplotlib()
    summary = summary or summarize(run)
    origin, unit, unit_name = _time_axis(run)
    unit_of_batches = next((r["unit"] for r in run.steps if r.get("unit")), "samples")
    figure = Figure(figsize=(14, 3 * len(_PANELS) + 1), dpi=dpi, layout="constrained")
    axes = figure.subplots(len(_PANELS), 2, sharex="col", squeeze=False)

    def by_step(record: dict) -> float | None:
        return _number(record.get("step"))

    def by_time(record: dict) -> float | None:
        when = _number(record.get("time"))
        return None if when is None else (when - origin) / unit

    for row, (title, keys, log_ok) in enumerate(_PANELS):
        left, right = axes[row]
        _draw_panel(left, run, keys, by_step, log_ok)
        _draw_panel(right, run, keys, by_time, log_ok)
        _mark_step_axis(left, run, summary, label=row == 0)
        _mark_time_axis(right, run, summary, origin, unit)
        left.set_ylabel(f"{title} ({unit_of_batches})" if row == 0 and unit_of_batches != "samples" else title)
        _legend(left)
        if row == 0:
            _annotate_replicas(left, summary)
            _annotate_losses(left, summary)
            _annotate_losses(right, summary, origin, unit)
            left.set_title("against optimizer step")
            right.set_title("against wall time (red band: time between processes)")
    axes[-1][0].set_xlabel("optimizer step")
    axes[-1][1].set_xlabel(f"wall time since the first record ({unit_name})")
    figure.suptitle(_title(run, summary), color=_LOSS_COLOR if summary.progress_losses else None)
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(output, format="png")
    logger.info("report written to %s", output)
    return output
