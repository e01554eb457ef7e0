"""Goodput model (Pollux): throughput x statistical efficiency.

A training job's useful speed is its *goodput*: samples per second
(throughput) times the fraction of each sample's worth that a step at that
batch size still gets (statistical efficiency).  Both halves are models:

* **Throughput** comes from a fitted model of the optimizer-step time in
  the configuration ``(num_nodes, num_replicas, local_bsz, accum_steps)``::

      compute = alpha_c + beta_c * local_bsz          # one micro-batch fwd+bwd
      sync    = 0                                      # one replica
              | alpha_r + beta_r * max(replicas - 2, 0)  # one node
              | alpha_n + beta_n * max(replicas - 2, 0)  # several nodes
      step    = (accum_steps - 1) * compute + (compute**gamma + sync**gamma)**(1/gamma)
      throughput = replicas * local_bsz * accum_steps / step

  ``gamma >= 1`` measures how well the gradient all-reduce overlaps the
  backward pass (1: not at all, large: completely).

* **Efficiency** follows from the gradient statistics measured by
  :class:`adaptive.batchsize.gns.GradientNoiseScale`: with ``sqr = |G|^2`` and
  ``var = tr(Sigma) / init_batch_size``, a step at ``scale = batch /
  init_batch_size`` makes ``gain = (var + sqr) / (var / scale + sqr)``
  reference steps of progress, so ``efficiency = gain / scale``.

:meth:`GoodputFunction.optimize` picks the local batch size and number of
accumulation steps of highest goodput, exactly (it returns the same
goodput as trying every feasible integer configuration; the search is
:mod:`adaptive.goodput.search`).  The parameters are fitted to measured
step times by :func:`adaptive.goodput.fit.fit_perf_params`, from the record
kept by :class:`adaptive.batchsize.throughput_profile.ThroughputProfile`.
The formulas themselves are the private functions below (unvalidated,
numpy-broadcastable); :func:`overlap` is public for the fit.
Everything here is numpy only: the job's batch-size controller and the
cluster scheduler both import it, and the scheduler has no torch.

:class:`PerfParams` and :class:`GradParams` are saved (in checkpoints and in
the scheduler hints) with ``state_dict()`` and read with
``from_state_dict()``, format version 1; release 0.1 wrote the same fields
without a version key, which reads as version 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from adaptive._utils.checks import check_float, check_int
from adaptive._utils.types import StateDict
from adaptive.checkpoint.versions import UNVERSIONED, check_fields, read_state
from adaptive.goodput import search

__all__ = ["PerfParams", "GradParams", "GoodputFunction", "GAMMA_MAX", "PERF_FIELDS", "overlap"]

logger = logging.getLogger(__name__)

#: Largest overlap exponent the fit uses; gamma = 10 is already very close
#: to perfect overlap, ``max(compute, sync)``.
GAMMA_MAX = 10.0

#: The seven parameters of :class:`PerfParams`, in order.
PERF_FIELDS = ("alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r", "gamma")
_GRAD_FIELDS = ("sqr", "var")


@dataclass(frozen=True)
class PerfParams:
    """Parameters of the step-time model (seconds); see the module docstring.

    All alphas and betas are >= 0 (compute time must be positive:
    ``alpha_c + beta_c > 0``) and ``gamma >= 1``.
    """

    #: Format of :meth:`state_dict` (1: the seven fields; 0.1 wrote them without a version).
    version = 1

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float

    def __post_init__(self) -> None:
        for name in PERF_FIELDS:
            minimum = 1.0 if name == "gamma" else 0.0
            object.__setattr__(self, name, check_float(f"PerfParams.{name}", getattr(self, name), minimum))
        if self.alpha_c + self.beta_c <= 0:
            raise ValueError("PerfParams.alpha_c + beta_c must be > 0 (compute time cannot be zero)")

    def state_dict(self) -> StateDict:
        """The seven parameters and the format version, JSON-ready."""
        return {"version": self.version, **{name: getattr(self, name) for name in PERF_FIELDS}}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object]) -> PerfParams:
        """Validated inverse of :meth:`state_dict` (exactly the seven fields)."""
        fields = read_state("perf_params", state, cls, unversioned=UNVERSIONED)
        check_fields("perf_params", fields, PERF_FIELDS)
        return cls(**{name: fields[name] for name in PERF_FIELDS})


@dataclass(frozen=True)
class GradParams:
    """Gradient statistics that decide statistical efficiency.

    Attributes:
        sqr: ``|G|^2``, squared norm of the true (full-batch) gradient.
        var: ``tr(Sigma) / init_batch_size``: the trace of the gradient
            noise covariance of a minibatch of the reference size.
    Both are >= 0 and not both 0.
    """

    #: Format of :meth:`state_dict` (1: sqr and var; 0.1 wrote them without a version).
    version = 1

    sqr: float
    var: float

    def __post_init__(self) -> None:
        for name in _GRAD_FIELDS:
            object.__setattr__(self, name, check_float(f"GradParams.{name}", getattr(self, name), 0.0))
        if self.sqr + self.var <= 0:
            raise ValueError("GradParams.sqr and GradParams.var cannot both be 0")

    def state_dict(self) -> StateDict:
        """``sqr``, ``var`` and the format version, JSON-ready."""
        return {"version": self.version, "sqr": self.sqr, "var": self.var}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object]) -> GradParams:
        """Validated inverse of :meth:`state_dict` (exactly ``sqr`` and ``var``)."""
        fields = read_state("grad_params", state, cls, unversioned=UNVERSIONED)
        check_fields("grad_params", fields, _GRAD_FIELDS)
        return cls(sqr=fields["sqr"], var=fields["var"])


# ------------------------------------------------------------------ formulas
# Unvalidated and numpy-broadcastable: GoodputFunction checks its arguments and
# calls these; the fit (adaptive.goodput.fit) evaluates overlap() for many
# parameter vectors at once.  The formulas are in the module docstring.

def _compute_time(p: PerfParams, local_bsz: ArrayLike) -> np.ndarray:
    """Seconds of one micro-batch's forward and backward."""
    return p.alpha_c + p.beta_c * np.asarray(local_bsz, dtype=float)


