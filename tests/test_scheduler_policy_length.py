"""The goodput policy's use of remaining work: the estimate, the weights, the restart horizon, the efficiency floor."""

import numpy as np
import pytest

from adaptive.goodput import GoodputFunction, GradParams, Hints, PerfParams
from scheduler.cluster import ClusterSpec
from scheduler.job_info import JobInfo, estimate_remaining_work, job_info_from_hints
from scheduler.policies import GoodputPolicy
from scheduler.profiles import load_profiles
from scheduler.sim.job import SimulatedJob
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import WorkloadJob
from scheduler.speedup import SpeedupFunction

from policy_cases import PowerLawGoodput


def info(name, exponent=0.9, submitted=-1e4, work=None, **kw):
    return JobInfo(name=name, submission_time=submitted, max_replicas=kw.pop("max_replicas", 16),
                   speedup_fn=SpeedupFunction(PowerLawGoodput(exponent)), profiled_replicas=16,
                   remaining_work=work, **kw)


# ---------------------------------------------------------------- the estimate
def test_remaining_work_extrapolates_progress_at_one_device_goodput():
    speedup = SpeedupFunction(PowerLawGoodput(0.9))
    # 10 reference steps in a quarter of the training: 30 more, of 32 samples each, at 1 sample/s.
    assert estimate_remaining_work(speedup, progress=10.0, completed_fraction=0.25) == pytest.approx(960.0)
    assert estimate_remaining_work(speedup, progress=10.0, completed_fraction=1.0) == 0.0
    for progress, fraction in ((10.0, None), (0.0, 0.5), (10.0, 0.0)):
        assert estimate_remaining_work(speedup, progress, fraction) is None
    assert estimate_remaining_work(None, 10.0, 0.5) is None
    with pytest.raises(ValueError, match="remaining_work"):
        JobInfo(name="a", max_replicas=2, remaining_work=-1.0)


def test_job_info_from_hints_reads_the_completed_fraction():
    perf = PerfParams(alpha_c=0.02, beta_c=0.0006, alpha_n=0.1, beta_n=0.01, alpha_r=0.01, beta_r=0.002, gamma=1.3)
    common = dict(job_id="a", timestamp=0.0, init_batch_size=128, max_batch_size=1024, local_bsz_bounds=(32, 256),
                  gradient_accumulation=True, perf_params=perf, grad_params=GradParams(sqr=1.0, var=40.0),
                  max_profiled_replicas=2, max_profiled_nodes=1, progress=50.0, current=None)
    declared = job_info_from_hints("a", Hints(**common, completed_fraction=0.5), submission_time=0.0)
    one_device = GoodputFunction(perf, GradParams(sqr=1.0, var=40.0), 128).optimize(
        1, 1, max_batch_size=1024, local_bsz_bounds=(32, 256), gradient_accumulation=True)[0]
    assert declared.remaining_work == pytest.approx(50.0 * 128 / one_device, rel=0.02)  # grid vs exact optimum
    undeclared = job_info_from_hints("a", Hints(**common, completed_fraction=None), submission_time=0.0)
    assert undeclared.remaining_work is None


def test_simulated_job_reports_its_exact_completed_fraction():
    profiles = load_profiles()
    spec = WorkloadJob("cifar10-0", 0.0, "cifar10", 1, 128)
    job = SimulatedJob(spec, profiles["cifar10"], adaptive=True, restart_penalty=30.0)
    assert job.completed_fraction == 0.0
    job.reallocate((0, 0))
    job.advance(0.0, 600.0)
    assert job.completed_fraction == pytest.approx(job.progress / profiles["cifar10"].total_progress)
    assert 0 < job.completed_fraction < 1
    sim = Simulator([spec], profiles, GoodputPolicy(), ClusterSpec(1, 4))
    sim.jobs[0] = job
    seen = sim._job_info(job, now=600.0)
    left = (profiles["cifar10"].total_progress - job.progress) * 128 / seen.speedup_fn.base_goodput
    assert seen.remaining_work == pytest.approx(left)


