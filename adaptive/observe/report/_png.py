"""Drawing a run as one PNG (needs the optional ``matplotlib``, the ``report`` extra).

Global and local batch size, accumulation steps and replicas, noise scale,
gain and LR factor, samples/s and goodput, and the totals of the script's
own accumulators (losses, accuracies), against the optimizer step (left
column) and the wall time (right column), with restarts and replica-count
changes marked by vertical lines, and the steps trained again after a loss
of progress shaded.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Callable, Sequence

from adaptive._utils.text import format_duration
from adaptive._utils.types import JSON
from adaptive.observe.report._runs import Run, finite_number
from adaptive.observe.report._summary import ProgressLoss, RunSummary, summarize

if TYPE_CHECKING:  # matplotlib is optional: imported when a PNG is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

#: What to install for the PNG.
INSTALL_HINT = 'pip install "adaptive-elastic[report]" (in a source checkout: pip install -e ".[report]")'


class MissingDependencyError(ImportError):
    """An optional dependency (matplotlib for the PNG) is not installed."""



#: (panel title, [(record key, label, line style)], log scale allowed)
_PANELS = (
    ("batch size", [("batch_size", "global", "-"), ("local_bsz", "local (per replica, per micro-step)", "--")], True),
    ("accumulation steps and replicas", [("accum_steps", "accumulation steps", "-"),
                                         ("replicas", "replicas", "--")], False),
    ("gradient noise scale", [("noise_scale", "noise scale (samples)", "-")], True),
    ("gain and LR factor", [("gain", "gain", "-"), ("lr_factor", "LR factor (scaling rule)", "--"),
                            ("step_lr_factor", "LR factor (step's size / planned; dips at an epoch's short "
                             "last step)", ":")], False),
    ("throughput", [("samples_per_sec", "samples/s", "-"), ("goodput", "goodput", "--"),
                    ("tokens_per_sec", "tokens/s", ":")], False),
)

_RESTART_COLOR = "tab:red"
_REPLICA_COLOR = "tab:green"
_LOSS_COLOR = "tab:orange"


def _load_matplotlib() -> type[Figure]:
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


#: The x value of a step record on one axis (its step, or its time), or None where it has none.
_XOf = Callable[[JSON], float | None]


def _series(records: Sequence[JSON], key: str, x_of: _XOf) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        x, y = x_of(record), finite_number(record.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _draw_panel(ax: Axes, run: Run, keys: Sequence[tuple[str, str, str]], x_of: _XOf, log_ok: bool) -> None:
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


def _legend(ax: Axes) -> None:
    """One legend entry per label (every process draws its own line)."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        ax.legend(list(unique.values()), list(unique.keys()), fontsize=8, loc="best")


def _mark_step_axis(ax: Axes, run: Run, summary: RunSummary, label: bool) -> None:
    # A restart is drawn wide and under the replica-change line, which usually falls on the same step:
    # both stay visible.
    for number, process in enumerate(run.processes[1:]):
        if process.first_step is not None:
            ax.axvline(process.first_step, color=_RESTART_COLOR, linestyle="-", linewidth=4, alpha=0.35,
                       zorder=1, label="restart" if label and number == 0 else None)
    for number, change in enumerate(summary.replica_changes):
        if change.step is not None:
            ax.axvline(change.step, color=_REPLICA_COLOR, linestyle=":", linewidth=1.5, zorder=3,
                       label="replicas changed" if label and number == 0 else None)
    for number, loss in enumerate(summary.progress_losses):
        ax.axvspan(loss.resumed_step, loss.reached_step, color=_LOSS_COLOR, alpha=0.12, hatch="//", linewidth=0,
                   label="trained again (progress lost)" if label and number == 0 else None)


def _mark_time_axis(ax: Axes, run: Run, summary: RunSummary, origin: float, unit: float) -> None:
    spans = run.processes
    for earlier, later in zip(spans, spans[1:]):
        ax.axvspan((earlier.end_time - origin) / unit, (later.start_time - origin) / unit,
                   color=_RESTART_COLOR, alpha=0.15, linewidth=0)
        ax.axvline((later.start_time - origin) / unit, color=_RESTART_COLOR, linestyle="--", linewidth=1)
    for change in summary.replica_changes:
        ax.axvline((change.time - origin) / unit, color=_REPLICA_COLOR, linestyle=":", linewidth=1.5)
    for loss in summary.progress_losses:
        ax.axvline((loss.time - origin) / unit, color=_LOSS_COLOR, linestyle="-", linewidth=2.5)


