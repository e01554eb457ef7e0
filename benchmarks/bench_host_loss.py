"""Loss of the node hosting a live job's store -> the job trains again, relaunched by the scheduler's local backend.

Three single-worker live nodes on 127.0.0.1 (``adaptive-run --live
--nproc-per-node=1`` each, the first hosting the job's TCPStore), run by the
executor with its local live backend (``scheduler.executor.local_live``) and a
policy that keeps the job on 3 replicas. The worker (written by this script)
trains a small MLP with Adam through ``AdaptiveDataParallel`` and
``AdaptiveDataLoader``, logs at INFO as a user's script would, checkpoints every
``--checkpoint-interval`` seconds and counts its optimizer steps in a buffer of
the model (checkpointed with it). Once a checkpoint exists and the job trained
at 3 replicas for a while, the store host's launcher is SIGKILLed (its worker
dies with it). Measured from the kill:

* ``survivors_exit``: every surviving launcher exited (each must exit 75);
* ``relaunch``: the executor launched the next incarnation (it reads 75 as
  "relaunch now", an infrastructure failure);
* ``training``: the first step of the relaunched job;
* ``steps_redone``: optimizer steps trained before the kill that the relaunch
  trains again (those since the newest checkpoint);
* ``tracebacks``: lines of the surviving launchers' logs (their workers' output
  included) that start a Python traceback or a C++ stack (``Traceback``,
  ``frame #``, ``Exception raised from``): the store's loss must be one line.

The median of the trials is printed under them.

    python benchmarks/bench_host_loss.py [--trials 3] [--checkpoint-interval 2] [--step-sleep 0.05] [--json PATH]

Prints a table; writes JSON (default ``benchmarks/results/bench_host_loss.json``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from adaptive.checkpoint.store import CheckpointStore  # noqa: E402
from scheduler.cluster import ClusterSpec, make_allocation  # noqa: E402
from scheduler.executor import Executor, JobSpec  # noqa: E402
from scheduler.executor.local_live import LiveLocalBackend  # noqa: E402
from scheduler.policies.base import Policy  # noqa: E402

logger = logging.getLogger("bench_host_loss")
REPLICAS = 3
PARTS = ("survivors_exit", "relaunch", "training")
COLUMNS = (*PARTS, "steps_redone", "tracebacks")
#: Steps at 3 replicas (after the first checkpoint) before the kill.
STEPS_BEFORE_KILL = 30
#: A traceback or a C++ stack in a log.
STACK = re.compile(r"Traceback \(most recent call last\)|frame #\d+|Exception raised from")

WORKER = textwrap.dedent('''
    """bench_host_loss.py's worker: logs the time, world size and optimizer step count of every step."""
    import json, logging, os, time

    import torch
    import torch.distributed as dist

    import adaptive

    logging.basicConfig(level=logging.INFO, format=f"[pid {os.getpid()}] %(name)s: %(message)s")
    OUT = os.environ["WORKER_OUT"]
    SLEEP = float(os.environ.get("BENCH_STEP_SLEEP", "0.05"))


    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return self.net(x)


    def main():
        adaptive.init_process_group("gloo")
        torch.manual_seed(0)
        module = Model()
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        model = adaptive.AdaptiveDataParallel(module, optimizer)
        data = torch.utils.data.TensorDataset(torch.randn(4800, 64), torch.randn(4800, 1))
        loader = adaptive.AdaptiveDataLoader(data, batch_size=48, shuffle=True)
        with open(os.path.join(OUT, f"steps.{os.getpid()}.jsonl"), "a") as log:
            for _ in adaptive.remaining_epochs_until(100000):
                for x, y in loader:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    model.module.steps += 1
                    log.write(json.dumps({"time": time.time(), "world": dist.get_world_size(),
                                          "steps": int(model.module.steps)}) + "\\n")
                    log.flush()
                    time.sleep(SLEEP)


    main()