def _sync_time(p: PerfParams, num_nodes: ArrayLike, num_replicas: ArrayLike) -> np.ndarray:
    """Seconds of one gradient synchronisation (0 for one replica)."""
    nodes = np.asarray(num_nodes, dtype=float)
    replicas = np.asarray(num_replicas, dtype=float)
    extra = np.maximum(replicas - 2.0, 0.0)
    multi_node = p.alpha_n + p.beta_n * extra
    one_node = p.alpha_r + p.beta_r * extra
    return np.where(replicas > 1, np.where(nodes > 1, multi_node, one_node), 0.0)


def overlap(compute: np.ndarray, sync: np.ndarray, gamma: float | np.ndarray) -> np.ndarray:
    """``(compute**gamma + sync**gamma) ** (1/gamma)`` without overflow."""
    high = np.maximum(compute, sync)
    low = np.minimum(compute, sync)
    ratio = np.divide(low, high, out=np.zeros_like(high, dtype=float), where=high > 0)
    combined: np.ndarray = high * (1.0 + ratio ** gamma) ** (1.0 / gamma)
    return combined


def _step_time(p: PerfParams, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike,
               accum_steps: ArrayLike) -> np.ndarray:
    """Seconds of one optimizer step: ``accum_steps - 1`` plain micro-batches,
    then one whose backward overlaps the synchronisation."""
    compute = _compute_time(p, local_bsz)
    sync = _sync_time(p, num_nodes, num_replicas)
    accum = np.asarray(accum_steps, dtype=float)
    step: np.ndarray = (accum - 1.0) * compute + overlap(compute, sync, p.gamma)
    return step


def _efficiency(g: GradParams, init_batch_size: int, batch_size: ArrayLike) -> np.ndarray:
    """``gain / scale`` of a global batch (batches below the reference count as 1)."""
    scale = np.maximum(np.asarray(batch_size, dtype=float) / init_batch_size, 1.0)
    return (g.var + g.sqr) / (g.var + scale * g.sqr)


def _as_output(value: np.ndarray, scalar: bool) -> float | np.ndarray:
    return float(value) if scalar else np.asarray(value)


def _all_scalar(*values: ArrayLike) -> bool:
    return all(np.ndim(v) == 0 for v in values)


