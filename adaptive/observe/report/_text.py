"""The summary of a run as the lines ``adaptive report`` prints."""

from __future__ import annotations

from adaptive._utils.text import format_duration
from adaptive.observe.report._summary import RunSummary


def format_summary(summary: RunSummary) -> str:
    """The summary as a few human-readable lines."""
    lines = [f"metrics: {summary.path} ({summary.step_records} step records, steps "
             f"{summary.first_step}..{summary.final_step}, {format_duration(summary.wall_time)} wall time)"]
    if summary.loader is not None:
        lines.append(f"loader: {summary.loader} (records of other loaders are left out)")
    scratch = summary.restarts_from_scratch
    lines.append(f"restarts: {summary.restarts} (time lost between processes: {format_duration(summary.time_lost)})"
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
