"""The goodput models and exchange formats that a job and the scheduler share (torch-free).

A training job measures itself and the cluster scheduler decides with the
same models, so they live here, below both: the job side
(:mod:`adaptive.batchsize`, with torch) and the cluster side (``scheduler``,
without torch) import these public names and nothing private.

- :mod:`.model`: the goodput model (Pollux): :class:`PerfParams` (the
  step-time model), :class:`GradParams` (gradient statistics),
  :class:`GoodputFunction` (throughput x statistical efficiency, and its exact
  optimum over batch configurations, searched by :mod:`.search`),
  :data:`GAMMA_MAX`.
- :mod:`.fit`: :func:`fit_perf_params`, the step-time model fitted to
  measured times.
- :mod:`.noise_estimate`: the arithmetic of the gradient noise scale
  (:class:`BatchConfig`, :func:`estimate_from_norms`); the torch hooks that
  feed it are :class:`adaptive.batchsize.GradientNoiseScale`.
- :mod:`.hints`: the scheduler hints a job reports (:class:`Hints`,
  :class:`CurrentConfig`, :func:`write_hints`, :func:`read_hints`,
  :data:`HINTS_VERSION`, :data:`HINTS_FILENAME`); posting them over HTTP is
  the job's (:func:`adaptive.batchsize.hint_posting.post_hints`).
- :func:`write_json_atomic`, :func:`read_json`: the one writer and reader of
  the small JSON files both sides rewrite in place (``hints.json``, the
  supervisor's state, the executor's status).  Their implementation is the
  library's ground floor (``adaptive._utils.files``, which the checkpoint
  store shares); this is their public name.

Names are imported on first use, like every face of the library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "GAMMA_MAX": "adaptive.goodput.model",
    "GoodputFunction": "adaptive.goodput.model",
    "GradParams": "adaptive.goodput.model",
    "PerfParams": "adaptive.goodput.model",
    "fit_perf_params": "adaptive.goodput.fit",
    "BatchConfig": "adaptive.goodput.noise_estimate",
    "estimate_from_norms": "adaptive.goodput.noise_estimate",
    "CurrentConfig": "adaptive.goodput.hints",
    "HINTS_FILENAME": "adaptive.goodput.hints",
    "HINTS_VERSION": "adaptive.goodput.hints",
    "Hints": "adaptive.goodput.hints",
    "read_hints": "adaptive.goodput.hints",
    "write_hints": "adaptive.goodput.hints",
    "read_json": "adaptive._utils.files",
    "write_json_atomic": "adaptive._utils.files",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from adaptive._utils.files import read_json, write_json_atomic
    from adaptive.goodput.fit import fit_perf_params
    from adaptive.goodput.hints import HINTS_FILENAME, HINTS_VERSION, CurrentConfig, Hints, read_hints, write_hints
    from adaptive.goodput.model import GAMMA_MAX, GoodputFunction, GradParams, PerfParams
    from adaptive.goodput.noise_estimate import BatchConfig, estimate_from_norms
