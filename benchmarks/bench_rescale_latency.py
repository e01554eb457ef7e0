"""Rescale latency: a scheduling decision that changes a job's allocation -> its first step on the new one.

One job (tests/workers/elastic_worker.py) runs under the executor with a
scripted policy on 1 replica; once it is training, the policy moves it to 2
replicas, and the clock starts when the policy returns that decision. Parts,
from the worker's files and the executor's state (polled every 20 ms):

* ``stop``: decision -> the stop checkpoint's creation time (SIGTERM, checkpoint);
* ``exit``: checkpoint -> the executor reaps the incarnation (workers and launcher exit);
* ``relaunch``: reaped -> the new workers resumed the checkpoint (start, rendezvous, restore);
* ``first_step``: resumed -> rank 0 reports its first step on the new world size.

Backends: ``local`` (1 -> 2 replicas on this machine) and ``ray`` (a
2-node ``ray.cluster_utils.Cluster`` on this machine, bound to 127.0.0.1,
node 0 -> nodes 0 and 1, one replica each), same worker, same machine.

    python benchmarks/bench_rescale_latency.py [--trials 3] [--backends local,ray] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Ray replaces 127.0.0.1 by this machine's network address when it connects, unless its single-machine
# switch is off: with it, the driver, every node and the rendezvous stay on the loopback interface.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from elastic_harness import WORKER, progress, resume_records  # noqa: E402

from adaptive.checkpoint.store import CheckpointStore  # noqa: E402

from scheduler.cluster import ClusterSpec, make_allocation  # noqa: E402
from scheduler.executor import Executor, JobSpec, JobState, LocalBackend  # noqa: E402
from scheduler.policies.base import Policy  # noqa: E402

logger = logging.getLogger("bench_rescale_latency")
PARTS = ("stop", "exit", "relaunch", "first_step", "total")


class Scripted(Policy):
    """The allocation the benchmark sets; remembers when it first returned each one."""

    name, adaptive = "scripted", False

    def __init__(self, allocation: tuple[int, ...]):
        self.allocation = allocation
        self.decided_at: dict[tuple[int, ...], float] = {}

    def optimize(self, jobs, cluster, current, now):
        self.decided_at.setdefault(self.allocation, time.time())
        return {name: make_allocation(self.allocation) for name in jobs}


def trial(backend, cluster: ClusterSpec, before: tuple[int, ...], after: tuple[int, ...], tmp: Path) -> dict:
    out = tmp / "out"
    out.mkdir(parents=True)
    spec = JobSpec(name="job", command=(str(WORKER),), checkpoint_dir=str(tmp / "ckpt"), max_replicas=4,
                   max_failures=0, env={"WORKER_OUT": str(out), "WORKER_SAMPLES": "480", "WORKER_BATCH": "24",
                                        "WORKER_EPOCHS": "2", "WORKER_STEP_SLEEP": "0.05",
                                        "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    policy = Scripted(before)
    ex = Executor(backend, policy, cluster, interval=0.1, grace_period=60)
    ex.submit(spec)
    marks: dict[str, float] = {}
    deadline = time.monotonic() + 300
    try:
        while not ex.done and "first_step" not in marks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"trial did not finish in 300 s: {ex.status()}")
            ex.step()
            job = ex.jobs["job"]
            rank0 = progress(out, 0) or {}
            if policy.allocation == before and rank0.get("world") == len(before) and rank0.get("step", 0) >= 5:
                policy.allocation = after
            if "decision" not in marks and after in policy.decided_at:
                marks["decision"] = policy.decided_at[after]
            if "decision" in marks and "exit" not in marks and job.state is not JobState.STOPPING:
                marks["exit"] = time.time()
            if "exit" in marks and rank0.get("world") == len(after):
                marks["first_step"] = time.time()
            time.sleep(0.02)
    finally:
        ex.shutdown(timeout=30)
    stops = [info for info in CheckpointStore(spec.checkpoint_dir).list()
             if info.metadata.get("reason") == "stop" and info.created >= marks["decision"]]
    checkpoint = min(stops, key=lambda info: info.created)  # the rescale's, not the final shutdown's
    resumed = [r for r in resume_records(out) if r["world"] == len(after)]
    marks["stop"] = checkpoint.created
    marks["relaunch"] = max(r["time"] for r in resumed)
    parts = {"stop": marks["stop"] - marks["decision"], "exit": marks["exit"] - marks["stop"],
             "relaunch": marks["relaunch"] - marks["exit"], "first_step": marks["first_step"] - marks["relaunch"],
             "total": marks["first_step"] - marks["decision"]}
    return {k: round(v, 3) for k, v in parts.items()}


def run_backend(name: str, trials: int, root: Path) -> list[dict]:
    results = []
    if name == "local":
        for i in range(trials):
            tmp = root / f"local-{i}"
            results.append(trial(LocalBackend(str(tmp / "logs")), ClusterSpec(1, 2), (0,), (0, 0), tmp))
            logger.info("local trial %d: %s", i, results[-1])
        return results
    import ray
    from ray.cluster_utils import Cluster

    from scheduler.executor.ray_backend import RayBackend
    from scheduler.executor.ray_pool import RayPool

    node = {"num_cpus": 1, "resources": {"slot": 2}, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        pool = RayPool("slot", refresh=0.5)
        for i in range(trials):
            tmp = root / f"ray-{i}"
            results.append(trial(RayBackend(str(tmp / "logs"), pool, timeout=60), pool.cluster_spec(),
                                 (0,), (0, 1), tmp))
            logger.info("ray trial %d: %s", i, results[-1])
    finally:
        ray.shutdown()
        cluster.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--backends", default="local,ray")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_rescale_latency.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rescale-") as root:
        for name in args.backends.split(","):
            results[name] = run_backend(name, args.trials, Path(root))
    medians = {b: {p: statistics.median(r[p] for r in runs) for p in PARTS} for b, runs in results.items()}
    print(f"{'backend':8} " + " ".join(f"{p:>10}" for p in PARTS) + "   (median seconds, "
          f"{args.trials} trials)")
    for backend, m in medians.items():
        print(f"{backend:8} " + " ".join(f"{m[p]:10.2f}" for p in PARTS))
    ratio = None
    if "local" in medians and "ray" in medians:
        ratio = medians["ray"]["total"] / medians["local"]["total"]
        print(f"ray / local total: {ratio:.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": results, "median": medians, "ratio_ray_local": ratio,
                                           "replicas": "1 -> 2"}, indent=2))


if __name__ == "__main__":
    main()
