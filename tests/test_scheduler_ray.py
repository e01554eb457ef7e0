"""The executor's Ray backend on a real Ray cluster of several nodes started on this machine.

The cluster (``ray.cluster_utils.Cluster``: a head and worker nodes, each a
raylet with ``slot: 2``, so placement is by slots) is started by a fixture and
shut down by it (Ray's own shutdown ends every process it started). Jobs run
the shared test worker (tests/workers/elastic_worker.py), which counts every
sample per epoch; every job must finish with exact data accounting.
"""

import json
import os
import time

import psutil
import pytest

ray = pytest.importorskip("ray", reason="the Ray backend tests need ray (pip install 'adaptive-elastic[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

from adaptive.checkpoint.store import CheckpointStore  # noqa: E402

from elastic_harness import assert_exact_counts, epoch_records, progress, resume_records, tail, wait_for  # noqa: E402
from scheduler.cluster import make_allocation  # noqa: E402
from scheduler.cluster import ClusterSpec  # noqa: E402
from scheduler.executor import Assignment, Backend, Executor, JobSpec, JobState, Spool  # noqa: E402
from scheduler.executor.__main__ import main as executor_main  # noqa: E402
from scheduler.executor.ray_backend import RayBackend  # noqa: E402
from scheduler.executor.ray_pool import RayPool  # noqa: E402
from scheduler.policies.base import Policy  # noqa: E402

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "elastic_worker.py")
NODE = {"num_cpus": 1, "resources": {"slot": 2}}


@pytest.fixture(scope="module")
def cluster():
    """A 2-node Ray cluster (tests may add nodes); ray.init connects this process to it."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def job_spec(tmp_path, name, epochs, sleep, max_replicas=4, **env):
    out = tmp_path / name
    out.mkdir()
    return JobSpec(name=name, command=(WORKER,), checkpoint_dir=str(tmp_path / f"{name}-ckpt"),
                   max_replicas=max_replicas, max_failures=2,
                   env={"WORKER_OUT": str(out), "WORKER_SAMPLES": "240", "WORKER_BATCH": "24",
                        "WORKER_EPOCHS": str(epochs), "WORKER_STEP_SLEEP": str(sleep), "OMP_NUM_THREADS": "1",
                        "ADAPTIVE_COLLECTIVE_TIMEOUT": "60", "PYTHONPATH": REPO, **env})


def node_logs(tmp_path, name):
    return "\n".join(f"--- {p.name}\n{tail(p, 30)}" for p in sorted((tmp_path / "logs" / name).glob("*.log")))


def wait_code(backend, handle, timeout, tmp_path, name):
    """The incarnation's exit status (``poll`` returns 0 for success, so wait for "not None")."""
    box = []
    wait_for(lambda: box.append(backend.poll(handle)) or box[-1] is not None, timeout,
             f"{name} to exit\n{node_logs(tmp_path, name)}", interval=0.3)
    return box[-1]


def test_pool_reads_nodes_and_rejects_bad_arguments(cluster):
    pool = RayPool("slot", refresh=0)
    spec = pool.cluster_spec()
    assert spec.num_nodes >= 2 and spec.gpus_per_node == 2
    assert pool.alive_nodes() == list(range(spec.num_nodes))
    assert RayPool("slot", slots_per_node=1, refresh=0).cluster_spec().gpus_per_node == 1
    with pytest.raises(ValueError, match="no alive node with resource 'TPU'"):
        RayPool("TPU").cluster_spec()
    with pytest.raises(ValueError, match="slots_per_node must be an integer >= 1"):
        RayPool("slot", slots_per_node=0)


def test_job_across_two_nodes_stops_gracefully_and_resumes_exactly(cluster, tmp_path):
    backend = RayBackend(str(tmp_path / "logs"), RayPool("slot", refresh=0), timeout=60)
    job = job_spec(tmp_path, "pair", epochs=3, sleep=0.1)
    out = tmp_path / "pair"
    handle = backend.launch(job, Assignment((0, 1), (0, 0)), attempt=1)
    assert handle.exit_code is None, node_logs(tmp_path, "pair")
    try:
        wait_for(lambda: (progress(out, 1) or {}).get("step", 0) >= 3, 90,
                 f"two replicas training\n{node_logs(tmp_path, 'pair')}")
        assert progress(out, 0)["world"] == 2
        assert backend.poll(handle) is None
        backend.stop(handle)
        assert wait_code(backend, handle, 60, tmp_path, "pair") == 143
        assert handle.placement_group is None and handle.actors == []  # released
        pids = [r["pid"] for r in resume_records(out)]
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 20, "the first incarnation's workers to exit")
        handle = backend.launch(job, Assignment((0, 1), (0, 0)), attempt=2)
        assert wait_code(backend, handle, 120, tmp_path, "pair") == 0
    finally:
        backend.kill(handle)
    records = resume_records(out)
    assert [r["seq"] is None for r in records] == [True, True, False, False], records
    assert_exact_counts(out, 3, tmp_path / "logs" / "pair" / "attempt-2.node-0.log")
    logs = sorted(p.name for p in (tmp_path / "logs" / "pair").glob("*.log"))
    assert logs == ["attempt-1.node-0.log", "attempt-1.node-1.log", "attempt-2.node-0.log", "attempt-2.node-1.log"]


