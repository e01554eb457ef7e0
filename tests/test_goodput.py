"""Goodput model: throughput formula, efficiency, exact optimisation, fitting, profile."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive.batchsize.goodput import (
    GAMMA_MAX,
    GoodputFunction,
    GradParams,
    PerfParams,
    ThroughputProfile,
    fit_perf_params,
)

TRUE = PerfParams(alpha_c=0.02, beta_c=0.001, alpha_n=0.08, beta_n=0.01, alpha_r=0.03, beta_r=0.004, gamma=2.5)


def _step_time(p: PerfParams, nodes, replicas, local_bsz, accum) -> float:
    """The contract's formula, written out independently of the module."""
    compute = p.alpha_c + p.beta_c * local_bsz
    if replicas == 1:
        sync = 0.0
    elif nodes > 1:
        sync = p.alpha_n + p.beta_n * max(replicas - 2, 0)
    else:
        sync = p.alpha_r + p.beta_r * max(replicas - 2, 0)
    return (accum - 1) * compute + (compute ** p.gamma + sync ** p.gamma) ** (1 / p.gamma)


# ---------------------------------------------------------------- params
def test_params_round_trip_and_validation():
    assert PerfParams.from_dict(TRUE.to_dict()) == TRUE
    grad = GradParams(sqr=2.0, var=3.0)
    assert GradParams.from_dict(grad.to_dict()) == grad
    with pytest.raises(ValueError, match="gamma"):
        PerfParams(0.1, 0.1, 0.1, 0.1, 0.1, 0.1, gamma=0.5)
    with pytest.raises(ValueError, match="beta_r"):
        PerfParams(0.1, 0.1, 0.1, 0.1, 0.1, -1.0, gamma=1.0)
    with pytest.raises(ValueError, match="alpha_c"):
        PerfParams(0.0, 0.0, 0.1, 0.1, 0.1, 0.1, gamma=1.0)
    with pytest.raises(ValueError, match="finite"):
        PerfParams(math.nan, 0.1, 0.1, 0.1, 0.1, 0.1, gamma=1.0)
    with pytest.raises(ValueError, match="unknown keys"):
        PerfParams.from_dict(dict(TRUE.to_dict(), delta=1.0))
    with pytest.raises(ValueError, match="missing"):
        GradParams.from_dict({"sqr": 1.0})
    with pytest.raises(ValueError, match="both be 0"):
        GradParams(0.0, 0.0)
    with pytest.raises(ValueError, match="var"):
        GradParams(1.0, -0.1)


# ---------------------------------------------------------------- model
@pytest.mark.parametrize("nodes,replicas,local_bsz,accum", [(1, 1, 32, 1), (1, 2, 64, 1), (1, 4, 16, 3),
                                                            (2, 4, 128, 1), (3, 12, 8, 2)])
def test_throughput_matches_formula(nodes, replicas, local_bsz, accum):
    fn = GoodputFunction(TRUE, GradParams(1.0, 4.0), init_batch_size=64)
    step = _step_time(TRUE, nodes, replicas, local_bsz, accum)
    assert fn.step_time(nodes, replicas, local_bsz, accum) == pytest.approx(step, rel=1e-12)
    expected = replicas * local_bsz * accum / step
    assert fn.throughput(nodes, replicas, local_bsz, accum) == pytest.approx(expected, rel=1e-12)
    batch = replicas * local_bsz * accum
    scale = max(batch / 64, 1.0)
    gain = (4.0 + 1.0) / (4.0 / scale + 1.0)
    assert fn.efficiency(batch) == pytest.approx(gain / scale, rel=1e-12)
    assert fn.evaluate(nodes, replicas, local_bsz, accum) == pytest.approx(expected * gain / scale, rel=1e-12)


def test_model_broadcasts_and_efficiency_range():
    fn = GoodputFunction(TRUE, GradParams(1.0, 10.0), init_batch_size=32)
    out = fn.throughput(np.array([1, 1, 2]), np.array([1, 4, 8]), 32, np.array([[1], [2]]))
    assert out.shape == (2, 3)
    eff = fn.efficiency(np.array([1, 32, 64, 4096]))
    assert np.all((eff > 0) & (eff <= 1))
    assert eff[0] == eff[1] == 1.0
    assert np.all(np.diff(eff[1:]) < 0)
    with pytest.raises(ValueError, match="batch_size"):
        fn.efficiency(0)


