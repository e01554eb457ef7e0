"""Fitting the step-time model to measured times: recovery, warm starts, robustness, priors."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from goodput_cases import TRUE, synthetic

from adaptive.goodput import GoodputFunction, GradParams, PerfParams, fit, fit_perf_params


def test_fit_recovers_parameters_without_noise():
    fitted = fit_perf_params(*synthetic(TRUE))
    for name, value in asdict(TRUE).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.01), name


def test_fit_recovers_from_step_times_alone():
    nodes, replicas, local_bsz, accum, step, _, _ = synthetic(TRUE)
    unknown = np.full(step.shape, np.nan)
    fitted = fit_perf_params(nodes, replicas, local_bsz, accum, step, unknown, unknown)
    for name, value in asdict(TRUE).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.05), name


def test_fit_warm_start_matches_cold_fit():
    data = synthetic(TRUE, noise=0.02, seed=5)
    cold = fit_perf_params(*data)
    guess = PerfParams(**{k: v * 1.3 for k, v in asdict(TRUE).items() if k != "gamma"}, gamma=1.5)
    warm = fit_perf_params(*data, initial=guess)
    for name in ("alpha_c", "beta_c", "alpha_r", "alpha_n", "gamma"):
        assert getattr(warm, name) == pytest.approx(getattr(cold, name), rel=0.02), name


def test_fit_with_noise_predicts_step_times():
    data = synthetic(TRUE, noise=0.05, seed=3)
    fitted = fit_perf_params(*data)
    nodes, replicas, local_bsz, accum = data[:4]
    truth = GoodputFunction(TRUE, GradParams(1, 1), 1).step_time(nodes, replicas, local_bsz, accum)
    predicted = GoodputFunction(fitted, GradParams(1, 1), 1).step_time(nodes, replicas, local_bsz, accum)
    assert np.max(np.abs(predicted / truth - 1)) < 0.05
    for name in ("alpha_c", "beta_c", "alpha_r", "alpha_n"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.2), name


def test_fit_is_robust_to_one_outlier():
    nodes, replicas, local_bsz, accum, step, compute, sync = synthetic(TRUE)
    step = step.copy()
    step[5] *= 5.0  # one step-time observation hit by a stall
    fitted = fit_perf_params(nodes, replicas, local_bsz, accum, step, compute, sync)
    for name in ("alpha_c", "beta_c", "alpha_r", "gamma"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name


def test_fit_converges_quickly_with_gamma_at_its_bound():
    """Measured step times that are slower than compute + sync (no overlap at
    all) push gamma against its lower bound; the search must hold it there
    and converge instead of crawling (it used to hit its iteration cap)."""
    bsz = np.array([10, 14, 20, 28, 40, 57, 80] * 3, dtype=float)
    replicas = np.repeat([1.0, 2.0, 3.0], 7)
    step = np.array([0.466, 0.559, 0.681, 0.851, 1.122, 1.664, 2.541, 0.523, 0.623, 0.723, 0.848, 1.279,
                     1.764, 2.632, 0.591, 0.693, 0.791, 0.918, 1.297, 1.736, 2.573])
    sync = np.array([0.0015] * 7 + [0.038, 0.046, 0.037, 0.027, 0.068, 0.070, 0.069,
                                    0.077, 0.086, 0.109, 0.042, 0.125, 0.090, 0.083])
    obs = fit._as_observations(np.ones(21), replicas, bsz, np.ones(21), step, step - sync, sync)
    problem = fit._FitProblem(obs)
    calls = []

    def counted(xs):
        calls.append(1)
        return problem.residuals(xs)

    x, _ = fit._levenberg_marquardt(counted, fit._initial_vector(obs, 1.2))
    assert fit._params_from_vector(x)[1] < 1.01  # gamma held at (about) 1
    assert len(calls) < 100  # two calls per iteration: far below the 100-iteration cap
    fitted = fit_perf_params(np.ones(21), replicas, bsz, np.ones(21), step, step - sync, sync)
    predicted = GoodputFunction(fitted, GradParams(1, 1), 1).step_time(np.ones(21), replicas, bsz, np.ones(21))
    assert np.sqrt(np.mean(np.log(predicted / step) ** 2)) < 0.1


def test_fit_with_one_observation_uses_priors():
    fitted = fit_perf_params([1], [1], [32], [1], [0.05], [0.05], [np.nan])
    assert fitted.alpha_c == pytest.approx(0.025, rel=1e-3)
    assert fitted.beta_c * 32 == pytest.approx(0.025, rel=1e-3)
    fn = GoodputFunction(fitted, GradParams(1, 1), 32)
    assert fn.step_time(1, 1, 32, 1) == pytest.approx(0.05, rel=1e-3)
    # Unseen network: optimistic, nearly free.
    assert fn.step_time(1, 2, 32, 1) == pytest.approx(0.05, rel=1e-3)
    # One multi-replica point on one node: multi-node assumed to cost the same.
    two = fit_perf_params([1, 1], [1, 2], [32, 32], [1, 1], [0.05, 0.07], [0.05, 0.05], [np.nan, 0.03])
    assert two.alpha_n == pytest.approx(two.alpha_r, rel=1e-3)
    assert GoodputFunction(two, GradParams(1, 1), 32).step_time(1, 2, 32, 1) == pytest.approx(0.07, rel=0.02)


def test_fit_validation():
    with pytest.raises(ValueError, match="at least one"):
        fit_perf_params([], [], [], [], [], [], [])
    with pytest.raises(ValueError, match="step_time"):
        fit_perf_params([1], [1], [8], [1], [0.0], [0.1], [np.nan])
    with pytest.raises(ValueError, match="entries"):
        fit_perf_params([1, 1], [1], [8], [1], [0.1], [0.1], [np.nan])
    with pytest.raises(ValueError, match="num_nodes"):
        fit_perf_params([2], [1], [8], [1], [0.1], [0.1], [np.nan])