class ScriptedPolicy(Policy):
    """Test policy: the allocations ``plan(active job names, number of nodes)`` dictates."""

    name = "scripted"
    adaptive = False

    def __init__(self, plan):
        self.plan = plan

    def optimize(self, jobs, cluster, current, now):
        plan = self.plan(set(jobs), cluster.num_nodes)
        return {name: make_allocation(plan[name]) for name in jobs if name in plan}


def test_executor_drops_a_lost_node_and_maps_the_policy_onto_the_alive_ones(tmp_path):
    """The executor change, without Ray: a backend that reports its alive nodes."""

    class Handle:
        def __init__(self, assignment):
            self.assignment, self.code, self.stopping = assignment, None, False

    class NodesBackend(Backend):
        def __init__(self):
            self.alive, self.launched, self.killed = [0, 1, 2], [], []

        def launch(self, spec, assignment, attempt):
            self.launched.append((spec.name, assignment.nodes, attempt))
            return Handle(assignment)

        def poll(self, handle):
            return 143 if handle.stopping else handle.code

        def stop(self, handle):
            handle.stopping = True

        def kill(self, handle):
            self.killed.append(handle.assignment.nodes)
            handle.code = 137

        def alive_nodes(self):
            return self.alive

    backend = NodesBackend()
    seen = []

    def plan(jobs, num_nodes):
        seen.append(num_nodes)
        return {"a": (0, 1), "b": (2, 2)} if num_nodes == 3 else {"a": (0, 1), "b": (1,)}

    ex = Executor(backend, ScriptedPolicy(plan), ClusterSpec(3, 2), interval=600, grace_period=30)
    for name in ("a", "b"):
        ex.submit(JobSpec(name=name, command=("t.py",), checkpoint_dir=str(tmp_path / name), max_replicas=2))
    ex.step()
    assert sorted(backend.launched) == [("a", (0, 1), 1), ("b", (2, 2), 1)]
    backend.alive = [0, 2]  # node 1 is lost: a (on nodes 0, 1) is killed; the policy now sees 2 nodes
    ex.step()
    assert backend.killed == [(0, 1)] and seen[-1] == 2
    assert ex.jobs["a"].failures == 1 and ex.jobs["a"].state is JobState.PENDING
    assert ex.jobs["b"].state is JobState.STOPPING  # policy node 1 is real node 2: b shrinks to (2,)
    ex.jobs["a"].not_before = 0  # skip the crash back-off
    ex.step()  # policy nodes (0, 1) are real nodes (0, 2)
    assert sorted(backend.launched[2:]) == [("a", (0, 2), 2), ("b", (2,), 2)]
    assert {s["name"]: s["placement"] for s in ex.status()} == {"a": [0, 2], "b": [2]}


