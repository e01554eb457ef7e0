"""The executor's Ray backend on a real Ray cluster of several nodes started on this machine.

The cluster (``ray.cluster_utils.Cluster``: a head and worker nodes, each a
raylet with ``slot: 2``, so placement is by slots) is started by a fixture and
shut down by it (Ray's own shutdown ends every process it started). Every
node, the driver and the rendezvous are bound to 127.0.0.1: nothing leaves
this machine. Jobs run the shared test worker (tests/workers/elastic_worker.py),
which counts every sample per epoch; every job must finish with exact data
accounting. The fast node-loss tests run a sleeping stand-in for the launcher.
"""

import json
import os
import sys
import textwrap
import time

import psutil
import pytest

# Ray replaces 127.0.0.1 by this machine's network address when it connects (resolve_ip_for_localhost),
# unless its "single-machine" switch is off; with it, the driver and every node stay on the loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the Ray backend tests need ray (pip install 'adaptive-elastic[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

from adaptive.checkpoint.store import CheckpointStore  # noqa: E402

from elastic_harness import assert_exact_counts, epoch_records, progress, resume_records, tail, wait_for  # noqa: E402
from scheduler.cluster import make_allocation  # noqa: E402
from scheduler.executor import Assignment, Executor, JobSpec, JobState  # noqa: E402
from scheduler.executor.backend import LAUNCH_FAILED_EXIT, LOST_NODE_EXIT  # noqa: E402
from scheduler.executor.ray_backend import Phase, RayBackend  # noqa: E402
from scheduler.executor.ray_pool import RayPool  # noqa: E402
from policy_cases import ScriptedPolicy  # noqa: E402

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "workers", "elastic_worker.py")
LOOPBACK = "127.0.0.1"
NODE = {"num_cpus": 1, "resources": {"slot": 2}, "node_ip_address": LOOPBACK}
#: A stand-in for the elastic launcher: records its pid per node rank, then sleeps (143 on SIGTERM).
#: With SLEEPER_FAIL set it prints that and exits 2 at once, like a script with a bad argument; the node
#: rank SLEEPER_PEER_RANK exits 1 once the file SLEEPER_PEER_LOST exists, like a peer of a lost node.
SLEEPER = textwrap.dedent("""
    import os, signal, sys, time
    if os.environ.get("SLEEPER_FAIL"):
        print("usage: train.py [--epochs N]", flush=True)
        print(os.environ["SLEEPER_FAIL"], flush=True)
        sys.exit(2)
    rank = [a.split("=")[1] for a in sys.argv if a.startswith("--node-rank=")][0]
    print(" ".join(sys.argv[1:]), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(os.path.join(os.environ["SLEEPER_OUT"], "rank" + rank + ".pid"), "w") as f:
        f.write(str(os.getpid()))
    peer_lost = os.environ.get("SLEEPER_PEER_LOST") if os.environ.get("SLEEPER_PEER_RANK") == rank else None
    for _ in range(3000):
        if peer_lost and os.path.exists(peer_lost):
            print("RuntimeError: connection to the peer was reset", flush=True)
            sys.exit(1)
        time.sleep(0.1)
""")


@pytest.fixture(scope="module")
def cluster():
    """A 2-node Ray cluster on 127.0.0.1 (tests may add nodes); ray.init connects this process to it."""
    assert not ray._private.ray_constants.ENABLE_RAY_CLUSTER, \
        "ray was imported before this module set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: it would leave 127.0.0.1"
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, logging_level="WARNING")
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


def sleeper_backend(tmp_path, pool, **kw):
    """A backend whose 'launcher' is SLEEPER, and a job spec for it (its pid files go to tmp_path/pids)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    (tmp_path / "pids").mkdir(exist_ok=True)
    backend = RayBackend(str(tmp_path / "logs"), pool, launcher=[sys.executable, str(script)], **kw)
    spec = JobSpec(name="sleeper", command=("train.py",), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=4,
                   env={"SLEEPER_OUT": str(tmp_path / "pids"), "PYTHONPATH": REPO})
    return backend, spec


def node_logs(tmp_path, name):
    return "\n".join(f"--- {p.name}\n{tail(p, 30)}" for p in sorted((tmp_path / "logs" / name).glob("*.log")))


class Longest:
    """Calls a function and keeps the longest time one call took: the backend must never block."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, fn, *args):
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.seconds = max(self.seconds, time.monotonic() - start)


