"""The goodput policy's mechanisms over Pollux's: exact counts, restart payback, and generated workloads."""

import itertools

import numpy as np
import pytest

from scheduler.cluster import ClusterSpec
from scheduler.job_info import JobInfo
from scheduler.policies import GoodputPolicy, PolluxPolicy, make_policy
from scheduler.policies.pollux import _greedy_counts, _local_search
from scheduler.policies.search import exact_counts
from scheduler.profiles import load_profiles
from scheduler.sim.generate import GENERATED_SET, generate_workload, main as generate_main, source_jobs
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import WorkloadJob, load_workload
from scheduler.speedup import SpeedupFunction

from policy_cases import PowerLawGoodput


def info(name, exponent=0.9, submitted=0.0, **kw):
    return JobInfo(name=name, submission_time=submitted, max_replicas=kw.pop("max_replicas", 16),
                   speedup_fn=SpeedupFunction(PowerLawGoodput(exponent)), **kw)


def brute_force(utility, caps, capacity):
    best = -np.inf
    for counts in itertools.product(*[range(int(c) + 1) for c in caps]):
        if sum(counts) <= capacity:
            best = max(best, sum(utility[j, r] for j, r in enumerate(counts)))
    return best


# ------------------------------------------------------------------ exact search
@pytest.mark.parametrize("seed", range(40))
def test_exact_counts_reach_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    jobs, capacity = int(rng.integers(1, 5)), int(rng.integers(0, 8))
    utility = rng.normal(size=(jobs, capacity + 2))  # non-concave, some counts above capacity
    utility[rng.random(utility.shape) < 0.2] = -np.inf
    utility[:, 0] = rng.normal(size=jobs)
    caps = rng.integers(0, capacity + 2, size=jobs)
    counts = exact_counts(utility, caps, capacity)
    assert counts.sum() <= capacity and (counts <= caps).all()
    total = sum(utility[j, r] for j, r in enumerate(counts))
    assert total == pytest.approx(brute_force(utility, caps, capacity))


def test_exact_counts_beat_greedy_where_a_job_pays_off_only_at_a_whole_node():
    # Job 0 is worth nothing until it has 4 GPUs (1.5 per GPU then); job 1's
    # first GPU is worth more per GPU, which the greedy alone takes first.
    utility = np.array([[0.0, 0.0, 0.0, 0.0, 6.0], [0.0, 2.0, 2.5, 2.8, 3.0]])
    caps, capacity = np.array([4, 4]), 4
    greedy = _local_search(utility, _greedy_counts(utility, caps, capacity), caps, capacity, passes=0)
    exact = exact_counts(utility, caps, capacity)
    assert list(exact) == [4, 0]
    assert utility[[0, 1], exact].sum() > utility[[0, 1], greedy].sum()


def test_exact_counts_reject_a_table_without_zero_replicas():
    with pytest.raises(ValueError, match="zero replicas"):
        exact_counts(np.array([[-np.inf, 1.0]]), np.array([1]), 1)
    assert exact_counts(np.zeros((0, 3)), np.zeros(0, dtype=int), 4).shape == (0,)


# --------------------------------------------------------------- restart payback
def test_payback_keeps_a_young_job_where_pollux_moves_it():
    job = info("a", submitted=0.0)
    pollux, goodput = PolluxPolicy(), GoodputPolicy(payback=2)
    # 75 s old, no restarts yet: Pollux charges one 30 s restart, payback=2 charges two.
    assert pollux._restart_factor(job, 75.0, 2.0) == pytest.approx(45 / 75)
    assert goodput._restart_factor(job, 75.0, 2.0) == pytest.approx(15 / 75)
    # Growing from 2 to 8 GPUs pays back one restart (6.5 x 0.6 > 1.9) but not two (6.5 x 0.2).
    cluster, current = ClusterSpec(1, 8), {"a": (0, 0)}
    assert len(pollux.optimize({"a": job}, cluster, current, now=75.0)["a"]) == 8
    assert goodput.optimize({"a": job}, cluster, current, now=75.0) == current
    assert len(goodput.optimize({"a": job}, cluster, current, now=600.0)["a"]) == 8  # older: pays back
    with pytest.raises(ValueError, match="payback"):
        GoodputPolicy(payback=0.5)


def test_goodput_options_are_checked_and_pollux_stays_registered():
    assert isinstance(make_policy("pollux"), PolluxPolicy) and not isinstance(make_policy("pollux"), GoodputPolicy)
    assert make_policy("goodput").search == "exact"
    with pytest.raises(ValueError, match="search"):
        GoodputPolicy(search="genetic")