def test_status_command_shows_nodes_and_placements(tmp_path, capsys):
    spool = Spool(str(tmp_path / "work"))
    spool.write_status([{"name": "j1", "state": "running", "replicas": 3, "target_replicas": 3, "restarts": 1,
                         "failures": 0, "progress": 2.0, "placement": [0, 1, 1]}], slots=4, backend="ray",
                       nodes=[{"index": 0, "node_id": "a" * 40, "address": "10.0.0.1", "slots": 2, "alive": True},
                              {"index": 1, "node_id": "b" * 40, "address": "10.0.0.2", "slots": 2, "alive": False}])
    assert executor_main(["status", "--workdir", str(tmp_path / "work")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("node 0") and "alive" in lines[0] and "10.0.0.1" in lines[0]
    assert lines[1].startswith("node 1") and "LOST" in lines[1]
    assert lines[-1].startswith("j1") and lines[-1].endswith("0,1,1")


@pytest.mark.slow
@pytest.mark.ci_sample
def test_executor_places_rescales_and_survives_a_lost_node(cluster, tmp_path):
    extra = cluster.add_node(**NODE)
    cluster.wait_for_nodes(timeout=120)
    pool = RayPool("slot", refresh=0)
    assert pool.cluster_spec().num_nodes == 3
    # x: the node that will be lost; p, q: the others (pool indices follow Ray's node table, not the start order)
    (x,) = [n.index for n in pool.nodes() if n.node_id == extra.node_id]
    p, q = sorted({0, 1, 2} - {x})
    backend = RayBackend(str(tmp_path / "logs"), pool, timeout=60)
    def plan(jobs, num_nodes):
        if num_nodes == 2:  # x was lost: long goes on over the two nodes left (policy nodes 0, 1 = p, q)
            return {"long": (0, 1)}
        # short spans nodes p and q while long trains on x; once short is done, long is scaled up
        # across nodes q and x
        # (with all 3 nodes alive the policy's node indices are the pool's)
        return ({"short": (p, q), "long": (x,)} if "short" in jobs
                else {"long": make_allocation((q, q, x, x))})

    policy = ScriptedPolicy(plan)
    gate = tmp_path / "long-may-continue"
    short = job_spec(tmp_path, "short", epochs=2, sleep=0.05, WORKER_GATE=str(tmp_path / "long" / "epochs.jsonl"))
    long = job_spec(tmp_path, "long", epochs=8, sleep=0.1, WORKER_GATE=str(gate), WORKER_GATE_EPOCH="1",
                    WORKER_SAMPLES="480",  # 20 steps per epoch: time to remove a node while it trains
                    ADAPTIVE_CHECKPOINT_KEEP="1000")  # keep every checkpoint: which was newest when a process started
    ex = Executor(backend, policy, pool.cluster_spec(), interval=600, grace_period=60)
    ex.submit(short)
    ex.submit(long)
    out = tmp_path / "long"
    removed_pids = None
    deadline = time.monotonic() + 600
    try:
        while not ex.done:
            assert time.monotonic() < deadline, f"jobs did not finish: {ex.status()}\n{node_logs(tmp_path, 'long')}"
            ex.step()
            state = {s["name"]: s for s in ex.status()}
            if state["short"]["state"] == "succeeded" and not gate.exists():
                assert ex.jobs["long"].state is JobState.STOPPING, ex.status()  # asked to stop in that step
                gate.touch()
            rank0 = progress(out, 0) or {}
            if removed_pids is None and rank0.get("world") == 4 and rank0.get("epoch", 0) >= 2:
                assert state["long"]["placement"] == list(make_allocation((q, q, x, x))), state
                removed_pids = [r["pid"] for r in resume_records(out) if r["world"] == 4]
                cluster.remove_node(extra)
            time.sleep(0.2)
    finally:
        ex.shutdown(timeout=30)
    status = {s["name"]: s for s in ex.status()}
    assert status["short"]["state"] == "succeeded" and status["long"]["state"] == "succeeded", status
    assert status["short"]["launches"] == 1 and status["long"]["launches"] == 3, status
    assert status["long"]["failures"] == 1 and status["long"]["last_exit"] == 0  # the lost node: one crash
    assert removed_pids is not None and len(removed_pids) == 4
    wait_for(lambda: not any(psutil.pid_exists(p) for p in removed_pids), 30,
             "the processes of the incarnation on the lost node to be gone")
    assert_exact_counts(tmp_path / "short", 2, tmp_path / "logs" / "short" / f"attempt-1.node-{p}.log")
    records = assert_exact_counts(out, 8, tmp_path / "logs" / "long" / f"attempt-3.node-{p}.log")
    assert records[0]["world"] == 1, records  # (later epochs: 4 replicas, or 2 where replayed after the loss)
    assert {r["world"] for r in epoch_records(out).values()} <= {1, 2, 4}
    resumes = resume_records(out)
    assert [r["world"] for r in resumes if r["rank"] == 0] == [1, 4, 2], resumes
    third = [r for r in resumes if r["world"] == 2]
    checkpoints = CheckpointStore(long.checkpoint_dir).list()
    for r in third:  # each resumed the newest checkpoint there was when it started, past epoch 0
        assert r["seq"] == max(c.seq for c in checkpoints if c.created <= r["time"]) and r["loader_step"] >= 20, \
            (third, checkpoints)
    assert json.loads((out / "done.json").read_text())["world"] == 2
    assert sorted(p.name for p in (tmp_path / "logs" / "long").glob("attempt-3.*.log")) == \
        [f"attempt-3.node-{p}.log", f"attempt-3.node-{q}.log"]  # relaunched on the two nodes left