''')


class AlwaysThree(Policy):
    """Every job on :data:`REPLICAS` replicas of node 0."""

    name, adaptive = "always-three", False

    def optimize(self, jobs, cluster, current, now):
        return {name: make_allocation([0] * REPLICAS) for name in jobs}


def step_records(out: Path) -> list[dict]:
    """Every step record of every worker process, oldest first."""
    records = []
    for path in out.glob("steps.*.jsonl"):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return sorted(records, key=lambda r: r["time"])


def stack_lines(paths: list[Path]) -> int:
    """Lines that start a traceback or a C++ stack in the logs at ``paths``."""
    return sum(len(STACK.findall(path.read_text(errors="replace"))) for path in paths if path.exists())


def job_spec(tmp: Path, out: Path, interval: float, sleep: float) -> JobSpec:
    """The benchmark's job: the worker above on :data:`REPLICAS` live nodes."""
    script = tmp / "host_loss_worker.py"
    script.write_text(WORKER)
    return JobSpec(name="job", command=(str(script),), checkpoint_dir=str(tmp / "ckpt"), min_replicas=REPLICAS,
                   max_replicas=REPLICAS, max_failures=0,
                   env={"WORKER_OUT": str(out), "BENCH_STEP_SLEEP": str(sleep), "OMP_NUM_THREADS": "1",
                        "ADAPTIVE_CHECKPOINT_INTERVAL": str(interval), "ADAPTIVE_COLLECTIVE_TIMEOUT": "30",
                        "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)})


def ready_to_kill(spec: JobSpec, out: Path, marks: dict[str, float]) -> bool:
    """A checkpoint exists (since ``marks["checkpoint"]``) and the job trained :data:`STEPS_BEFORE_KILL` steps at
    :data:`REPLICAS` replicas since."""
    if "checkpoint" not in marks:
        if not CheckpointStore(spec.checkpoint_dir).list():
            return False
        marks["checkpoint"] = time.time()
    since = [r for r in step_records(out) if r["world"] == REPLICAS and r["time"] > marks["checkpoint"]]
    return len(since) >= STEPS_BEFORE_KILL


def trial(tmp: Path, interval: float, sleep: float) -> dict:
    """One kill of the store host under the executor; seconds after the kill, steps redone, stack lines."""
    out = tmp / "out"
    out.mkdir(parents=True)
    spec = job_spec(tmp, out, interval, sleep)
    backend = LiveLocalBackend(str(tmp / "logs"))
    ex = Executor(backend, AlwaysThree(), ClusterSpec(1, REPLICAS), interval=600, grace_period=30)
    ex.submit(spec)
    marks: dict[str, float] = {}
    exits: dict[int, int] = {}
    survivors: list = []
    deadline = time.monotonic() + 300
    try:
        while "training" not in marks:
            if time.monotonic() > deadline or ex.done:
                raise RuntimeError(f"no relaunched step within 300 s, or the job ended: {ex.status()} {marks}")
            ex.step()
            job = ex.jobs["job"]
            if "kill" not in marks:
                if job.handle is not None and len(job.handle.launchers) == REPLICAS and ready_to_kill(spec, out, marks):
                    survivors = list(job.handle.launchers[1:])
                    marks["kill"] = time.time()
                    os.kill(job.handle.pid, signal.SIGKILL)  # ours: the first launcher, which hosts the store
                    logger.info("SIGKILLed the store host's launcher (pid %d)", job.handle.pid)
                time.sleep(0.02)
                continue
            now = time.time()
            for process in survivors:
                if process.pid not in exits and process.poll() is not None:
                    exits[process.pid] = process.returncode
                    marks[f"exit-{process.pid}"] = now
            if "survivors_exit" not in marks and len(exits) == len(survivors):
                marks["survivors_exit"] = now
            if "relaunch" not in marks and job.launches >= 2:
                marks["relaunch"] = now
            later = [r for r in step_records(out) if r["time"] > marks.get("relaunch", now + 1)]
            if later:
                marks["training"] = later[0]["time"]
            time.sleep(0.02)
        status = ex.status()[0]
    finally:
        ex.shutdown(timeout=30)
    records = step_records(out)
    before = max(r["steps"] for r in records if r["time"] < marks["kill"])
    resumed = next(r["steps"] for r in records if r["time"] >= marks["training"]) - 1  # the checkpoint's
    logs = sorted((tmp / "logs" / "job").glob("attempt-1.node-*.log"))[1:]  # the surviving launchers'
    result = {part: round(marks[part] - marks["kill"], 2) for part in PARTS}
    result.update({"steps_redone": before - resumed, "tracebacks": stack_lines(logs),
                   "survivor_exit_codes": sorted(exits.values()), "failures": status["failures"],
                   "infra_failures": status["infra_failures"], "launches": status["launches"]})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--checkpoint-interval", type=float, default=2.0, help="ADAPTIVE_CHECKPOINT_INTERVAL (s)")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds each step sleeps (the compute)")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_host_loss.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-host-loss-") as root:
        for i in range(args.trials):
            results.append(trial(Path(root) / f"trial-{i}", args.checkpoint_interval, args.step_sleep))
            logger.info("trial %d: %s", i, results[-1])
    print(f"{'trial':6} " + " ".join(f"{c:>15}" for c in COLUMNS) + "   (seconds after the kill; steps; lines)")
    for i, r in enumerate(results):
        print(f"{i:<6} " + " ".join(f"{r[c]:>15}" for c in COLUMNS))
    median = {c: statistics.median(r[c] for r in results) for c in COLUMNS}
    print(f"{'median':6} " + " ".join(f"{median[c]:>15}" for c in COLUMNS))
    print(f"surviving launchers' exit statuses: {[r['survivor_exit_codes'] for r in results]}; "
          f"failures / infra failures / launches: {[(r['failures'], r['infra_failures'], r['launches']) for r in results]}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": results, "median": median, "replicas": REPLICAS,
                                           "checkpoint_interval": args.checkpoint_interval,
                                           "step_sleep": args.step_sleep}, indent=2))


if __name__ == "__main__":
    main()
