"""Summarising a run: restarts, time and progress lost, replica changes, batch size, goodput.

:func:`summarize` turns a :class:`~adaptive.observe.report.Run` into the
:class:`RunSummary` that ``adaptive report`` prints: restarts, wall time
lost between the last record of one process and the first of the next,
replica-count changes (at the step the new process continued from),
*progress lost* (a process that started from scratch although earlier ones
had trained, or that resumed a checkpoint older than the step already
reached: :func:`progress_losses`), initial and final batch size, and the
mean goodput relative to the goodput measured at the initial batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from adaptive._utils.types import JSON
from adaptive.observe.report._runs import Run, finite_int, finite_number, record_time

#: Records at the initial batch size that define the baseline goodput.
_BASELINE_RECORDS = 3


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

    def to_dict(self) -> JSON:
        """Plain JSON-ready form (for ``adaptive report --json``)."""
        out = {key: getattr(self, key) for key in self.__dataclass_fields__}
        out["replica_changes"] = [vars(change) for change in self.replica_changes]
        out["progress_losses"] = [dict(vars(loss), steps_lost=loss.steps_lost, epochs_lost=loss.epochs_lost)
                                  for loss in self.progress_losses]
        out["restarts_from_scratch"] = self.restarts_from_scratch
        out["steps_lost"] = self.steps_lost
        out["notes"] = list(self.notes)
        return out



def replica_changes(records: Sequence[JSON], loader: str | None = None) -> list[ReplicaChange]:
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
            step = resumed_step(record, loader) if record.get("event") == "start" else finite_int(record.get("step"))
            changes.append(ReplicaChange(time=record_time(record), step=step, before=int(previous),
                                         after=int(replicas)))
        previous = replicas
    return changes



def _started_from_scratch(start: JSON) -> bool:
    """A ``start`` event that says its process resumed no checkpoint (``"resumed": null``)."""
    return "resumed" in start and start["resumed"] is None


def resumed_step(start: JSON, loader: str | None = None) -> int | None:
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
            return finite_int(steps.get(loader))
        named = start.get("loader")
        if named is not None:
            return finite_int(steps.get(named))
        return finite_int(next(iter(steps.values()))) if len(steps) == 1 else None
    named = start.get("loader")
    if loader is not None and (named is None or str(named) != loader):
        return None
    return finite_int(start.get("step"))


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
        epoch = 0 if scratch else (finite_int(start.get("epoch")) if start is not None else None)
        if step is None and process.first_step is not None:  # the start event does not say: the first record
            step = finite_int(process.first_step)
            epoch = finite_int(process.steps[0].get("epoch")) if epoch is None else epoch
        if step is not None:
            if index and reached_step is not None and 0 < reached_step and step < reached_step:
                losses.append(ProgressLoss(
                    process=index, pid=process.pid, time=process.start_time, from_scratch=scratch,
                    checkpoint=None if start is None or scratch else finite_int(start.get("resumed")),
                    reached_step=reached_step, reached_epoch=reached_epoch, resumed_step=step,
                    resumed_epoch=epoch))
            # training goes on from here: what lay beyond is lost (and counted) once
            reached_step, reached_epoch = step, epoch
        for record in process.steps:
            reach(finite_int(record.get("step")), finite_int(record.get("epoch")))
    return losses


def _batch_size_of(record: JSON) -> int | None:
    """Global batch size a record reports: a step record's, or a batch-size decision's new size."""
    if record.get("event") == "batch_size":
        return record.get("after")
    return record.get("batch_size")


def _baseline_goodput(steps: Sequence[JSON]) -> tuple[float | None, list[str]]:
    """Mean goodput of the first records at the initial batch size (the run's starting point)."""
    notes: list[str] = []
    initial = next((r.get("batch_size") for r in steps if r.get("batch_size") is not None), None)
    measured = [r for r in steps if finite_number(r.get("goodput")) is not None]
    if not measured:
        return None, notes
    at_initial = [r for r in measured if r.get("batch_size") == initial]
    if not at_initial:
        at_initial = measured
        notes.append(f"no goodput was measured at the initial batch size {initial}; the baseline is the first "
                     f"goodput measured (batch size {measured[0].get('batch_size')})")
    chosen = at_initial[:_BASELINE_RECORDS]
    return sum(finite_number(r["goodput"]) or 0.0 for r in chosen) / len(chosen), notes  # never None: measured


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
    timeline = sorted(steps + events, key=record_time)
    replicas = [r["replicas"] for r in timeline if r.get("replicas") is not None]
    batch_sizes = [size for size in map(_batch_size_of, timeline) if size is not None]
    goodputs = [g for g in (finite_number(r.get("goodput")) for r in steps) if g is not None]
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


def _first_step_after(steps: Sequence[JSON], when: float) -> int | None:
    """The step of the first step record at or after ``when`` (None if none)."""
    return next((finite_int(r.get("step")) for r in steps
                 if record_time(r) >= when and finite_int(r.get("step")) is not None), None)
