"""Policy invariants and behaviour: capacity, replica limits, interference, pinning, determinism."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.cluster import ClusterSpec, check_allocations, num_nodes_of
from scheduler.job_info import JobInfo
from scheduler.policies import GoodputPolicy, TiresiasPolicy, make_policy
from scheduler.speedup import SpeedupFunction


class PowerLawGoodput:
    """Test double with the ``GoodputFunction.evaluate`` contract:
    goodput = replicas ** exponent at any batch size, 20% lower across nodes."""

    init_batch_size = 32

    def __init__(self, exponent):
        self.exponent = exponent

    def evaluate(self, num_nodes, num_replicas, local_bsz, accum_steps):
        nodes, reps, _, _ = np.broadcast_arrays(num_nodes, num_replicas, local_bsz, accum_steps)
        return np.power(reps, self.exponent) * np.where(nodes > 1, 0.8, 1.0)


def info(name, exponent=0.9, max_replicas=16, min_replicas=0, submitted=0.0, **kw):
    speedup = SpeedupFunction(PowerLawGoodput(exponent)) if exponent is not None else None
    return JobInfo(name=name, submission_time=submitted, min_replicas=min_replicas,
                   max_replicas=max_replicas, speedup_fn=speedup, **kw)


def test_make_policy_rejects_unknown_names():
    assert isinstance(make_policy("goodput"), GoodputPolicy)
    with pytest.raises(ValueError, match="unknown policy 'fifo'; choose from"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="p must be <= 1"):
        GoodputPolicy(p=2)


def test_check_allocations_catches_each_violation():
    cluster = ClusterSpec(2, 2)
    jobs = {"a": info("a", max_replicas=2), "b": info("b", max_replicas=4, min_replicas=2)}
    check_allocations({"a": (0, 0), "b": (1, 1)}, cluster, jobs)
    with pytest.raises(ValueError, match="over capacity"):
        check_allocations({"a": (0, 0), "b": (0, 1)}, cluster, jobs)
    with pytest.raises(ValueError, match="outside"):
        check_allocations({"b": (1,)}, cluster, jobs)
    with pytest.raises(ValueError, match="more than one multi-node"):
        check_allocations({"a": (0, 1), "b": (0, 1)}, cluster, jobs)
    check_allocations({"a": (0, 1), "b": (0, 1)}, cluster, jobs, exclusive_multinode=False)
    with pytest.raises(ValueError, match="unknown jobs"):
        check_allocations({"c": (0,)}, cluster, jobs)
    pinned = {"a": info("a", max_replicas=2, preemptible=False)}
    with pytest.raises(ValueError, match="pinned"):
        check_allocations({}, cluster, pinned, current={"a": (0,)})


# --------------------------------------------------------------------- tiresias
def test_tiresias_runs_fixed_gangs_in_arrival_order_with_backfill():
    cluster = ClusterSpec(2, 4)
    jobs = {"a": info("a", max_replicas=6, submitted=0), "b": info("b", max_replicas=4, submitted=1),
            "c": info("c", max_replicas=2, submitted=2)}
    alloc = TiresiasPolicy().optimize(jobs, cluster, {}, now=0)
    assert sorted(alloc) == ["a", "c"]  # b does not fit behind a, c does
    assert len(alloc["a"]) == 6 and len(alloc["c"]) == 2
    assert alloc["a"] == (0, 0, 0, 0, 1, 1)  # packed onto the emptiest nodes


def test_tiresias_demotes_after_threshold_and_preempts():
    policy = TiresiasPolicy(queue_threshold=100)
    cluster = ClusterSpec(1, 2)
    first = policy.optimize({"a": info("a", max_replicas=2)}, cluster, {}, now=0)
    jobs = {"a": info("a", max_replicas=2, attained_service=100), "b": info("b", max_replicas=2, submitted=5)}
    second = policy.optimize(jobs, cluster, first, now=60)
    assert list(second) == ["b"]
    jobs["b"] = info("b", max_replicas=2, submitted=5, attained_service=10)
    assert policy.optimize(jobs, cluster, second, now=120) == second  # a stays behind b


# ---------------------------------------------------------------------- goodput
def test_goodput_gives_more_gpus_to_the_job_that_scales_better():
    cluster = ClusterSpec(1, 8)
    jobs = {"good": info("good", exponent=0.95, submitted=-1e6), "poor": info("poor", exponent=0.3, submitted=-1e6)}
    alloc = GoodputPolicy().optimize(jobs, cluster, {}, now=0)
    assert len(alloc["good"]) > len(alloc["poor"]) >= 1
    assert sum(map(len, alloc.values())) == 8


def test_goodput_is_stable_when_nothing_changes():
    cluster = ClusterSpec(4, 4)
    jobs = {f"j{i}": info(f"j{i}", exponent=0.5 + 0.1 * i, submitted=-3600.0) for i in range(5)}
    policy = GoodputPolicy()
    first = policy.optimize(jobs, cluster, {}, now=0)
    assert policy.optimize(jobs, cluster, first, now=60) == first


def test_goodput_new_job_without_model_gets_at_most_its_limit():
    cluster = ClusterSpec(2, 4)
    jobs = {"new": info("new", exponent=None, max_replicas=1, submitted=0),
            "old": info("old", exponent=0.9, submitted=-1e5)}
    alloc = GoodputPolicy().optimize(jobs, cluster, {}, now=30)
    assert len(alloc["new"]) == 1 and len(alloc["old"]) == 7


def test_goodput_keeps_pinned_jobs_and_respects_min_replicas():
    cluster = ClusterSpec(2, 4)
    jobs = {"pin": info("pin", exponent=0.1, max_replicas=3, preemptible=False),
            "gang": info("gang", exponent=0.9, min_replicas=5, max_replicas=8)}
    alloc = GoodputPolicy().optimize(jobs, cluster, {"pin": (1, 1, 1)}, now=100)
    assert alloc["pin"] == (1, 1, 1)
    assert alloc["gang"] == (0, 0, 0, 0, 1)  # the 5 GPUs left; single-node jobs may share its node
    check_allocations(alloc, cluster, jobs, {"pin": (1, 1, 1)})


@pytest.mark.parametrize("name", ["goodput", "pollux"])
def test_a_pinned_multinode_job_keeps_its_nodes_from_other_multinode_jobs(name):
    """Found by the invariant test below: a non-preemptible job spanning nodes 0-1 must not share node 1
    with a new multi-node job."""
    cluster = ClusterSpec(4, 2)
    jobs = {"pin": info("pin", exponent=0.9, min_replicas=2, max_replicas=3, preemptible=False),
            "gang": info("gang", exponent=0.9, min_replicas=3, max_replicas=3)}
    for n in ("a", "b"):
        jobs[n] = info(n, exponent=None, max_replicas=1)
    current = {"pin": (0, 0, 1)}
    alloc = make_policy(name).optimize(jobs, cluster, current, now=100)
    assert alloc["pin"] == (0, 0, 1)
    check_allocations(alloc, cluster, jobs, current)
    assert 1 not in alloc.get("gang", ())


def test_goodput_never_puts_two_multinode_jobs_on_one_node():
    cluster = ClusterSpec(3, 4)
    jobs = {n: info(n, exponent=0.99, min_replicas=5, max_replicas=6, submitted=-1e5) for n in "ab"}
    alloc = GoodputPolicy().optimize(jobs, cluster, {}, now=0)
    check_allocations(alloc, cluster, jobs)
    multi = [a for a in alloc.values() if num_nodes_of(a) > 1]
    assert len(multi) == len(alloc) >= 1


@st.composite
def scenarios(draw):
    cluster = ClusterSpec(draw(st.integers(1, 5)), draw(st.integers(1, 4)))
    count = draw(st.integers(1, 10))
    jobs = {}
    for i in range(count):
        lo = draw(st.integers(0, 3))
        hi = draw(st.integers(max(lo, 1), 10))
        exponent = draw(st.one_of(st.none(), st.floats(0.1, 1.0)))
        jobs[f"j{i}"] = info(f"j{i}", exponent=exponent, min_replicas=lo, max_replicas=hi,
                             submitted=-draw(st.floats(0, 1e4)), preemptible=draw(st.booleans()),
                             attained_service=draw(st.floats(0, 1e5)), num_restarts=draw(st.integers(0, 5)))
    dropped = draw(st.lists(st.sampled_from(sorted(jobs)), unique=True))
    return cluster, jobs, dropped


@pytest.mark.parametrize("name", ["goodput", "pollux", "tiresias"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_policy_invariants_hold_over_two_rounds(name, scenario):
    cluster, jobs, dropped = scenario
    policy = make_policy(name)
    policy_twin = make_policy(name)
    exclusive = policy.avoids_interference
    first = policy.optimize(jobs, cluster, {}, now=0.0)
    assert first == policy_twin.optimize(jobs, cluster, {}, now=0.0)  # deterministic
    check_allocations(first, cluster, jobs, {}, exclusive_multinode=exclusive)
    later = {n: j for n, j in jobs.items() if n not in dropped}
    second = policy.optimize(later, cluster, first, now=60.0)
    check_allocations(second, cluster, later, first, exclusive_multinode=exclusive)
    for job_name, job in later.items():
        if job.is_pinned(first.get(job_name, ())):
            assert second[job_name] == first[job_name]