def _annotate_replicas(ax: Axes, summary: RunSummary) -> None:
    for change in summary.replica_changes:
        if change.step is not None:
            ax.annotate(f"{change.before}->{change.after} replicas", xy=(change.step, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                        fontsize=8, color=_REPLICA_COLOR)


def _loss_label(loss: ProgressLoss) -> str:
    what = "started from scratch" if loss.from_scratch else "rolled back"
    return f"process {loss.process + 1} {what}: {loss.steps_lost} steps lost"


def _annotate_losses(ax: Axes, summary: RunSummary, origin: float | None = None, unit: float = 1.0) -> None:
    """Label each loss of progress: at its steps on the step axis, at its time on the time axis."""
    for number, loss in enumerate(summary.progress_losses):
        on_time_axis = origin is not None
        x = (loss.time - origin) / unit if origin is not None else loss.resumed_step
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
    title = (f"{_run_name(run.path)}: {summary.restarts} restart(s), {format_duration(summary.time_lost)} lost, "
             f"final batch size {summary.final_batch_size}")
    measured = _first_and_last(run, "samples_per_sec")
    if measured is not None:
        title += f", measured samples/s {measured[0]:.0f} at the start -> {measured[1]:.0f} at the end"
    if summary.goodput_gain is not None:
        title += f"\nmodel-estimated goodput x{summary.goodput_gain:.2f} of the first configuration's"
    if summary.progress_losses:
        scratch = summary.restarts_from_scratch
        title += (f"\nPROGRESS LOST: {summary.steps_lost} steps trained again"
                  + (f" ({scratch} restart(s) from scratch)" if scratch else ""))
    return title


def _first_and_last(run: Run, key: str, window: int = 5) -> tuple[float, float] | None:
    """The mean of ``key`` over the first and over the last ``window`` step records that have it."""
    values = [value for value in (finite_number(record.get(key)) for record in run.steps) if value is not None]
    if not values:
        return None
    head, tail = values[:window], values[-window:]
    return sum(head) / len(head), sum(tail) / len(tail)


#: Keys that count what an accumulator's other totals are sums over (the first found divides them).
_COUNT_KEYS = ("n", "count", "total", "samples", "num_samples", "num", "seen")


def _totals_series(run: Run) -> dict[str, list[tuple[float | None, float, float]]]:
    """From the ``totals`` events: label -> [(step, time, value)], each total divided by its block's count."""
    series: dict[str, list[tuple[float | None, float, float]]] = {}
    for event in run.events:
        if event.get("event") != "totals" or not isinstance(event.get("values"), dict):
            continue
        values = {k: v for k, v in event["values"].items() if finite_number(v) is not None}
        count_key = next((key for key in _COUNT_KEYS if values.get(key)), None)
        name = re.sub(r"^e\d+\.", "epoch's #", str(event.get("accumulator", "")))
        for key, value in values.items():
            if key == count_key:
                continue
            label = f"{key} / {count_key}" if count_key else key
            series.setdefault(f"{label} ({name})" if name else label, []).append(
                (finite_number(event.get("step")), float(event.get("time", 0.0)),
                 value / values[count_key] if count_key else value))
    return series


def _draw_totals(ax: Axes, series: dict[str, list[tuple[float | None, float, float]]], by_time: bool,
                 origin: float, unit: float) -> None:
    for label, points in sorted(series.items()):
        xs = [(when - origin) / unit if by_time else step for step, when, _ in points]
        keep = [(x, y) for x, (_, _, y) in zip(xs, points) if x is not None]
        if keep:
            ax.plot([x for x, _ in keep], [y for _, y in keep], "-o", markersize=3, linewidth=1.2, label=label)
    values = [y for points in series.values() for _, _, y in points]
    if values and min(values) > 0 and max(values) / min(values) > 20:  # a loss falling by orders of magnitude
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


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
    totals = _totals_series(run)
    rows = len(_PANELS) + (1 if totals else 0)
    figure = Figure(figsize=(14, 3 * rows + 1), dpi=dpi, layout="constrained")
    axes = figure.subplots(rows, 2, sharex="col", squeeze=False)

    def by_step(record: JSON) -> float | None:
        return finite_number(record.get("step"))

    def by_time(record: JSON) -> float | None:
        when = finite_number(record.get("time"))
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
    if totals:  # losses, accuracies: what the script's Accumulators summed at each synchronized() block
        left, right = axes[len(_PANELS)]
        _draw_totals(left, totals, False, origin, unit)
        _draw_totals(right, totals, True, origin, unit)
        _mark_step_axis(left, run, summary, label=False)
        _mark_time_axis(right, run, summary, origin, unit)
        left.set_ylabel("your totals (Accumulator)")
        _legend(left)
    axes[-1][0].set_xlabel("optimizer step")
    axes[-1][1].set_xlabel(f"wall time since the first record ({unit_name})")
    figure.suptitle(_title(run, summary), color=_LOSS_COLOR if summary.progress_losses else None)
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(output, format="png")
    logger.info("report written to %s", output)
    return output