def _check_at_least_one(values: ArrayLike, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if not np.all(np.isfinite(array)) or np.any(array < 1):
        raise ValueError(f"{name} must be >= 1 everywhere, got {values!r}")
    return array


class GoodputFunction:
    """Goodput of a job under a throughput model and gradient statistics.

    Args:
        perf_params: fitted step-time model.
        grad_params: measured gradient statistics (``var`` at
            ``init_batch_size``).
        init_batch_size: the reference (user's) global batch size.
    """

    def __init__(self, perf_params: PerfParams, grad_params: GradParams, init_batch_size: int) -> None:
        if not isinstance(perf_params, PerfParams):
            raise TypeError(f"perf_params must be a PerfParams, got {type(perf_params).__name__}")
        if not isinstance(grad_params, GradParams):
            raise TypeError(f"grad_params must be a GradParams, got {type(grad_params).__name__}")
        self._perf = perf_params
        self._grad = grad_params
        self._init = check_int("init_batch_size", init_batch_size, 1)

    @property
    def perf_params(self) -> PerfParams:
        return self._perf

    @property
    def grad_params(self) -> GradParams:
        return self._grad

    @property
    def init_batch_size(self) -> int:
        return self._init

    def step_time(self, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike,
                  accum_steps: ArrayLike) -> float | np.ndarray:
        """Predicted seconds per optimizer step (numpy-broadcastable)."""
        scalar = _all_scalar(num_nodes, num_replicas, local_bsz, accum_steps)
        for value, name in ((num_nodes, "num_nodes"), (num_replicas, "num_replicas"),
                            (local_bsz, "local_bsz"), (accum_steps, "accum_steps")):
            _check_at_least_one(value, name)
        return _as_output(_step_time(self._perf, num_nodes, num_replicas, local_bsz, accum_steps), scalar)

    def throughput(self, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike,
                   accum_steps: ArrayLike) -> float | np.ndarray:
        """Predicted samples per second (numpy-broadcastable)."""
        step = self.step_time(num_nodes, num_replicas, local_bsz, accum_steps)
        samples = (np.asarray(num_replicas, dtype=float) * np.asarray(local_bsz, dtype=float)
                   * np.asarray(accum_steps, dtype=float))
        return samples / step if np.ndim(step) else float(samples / step)

    def efficiency(self, batch_size: ArrayLike) -> float | np.ndarray:
        """Statistical efficiency in (0, 1] of a global batch of ``batch_size``.

        ``gain / scale`` with ``scale = batch_size / init_batch_size``;
        batches below the reference size count as efficiency 1 (the model
        is not trusted to reward them).
        """
        _check_at_least_one(batch_size, "batch_size")
        return _as_output(_efficiency(self._grad, self._init, batch_size), np.ndim(batch_size) == 0)

    def evaluate(self, num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike,
                 accum_steps: ArrayLike) -> float | np.ndarray:
        """Goodput: throughput x efficiency(num_replicas * local_bsz * accum_steps)."""
        throughput = self.throughput(num_nodes, num_replicas, local_bsz, accum_steps)
        batch = (np.asarray(num_replicas, dtype=float) * np.asarray(local_bsz, dtype=float)
                 * np.asarray(accum_steps, dtype=float))
        result = throughput * _efficiency(self._grad, self._init, batch)
        return result if np.ndim(result) else float(result)

    def _goodput(self, nodes: int, replicas: int, local_bsz: np.ndarray, accum: np.ndarray) -> np.ndarray:
        """Unvalidated goodput for one placement and arrays of (local_bsz, accum)."""
        step = _step_time(self._perf, nodes, replicas, local_bsz, accum)
        batch = replicas * np.asarray(local_bsz, dtype=float) * np.asarray(accum, dtype=float)
        goodput: np.ndarray = batch / step * _efficiency(self._grad, self._init, batch)
        return goodput

    def optimize(self, num_nodes: ArrayLike, num_replicas: ArrayLike, max_batch_size: int | None = None,
                 local_bsz_bounds: Sequence[int | None] | None = None, gradient_accumulation: bool = False
                 ) -> tuple[float, int, int] | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Best ``(goodput, local_bsz, accum_steps)`` for each placement.

        Searches every integer ``local_bsz`` within ``local_bsz_bounds`` and
        ``accum_steps >= 1`` (only 1 unless ``gradient_accumulation``) whose
        global batch ``num_replicas * local_bsz * accum_steps`` is at most
        ``max_batch_size`` and, where any such configuration exists, at
        least ``init_batch_size``.  The returned goodput equals the maximum
        over all of them; among configurations of equal goodput the smaller
        global batch, then the fewer accumulation steps, is preferred.

        Args:
            num_nodes, num_replicas: placements (numpy-broadcastable
                integers, ``1 <= num_nodes <= num_replicas``).
            max_batch_size: largest global batch; default
                ``init_batch_size`` (the batch size stays fixed).
            local_bsz_bounds: ``(lo, hi)`` samples per replica per
                micro-batch; either may be None (lo = 1, hi =
                ``max_batch_size``).
            gradient_accumulation: allow ``accum_steps > 1``.

        Returns:
            Arrays of the broadcast shape (Python scalars for scalar
            inputs).  A placement with no feasible configuration (even
            ``lo`` samples per replica exceed ``max_batch_size``) gets
            goodput 0, ``local_bsz = lo`` and ``accum_steps = 1``.
        """
        nodes, replicas = np.broadcast_arrays(np.asarray(num_nodes), np.asarray(num_replicas))
        scalar = nodes.ndim == 0
        search.validate_placements(nodes, replicas)
        max_bs = self._init if max_batch_size is None else \
            check_int("max_batch_size", max_batch_size, self._init, hint="; it cannot be below init_batch_size")
        lo, hi = search.resolve_bounds(local_bsz_bounds, max_bs)
        accumulation = bool(gradient_accumulation)
        flat_nodes, flat_replicas = nodes.reshape(-1), replicas.reshape(-1)
        goodput = np.zeros(flat_nodes.shape, dtype=float)
        local = np.full(flat_nodes.shape, lo, dtype=np.int64)
        accum = np.ones(flat_nodes.shape, dtype=np.int64)
        memo: dict[tuple[int, int], tuple[float, int, int]] = {}
        for i, key in enumerate(zip(flat_nodes.tolist(), flat_replicas.tolist())):
            if key not in memo:
                memo[key] = search.optimize_one(self._goodput, self._init, int(key[0]), int(key[1]), max_bs, lo, hi,
                                                accumulation)
            goodput[i], local[i], accum[i] = memo[key]
        if scalar:
            return float(goodput[0]), int(local[0]), int(accum[0])
        shape = nodes.shape
        return goodput.reshape(shape), local.reshape(shape), accum.reshape(shape)

