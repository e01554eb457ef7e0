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
goodput as trying every feasible integer configuration).
:func:`fit_perf_params` fits the throughput model to measured step times
with priors that keep it sensible when only a few configurations have been
seen, and :class:`ThroughputProfile` is the bounded, checkpointable record
of those measurements.  Everything here is numpy only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "PerfParams",
    "GradParams",
    "GoodputFunction",
    "fit_perf_params",
    "ThroughputProfile",
    "GAMMA_MAX",
]

logger = logging.getLogger(__name__)

#: Largest overlap exponent the fit uses; gamma = 10 is already very close
#: to perfect overlap, ``max(compute, sync)``.
GAMMA_MAX = 10.0

_PERF_FIELDS = ("alpha_c", "beta_c", "alpha_n", "beta_n", "alpha_r", "beta_r", "gamma")
_GRAD_FIELDS = ("sqr", "var")


def _real(value: Any, name: str) -> float:
    """``value`` as a finite float, or ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


def _positive_int(value: Any, name: str) -> int:
    """``value`` as an int >= 1, or ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value}")
    return int(value)


def _check_keys(data: Any, fields: Sequence[str], what: str) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a mapping with keys {list(fields)}, got {type(data).__name__}")
    missing = [k for k in fields if k not in data]
    unknown = [k for k in data if k not in fields]
    if missing:
        raise ValueError(f"{what} is missing {missing}; required keys are {list(fields)}")
    if unknown:
        raise ValueError(f"{what} has unknown keys {unknown}; allowed keys are {list(fields)}")


