"""Speedup tables from the goodput model, job infos from hints, adaptive simulated jobs."""

import numpy as np
import pytest

from adaptive.goodput import GoodputFunction, GradParams, Hints, PerfParams
from scheduler.cluster import ClusterSpec
from scheduler.job_info import batch_replica_limit, job_info_from_hints
from scheduler.policies import PolluxPolicy
from scheduler.profiles import load_profiles
from scheduler.sim.job import SimulatedJob, ThroughputModels
from scheduler.sim.simulator import Simulator
from scheduler.speedup import SpeedupCache, SpeedupFunction, flat_sync_beyond
from scheduler.sim.workload import WorkloadJob

PERF = PerfParams(alpha_c=0.02, beta_c=0.0006, alpha_n=0.1, beta_n=0.01, alpha_r=0.01, beta_r=0.002, gamma=1.3)
GRAD = GradParams(sqr=1.0, var=40.0)


class CountingGoodput:
    """Wraps a GoodputFunction and counts evaluate() calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0
        self.init_batch_size, self.perf_params, self.grad_params = fn.init_batch_size, fn.perf_params, fn.grad_params

    def evaluate(self, *args):
        self.calls += 1
        return self.fn.evaluate(*args)


def test_grid_search_is_close_to_the_exact_optimum():
    fn = GoodputFunction(PERF, GRAD, 128)
    speedup = SpeedupFunction(fn, 4096, (32, 1024), gradient_accumulation=True)
    nodes = np.array([1, 1, 1, 2, 4, 8])
    reps = np.array([1, 2, 4, 8, 16, 32])
    exact, _, _ = fn.optimize(nodes, reps, max_batch_size=4096, local_bsz_bounds=(32, 1024),
                              gradient_accumulation=True)
    approx = speedup.goodput(nodes, reps)
    assert np.all(approx <= exact * (1 + 1e-9))
    assert np.all(approx >= 0.97 * exact)
    assert speedup(np.array([1]), np.array([1]))[0] == pytest.approx(1.0)


def test_answers_are_memoised():
    counting = CountingGoodput(GoodputFunction(PERF, GRAD, 128))
    speedup = SpeedupFunction(counting, 4096, (32, 1024), True)
    speedup([1, 2], [4, 8])
    calls = counting.calls
    speedup([2, 1], [8, 4])
    assert counting.calls == calls
    assert speedup([1], [0])[0] == 0.0


def test_sync_cost_is_not_extrapolated_beyond_profiled_replicas():
    fn = GoodputFunction(PERF, GRAD, 128)
    trusting = SpeedupFunction(fn, 4096, (32, 1024), True)
    exploring = SpeedupFunction(fn, 4096, (32, 1024), True, profiled_replicas=4)
    nodes, reps = np.array([1, 1, 2, 4]), np.array([2, 4, 8, 16])
    assert np.allclose(exploring(nodes[:2], reps[:2]), trusting(nodes[:2], reps[:2]))
    assert np.all(exploring(nodes[2:], reps[2:]) > trusting(nodes[2:], reps[2:]))
    flat = flat_sync_beyond(fn, 4).perf_params
    assert flat.beta_n == 0 and flat.alpha_n == pytest.approx(PERF.alpha_n + 2 * PERF.beta_n)


def test_infeasible_limits_are_rejected():
    fn = GoodputFunction(PERF, GRAD, 64)
    with pytest.raises(ValueError, match="no feasible configuration"):
        SpeedupFunction(fn, 64, (100, 200))
    with pytest.raises(ValueError, match="max_batch_size must be >="):
        SpeedupFunction(fn, 32)


def test_speedup_cache_rebuilds_only_when_the_model_changes():
    cache = SpeedupCache()
    first = cache.get("a", GoodputFunction(PERF, GRAD, 128), 4096, (32, 1024), True, 2)
    assert cache.get("a", GoodputFunction(PERF, GRAD, 128), 4096, (32, 1024), True, 2) is first
    changed = cache.get("a", GoodputFunction(PERF, GradParams(sqr=1.0, var=80.0), 128), 4096, (32, 1024), True, 2)
    assert changed is not first
    cache.retain([])
    assert cache.get("a", GoodputFunction(PERF, GRAD, 128), 4096, (32, 1024), True, 2) is not first


def make_hints(**changes):
    data = dict(job_id="a", timestamp=0.0, init_batch_size=128, max_batch_size=4096, local_bsz_bounds=(32, 1024),
                gradient_accumulation=True, perf_params=PERF, grad_params=GRAD, max_profiled_replicas=3,
                max_profiled_nodes=1, progress=0.0, current=None)
    data.update(changes)
    return Hints(**data)


def test_job_info_from_hints_carries_limits_and_profile():
    info = job_info_from_hints("a", make_hints(), submission_time=0.0, max_replicas=64)
    assert info.max_replicas == 64 and info.profiled_replicas == 3 and info.speedup_fn is not None
    assert job_info_from_hints("a", make_hints(), submission_time=0, max_replicas=4).max_replicas == 4
    fresh = job_info_from_hints("a", None, submission_time=0, min_replicas=2)
    assert fresh.profiled_replicas == 0 and fresh.speedup_fn is None and fresh.max_replicas == 64
    no_model = job_info_from_hints("a", make_hints(perf_params=None), submission_time=0)
    assert no_model.speedup_fn is None and no_model.profiled_replicas == 3
    assert batch_replica_limit(64, max_batch_size=4096, local_bsz_bounds=(256, 1024)) == 16


def test_goodput_policy_explores_a_bounded_factor_beyond_the_profile():
    cluster = ClusterSpec(4, 4)
    fresh = job_info_from_hints("a", None, submission_time=-1e4)
    assert PolluxPolicy().optimize({"a": fresh}, cluster, {}, now=0.0) == {"a": (0,)}
    profiled = job_info_from_hints("a", make_hints(), submission_time=-1e4)
    assert len(PolluxPolicy(exploration_factor=2).optimize({"a": profiled}, cluster, {}, now=0.0)["a"]) <= 6
    assert 6 < len(PolluxPolicy().optimize({"a": profiled}, cluster, {}, now=0.0)["a"]) <= 12


def test_adaptive_simulated_job_learns_and_grows_its_batch():
    profiles = load_profiles()
    job = WorkloadJob("cifar10-0", 0.0, "cifar10", 1, 128)
    sim = Simulator([job], profiles, PolluxPolicy(), ClusterSpec(2, 4), record_timeline=True)
    result = sim.run()
    ran = sim.jobs[0]
    assert ran.done and result.jct["cifar10-0"] > 0
    assert max(max(r.values()) for _, r in result.timeline) == 8  # explored up to the whole cluster
    assert ran.batch_size > profiles["cifar10"].init_batch_size  # adapted its batch size
    assert ran.perf_params is not None and ran.max_profiled_replicas == 8
    assert result.restarts["cifar10-0"] >= 2  # 1 -> 4 -> 8 replicas


def test_throughput_models_are_shared_by_placements_seen():
    prof = load_profiles()["ncf"]
    models = ThroughputModels()
    first = models.get(prof, frozenset({(1, 1)}))
    assert models.get(prof, frozenset({(1, 1)})) is first and len(models) == 1
    job = SimulatedJob(WorkloadJob("ncf-0", 0, "ncf", 1, 256), prof, True, 30.0, models)
    job.reallocate((0,))
    assert job.perf_params is first and job.local_bsz > 0
