"""Node loss: a Ray node that dies under a training job -> the job trains again on the nodes left.

A Ray cluster on this machine, bound to 127.0.0.1 (``ray.cluster_utils.Cluster``:
a head without slots and 3 worker nodes with 2 ``slot`` each). One job
(tests/workers/elastic_worker.py) runs under the executor with the Ray backend
and a policy that puts it on the first two alive nodes (``--per-node``
replicas on each). Once it trains, the node hosting its rendezvous (rank 0's
node) is removed with ``remove_node(allow_graceful=False)`` (its raylet and
everything Ray started there are killed at once). Measured from the removal:

* ``detect``: the executor ended the incarnation (an infrastructure failure);
* ``shown``: the status shows the node suspect or lost;
* ``relaunch``: the executor launched the next incarnation (on the nodes left);
* ``resumed``: its workers resumed the checkpoint;
* ``first_step``: rank 0 of the new incarnation reports its first step (goal: <= 30 s);
* ``orphans``: processes of the lost node's incarnation (its guard, launcher and
  workers: the guard's process tree, read with psutil before the removal) still
  alive 5 s after the loss, and at the end of the trial;
* ``max_step``: the executor loop's longest step during the whole trial (goal: < 1 s).

    python benchmarks/bench_node_loss.py [--trials 3] [--per-node 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# Ray replaces 127.0.0.1 by this machine's network address when it connects, unless its single-machine
# switch is off: with it, the driver, every node and the rendezvous stay on the loopback interface.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import psutil  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from elastic_harness import WORKER, live_pids, progress, resume_records  # noqa: E402

from scheduler.cluster import make_allocation  # noqa: E402
from scheduler.executor import Executor, JobSpec  # noqa: E402
from scheduler.policies.base import Policy  # noqa: E402

logger = logging.getLogger("bench_node_loss")
LOOPBACK = "127.0.0.1"
PARTS = ("detect", "shown", "relaunch", "resumed", "first_step")
#: Seconds after the loss at which the lost node's processes are counted.
ORPHAN_CHECK = 5.0


class FirstTwoNodes(Policy):
    """The job on the first two alive nodes, ``per_node`` replicas on each."""

    name, adaptive = "first-two", False

    def __init__(self, per_node: int):
        self.per_node = per_node

    def optimize(self, jobs, cluster, current, now):
        return {name: make_allocation([0] * self.per_node + [1] * self.per_node) for name in jobs}


@contextmanager
def loopback_cluster(workers: int, slots: int):
    """A Ray cluster on 127.0.0.1: a head without slots and ``workers`` nodes with ``slots`` each."""
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "resources": {"slot": slots}, "node_ip_address": LOOPBACK}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK,
                                                            "include_dashboard": False})
    nodes = [cluster.add_node(**node) for _ in range(workers)]
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, logging_level="WARNING")
    addresses = {n["NodeManagerAddress"] for n in ray.nodes()}
    if addresses != {LOOPBACK}:
        raise RuntimeError(f"Ray nodes are not all on {LOOPBACK}: {addresses}")
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def trial(per_node: int, tmp: Path) -> dict:
    from scheduler.executor.ray_backend import RayBackend
    from scheduler.executor.ray_pool import RayPool

    out = tmp / "out"
    out.mkdir(parents=True)
    spec = JobSpec(name="job", command=(str(WORKER),), checkpoint_dir=str(tmp / "ckpt"), max_replicas=2 * per_node,
                   max_failures=0, env={"WORKER_OUT": str(out), "WORKER_SAMPLES": "960", "WORKER_BATCH": "24",
                                        "WORKER_EPOCHS": "1000", "WORKER_STEP_SLEEP": "0.05",
                                        "ADAPTIVE_CHECKPOINT_INTERVAL": "5", "ADAPTIVE_COLLECTIVE_TIMEOUT": "60",
                                        "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    with loopback_cluster(workers=3, slots=2) as (cluster, ray_nodes):
        pool = RayPool("slot", refresh=0.5)
        backend = RayBackend(str(tmp / "logs"), pool, timeout=60)
        ex = Executor(backend, FirstTwoNodes(per_node), pool.cluster_spec(), interval=600, grace_period=30)
        ex.submit(spec)
        marks: dict[str, float] = {}
        steps: list[float] = []
        lost_tree: list[int] = []
        orphans_at_check: list[int] | None = None
        lost_index = None
        deadline = time.monotonic() + 300
        try:
            while "first_step" not in marks:
                if time.monotonic() > deadline or ex.done:
                    raise RuntimeError(f"no relaunched step within 300 s, or the job ended: {ex.status()} {marks}")
                started = time.monotonic()
                ex.step()
                steps.append(time.monotonic() - started)
                job = ex.jobs["job"]
                rank0 = progress(out, 0) or {}
                if "loss" not in marks and job.launches == 1 and rank0.get("step", 0) >= 20:
                    lost_index = min(job.assignment.nodes)  # node rank 0: hosts the rendezvous
                    position = job.handle.nodes.index(lost_index)
                    lost_tree = process_tree(job.handle.pids[position])
                    first_pids = {r["pid"] for r in resume_records(out)}
                    (ray_node,) = [n for n in ray_nodes if n.node_id == pool.node(lost_index).node_id]
                    cluster.remove_node(ray_node, allow_graceful=False)
                    marks["loss"], marks["loss_wall"] = time.monotonic(), time.time()
                    logger.info("removed pool node %d (rank 0's); its processes: %s", lost_index, lost_tree)
                if "loss" not in marks:
                    time.sleep(0.02)
                    continue
                now = time.monotonic()
                if "detect" not in marks and job.infra_failures >= 1:
                    marks["detect"] = now
                if "shown" not in marks and \
                        {n["index"]: n["state"] for n in backend.describe()}[lost_index] != "alive":
                    marks["shown"] = now
                if "relaunch" not in marks and job.launches >= 2:
                    marks["relaunch"] = now
                    if lost_index in job.assignment.nodes:
                        raise RuntimeError(f"relaunched onto the lost node: {job.assignment}")
                if "resumed" not in marks:
                    later = [r for r in resume_records(out, since=marks["loss_wall"]) if r["pid"] not in first_pids]
                    if later:
                        marks["resumed"] = marks["loss"] + (min(r["time"] for r in later) - marks["loss_wall"])
                if rank0.get("pid") not in first_pids and rank0.get("pid") is not None:
                    marks["first_step"] = now
                if orphans_at_check is None and now - marks["loss"] >= ORPHAN_CHECK:
                    orphans_at_check = live_pids(lost_tree)
                time.sleep(0.02)
            if orphans_at_check is None:
                time.sleep(max(0.0, marks["loss"] + ORPHAN_CHECK - time.monotonic()))
                orphans_at_check = live_pids(lost_tree)
            status = ex.status()[0]
        finally:
            ex.shutdown(timeout=30)
        orphans_at_end = live_pids(lost_tree)
        for pid in orphans_at_end:  # ours (started through the backend): do not leave them running
            os.kill(pid, signal.SIGKILL)
    result = {part: round(marks[part] - marks["loss"], 2) for part in PARTS if part in marks}
    result.update({"orphans_5s": len(orphans_at_check), "orphans_end": len(orphans_at_end),
                   "lost_processes": len(lost_tree), "max_step": round(max(steps), 3),
                   "failures": status["failures"], "infra_failures": status["infra_failures"],
                   "launches": status["launches"], "placement_after": status["placement"], "lost_node": lost_index})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--per-node", type=int, default=1, choices=(1, 2), help="replicas on each of the two nodes")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_node_loss.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as root:
        for i in range(args.trials):
            results.append(trial(args.per_node, Path(root) / f"trial-{i}"))
            logger.info("trial %d: %s", i, results[-1])
    columns = (*PARTS, "orphans_5s", "orphans_end", "max_step")
    print(f"{'trial':6} " + " ".join(f"{c:>11}" for c in columns) + "   (seconds after the loss; orphans: processes)")
    for i, r in enumerate(results):
        print(f"{i:<6} " + " ".join(f"{r.get(c, float('nan')):>11}" for c in columns))
    median = {c: statistics.median(r[c] for r in results if c in r) for c in columns
              if any(c in r for r in results)}
    print(f"{'median':6} " + " ".join(f"{median.get(c, float('nan')):>11}" for c in columns))
    print(f"failures / infra failures / launches per trial: "
          f"{[(r['failures'], r['infra_failures'], r['launches']) for r in results]}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": results, "median": median, "replicas": 2 * args.per_node,
                                           "cluster": "head without slots + 3 nodes x 2 slots, 127.0.0.1"},
                                          indent=2))


if __name__ == "__main__":
    main()
