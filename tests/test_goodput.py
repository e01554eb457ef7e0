"""Goodput model: throughput formula, efficiency, exact optimisation, parameter records."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest
from goodput_cases import TRUE, reference_step_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive.goodput import GAMMA_MAX, GoodputFunction, GradParams, PerfParams
from adaptive.checkpoint.versions import StateFormatError


# ---------------------------------------------------------------- params
def test_params_round_trip_and_validation():
    assert PerfParams.from_state_dict(TRUE.state_dict()) == TRUE
    grad = GradParams(sqr=2.0, var=3.0)
    assert GradParams.from_state_dict(grad.state_dict()) == grad
    with pytest.raises(ValueError, match="gamma"):
        PerfParams(0.1, 0.1, 0.1, 0.1, 0.1, 0.1, gamma=0.5)
    with pytest.raises(ValueError, match="beta_r"):
        PerfParams(0.1, 0.1, 0.1, 0.1, 0.1, -1.0, gamma=1.0)
    with pytest.raises(ValueError, match="alpha_c"):
        PerfParams(0.0, 0.0, 0.1, 0.1, 0.1, 0.1, gamma=1.0)
    with pytest.raises(ValueError, match="finite"):
        PerfParams(math.nan, 0.1, 0.1, 0.1, 0.1, 0.1, gamma=1.0)
    with pytest.raises(ValueError, match="unknown keys"):
        PerfParams.from_state_dict(dict(TRUE.state_dict(), delta=1.0))
    with pytest.raises(ValueError, match="missing"):
        GradParams.from_state_dict({"sqr": 1.0})
    with pytest.raises(ValueError, match="both be 0"):
        GradParams(0.0, 0.0)
    with pytest.raises(ValueError, match="var"):
        GradParams(1.0, -0.1)


def test_params_state_format_versions():
    """Version 1 has a version key; release 0.1 wrote the bare fields (read as version 1);
    a later format is refused with a clear error; wrong types are TypeErrors."""
    assert TRUE.state_dict() == {"version": 1, **asdict(TRUE)}
    assert GradParams(2.0, 3.0).state_dict() == {"version": 1, "sqr": 2.0, "var": 3.0}
    release_01 = {"alpha_c": 0.02, "beta_c": 0.001, "alpha_n": 0.08, "beta_n": 0.01, "alpha_r": 0.03,
                  "beta_r": 0.004, "gamma": 2.5}  # what PerfParams.to_dict() wrote
    assert PerfParams.from_state_dict(release_01) == TRUE
    assert GradParams.from_state_dict({"sqr": 2.0, "var": 3.0}) == GradParams(2.0, 3.0)
    with pytest.raises(StateFormatError, match="version 2"):
        PerfParams.from_state_dict(dict(TRUE.state_dict(), version=2))
    with pytest.raises(StateFormatError, match="mapping"):
        GradParams.from_state_dict([1.0, 2.0])
    with pytest.raises(TypeError, match="PerfParams.alpha_c"):
        PerfParams("0.1", 0.1, 0.1, 0.1, 0.1, 0.1, gamma=1.0)
    with pytest.raises(TypeError, match="perf_params"):
        GoodputFunction(asdict(TRUE), GradParams(1.0, 1.0), 32)
    with pytest.raises(TypeError, match="init_batch_size"):
        GoodputFunction(TRUE, GradParams(1.0, 1.0), 32.0)


# ---------------------------------------------------------------- model
@pytest.mark.parametrize("nodes,replicas,local_bsz,accum", [(1, 1, 32, 1), (1, 2, 64, 1), (1, 4, 16, 3),
                                                            (2, 4, 128, 1), (3, 12, 8, 2)])
def test_throughput_matches_formula(nodes, replicas, local_bsz, accum):
    fn = GoodputFunction(TRUE, GradParams(1.0, 4.0), init_batch_size=64)
    step = reference_step_time(TRUE, nodes, replicas, local_bsz, accum)
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
