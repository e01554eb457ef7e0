"""``adaptive report``: a picture and a short summary of one job's metrics.

The library's rank 0 appends step records and events to
``<ADAPTIVE_SHARE_PATH>/metrics.jsonl`` (see :mod:`adaptive.observe.metrics`).
This package reads that file and

* splits it into *processes* (:func:`load_run`, in ``_runs``): a new ``pid``
  in the records, or a ``start`` event, begins a new one (a restart,
  whether graceful or after a crash);
* summarises the run (:func:`summarize`, in ``_summary``): restarts, wall
  time lost between processes, replica-count changes, *progress lost*
  (:func:`progress_losses`), initial and final batch size, and the mean
  goodput relative to the goodput measured at the initial batch size;
* prints the summary (:func:`format_summary`, in ``_text``);
* draws one PNG (:func:`render_png`, in ``_png``; needs the optional
  ``matplotlib``): batch sizes, noise scale, gain and LR factor,
  throughput and goodput against the optimizer step and the wall time.

Only plain records are read; nothing in the file is executed.  The command
line is ``adaptive report RUN_DIR`` (:mod:`adaptive.observe.cli`).  Names
are imported on first use, so the summary works without matplotlib.
"""

from typing import TYPE_CHECKING

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "ProcessSpan": "adaptive.observe.report._runs",
    "Run": "adaptive.observe.report._runs",
    "find_metrics_file": "adaptive.observe.report._runs",
    "load_run": "adaptive.observe.report._runs",
    "ProgressLoss": "adaptive.observe.report._summary",
    "ReplicaChange": "adaptive.observe.report._summary",
    "RunSummary": "adaptive.observe.report._summary",
    "progress_losses": "adaptive.observe.report._summary",
    "replica_changes": "adaptive.observe.report._summary",
    "resumed_step": "adaptive.observe.report._summary",
    "summarize": "adaptive.observe.report._summary",
    "format_summary": "adaptive.observe.report._text",
    "INSTALL_HINT": "adaptive.observe.report._png",
    "MissingDependencyError": "adaptive.observe.report._png",
    "render_png": "adaptive.observe.report._png",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from adaptive.observe.report._png import INSTALL_HINT, MissingDependencyError, render_png
    from adaptive.observe.report._runs import ProcessSpan, Run, find_metrics_file, load_run
    from adaptive.observe.report._summary import (ProgressLoss, ReplicaChange, RunSummary, progress_losses,
                                                  replica_changes, resumed_step, summarize)
    from adaptive.observe.report._text import format_summary