def wait_code(backend, handle, timeout, tmp_path, name, longest=None):
    """The incarnation's exit status (``poll`` returns 0 for success, so wait for "not None")."""
    box, timed = [], longest or Longest()
    wait_for(lambda: box.append(timed(backend.poll, handle)) or box[-1] is not None, timeout,
             f"{name} to exit\n{node_logs(tmp_path, name)}", interval=0.1)
    return box[-1]


def wait_running(backend, handle, timeout, tmp_path, longest):
    """Poll ``handle`` through its launch phases until its launchers run."""
    wait_for(lambda: timed_poll(backend, handle, longest) is not None or handle.phase is Phase.RUNNING, timeout,
             f"{handle.name} to start\n{node_logs(tmp_path, handle.name)}", interval=0.1)
    assert handle.exit_code is None, node_logs(tmp_path, handle.name)


def timed_poll(backend, handle, longest):
    return longest(backend.poll, handle)


def processes(pids):
    """``psutil.Process`` of each pid that runs now (they tell a reused pid from the process they were)."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def kill_leftovers(procs):
    """SIGKILL the processes of ours (started through the backend) that outlived a lost node."""
    for proc in procs:
        try:
            if proc.is_running():
                proc.kill()
        except psutil.NoSuchProcess:
            pass


def placement_state(pg):
    return ray.util.placement_group_table(pg)["state"]


class FakeReplicas:
    """Stands in for the RayBackend that runs each replica of a live job: exit statuses and time set by the test."""

    def __init__(self):
        self.codes, self.killed, self.now = {}, [], 0.0

    def clock(self):
        return self.now

    def poll(self, incarnation):
        return self.codes.get(incarnation)

    def kill(self, incarnation):
        self.killed.append(incarnation)


def test_a_live_job_on_ray_whose_store_host_failed_reads_75_once_a_joiner_said_so(tmp_path):
    """The decision alone (no cluster): the host's launcher killed (137), the joiners end with 75 within seconds:
    the job ends with 75 (relaunch, an infrastructure failure); 137 when none did within STORE_LOSS_WAIT; a host's
    2 (configuration error) stands at once."""
    from scheduler.executor import ray_live
    from scheduler.executor.ray_live import LiveRayBackend, LiveRayHandle, Replica

    backend = LiveRayBackend(str(tmp_path / "logs"), pool=object())
    fake = backend.ray_backend = FakeReplicas()
    spec = JobSpec(name="live", command=("train.py",), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=3)

    def job():
        replicas = [Replica(0, 0, "host"), Replica(1, 1, "joiner-1"), Replica(1, 2, "joiner-2")]
        return LiveRayHandle(spec, 1, replicas=replicas, started=3, serving=True)

    handle = job()
    fake.codes["host"] = 137
    assert backend.poll(handle) is None  # the joiners have not noticed yet
    fake.now, fake.codes["joiner-2"] = 4.0, LOST_NODE_EXIT
    assert backend.poll(handle) == LOST_NODE_EXIT and handle.ended_by.number == 2
    assert sorted(fake.killed) == ["host", "joiner-1", "joiner-2"]
    fake.codes, fake.now = {"host": 137}, 10.0
    handle = job()
    assert backend.poll(handle) is None
    fake.now += ray_live.STORE_LOSS_WAIT + 1
    assert backend.poll(handle) == 137 and handle.ended_by.number == 0
    fake.codes = {"host": 2}
    assert backend.poll(job()) == 2


def test_cluster_driver_and_rendezvous_stay_on_loopback(cluster, tmp_path):
    assert cluster.address.startswith(f"{LOOPBACK}:")
    nodes = ray.nodes()
    assert nodes and {n["NodeManagerAddress"] for n in nodes} == {LOOPBACK}, nodes
    assert ray.util.get_node_ip_address() == LOOPBACK  # the driver
    backend, spec = sleeper_backend(tmp_path, RayPool("slot", refresh=0), timeout=60)
    longest = Longest()
    handle = backend.launch(spec, Assignment((0, 1), (0, 0)), attempt=1)
    try:
        wait_running(backend, handle, 60, tmp_path, longest)
        assert handle.endpoint.startswith(f"{LOOPBACK}:"), handle.endpoint
        wait_for(lambda: len(list((tmp_path / "pids").glob("*.pid"))) == 2, 30, "both launchers to start")
        for log in handle.log_paths:
            wait_for(lambda: "--rdzv-endpoint=" in open(log).read(), 10, f"the command line in {log}")
            assert f"--rdzv-endpoint={handle.endpoint}" in open(log).read()
        assert longest.seconds < 1.0, f"a poll blocked for {longest.seconds:.2f} s"
    finally:
        backend.kill(handle)
        backend.close()


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
    with pytest.raises(ValueError, match="probe_timeout must be > 0 s"):
        RayPool("slot", probe_timeout=0)
    with pytest.raises(KeyError, match="no Ray node with executor index 99"):
        pool.suspect(99, "never seen")


def test_suspect_node_is_left_out_until_a_probe_pinned_to_it_answers(cluster):
    pool = RayPool("slot", refresh=0)
    node = pool.alive_nodes()[0]
    pool.suspect(node, "the test says so")
    assert node not in pool.alive_nodes() and not pool.usable(node)  # this call sends the probe
    assert {n["index"]: n["state"] for n in pool.describe()}[node] == "suspect"
    wait_for(lambda: node in pool.alive_nodes(), 30, f"a probe to clear node {node}")
    assert pool.suspects == {} and pool.usable(node)


@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s: CI runs it after the default suite
def test_job_across_two_nodes_stops_gracefully_and_resumes_exactly(cluster, tmp_path):
    backend = RayBackend(str(tmp_path / "logs"), RayPool("slot", refresh=0), timeout=60)
    job = job_spec(tmp_path, "pair", epochs=3, sleep=0.1)
    out = tmp_path / "pair"
    longest = Longest()
    handle = backend.launch(job, Assignment((0, 1), (0, 0)), attempt=1)
    assert handle.exit_code is None and handle.phase is Phase.PLACING  # launch returns at once
    try:
        wait_running(backend, handle, 60, tmp_path, longest)
        assert handle.endpoint.startswith(f"{LOOPBACK}:")
        wait_for(lambda: timed_poll(backend, handle, longest) is None
                 and (progress(out, 1) or {}).get("step", 0) >= 3, 90,
                 f"two replicas training\n{node_logs(tmp_path, 'pair')}")
        assert progress(out, 0)["world"] == 2
        backend.stop(handle)
        assert wait_code(backend, handle, 60, tmp_path, "pair", longest) == 143
        assert handle.placement_group is None and handle.actors == []  # released
        pids = [r["pid"] for r in resume_records(out)]
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 20, "the first incarnation's workers to exit")
        handle = backend.launch(job, Assignment((0, 1), (0, 0)), attempt=2)
        assert wait_code(backend, handle, 120, tmp_path, "pair", longest) == 0
    finally:
        backend.kill(handle)
        backend.close()
    assert longest.seconds < 1.0, f"a poll blocked for {longest.seconds:.2f} s"
    records = resume_records(out)
    assert [r["seq"] is None for r in records] == [True, True, False, False], records
    assert_exact_counts(out, 3, tmp_path / "logs" / "pair" / "attempt-2.node-0.log")
    logs = sorted(p.name for p in (tmp_path / "logs" / "pair").glob("*.log"))
    assert logs == ["attempt-1.node-0.log", "attempt-1.node-1.log", "attempt-2.node-0.log", "attempt-2.node-1.log"]


def test_launch_phases_time_out_stop_and_kill_alone_without_blocking(cluster, tmp_path):
    backend, spec = sleeper_backend(tmp_path, RayPool("slot", refresh=0), timeout=3)
    longest = Longest()
    # 3 replicas on a 2-slot node: the placement group can never be placed
    launched = time.monotonic()
    unplaceable = backend.launch(spec, Assignment((0, 0, 0), (0, 1, 2)), attempt=1)
    stopped = backend.launch(spec, Assignment((0, 0, 0), (0, 1, 2)), attempt=2)
    fine = backend.launch(spec, Assignment((1,), (0,)), attempt=3)
    groups = [unplaceable.placement_group, stopped.placement_group]
    try:
        assert longest(backend.poll, stopped) is None
        backend.stop(stopped)  # still placing: ends at once, its placement group is released
        assert backend.poll(stopped) == 143 and stopped.placement_group is None
        assert wait_code(backend, unplaceable, 20, tmp_path, "sleeper", longest) == LAUNCH_FAILED_EXIT
        assert 3 <= time.monotonic() - launched < 10  # the backend's timeout, then at the next poll
        wait_running(backend, fine, 60, tmp_path, longest)  # the other launch did not notice
        assert longest.seconds < 1.0, f"a poll blocked for {longest.seconds:.2f} s"
        killed = backend.launch(spec, Assignment((0,), (0,)), attempt=4)
        wait_for(lambda: timed_poll(backend, killed, longest) is not None or killed.actors, 60,
                 "the actors to be created")
        actors = list(killed.actors)
        backend.kill(killed)  # creating or starting: actors and placement group go
        assert backend.poll(killed) == 137
    finally:
        for handle in (unplaceable, stopped, fine):
            backend.kill(handle)
        backend.close()
    assert [placement_state(pg) for pg in groups] == ["REMOVED", "REMOVED"]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actors[0].poll.remote(), timeout=30)


def test_early_failure_is_reported_once_with_the_end_of_its_output(cluster, tmp_path):
    backend, spec = sleeper_backend(tmp_path, RayPool("slot", refresh=0), timeout=60)
    spec = JobSpec(name=spec.name, command=spec.command, checkpoint_dir=spec.checkpoint_dir, max_replicas=4,
                   max_failures=1, env={**spec.env, "SLEEPER_FAIL": "ModuleNotFoundError: No module named 'tain'"})
    ex = Executor(backend, ScriptedPolicy(lambda jobs, n: {"sleeper": (0, 1)}), backend.pool.cluster_spec(),
                  interval=600, grace_period=30)
    ex.submit(spec)
    deadline = time.monotonic() + 120
    try:
        while not ex.done:
            assert time.monotonic() < deadline, ex.status()
            ex.step()
            time.sleep(0.1)
    finally:
        ex.shutdown(timeout=10)
    (status,) = ex.status()
    # exit 2 (a usage error) is not relaunched, although max_failures=1 would allow one more launch
    assert status["state"] == "failed" and status["failures"] == 1 and status["infra_failures"] == 0, status
    assert status["last_exit"] == 2 and status["launches"] == 1
    assert "No module named 'tain'" in status["last_error"] and "--- node" in status["last_error"], status


# (last of the fast tests: the node it removes is listed as alive by Ray for a while after)
def test_lost_node_ends_its_incarnation_within_seconds_and_is_never_placed_again(cluster, tmp_path):
    extra = cluster.add_node(**NODE)
    cluster.wait_for_nodes(timeout=120)
    pool = RayPool("slot", refresh=0.5)
    (x,) = [n.index for n in pool.nodes() if n.node_id == extra.node_id]
    other = [n for n in pool.alive_nodes() if n != x][0]
    backend, spec = sleeper_backend(tmp_path, pool, timeout=60, heartbeat_timeout=5)
    # the survivor's launcher fails as soon as the node is removed, before Ray's actor there is seen dead:
    # that exit must not pass for the job's crash
    peer_lost = tmp_path / "peer-lost"
    spec = JobSpec(name=spec.name, command=spec.command, checkpoint_dir=spec.checkpoint_dir, max_replicas=4,
                   env={**spec.env, "SLEEPER_PEER_LOST": str(peer_lost),
                        "SLEEPER_PEER_RANK": str(sorted((other, x)).index(other))})
    longest = Longest()
    handle = backend.launch(spec, Assignment((other, x), (0, 0)), attempt=1)
    launchers = []
    try:
        wait_running(backend, handle, 60, tmp_path, longest)
        pid_files = {n: tmp_path / "pids" / f"rank{rank}.pid" for rank, n in enumerate(handle.nodes)}
        wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files.values()), 30, "both launchers")
        pids = {n: int(p.read_text()) for n, p in pid_files.items()}
        launchers = processes(pids.values())
        cluster.remove_node(extra, allow_graceful=False)
        removed = time.monotonic()
        peer_lost.touch()
        assert wait_code(backend, handle, 30, tmp_path, "sleeper", longest) == LOST_NODE_EXIT
        detected = time.monotonic() - removed
        # the peer's exit was seen first, yet the incarnation ended as the lost node's
        assert handle.codes == {sorted((other, x)).index(other): 1}, handle.codes
        assert detected < 10, f"the lost node was noticed after {detected:.1f} s"
        assert x not in backend.alive_nodes() and other in backend.alive_nodes()
        assert {n["index"]: n["state"] for n in backend.describe()}[x] in ("suspect", "lost")
        again = backend.launch(spec, Assignment((x,), (0,)), attempt=2)
        assert backend.poll(again) == LOST_NODE_EXIT  # never placed on the lost node
        assert longest.seconds < 1.0, f"a poll blocked for {longest.seconds:.2f} s"
        wait_for(lambda: not psutil.pid_exists(pids[other]), 15, "the surviving node's launcher to exit")
        wait_for(lambda: not psutil.pid_exists(pids[x]), 30, "the lost node's launcher to be gone")
    finally:
        backend.kill(handle)
        backend.close()
        kill_leftovers(launchers)


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
    removed_pids = removed_at = noticed = shown_lost = None
    longest = Longest()
    deadline = time.monotonic() + 600
    try:
        while not ex.done:
            assert time.monotonic() < deadline, f"jobs did not finish: {ex.status()}\n{node_logs(tmp_path, 'long')}"
            longest(ex.step)
            state = {s["name"]: s for s in ex.status()}
            if removed_at is not None and noticed is None and state["long"]["infra_failures"] == 1:
                noticed = time.monotonic() - removed_at
            if removed_at is not None and shown_lost is None and \
                    {n["index"]: n["state"] for n in backend.describe()}[x] != "alive":
                shown_lost = time.monotonic() - removed_at
            if state["short"]["state"] == "succeeded" and not gate.exists():
                assert ex.jobs["long"].state is JobState.STOPPING, ex.status()  # asked to stop in that step
                gate.touch()
            rank0 = progress(out, 0) or {}
            if removed_pids is None and rank0.get("world") == 4 and rank0.get("epoch", 0) >= 2:
                assert state["long"]["placement"] == list(make_allocation((q, q, x, x))), state
                removed_pids = [r["pid"] for r in resume_records(out) if r["world"] == 4]
                removed = processes(removed_pids)
                cluster.remove_node(extra, allow_graceful=False)
                removed_at = time.monotonic()
            time.sleep(0.2)
    finally:
        ex.shutdown(timeout=30)
    status = {s["name"]: s for s in ex.status()}
    assert status["short"]["state"] == "succeeded" and status["long"]["state"] == "succeeded", status
    # the lost node: one infrastructure failure, not charged, and one launch after it (on the nodes left)
    assert status["short"]["launches"] == 1 and status["long"]["launches"] == 3, status
    assert status["long"]["failures"] == 0 and status["long"]["infra_failures"] == 1, status
    assert status["long"]["last_exit"] == 0
    assert noticed is not None and noticed < 10, f"the loss ended the incarnation after {noticed} s"
    assert shown_lost is not None and shown_lost < 10, f"the node was shown lost after {shown_lost} s"
    assert longest.seconds < 2.0, f"an executor step blocked for {longest.seconds:.2f} s"
    assert removed_pids is not None and len(removed_pids) == 4
    try:
        wait_for(lambda: not any(psutil.pid_exists(p) for p in removed_pids), 30,
                 "the processes of the incarnation on the lost node to be gone")
    finally:
        kill_leftovers(removed)
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
