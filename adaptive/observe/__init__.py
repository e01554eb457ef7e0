"""Observability: per-step metrics, the run report and the ``adaptive`` command.

:mod:`.metrics` writes and reads the metrics file (and TensorBoard);
:mod:`.report` turns it into a summary and a picture; :mod:`.cli` is the
``adaptive`` console command.
"""

from typing import TYPE_CHECKING

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "MetricsWriter": "adaptive.observe.metrics",
    "read_metrics": "adaptive.observe.metrics",
    "to_tensorboard": "adaptive.observe.metrics",
    "load_run": "adaptive.observe.report",
    "summarize": "adaptive.observe.report",
    "format_summary": "adaptive.observe.report",
    "render_png": "adaptive.observe.report",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from adaptive.observe.metrics import MetricsWriter, read_metrics, to_tensorboard
    from adaptive.observe.report import format_summary, load_run, render_png, summarize