# ------------------------------------------------------------------ the weights
def test_the_job_with_less_time_left_gets_more_gpus():
    cluster = ClusterSpec(1, 8)
    jobs = {"long": info("long", work=1e4), "short": info("short", work=1e3)}
    even = GoodputPolicy(length_weight=0.0).optimize(jobs, cluster, {}, now=0.0)
    assert len(even["long"]) == len(even["short"]) == 4
    weighted = GoodputPolicy(length_weight=0.5).optimize(jobs, cluster, {}, now=0.0)
    assert len(weighted["short"]) > len(weighted["long"]) >= 1


def test_weights_use_the_time_left_at_the_fastest_count():
    policy = GoodputPolicy(length_weight=1.0, min_efficiency=0.0)
    jobs = {"scales": info("scales", 1.0, work=1000.0), "flat": info("flat", 0.0, work=1000.0),
            "unknown": info("unknown", 1.0, work=None)}
    names = ["scales", "flat", "unknown"]
    fastest = np.array([16.0, 1.0, 16.0])
    weights = policy._job_weights(names, jobs, fastest)
    # The same work: the job that can use 16 GPUs has 1/16 of the time left; the unknown one weighs 1.
    assert weights[0] / weights[1] == pytest.approx(16.0)
    assert weights[2] == 1.0
    assert (GoodputPolicy(length_weight=0.0)._job_weights(names, jobs, fastest) == 1.0).all()


# ------------------------------------------------------------- restart horizon
def test_a_job_about_to_finish_is_not_moved():
    cluster, current = ClusterSpec(1, 8), {"a": (0, 0)}
    policy = GoodputPolicy(min_efficiency=0.0)
    old = info("a", submitted=-1e4)  # age alone: a move to 8 GPUs pays back
    assert len(policy.optimize({"a": old}, cluster, current, now=0.0)["a"]) == 8
    # 100 s of one-device work left at speedup 2 ** 0.9: about 54 s, less than the two restarts charged.
    ending = info("a", submitted=-1e4, work=100.0)
    assert policy._restart_factor(ending, 0.0, 2 ** 0.9) == 0.0
    assert policy.optimize({"a": ending}, cluster, current, now=0.0) == current
    young = info("a", submitted=-75.0, work=1e6)  # long to go but young: its age is the horizon
    assert policy._restart_factor(young, 0.0, 2 ** 0.9) == pytest.approx(15 / 75)


# ------------------------------------------------------------ efficiency floor
def test_no_job_gets_replicas_it_would_use_below_the_floor():
    cluster = ClusterSpec(1, 8)
    poor = {"a": info("a", exponent=0.2)}  # speedup 2 ** 0.2 = 1.15 on 2 GPUs: 57% of them wasted
    assert len(GoodputPolicy(min_efficiency=0.0).optimize(poor, cluster, {}, now=0.0)["a"]) == 8
    assert len(GoodputPolicy(min_efficiency=0.6).optimize(poor, cluster, {}, now=0.0)["a"]) == 1
    # r ** 0.2 >= 0.5 r up to r = 2 ** 1.25 = 2.4
    assert len(GoodputPolicy(min_efficiency=0.5).optimize(poor, cluster, {}, now=0.0)["a"]) == 2
    floor = {"a": info("a", exponent=0.2, min_replicas=4)}  # its minimum stays allowed
    assert len(GoodputPolicy(min_efficiency=0.6).optimize(floor, cluster, {}, now=0.0)["a"]) == 4


def test_length_and_efficiency_options_are_checked():
    for kw, word in (({"length_weight": -0.1}, "length_weight"), ({"min_efficiency": 1.0}, "min_efficiency"),
                     ({"min_efficiency": -0.1}, "min_efficiency")):
        with pytest.raises(ValueError, match=word):
            GoodputPolicy(**kw)