def test_greedy_search_option_gives_pollux_counts():
    cluster = ClusterSpec(4, 4)
    jobs = {f"j{i}": info(f"j{i}", exponent=0.3 + 0.15 * i, submitted=-3600.0) for i in range(5)}
    greedy = GoodputPolicy(p=-1.0, payback=1.0, search="greedy").optimize(jobs, cluster, {}, now=0.0)
    assert greedy == PolluxPolicy().optimize(jobs, cluster, {}, now=0.0)


# ---------------------------------------------------------- generated workloads
def test_generated_workloads_are_deterministic_resampled_and_rate_scaled():
    pool = source_jobs()
    first, again = generate_workload(7, pool=pool), generate_workload(7, pool=pool)
    assert first == again and len(first) == 160
    assert generate_workload(8, pool=pool) != first
    kinds = {(j.application, j.num_replicas, j.batch_size) for j in pool}
    assert all((j.application, j.num_replicas, j.batch_size) in kinds for j in first)
    times = [j.submission_time for j in first]
    assert times == sorted(times) and len({j.name for j in first}) == len(first)
    fast = generate_workload(7, rate=2.0, pool=pool)
    assert max(j.submission_time for j in fast) == pytest.approx(max(times) / 2, abs=1)
    with pytest.raises(ValueError, match="rate"):
        generate_workload(7, rate=0.0, pool=pool)
    capped = generate_workload(7, pool=pool, max_replicas=8)
    assert max(j.num_replicas for j in capped) == 8 < max(j.num_replicas for j in first)


def test_generated_set_spans_rates_and_cluster_sizes():
    rates = {c.rate for c in GENERATED_SET}
    nodes = {c.nodes for c in GENERATED_SET}
    assert min(rates) == 0.5 and max(rates) == 2.0 and min(nodes) == 8 and max(nodes) == 32
    assert len({c.seed for c in GENERATED_SET}) == len(GENERATED_SET)
    assert {c.nodes: c.num_jobs for c in GENERATED_SET}[32] == 320
    small = next(c for c in GENERATED_SET if c.nodes == 8)
    assert max(j.num_replicas for j in small.jobs()) <= 32 and len(small.jobs()) == small.num_jobs


def test_generate_command_writes_a_loadable_workload(tmp_path):
    out = tmp_path / "gen.csv"
    assert generate_main([str(out), "--seed", "3", "--rate", "0.5", "--jobs", "20"]) == 0
    jobs = load_workload(str(out))
    assert len(jobs) == 20 and all(isinstance(j, WorkloadJob) for j in jobs)
    assert generate_main([str(out), "--rate", "-1"]) == 2


def test_goodput_simulation_of_a_generated_workload_is_deterministic():
    profiles = load_profiles()
    jobs = [j for j in generate_workload(5, rate=4.0, num_jobs=30) if j.application in ("ncf", "cifar10")][:8]
    runs = [Simulator(jobs, profiles, GoodputPolicy(), ClusterSpec(2, 4)).run() for _ in range(2)]
    assert runs[0].jct == runs[1].jct and runs[0].restarts == runs[1].restarts
    assert len(runs[0].jct) == len(jobs) >= 4


# ------------------------------------------------------- larger first allocations
def test_a_job_without_a_model_starts_on_up_to_initial_replicas():
    cluster = ClusterSpec(4, 4)
    fresh = JobInfo(name="a", submission_time=-1e4, max_replicas=64, profiled_replicas=0)
    assert PolluxPolicy().optimize({"a": fresh}, cluster, {}, now=0.0) == {"a": (0,)}
    assert GoodputPolicy().optimize({"a": fresh}, cluster, {}, now=0.0) == {"a": (0, 0, 0, 0)}
    assert len(GoodputPolicy(initial_replicas=2).optimize({"a": fresh}, cluster, {}, now=0.0)["a"]) == 2
    small = JobInfo(name="a", submission_time=-1e4, max_replicas=3, profiled_replicas=0)
    assert len(GoodputPolicy().optimize({"a": small}, cluster, {}, now=0.0)["a"]) == 3
    profiled = info("a", submitted=-1e4, profiled_replicas=1)  # once profiled, Pollux's 4x rule
    assert len(GoodputPolicy(initial_replicas=16).optimize({"a": profiled}, cluster, {}, now=0.0)["a"]) == 4
    with pytest.raises(ValueError, match="initial_replicas"):
        GoodputPolicy(initial_replicas=0)
