"""Live membership changes (``adaptive-run --live``): what a join, a leave and a lost worker cost.

One trial runs the model of ``bench_restart.py`` (a 2.1M-parameter MLP with
Adam; ``--quick``: 0.5M) on one live node, then:

1. **join**: a second node starts; measured are the survivor's pause (the
   longest step interval around the change, less the median step) and the
   joiner's first step counted from the moment its Python process had
   imported torch.  The joiner is started ahead of the change (it asks to
   join once it is up), so *the change to the first step at the new size*
   is the planned rescale's cost: the gap in the survivor's steps;
2. **leave**: SIGTERM to the second node; the survivor's pause;
3. **lost worker**: SIGKILL of the second node's worker; the survivor's
   pause (it discards the step in flight, re-forms alone and goes back to
   its last in-memory snapshot; the steps since the snapshot are trained
   again, which the pause does not count) and the time until the killed
   worker's restart trains with it again;
4. **steady state**: the median step time with two members against plain
   DDP with a plain DataLoader on ``torchrun`` (2 processes, gloo), measured
   in the same run.

    python benchmarks/bench_live.py [--quick] [--trials N] [--json PATH]

Prints a table; writes JSON (default ``benchmarks/results/bench_live.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from adaptive.runtime.process_tree import kill_process_tree  # noqa: E402

WORKER = HERE / "workers" / "live_bench_worker.py"
GOALS = {"survivor pause at a lost worker": 0.3, "joiner first step from import torch": 1.0,
         "planned rescale (change to first step at 2)": 1.0, "survivor pause at a leave": 0.3,
         "steady state live / plain DDP": 1.02}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _steps(out: Path) -> dict[int, list[dict]]:
    found = {}
    for path in out.glob("steps.*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        found[int(path.name.split(".")[1])] = lines
    return found


def _environment(out: Path, width: int, **extra: str) -> dict[str, str]:
    return dict(os.environ, WORKER_OUT=str(out), ADAPTIVE_CHECKPOINT_PATH=str(out / "ckpt"), BENCH_WIDTH=str(width),
                OMP_NUM_THREADS="1", ADAPTIVE_COLLECTIVE_TIMEOUT="30", ADAPTIVE_CHECKPOINT_INTERVAL="2",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **extra)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _pause(times: list[float], at: float) -> tuple[float, float]:
    """(longest step interval within 3 steps of ``at``, less the median interval; that longest interval)."""
    intervals = [(b, b - a) for a, b in zip(times, times[1:])]
    median = statistics.median(d for _, d in intervals)
    near = [d for end, d in intervals if at - 3 * median <= end <= at + 3 * median + 2.0]
    longest = max(near) if near else float("nan")
    return longest - median, longest


def live_trial(width: int) -> dict:
    import portpicker

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = _environment(out, width)
        port = portpicker.pick_unused_port()
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--live", "--nnodes", "1:2", "--nproc-per-node",
               "1", "--max-restarts", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER)]
        first = _start(cmd, env, out / "first.log")
        second = None
        try:
            _wait(lambda: sum(len(v) for v in _steps(out).values()) >= 30, 120, "the first node to train")
            (survivor,) = _steps(out)
            second = _start(cmd, env, out / "second.log")
            _wait(lambda: len([s for s in _steps(out).get(survivor, []) if s["world"] == 2]) >= 40, 120, "the join")
            steps = _steps(out)
            joiner = next(pid for pid in steps if pid != survivor)
            mine = steps[survivor]
            change = next(s["time"] for s in mine if s["world"] == 2)
            last_alone = max(s["time"] for s in mine if s["world"] == 1)
            join_pause, _ = _pause([s["time"] for s in mine], change)
            start = json.loads((out / f"start.{joiner}.json").read_text())
            joiner_first = steps[joiner][0]["time"] - start["torch"]
            two = [b["time"] - a["time"] for a, b in zip(mine, mine[1:]) if a["world"] == b["world"] == 2][5:]
            left_at = time.time()
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=60)
            _wait(lambda: len([s for s in _steps(out)[survivor] if s["time"] > left_at and s["world"] == 1]) >= 10,
                  60, "steps after the leave")
            mine = _steps(out)[survivor]
            after_leave = next(s["time"] for s in mine if s["time"] > left_at and s["world"] == 1)
            leave_pause, _ = _pause([s["time"] for s in mine], after_leave)
            # a lost worker: a third node joins, its worker is killed
            second = _start(cmd, env, out / "third.log")
            _wait(lambda: len([s for s in _steps(out)[survivor] if s["time"] > after_leave and s["world"] == 2])
                  >= 10, 120, "the second join")
            victim = next(pid for pid in _steps(out) if pid not in (survivor, joiner))
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            before = {survivor, joiner, victim}
            _wait(lambda: any(pid not in before and v for pid, v in _steps(out).items()), 120,
                  "the lost worker to be back")
            back = min(v[0]["time"] for pid, v in _steps(out).items() if pid not in before and v)
            mine = _steps(out)[survivor]
            loss_pause, _ = _pause([s["time"] for s in mine], next(s["time"] for s in mine if s["time"] > killed))
            return {"survivor pause at a join": join_pause,
                    "joiner first step from import torch": joiner_first,
                    "planned rescale (change to first step at 2)": change - last_alone,
                    "survivor pause at a leave": leave_pause,
                    "survivor pause at a lost worker": loss_pause,
                    "lost worker: kill to its restart's first step": back - killed,
                    "step time, 2 live members": statistics.median(two)}
        except RuntimeError as error:
            return {"failed": str(error), "log": (out / "first.log").read_text(errors="replace")[-3000:]}
        finally:
            for proc in (first, second):
                if proc is not None:
                    kill_process_tree(proc.pid)
                    proc.wait()


def plain_trial(width: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = _environment(out, width, BENCH_PLAIN="1", BENCH_STEPS="80")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
        proc = _start(cmd, env, out / "log.txt")
        try:
            proc.wait(timeout=300)
        finally:
            kill_process_tree(proc.pid)
        steps = _steps(out)
        times = [s["time"] for s in min(steps.values(), key=len)]
        return {"step time, plain DDP": statistics.median([b - a for a, b in zip(times, times[1:])][20:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one trial, a smaller model")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", default=str(HERE / "results" / "bench_live.json"))
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    width = 512 if args.quick else 1024
    runs = []
    for _ in range(trials):
        runs.append({**plain_trial(width), **live_trial(width)})
    good = [run for run in runs if "failed" not in run]
    keys = [key for key in (good[0] if good else {}) if key != "log"]
    median = {key: statistics.median(run[key] for run in good) for key in keys}
    if good:
        median["steady state live / plain DDP"] = median["step time, 2 live members"] / median["step time, plain DDP"]
    params = 2 * width * width + 10 * width + 2 * width + 10
    print(f"live membership changes, 2 processes, gloo, model {params / 1e6:.1f}M params + Adam; median of "
          f"{len(good)} of {trials} trials (seconds, or a ratio)")
    print(f"{'measure':<48}{'median':>10}{'goal':>8}")
    for key, value in median.items():
        goal = GOALS.get(key)
        print(f"{key:<48}{value:>10.3f}{'' if goal is None else f'{goal:>8.2f}'}")
    for run in runs:
        if "failed" in run:
            print(f"failed trial: {run['failed']}\n{run.get('log', '')}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": runs, "median": median, "goals": GOALS, "params": params},
                                          indent=2))


if __name__ == "__main__":
    main()
