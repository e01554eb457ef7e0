"""Fitting the goodput model's step-time parameters to measured times (numpy only).

:func:`fit_perf_params` finds the :class:`~adaptive.goodput.model.PerfParams`
whose predicted step, compute and synchronisation times best match the
measurements (squared log-errors, Huber-weighted against outliers), with
weak priors for what the measurements cannot decide.  The search is a
small projected Levenberg-Marquardt over log-parameters (and a logistic
transform of gamma), started from a few guesses derived from the data, or
from a previous fit when the profile grows.  The job fits its own record
(:meth:`adaptive.batchsize.throughput_profile.ThroughputProfile.fit`) and
the scheduler's simulator fits the measurements of its trace, both with this.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.typing import ArrayLike

from adaptive.goodput.model import GAMMA_MAX, PERF_FIELDS, PerfParams, overlap

__all__ = ["fit_perf_params"]

logger = logging.getLogger(__name__)

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


def _params_from_vector(x: np.ndarray) -> tuple[np.ndarray, float]:
    """(alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r), gamma from the search vector."""
    return np.exp(x[:6]), 1.0 + (GAMMA_MAX - 1.0) / (1.0 + math.exp(-x[6]))


def _gammas(xs: np.ndarray) -> np.ndarray:
    """gamma of each row of a batch of search vectors, as a column."""
    gammas: np.ndarray = 1.0 + (GAMMA_MAX - 1.0) / (1.0 + np.exp(-xs[:, 6:7]))
    return gammas


def _predict(xs: np.ndarray, obs: _Observations) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step, compute and sync times of every observation (columns) under
    every search vector in ``xs`` (rows): one vectorised pass per batch."""
    a_c, b_c, a_n, b_n, a_r, b_r = np.exp(xs[:, :6]).T[:, :, None]
    compute = a_c + b_c * obs.local_bsz
    extra = np.maximum(obs.replicas - 2.0, 0.0)
    sync = np.where(obs.replicas > 1, np.where(obs.nodes > 1, a_n + b_n * extra, a_r + b_r * extra), 0.0)
    step = (obs.accum - 1.0) * compute + overlap(compute, sync, _gammas(xs))
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

    def _priors(self) -> tuple[np.ndarray, np.ndarray]:
        """Pseudo-residuals for directions the observations cannot decide,
        as rows ``a`` and offsets ``c`` of linear terms ``a . x - c`` (the
        pull of gamma towards 1 is added separately)."""
        obs, rows = self.obs, []

        def prior(coefficients: dict[int, float], offset: float = 0.0) -> None:
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
                         max_iter: int = 100, rtol: float = 1e-9) -> tuple[np.ndarray, float]:
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
    values = [max(getattr(params, name), math.exp(_LOG_LIMITS[0])) for name in PERF_FIELDS[:6]]
    gamma = min(max(params.gamma, 1.0 + 1e-3), GAMMA_MAX - 1e-3)
    z_gamma = min(max(math.log((gamma - 1.0) / (GAMMA_MAX - gamma)), -_Z_GAMMA_LIMIT), _Z_GAMMA_LIMIT)
    return np.array([math.log(v) for v in values] + [z_gamma])


def _as_observations(num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike, accum_steps: ArrayLike,
                     step_time: ArrayLike, compute_time: ArrayLike, sync_time: ArrayLike) -> _Observations:
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


def fit_perf_params(num_nodes: ArrayLike, num_replicas: ArrayLike, local_bsz: ArrayLike, accum_steps: ArrayLike,
                    step_time: ArrayLike, compute_time: ArrayLike, sync_time: ArrayLike, *,
                    initial: PerfParams | None = None) -> PerfParams:
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
    # At least one start, and the fits only accept finite costs, so one of them was kept.
    assert best_x is not None, "no fit kept"
    params, gamma = _params_from_vector(best_x)
    alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r = (float(v) for v in params)
    result = PerfParams(alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r,
                        gamma=float(min(max(gamma, 1.0), GAMMA_MAX)))
    logger.debug("fitted %s to %d observations (cost %.3g)", result, obs.step.size, best_cost)
    return result

