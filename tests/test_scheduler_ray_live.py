"""The executor's live Ray backend on a real Ray cluster of two nodes started on this machine.

The cluster (``ray.cluster_utils.Cluster``: a head and a worker node, each a
raylet with ``slot: 2``, used here as one slot each) is started and shut down
by the fixture of tests/test_scheduler_ray.py (Ray's own shutdown ends every
process it started). Every node, the driver and the job's store are bound to
127.0.0.1: nothing leaves this machine. The job runs the live test worker
(tests/workers/live_worker.py), which logs every step it trains per process:
the checks are made on those records.
"""

import sys
import time

import pytest

# the cluster fixture (a head and a node, slot: 2 each, on 127.0.0.1; ray.init connected): importing that
# module also turns Ray's "single-machine" switch off before ray is imported, and skips without ray
from test_scheduler_ray import cluster  # noqa: F401

from elastic_harness import live_pids
from live_harness import BATCH, LIVE_WORKER, REPO, SAMPLES, check_steps, exits, logs, steps
from policy_cases import ScriptedPolicy
from scheduler.executor import Assignment, Executor, JobSpec
from scheduler.executor.ray_live import LiveRayBackend
from scheduler.executor.ray_pool import RayPool

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.ci_sample]  # CI runs them in its sample

EPOCHS = 8


def test_the_executor_resizes_a_live_job_on_ray_without_stopping_it(cluster, tmp_path):
    """The scheduler's decisions 1 -> 2 -> 1 replicas reach a job running on Ray as a joiner started on the
    other node and a leave, while the first replica keeps training."""
    out = tmp_path / "job"
    out.mkdir()
    spec = JobSpec(name="live", command=(str(LIVE_WORKER),), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=2,
                   max_failures=0, env={"WORKER_OUT": str(out), "WORKER_SAMPLES": str(SAMPLES),
                                        "WORKER_BATCH": str(BATCH), "WORKER_EPOCHS": str(EPOCHS),
                                        "WORKER_STEP_SLEEP": "0.1", "OMP_NUM_THREADS": "1",
                                        "GLOO_SOCKET_IFNAME": "lo", "ADAPTIVE_COLLECTIVE_TIMEOUT": "60",
                                        "PYTHONPATH": str(REPO)})
    pool = RayPool("slot", slots_per_node=1, refresh=0)
    log_dir = tmp_path / "logs"
    backend = LiveRayBackend(str(log_dir), pool, timeout=60)
    replicas = {"n": 1}  # one replica per node: growing to 2 starts the joiner on the other node
    ex = Executor(backend, ScriptedPolicy(lambda jobs, nodes: {name: tuple(range(replicas["n"])) for name in jobs}),
                  pool.cluster_spec(), interval=0.2, grace_period=30)
    ex.submit(spec)
    phase, longest = "alone", 0.0
    deadline = time.monotonic() + 150
    try:
        while not ex.done:
            assert time.monotonic() < deadline, f"the job did not finish: {ex.status()}\n{logs(log_dir)}"
            started = time.monotonic()
            ex.step()
            longest = max(longest, time.monotonic() - started)
            records = steps(out)
            if phase == "alone" and len(records) >= 6:
                replicas["n"], phase = 2, "growing"
            elif phase == "growing" and sum(r["world"] == 2 for r in records) >= 10:
                replicas["n"], phase = 1, "shrinking"
            elif phase == "shrinking" and exits(out):  # the leaver's worker exited
                handle = ex.jobs["live"].handle  # None once the job ended
                if handle is not None and not handle.leaving:  # its launcher too: its actor is being released
                    phase = "released"
            time.sleep(0.1)
    finally:
        ex.shutdown(timeout=30)
    (status,) = ex.status()
    assert status["state"] == "succeeded" and status["launches"] == 1 and status["last_exit"] == 0, \
        f"{status}\n{logs(log_dir)}"
    assert status["failures"] == 0 and status["infra_failures"] == 0, status
    assert phase == "released", f"the leaver was not gone while the job ran (last phase: {phase})"
    assert longest < 1.0, f"an executor step took {longest:.2f} s"

    by_step = check_steps(out, epochs=EPOCHS)  # every step by its world's members from one state, samples once
    worlds = [records[0]["world"] for _, records in sorted(by_step.items())]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1, worlds
    first = steps(out)[0]["pid"]
    assert all(any(r["pid"] == first for r in records) for records in by_step.values()), \
        "the first worker did not train every step"
    (joiner,) = {r["pid"] for r in steps(out)} - {first}  # nothing restarted
    first_generation = min(r["generation"] for r in steps(out) if r["pid"] == first)
    assert min(r["generation"] for r in steps(out) if r["pid"] == joiner) > first_generation
    assert sorted({r["generation"] for r in steps(out)}) == [1, 2, 3]  # one join, one leave
    assert exits(out) == {first: 0, joiner: 143}
    assert sorted(p.name for p in (log_dir / "live").glob("*.log")) == \
        ["attempt-1.replica-0.log", "attempt-1.replica-1.log"]
    assert live_pids([first, joiner]) == []


def test_a_joiner_waits_for_the_store_and_a_resize_that_would_remove_its_host_is_refused(cluster, tmp_path):
    """The joiners of a job just launched wait for the first replica's store; an allocation with no replica on
    the first replica's node is refused (the executor then stops and relaunches the job)."""
    backend = LiveRayBackend(str(tmp_path / "logs"), RayPool("slot", slots_per_node=1, refresh=0),
                             launcher=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=30)
    spec = JobSpec(name="refused", command=("train.py",), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=2)
    handle = backend.launch(spec, Assignment((0, 1), (0, 0)), attempt=1)
    try:
        assert backend.poll(handle) is None
        assert [r.node for r in handle.replicas] == [0, 1] and handle.replicas[1].incarnation is None
        assert not backend.resize(handle, Assignment((1,), (0,)))
        assert backend.resize(handle, Assignment((0,), (0,)))  # the waiting joiner is dropped
        assert [r.node for r in handle.replicas] == [0] and handle.leaving == []
    finally:
        backend.kill(handle)
        backend.close()
    assert backend.poll(handle) == 137 and handle.replicas[0].incarnation.placement_group is None