def test_gamma_large_is_max_and_one_is_sum():
    base = dict(alpha_c=0.1, beta_c=0.0, alpha_n=0.0, beta_n=0.0, alpha_r=0.05, beta_r=0.0)
    slow = GoodputFunction(PerfParams(**base, gamma=1.0), GradParams(1, 1), 1)
    fast = GoodputFunction(PerfParams(**base, gamma=200.0), GradParams(1, 1), 1)
    assert slow.step_time(1, 2, 1, 1) == pytest.approx(0.15)
    assert fast.step_time(1, 2, 1, 1) == pytest.approx(0.1, rel=1e-3)


# ---------------------------------------------------------------- optimize
def _brute_force(fn: GoodputFunction, nodes, replicas, max_bs, lo, hi, accumulation):
    """Best goodput over every feasible (local_bsz, accum_steps), as the contract states."""
    pairs = []
    max_accum = max_bs // (replicas * lo) if accumulation else 1
    for a in range(1, max_accum + 1):
        for m in range(lo, min(hi, max_bs // (replicas * a)) + 1):
            pairs.append((m, a))
    if not pairs:
        return 0.0, set()
    preferred = [(m, a) for m, a in pairs if replicas * m * a >= fn.init_batch_size]
    pool = preferred or pairs
    m, a = (np.array(v) for v in zip(*pool))
    values = fn.evaluate(nodes, replicas, m, a)
    return float(values.max()), set(pool)


_times = st.floats(1e-4, 1.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(alpha_c=_times, beta_c=st.floats(1e-6, 0.05), alpha_n=_times, beta_n=st.floats(0.0, 0.1),
       alpha_r=_times, beta_r=st.floats(0.0, 0.1), gamma=st.floats(1.0, GAMMA_MAX),
       sqr=st.floats(1e-3, 10.0), var=st.floats(0.0, 1e3), init=st.integers(1, 96),
       extra=st.integers(0, 300), lo=st.integers(1, 24), width=st.integers(0, 64),
       accumulation=st.booleans(), placement=st.sampled_from([(1, 1), (1, 2), (1, 3), (2, 4), (2, 5)]))
def test_optimize_equals_brute_force(alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma, sqr, var,
                                     init, extra, lo, width, accumulation, placement):
    fn = GoodputFunction(PerfParams(alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma),
                         GradParams(sqr, var), init)
    max_bs, hi = init + extra, lo + width
    nodes, replicas = placement
    goodput, local_bsz, accum = fn.optimize(nodes, replicas, max_batch_size=max_bs,
                                            local_bsz_bounds=(lo, hi), gradient_accumulation=accumulation)
    best, pool = _brute_force(fn, nodes, replicas, max_bs, lo, hi, accumulation)
    assert goodput == pytest.approx(best, rel=1e-12, abs=0.0)
    if best > 0:
        assert (local_bsz, accum) in pool
        assert fn.evaluate(nodes, replicas, local_bsz, accum) == pytest.approx(goodput, rel=1e-12)
    else:
        assert (local_bsz, accum) == (lo, 1)
    if not accumulation:
        assert accum == 1


def test_optimize_arrays_match_scalars_and_defaults():
    fn = GoodputFunction(TRUE, GradParams(0.5, 20.0), init_batch_size=64)
    nodes, replicas = np.array([1, 1, 1, 2]), np.array([1, 2, 4, 8])
    goodput, local_bsz, accum = fn.optimize(nodes, replicas, max_batch_size=2048, local_bsz_bounds=(8, 256),
                                            gradient_accumulation=True)
    assert goodput.shape == local_bsz.shape == accum.shape == (4,)
    for i in range(4):
        assert fn.optimize(int(nodes[i]), int(replicas[i]), 2048, (8, 256), True) == \
            (goodput[i], local_bsz[i], accum[i])
    # No max_batch_size: the global batch stays at init_batch_size when it can.
    g, m, a = fn.optimize(1, 4)
    assert (m, a) == (16, 1) and g > 0
    # A single replica may need accumulation to reach the reference batch.
    g, m, a = fn.optimize(1, 1, max_batch_size=64, local_bsz_bounds=(8, 16), gradient_accumulation=True)
    assert m * a == 64 and m <= 16


def test_optimize_validation_and_infeasible():
    fn = GoodputFunction(TRUE, GradParams(1.0, 1.0), init_batch_size=64)
    with pytest.raises(ValueError, match="max_batch_size"):
        fn.optimize(1, 1, max_batch_size=32)
    with pytest.raises(ValueError, match="lo <= hi"):
        fn.optimize(1, 1, max_batch_size=128, local_bsz_bounds=(64, 32))
    with pytest.raises(ValueError, match="num_nodes"):
        fn.optimize(3, 2, max_batch_size=128)
    with pytest.raises(ValueError, match="num_replicas"):
        fn.optimize(1, 0, max_batch_size=128)
    # 16 replicas x at least 16 samples exceed 128: infeasible.
    assert fn.optimize(1, 16, max_batch_size=128, local_bsz_bounds=(16, 32)) == (0.0, 16, 1)


# ---------------------------------------------------------------- fitting
def _synthetic(params: PerfParams, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [(n, r, m, a) for n, r in [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 16)]
            for m in (16, 64, 256) for a in (1, 2)]
    nodes, replicas, local_bsz, accum = (np.array(v) for v in zip(*rows))
    step = np.array([_step_time(params, *row) for row in rows])
    compute = params.alpha_c + params.beta_c * local_bsz
    extra = np.maximum(replicas - 2, 0)
    sync = np.where(replicas == 1, np.nan, np.where(nodes > 1, params.alpha_n + params.beta_n * extra,
                                                    params.alpha_r + params.beta_r * extra))

    def jitter(x):
        return x * np.exp(rng.normal(0.0, noise, size=x.shape)) if noise else x

    return nodes, replicas, local_bsz, accum, jitter(step), jitter(compute), jitter(sync)


def test_fit_recovers_parameters_without_noise():
    fitted = fit_perf_params(*_synthetic(TRUE))
    for name, value in TRUE.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.01), name


def test_fit_recovers_from_step_times_alone():
    nodes, replicas, local_bsz, accum, step, _, _ = _synthetic(TRUE)
    unknown = np.full(step.shape, np.nan)
    fitted = fit_perf_params(nodes, replicas, local_bsz, accum, step, unknown, unknown)
    for name, value in TRUE.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, rel=0.05), name


def test_fit_warm_start_matches_cold_fit():
    data = _synthetic(TRUE, noise=0.02, seed=5)
    cold = fit_perf_params(*data)
    guess = PerfParams(**{k: v * 1.3 for k, v in TRUE.to_dict().items() if k != "gamma"}, gamma=1.5)
    warm = fit_perf_params(*data, initial=guess)
    for name in ("alpha_c", "beta_c", "alpha_r", "alpha_n", "gamma"):
        assert getattr(warm, name) == pytest.approx(getattr(cold, name), rel=0.02), name


def test_fit_with_noise_predicts_step_times():
    data = _synthetic(TRUE, noise=0.05, seed=3)
    fitted = fit_perf_params(*data)
    nodes, replicas, local_bsz, accum = data[:4]
    truth = GoodputFunction(TRUE, GradParams(1, 1), 1).step_time(nodes, replicas, local_bsz, accum)
    predicted = GoodputFunction(fitted, GradParams(1, 1), 1).step_time(nodes, replicas, local_bsz, accum)
    assert np.max(np.abs(predicted / truth - 1)) < 0.05
    for name in ("alpha_c", "beta_c", "alpha_r", "alpha_n"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.2), name


def test_fit_is_robust_to_one_outlier():
    nodes, replicas, local_bsz, accum, step, compute, sync = _synthetic(TRUE)
    step = step.copy()
    step[5] *= 5.0  # one step-time observation hit by a stall
    fitted = fit_perf_params(nodes, replicas, local_bsz, accum, step, compute, sync)
    for name in ("alpha_c", "beta_c", "alpha_r", "gamma"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name


def test_fit_converges_quickly_with_gamma_at_its_bound():
    """Measured step times that are slower than compute + sync (no overlap at
    all) push gamma against its lower bound; the search must hold it there
    and converge instead of crawling (it used to hit its iteration cap)."""
    from adaptive.batchsize import goodput

    bsz = np.array([10, 14, 20, 28, 40, 57, 80] * 3, dtype=float)
    replicas = np.repeat([1.0, 2.0, 3.0], 7)
    step = np.array([0.466, 0.559, 0.681, 0.851, 1.122, 1.664, 2.541, 0.523, 0.623, 0.723, 0.848, 1.279,
                     1.764, 2.632, 0.591, 0.693, 0.791, 0.918, 1.297, 1.736, 2.573])
    sync = np.array([0.0015] * 7 + [0.038, 0.046, 0.037, 0.027, 0.068, 0.070, 0.069,
                                    0.077, 0.086, 0.109, 0.042, 0.125, 0.090, 0.083])
    obs = goodput._as_observations(np.ones(21), replicas, bsz, np.ones(21), step, step - sync, sync)
    problem = goodput._FitProblem(obs)
    calls = []

    def counted(xs):
        calls.append(1)
        return problem.residuals(xs)

    x, _ = goodput._levenberg_marquardt(counted, goodput._initial_vector(obs, 1.2))
    assert goodput._params_from_vector(x)[1] < 1.01  # gamma held at (about) 1
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


# ---------------------------------------------------------------- profile
def test_profile_running_means_window_and_cap():
    profile = ThroughputProfile(max_entries=3, window=4)
    for value in (1.0, 2.0, 3.0):
        profile.record(1, 1, 32, 1, step_time=value, compute_time=value / 2)
    entry = profile.get(1, 1, 32, 1)
    assert entry["step_time"] == pytest.approx(2.0)
    assert entry["compute_time"] == pytest.approx(1.0)
    assert math.isnan(entry["sync_time"])
    for _ in range(100):  # past the window the mean follows the new level
        profile.record(1, 1, 32, 1, step_time=10.0)
    assert profile.get(1, 1, 32, 1)["step_time"] == pytest.approx(10.0, rel=1e-6)
    profile.record(1, 2, 32, 1, step_time=1.0, sync_time=0.2)
    profile.record(2, 4, 32, 1, step_time=1.0)
    profile.record(1, 1, 32, 1, step_time=10.0)  # touch: now the most recent
    profile.record(1, 1, 64, 1, step_time=1.0)  # full: evicts (1, 2, 32, 1), the least recent
    assert len(profile) == 3
    assert profile.get(1, 2, 32, 1) is None and profile.get(1, 1, 32, 1) is not None
    assert profile.max_replicas == 4 and profile.max_nodes == 2


def test_profile_state_dict_round_trip_and_fit():
    profile = ThroughputProfile()
    nodes, replicas, local_bsz, accum, step, compute, sync = _synthetic(TRUE)
    for row in zip(nodes, replicas, local_bsz, accum, step, compute, sync):
        n, r, m, a = (int(v) for v in row[:4])
        s, c, y = (float(v) for v in row[4:])
        profile.record(n, r, m, a, step_time=s, compute_time=c, sync_time=None if math.isnan(y) else y)
    copy = ThroughputProfile()
    copy.load_state_dict(profile.state_dict())
    assert list(copy) == list(profile)
    for key in profile:
        assert copy.get(*key) == pytest.approx(profile.get(*key), nan_ok=True)
    fitted = copy.fit()
    assert fitted.alpha_r == pytest.approx(TRUE.alpha_r, rel=0.01)
    assert ThroughputProfile().fit() is None


def test_profile_validation():
    profile = ThroughputProfile()
    with pytest.raises(ValueError, match="step_time"):
        profile.record(1, 1, 8, 1, step_time=0.0)
    with pytest.raises(ValueError, match="sync_time"):
        profile.record(1, 2, 8, 1, step_time=1.0, sync_time=-1.0)
    with pytest.raises(ValueError, match="num_nodes"):
        profile.record(2, 1, 8, 1, step_time=1.0)
    with pytest.raises(ValueError, match="max_entries"):
        ThroughputProfile(max_entries=0)
    with pytest.raises(ValueError, match="version"):
        profile.load_state_dict({"entries": []})