@dataclass(frozen=True)
class PerfParams:
    """Parameters of the step-time model (seconds); see the module docstring.

    All alphas and betas are >= 0 (compute time must be positive:
    ``alpha_c + beta_c > 0``) and ``gamma >= 1``.
    """

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float

    def __post_init__(self) -> None:
        for name in _PERF_FIELDS:
            value = _real(getattr(self, name), f"PerfParams.{name}")
            object.__setattr__(self, name, value)
            if name != "gamma" and value < 0:
                raise ValueError(f"PerfParams.{name} must be >= 0, got {value}")
        if self.gamma < 1.0:
            raise ValueError(f"PerfParams.gamma must be >= 1, got {self.gamma}")
        if self.alpha_c + self.beta_c <= 0:
            raise ValueError("PerfParams.alpha_c + beta_c must be > 0 (compute time cannot be zero)")

    def to_dict(self) -> Dict[str, float]:
        """The seven parameters as a JSON-ready dict."""
        return {name: getattr(self, name) for name in _PERF_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PerfParams":
        """Validated inverse of :meth:`to_dict` (exactly the seven keys)."""
        _check_keys(data, _PERF_FIELDS, "perf_params")
        return cls(**{name: data[name] for name in _PERF_FIELDS})


@dataclass(frozen=True)
class GradParams:
    """Gradient statistics that decide statistical efficiency.

    Attributes:
        sqr: ``|G|^2``, squared norm of the true (full-batch) gradient.
        var: ``tr(Sigma) / init_batch_size``: the trace of the gradient
            noise covariance of a minibatch of the reference size.
    Both are >= 0 and not both 0.
    """

    sqr: float
    var: float

    def __post_init__(self) -> None:
        for name in _GRAD_FIELDS:
            value = _real(getattr(self, name), f"GradParams.{name}")
            if value < 0:
                raise ValueError(f"GradParams.{name} must be >= 0, got {value}")
            object.__setattr__(self, name, value)
        if self.sqr + self.var <= 0:
            raise ValueError("GradParams.sqr and GradParams.var cannot both be 0")

    def to_dict(self) -> Dict[str, float]:
        return {"sqr": self.sqr, "var": self.var}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GradParams":
        _check_keys(data, _GRAD_FIELDS, "grad_params")
        return cls(sqr=data["sqr"], var=data["var"])


# ----------------------------------------------------------------- model math
def _compute_time(p: PerfParams, local_bsz: Any) -> np.ndarray:
    return p.alpha_c + p.beta_c * np.asarray(local_bsz, dtype=float)


def _sync_time(p: PerfParams, num_nodes: Any, num_replicas: Any) -> np.ndarray:
    nodes = np.asarray(num_nodes, dtype=float)
    replicas = np.asarray(num_replicas, dtype=float)
    extra = np.maximum(replicas - 2.0, 0.0)
    multi_node = p.alpha_n + p.beta_n * extra
    one_node = p.alpha_r + p.beta_r * extra
    return np.where(replicas > 1, np.where(nodes > 1, multi_node, one_node), 0.0)


def _overlap(compute: np.ndarray, sync: np.ndarray, gamma: Any) -> np.ndarray:
    """``(compute**gamma + sync**gamma) ** (1/gamma)`` without overflow."""
    high = np.maximum(compute, sync)
    low = np.minimum(compute, sync)
    ratio = np.divide(low, high, out=np.zeros_like(high, dtype=float), where=high > 0)
    return high * (1.0 + ratio ** gamma) ** (1.0 / gamma)


def _step_time(p: PerfParams, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any) -> np.ndarray:
    compute = _compute_time(p, local_bsz)
    sync = _sync_time(p, num_nodes, num_replicas)
    accum = np.asarray(accum_steps, dtype=float)
    return (accum - 1.0) * compute + _overlap(compute, sync, p.gamma)


def _efficiency(g: GradParams, init_batch_size: int, batch_size: Any) -> np.ndarray:
    scale = np.maximum(np.asarray(batch_size, dtype=float) / init_batch_size, 1.0)
    return (g.var + g.sqr) / (g.var + scale * g.sqr)


def _as_output(value: Any, scalar: bool, kind: type) -> Any:
    return kind(value) if scalar else np.asarray(value)


def _all_scalar(*values: Any) -> bool:
    return all(np.ndim(v) == 0 for v in values)


def _check_at_least_one(values: Any, name: str) -> np.ndarray:
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
            raise ValueError(f"perf_params must be a PerfParams, got {type(perf_params).__name__}")
        if not isinstance(grad_params, GradParams):
            raise ValueError(f"grad_params must be a GradParams, got {type(grad_params).__name__}")
        self._perf = perf_params
        self._grad = grad_params
        self._init = _positive_int(init_batch_size, "init_batch_size")

    @property
    def perf_params(self) -> PerfParams:
        return self._perf

    @property
    def grad_params(self) -> GradParams:
        return self._grad

    @property
    def init_batch_size(self) -> int:
        return self._init

    def step_time(self, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any) -> Any:
        """Predicted seconds per optimizer step (numpy-broadcastable)."""
        scalar = _all_scalar(num_nodes, num_replicas, local_bsz, accum_steps)
        for value, name in ((num_nodes, "num_nodes"), (num_replicas, "num_replicas"),
                            (local_bsz, "local_bsz"), (accum_steps, "accum_steps")):
            _check_at_least_one(value, name)
        return _as_output(_step_time(self._perf, num_nodes, num_replicas, local_bsz, accum_steps), scalar, float)

    def throughput(self, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any) -> Any:
        """Predicted samples per second (numpy-broadcastable)."""
        step = self.step_time(num_nodes, num_replicas, local_bsz, accum_steps)
        samples = (np.asarray(num_replicas, dtype=float) * np.asarray(local_bsz, dtype=float)
                   * np.asarray(accum_steps, dtype=float))
        return samples / step if np.ndim(step) else float(samples / step)

    def efficiency(self, batch_size: Any) -> Any:
        """Statistical efficiency in (0, 1] of a global batch of ``batch_size``.

        ``gain / scale`` with ``scale = batch_size / init_batch_size``;
        batches below the reference size count as efficiency 1 (the model
        is not trusted to reward them).
        """
        _check_at_least_one(batch_size, "batch_size")
        return _as_output(_efficiency(self._grad, self._init, batch_size), np.ndim(batch_size) == 0, float)

    def evaluate(self, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any) -> Any:
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
        return batch / step * _efficiency(self._grad, self._init, batch)

    def optimize(self, num_nodes: Any, num_replicas: Any, max_batch_size: Optional[int] = None,
                 local_bsz_bounds: Optional[Sequence[Optional[int]]] = None,
                 gradient_accumulation: bool = False) -> Tuple[Any, Any, Any]:
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
        _validate_placements(nodes, replicas)
        max_bs = self._init if max_batch_size is None else _positive_int(max_batch_size, "max_batch_size")
        if max_bs < self._init:
            raise ValueError(f"max_batch_size must be >= init_batch_size ({self._init}), got {max_bs}")
        lo, hi = _resolve_bounds(local_bsz_bounds, max_bs)
        accumulation = bool(gradient_accumulation)
        flat_nodes, flat_replicas = nodes.reshape(-1), replicas.reshape(-1)
        goodput = np.zeros(flat_nodes.shape, dtype=float)
        local = np.full(flat_nodes.shape, lo, dtype=np.int64)
        accum = np.ones(flat_nodes.shape, dtype=np.int64)
        memo: Dict[Tuple[int, int], Tuple[float, int, int]] = {}
        for i, key in enumerate(zip(flat_nodes.tolist(), flat_replicas.tolist())):
            if key not in memo:
                memo[key] = self._optimize_one(int(key[0]), int(key[1]), max_bs, lo, hi, accumulation)
            goodput[i], local[i], accum[i] = memo[key]
        if scalar:
            return float(goodput[0]), int(local[0]), int(accum[0])
        shape = nodes.shape
        return goodput.reshape(shape), local.reshape(shape), accum.reshape(shape)

    def _optimize_one(self, nodes: int, replicas: int, max_bs: int, lo: int, hi: int,
                      accumulation: bool) -> Tuple[float, int, int]:
        """Exact search for one placement.

        Candidates are indexed by ``n = local_bsz * accum_steps`` (samples
        per replica per step).  For a fixed ``n`` the global batch, hence
        the efficiency, is fixed, and the step time never decreases with
        more accumulation steps: ``T(n, a) - T(n, a') >= (a - a') alpha_c``
        for ``a > a'`` because the overlap term is 1-Lipschitz in compute.
        So each ``n`` only needs its smallest feasible ``a``.  The bound
        ``a >= ceil(n / hi)`` gives an upper bound on every ``n``'s goodput
        (exact when that ``a`` divides ``n``); only the few ``n`` whose
        bound beats the best exact value are searched for a divisor.
        """
        n_max = max_bs // replicas
        if n_max < lo:
            return 0.0, lo, 1
        n_pref = -(-self._init // replicas)  # smallest n with replicas * n >= init
        if not accumulation:
            n = np.arange(lo, min(hi, n_max) + 1, dtype=np.int64)
            pool = n >= n_pref
            if not pool.any():
                pool[:] = True
            values = np.where(pool, self._goodput(nodes, replicas, n, np.ones_like(n)), -np.inf)
            best = int(np.argmax(values))
            return float(values[best]), int(n[best]), 1
        n = np.arange(lo, n_max + 1, dtype=np.int64)
        a_low = np.maximum(-(-n // hi), 1)
        exact = (n % a_low == 0) & (n // a_low >= lo)
        bound = self._goodput(nodes, replicas, n / a_low, a_low)
        pool = n >= n_pref
        if not (exact & pool).any() and not self._any_divisible(n[pool & ~exact], a_low[pool & ~exact], lo):
            pool[:] = True
        exact_values = np.where(exact & pool, bound, -np.inf)
        best = int(np.argmax(exact_values))
        best_value, best_n, best_a = float(exact_values[best]), int(n[best]), int(a_low[best])
        open_mask = pool & ~exact & (bound > best_value)
        for i in np.flatnonzero(open_mask)[np.argsort(-bound[open_mask], kind="stable")]:
            if bound[i] <= best_value:
                break
            a = _smallest_divisor(int(n[i]), int(a_low[i]), int(n[i]) // lo)
            if a is None:
                continue
            value = float(self._goodput(nodes, replicas, np.array([n[i] / a]), np.array([a]))[0])
            if value > best_value or (value == best_value and n[i] < best_n):
                best_value, best_n, best_a = value, int(n[i]), a
        if best_value == -np.inf:
            return 0.0, lo, 1
        return best_value, best_n // best_a, best_a

    @staticmethod
    def _any_divisible(n: np.ndarray, a_low: np.ndarray, lo: int) -> bool:
        """Whether any ``n`` has a divisor ``a`` in ``[a_low, n // lo]``."""
        return any(_smallest_divisor(int(v), int(a), int(v) // lo) is not None for v, a in zip(n, a_low))


def _smallest_divisor(n: int, low: int, high: int) -> Optional[int]:
    """Smallest divisor of ``n`` in ``[low, high]``, or None."""
    if high < low:
        return None
    candidates = np.arange(low, high + 1, dtype=np.int64)
    hits = np.flatnonzero(n % candidates == 0)
    return int(candidates[hits[0]]) if hits.size else None


def _validate_placements(nodes: np.ndarray, replicas: np.ndarray) -> None:
    for array, name in ((nodes, "num_nodes"), (replicas, "num_replicas")):
        if array.dtype.kind not in "iu" and not (array.dtype.kind == "f" and np.all(array == np.round(array))):
            raise ValueError(f"{name} must hold integers, got {array!r}")
        if np.any(array < 1):
            raise ValueError(f"{name} must be >= 1, got {array!r}")
    if np.any(nodes > replicas):
        raise ValueError("num_nodes must be <= num_replicas (every node runs at least one replica)")


def _resolve_bounds(bounds: Optional[Sequence[Optional[int]]], max_bs: int) -> Tuple[int, int]:
    if bounds is None:
        return 1, max_bs
    if len(bounds) != 2:
        raise ValueError(f"local_bsz_bounds must be (lo, hi), got {bounds!r}")
    lo = 1 if bounds[0] is None else _positive_int(bounds[0], "local_bsz_bounds[0]")
    hi = max_bs if bounds[1] is None else _positive_int(bounds[1], "local_bsz_bounds[1]")
    if lo > hi:
        raise ValueError(f"local_bsz_bounds must have lo <= hi, got {bounds!r}")
    return lo, hi


# ------------------------------------------------------------------- fitting
#: Weight of the priors against one observation's log-error (small: data win
#: wherever they identify a parameter).
_PRIOR_WEIGHT = 0.01
#: "Negligible" time that unobserved network costs are pulled towards (an
#: optimistic model; the scheduler caps replicas relative to what was seen).
_TINY_TIME = 1e-8
#: Log-errors above this are down-weighted (Huber) as probable outliers.
_HUBER_DELTA = 0.1
_LOG_LIMITS = (math.log(1e-12), math.log(1e4))
#: gamma = 1 + (GAMMA_MAX - 1) * sigmoid(z); |z| <= 9 keeps the sigmoid from
#: flattening out (gamma within 1.001 of its bounds) so the search can move.
_Z_GAMMA_LIMIT = 9.0


@dataclass
class _Observations:
    nodes: np.ndarray
    replicas: np.ndarray
    local_bsz: np.ndarray
    accum: np.ndarray
    step: np.ndarray
    compute: np.ndarray
    sync: np.ndarray


def _params_from_vector(x: np.ndarray) -> Tuple[np.ndarray, float]:
    """(alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r), gamma from the search vector."""
    return np.exp(x[:6]), 1.0 + (GAMMA_MAX - 1.0) / (1.0 + math.exp(-x[6]))


def _gammas(xs: np.ndarray) -> np.ndarray:
    """gamma of each row of a batch of search vectors, as a column."""
    return 1.0 + (GAMMA_MAX - 1.0) / (1.0 + np.exp(-xs[:, 6:7]))


def _predict(xs: np.ndarray, obs: _Observations) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step, compute and sync times of every observation (columns) under
    every search vector in ``xs`` (rows): one vectorised pass per batch."""
    a_c, b_c, a_n, b_n, a_r, b_r = np.exp(xs[:, :6]).T[:, :, None]
    compute = a_c + b_c * obs.local_bsz
    extra = np.maximum(obs.replicas - 2.0, 0.0)
    sync = np.where(obs.replicas > 1, np.where(obs.nodes > 1, a_n + b_n * extra, a_r + b_r * extra), 0.0)
    step = (obs.accum - 1.0) * compute + _overlap(compute, sync, _gammas(xs))
    return step, compute, sync


class _FitProblem:
    """Residuals (log errors plus priors) of the step-time model, evaluated
    for a batch of search vectors at once (rows), so that a finite-difference
    Jacobian costs one call."""

    def __init__(self, obs: _Observations) -> None:
        self.obs = obs
        self.compute_mask = np.isfinite(obs.compute) & (obs.compute > 0)
        self.sync_mask = np.isfinite(obs.sync) & (obs.sync > 0) & (obs.replicas > 1)
        self.log_step = np.log(obs.step)
        self.log_compute = np.log(obs.compute[self.compute_mask])
        self.log_sync = np.log(obs.sync[self.sync_mask])
        self.data_weights = np.ones(len(obs.step) + int(self.compute_mask.sum()) + int(self.sync_mask.sum()))
        self.prior_matrix, self.prior_offset = self._priors()

    def _priors(self) -> Tuple[np.ndarray, np.ndarray]:
        """Pseudo-residuals for directions the observations cannot decide,
        as rows ``a`` and offsets ``c`` of linear terms ``a . x - c`` (the
        pull of gamma towards 1 is added separately)."""
        obs, rows = self.obs, []

        def prior(coefficients: Dict[int, float], offset: float = 0.0) -> None:
            row = np.zeros(8)
            for index, value in coefficients.items():
                row[index] = value
            row[7] = offset
            rows.append(row)

        multi = obs.replicas > 1
        one_node, many_nodes = multi & (obs.nodes == 1), multi & (obs.nodes > 1)
        tiny = math.log(_TINY_TIME)
        if np.unique(obs.local_bsz).size <= 1:
            # One local batch size: split its compute time evenly between the
            # fixed and the per-sample part.
            prior({0: 1.0, 1: -1.0}, math.log(float(np.mean(obs.local_bsz))))
        # Regime parameters: (alpha index, beta index, observed, observed with > 2 replicas).
        for alpha, beta, mask, other in ((4, 5, one_node, many_nodes), (2, 3, many_nodes, one_node)):
            if not mask.any():
                if other.any():  # assume the unseen link costs what the seen one does
                    prior({alpha: 1.0, 6 - alpha: -1.0})
                    prior({beta: 1.0, 8 - beta: -1.0})
                else:
                    prior({alpha: 1.0}, tiny)
                    prior({beta: 1.0}, tiny)
            elif not (obs.replicas[mask] > 2).any():
                prior({beta: 1.0}, tiny)
        table = np.array(rows).reshape(-1, 8)
        return table[:, :7], table[:, 7]

    def data_residuals(self, xs: np.ndarray) -> np.ndarray:
        step, compute, sync = _predict(np.atleast_2d(xs), self.obs)
        parts = [np.log(step) - self.log_step,
                 np.log(compute[:, self.compute_mask]) - self.log_compute,
                 0.5 * (np.log(np.maximum(sync[:, self.sync_mask], 1e-300)) - self.log_sync)]
        return np.concatenate(parts, axis=1)

    def robust_cost(self, x: np.ndarray) -> float:
        """Huber loss of the data residuals plus the squared priors: what
        fits from different starting points are ranked by."""
        err = np.abs(self.data_residuals(x)[0])
        huber = np.where(err <= _HUBER_DELTA, err ** 2, 2.0 * _HUBER_DELTA * err - _HUBER_DELTA ** 2)
        prior = self.prior_residuals(np.atleast_2d(x))[0]
        return float(huber.sum() + prior @ prior)

    def prior_residuals(self, xs: np.ndarray) -> np.ndarray:
        """Weighted prior pseudo-residuals, one row per search vector."""
        linear = xs @ self.prior_matrix.T - self.prior_offset
        overlap = _gammas(xs) - 1.0  # prefer less overlap (pessimistic)
        return np.concatenate([linear, overlap], axis=1) * _PRIOR_WEIGHT

    def residuals(self, xs: np.ndarray) -> np.ndarray:
        """Weighted residuals, one row per search vector in ``xs``."""
        xs = np.atleast_2d(xs)
        return np.concatenate([self.data_weights * self.data_residuals(xs), self.prior_residuals(xs)], axis=1)


def _levenberg_marquardt(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray,
                         max_iter: int = 100, rtol: float = 1e-9) -> Tuple[np.ndarray, float]:
    """Minimise ``|fun(x)|^2`` (forward-difference Jacobian, Marquardt
    damping); ``fun`` maps a batch of vectors (rows) to residual rows.

    Stops when an accepted step lowers the cost by less than ``rtol``
    relative to it: the model is a few-percent approximation of noisy
    timings, so polishing further only costs time.
    """
    lower = np.array([_LOG_LIMITS[0]] * 6 + [-_Z_GAMMA_LIMIT])
    upper = np.array([_LOG_LIMITS[1]] * 6 + [_Z_GAMMA_LIMIT])
    x = np.clip(x0, lower, upper)
    r = fun(x)[0]
    cost = float(r @ r)
    damping = 1e-3
    for _ in range(max_iter):
        steps = 1e-6 * np.maximum(1.0, np.abs(x))
        jac = ((fun(x + np.diag(steps)) - r) / steps[:, None]).T
        grad, hess = jac.T @ r, jac.T @ jac
        # Variables held at a bound by the gradient stay there (projected
        # steps), otherwise clipping would stall every step along them.
        free = ~(((x <= lower) & (grad > 0)) | ((x >= upper) & (grad < 0)))
        if not free.any():
            break
        grad, hess = grad[free], hess[np.ix_(free, free)]
        diag = np.diag(np.diag(hess) + 1e-12)
        for _ in range(30):
            try:
                delta = np.zeros_like(x)
                delta[free] = np.linalg.solve(hess + damping * diag, -grad)
            except np.linalg.LinAlgError:
                damping *= 10.0
                continue
            x_new = np.clip(x + delta, lower, upper)
            r_new = fun(x_new)[0]
            cost_new = float(r_new @ r_new)
            if np.isfinite(cost_new) and cost_new < cost:
                break
            damping *= 4.0
        else:
            return x, cost
        improvement = cost - cost_new
        x, r, cost = x_new, r_new, cost_new
        damping = max(damping / 3.0, 1e-12)
        if improvement <= rtol * cost + 1e-15:
            break
    return x, cost


def _initial_vector(obs: _Observations, gamma: float) -> np.ndarray:
    """Starting point: a compute line, then network costs from sync times or,
    where none were measured, from the step time left over by compute."""
    mask = np.isfinite(obs.compute) & (obs.compute > 0)
    single = obs.replicas == 1
    if mask.any():
        m, t = obs.local_bsz[mask], obs.compute[mask]
    elif single.any():
        m, t = obs.local_bsz[single], obs.step[single] / obs.accum[single]
    else:
        m, t = obs.local_bsz, obs.step / obs.accum
    alpha_c = beta_c = 0.0
    if np.unique(m).size >= 2:
        beta_c, alpha_c = np.polyfit(m, t, 1)
    if not (alpha_c > 0 and beta_c > 0):
        beta_c = 0.5 * float(np.mean(t / m))
        alpha_c = 0.5 * float(np.mean(t))
    compute = alpha_c + beta_c * obs.local_bsz
    leftover = obs.step - obs.accum * compute
    measured = np.isfinite(obs.sync) & (obs.sync > 0)
    sync = np.where(measured, obs.sync, leftover)
    network = []
    for regime in (obs.nodes > 1, obs.nodes == 1):
        sel = regime & (obs.replicas > 1) & (sync > 0)
        alpha = float(np.median(sync[sel])) if sel.any() else 0.1 * alpha_c
        beta = 0.01 * alpha
        extra = np.maximum(obs.replicas[sel] - 2.0, 0.0)
        if np.unique(extra).size >= 2:
            slope, intercept = np.polyfit(extra, sync[sel], 1)
            if slope > 0 and intercept > 0:
                alpha, beta = float(intercept), float(slope)
        network += [alpha, beta]
    z_gamma = math.log((gamma - 1.0) / (GAMMA_MAX - gamma))
    return np.array([math.log(alpha_c), math.log(beta_c)] + [math.log(v) for v in network] + [z_gamma])


def _vector_from_params(params: PerfParams) -> np.ndarray:
    values = [max(getattr(params, name), math.exp(_LOG_LIMITS[0])) for name in _PERF_FIELDS[:6]]
    gamma = min(max(params.gamma, 1.0 + 1e-3), GAMMA_MAX - 1e-3)
    z_gamma = min(max(math.log((gamma - 1.0) / (GAMMA_MAX - gamma)), -_Z_GAMMA_LIMIT), _Z_GAMMA_LIMIT)
    return np.array([math.log(v) for v in values] + [z_gamma])


def _as_observations(num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any,
                     step_time: Any, compute_time: Any, sync_time: Any) -> _Observations:
    arrays = {}
    names = ("num_nodes", "num_replicas", "local_bsz", "accum_steps", "step_time", "compute_time", "sync_time")
    values = (num_nodes, num_replicas, local_bsz, accum_steps, step_time, compute_time, sync_time)
    for name, value in zip(names, values):
        array = np.asarray(value, dtype=float).reshape(-1)
        arrays[name] = array
    size = arrays["step_time"].size
    if size == 0:
        raise ValueError("fit_perf_params needs at least one observation")
    for name, array in arrays.items():
        if array.size != size:
            raise ValueError(f"{name} has {array.size} entries but step_time has {size}; all must match")
    for name in names[:4]:
        if not np.all(np.isfinite(arrays[name])) or np.any(arrays[name] < 1):
            raise ValueError(f"{name} must be integers >= 1, got {arrays[name]!r}")
    if np.any(arrays["num_nodes"] > arrays["num_replicas"]):
        raise ValueError("num_nodes must be <= num_replicas in every observation")
    if not np.all(np.isfinite(arrays["step_time"])) or np.any(arrays["step_time"] <= 0):
        raise ValueError(f"step_time must be finite and > 0, got {arrays['step_time']!r}")
    return _Observations(arrays["num_nodes"], arrays["num_replicas"], arrays["local_bsz"],
                         arrays["accum_steps"], arrays["step_time"], arrays["compute_time"], arrays["sync_time"])


def fit_perf_params(num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any,
                    step_time: Any, compute_time: Any, sync_time: Any, *,
                    initial: Optional[PerfParams] = None) -> PerfParams:
    """Fit :class:`PerfParams` to measured times (one entry per configuration).

    Minimises the squared log-errors of the predicted step time, compute
    time (one micro-batch) and synchronisation time, with Huber
    down-weighting of outliers and weak priors for what the data cannot
    decide:

    * one local batch size seen: its compute time is split evenly between
      ``alpha_c`` and ``beta_c * local_bsz``;
    * a network regime never seen (e.g. several nodes): it costs what the
      other regime costs, or, if no multi-replica run was seen at all,
      almost nothing (optimistic; the scheduler explores at most a small
      factor beyond the profiled replica count);
    * no run with more than 2 replicas in a regime: no retrogression
      (``beta ~ 0``, as for ring all-reduce);
    * gamma is gently pulled towards 1 (no overlap).

    Args:
        num_nodes, num_replicas, local_bsz, accum_steps: configuration of
            each observation (integers >= 1).
        step_time: seconds per optimizer step (> 0).
        compute_time: seconds of one micro-batch's forward and backward
            (NaN or <= 0 where unknown).
        sync_time: seconds of gradient synchronisation per step (NaN or
            <= 0 where unknown; ignored for one replica).
        initial: a previous fit to start from (one local search instead of
            several starting points: a cheap refit when the profile grows).

    Returns:
        The fitted parameters (gamma within [1, GAMMA_MAX]).
    """
    obs = _as_observations(num_nodes, num_replicas, local_bsz, accum_steps, step_time, compute_time, sync_time)
    problem = _FitProblem(obs)
    best_x, best_cost = None, math.inf
    starts = [_vector_from_params(initial)] if initial is not None else \
        [_initial_vector(obs, gamma) for gamma in (1.2, 2.0, 4.0)]
    for x in starts:
        problem.data_weights[:] = 1.0
        x, _ = _levenberg_marquardt(problem.residuals, x)
        for _ in range(2):  # iteratively reweighted: Huber on the data residuals
            err = np.abs(problem.data_residuals(x)[0])
            if np.all(err <= _HUBER_DELTA):
                break
            problem.data_weights[:] = np.sqrt(np.minimum(1.0, _HUBER_DELTA / np.maximum(err, 1e-300)))
            x, _ = _levenberg_marquardt(problem.residuals, x)
        cost = problem.robust_cost(x)
        if cost < best_cost:
            best_x, best_cost = x, cost
    params, gamma = _params_from_vector(best_x)
    result = PerfParams(*(float(v) for v in params), gamma=float(min(max(gamma, 1.0), GAMMA_MAX)))
    logger.debug("fitted %s to %d observations (cost %.3g)", result, obs.step.size, best_cost)
    return result


# ------------------------------------------------------------------- profile
_Key = Tuple[int, int, int, int]
_TIMES = ("step_time", "compute_time", "sync_time", "data_time")


class ThroughputProfile:
    """Bounded record of measured times per configuration, for fitting.

    Each configuration ``(num_nodes, num_replicas, local_bsz, accum_steps)``
    keeps running means of its step, compute (one micro-batch), sync and
    data-wait times.  After ``window`` samples a mean becomes an
    exponential average with weight ``1/window``, so it follows slow drift.
    At most ``max_entries`` configurations are kept; recording a new one
    when full evicts the least recently updated.

    Args:
        max_entries: hard cap on configurations (>= 1).
        window: samples after which means turn into moving averages (>= 1).
    """

    def __init__(self, max_entries: int = 256, window: int = 64) -> None:
        self._max_entries = _positive_int(max_entries, "max_entries")
        self._window = _positive_int(window, "window")
        self._entries: Dict[_Key, Dict[str, float]] = {}
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[_Key]:
        return iter(sorted(self._entries))

    @property
    def max_entries(self) -> int:
        return self._max_entries

    def record(self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int, *,
               step_time: float, compute_time: Optional[float] = None, sync_time: Optional[float] = None,
               data_time: Optional[float] = None) -> None:
        """Add one optimizer step's measurements (seconds; None = not measured)."""
        key = (_positive_int(num_nodes, "num_nodes"), _positive_int(num_replicas, "num_replicas"),
               _positive_int(local_bsz, "local_bsz"), _positive_int(accum_steps, "accum_steps"))
        if key[0] > key[1]:
            raise ValueError(f"num_nodes must be <= num_replicas, got {key[0]} > {key[1]}")
        samples = {"step_time": step_time, "compute_time": compute_time,
                   "sync_time": sync_time, "data_time": data_time}
        for name, value in samples.items():
            if value is not None and _real(value, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if samples["step_time"] is None or samples["step_time"] <= 0:
            raise ValueError(f"step_time must be > 0, got {step_time}")
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self._max_entries:
                oldest = min(self._entries, key=lambda k: self._entries[k]["updated"])
                del self._entries[oldest]
            entry = {"updated": 0.0}
            for name in _TIMES:
                entry[name], entry[name + "_count"] = math.nan, 0.0
            self._entries[key] = entry
        self._clock += 1
        entry["updated"] = float(self._clock)
        for name, value in samples.items():
            if value is None:
                continue
            count = min(entry[name + "_count"] + 1.0, float(self._window))
            mean = entry[name]
            entry[name] = float(value) if math.isnan(mean) else mean + (float(value) - mean) / count
            entry[name + "_count"] = count

    def get(self, num_nodes: int, num_replicas: int, local_bsz: int, accum_steps: int) -> Optional[Dict[str, float]]:
        """Mean times of one configuration (NaN where never measured), or None."""
        entry = self._entries.get((num_nodes, num_replicas, local_bsz, accum_steps))
        return None if entry is None else {name: entry[name] for name in _TIMES}

    @property
    def max_replicas(self) -> int:
        """Largest replica count profiled (0 if empty)."""
        return max((k[1] for k in self._entries), default=0)

    @property
    def max_nodes(self) -> int:
        """Largest node count profiled (0 if empty)."""
        return max((k[0] for k in self._entries), default=0)

    def to_arrays(self) -> Dict[str, np.ndarray]:
        """Observations as the keyword arguments of :func:`fit_perf_params`."""
        keys = sorted(self._entries)
        columns = {"num_nodes": [k[0] for k in keys], "num_replicas": [k[1] for k in keys],
                   "local_bsz": [k[2] for k in keys], "accum_steps": [k[3] for k in keys]}
        arrays = {name: np.asarray(values, dtype=np.int64) for name, values in columns.items()}
        for name in ("step_time", "compute_time", "sync_time"):
            arrays[name] = np.asarray([self._entries[k][name] for k in keys], dtype=float)
        return arrays

    def fit(self, initial: Optional[PerfParams] = None) -> Optional[PerfParams]:
        """:func:`fit_perf_params` on the profile (warm-started from
        ``initial`` if given), or None while it is empty."""
        if not self._entries:
            return None
        return fit_perf_params(**self.to_arrays(), initial=initial)

    def state_dict(self) -> Dict[str, Any]:
        """Plain ints, floats and lists (safe to checkpoint and to JSON)."""
        rows = [list(key) + [entry["updated"]] + [entry[n] for n in _TIMES] + [entry[n + "_count"] for n in _TIMES]
                for key, entry in sorted(self._entries.items())]
        return {"version": 1, "max_entries": self._max_entries, "window": self._window,
                "clock": self._clock, "entries": rows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; keeps this profile's own size limits."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("ThroughputProfile state must be a dict with version 1")
        entries: Dict[_Key, Dict[str, float]] = {}
        width = 5 + 2 * len(_TIMES)
        for row in state.get("entries", []):
            if len(row) != width:
                raise ValueError(f"ThroughputProfile state rows must have {width} values, got {len(row)}")
            key = tuple(_positive_int(int(v), "profile key") for v in row[:4])
            entry = {"updated": float(row[4])}
            for i, name in enumerate(_TIMES):
                entry[name] = float(row[5 + i])
                entry[name + "_count"] = float(row[5 + len(_TIMES) + i])
            entries[key] = entry  # type: ignore[index]
        newest = sorted(entries, key=lambda k: entries[k]["updated"])[-self._max_entries:]
        self._entries = {k: entries[k] for k in newest}
        self._clock = int(state.get("clock", 0))
