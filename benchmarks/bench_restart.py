"""Restart latency: SIGKILL one of two workers, time until the job's first resumed step.

Broken down into detection (kill -> torchrun notices), restart (survivors
stopped, rendezvous, new processes up to the interpreter), ``import torch``,
process-group init, checkpoint load (model, optimizer, loader) and the first
step.  Compares ``adaptive-run`` with plain ``torchrun`` on the same script.

    python benchmarks/bench_restart.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
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

WORKER = HERE / "workers" / "restart_worker.py"
PHASES = ["detection", "restart", "import torch", "init", "checkpoint load", "first step", "total"]
_DETECT = re.compile(r"^[EW](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*failed \(exitcode: -9\)", re.M)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _steps(out: Path, rank: int):
    try:
        pid, step = (out / f"steps.rank{rank}").read_text().split()
        return int(pid), int(step)
    except (FileNotFoundError, ValueError):
        return None


def _timelines(out: Path, rank: int) -> list[dict]:
    path = out / f"timeline.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _detected_at(log: str) -> float | None:
    match = _DETECT.search(log)
    if not match:
        return None
    month, day, hour, minute, second = match.groups()
    now = datetime.datetime.now()
    stamp = datetime.datetime(now.year, int(month), int(day), int(hour), int(minute))
    return stamp.timestamp() + float(second)


def trial(launcher: str, width: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = dict(os.environ, WORKER_OUT=tmp, ADAPTIVE_CHECKPOINT_PATH=str(out / "ckpt"),
                   ADAPTIVE_CHECKPOINT_INTERVAL="1", BENCH_WIDTH=str(width), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        module = "adaptive.elastic.launcher" if launcher == "adaptive-run" else "torch.distributed.run"
        cmd = [sys.executable, "-m", module, "--standalone", "--nproc-per-node=2", "--max-restarts=1", str(WORKER)]
        log_path = out / "log.txt"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait(lambda: (s := _steps(out, 1)) and s[1] >= 20 and (out / "ckpt").exists()
                  and any(p.name.startswith("checkpoint-") for p in (out / "ckpt").iterdir()), 180, "training")
            victim = _steps(out, 1)[0]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            resumed = _wait(lambda: [t for t in _timelines(out, 1) if t["resumed"]] and
                            [t for t in _timelines(out, 0) if t["resumed"]], 180, "the resumed first step")
            latest = {r: [t for t in _timelines(out, r) if t["resumed"]][-1] for r in (0, 1)}
        except RuntimeError as error:
            saved = HERE / "results" / f"bench_restart-{launcher}-failure.log"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_bytes(log_path.read_bytes())
            return {"failed": f"{error} (log: {saved})"}
        finally:
            kill_process_tree(proc.pid)
            proc.wait()
        detected = _detected_at(log_path.read_text(errors="replace")) or killed
        start = min(t["start"] for t in latest.values())
        last = {key: max(t[key] for t in latest.values()) for key in ("torch", "init", "load", "first_step")}
        del resumed
        return {
            "detection": detected - killed,
            "restart": start - detected,
            "import torch": last["torch"] - start,
            "init": last["init"] - last["torch"],
            "checkpoint load": last["load"] - last["init"],
            "first step": last["first_step"] - last["load"],
            "total": last["first_step"] - killed,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one trial each, a smaller model")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", default=str(HERE / "results" / "bench_restart.json"))
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    width = 512 if args.quick else 1024
    results: dict[str, list[dict]] = {"adaptive-run": [], "torchrun": []}
    for _ in range(trials):  # alternate, so machine noise hits both alike
        for launcher in results:
            results[launcher].append(trial(launcher, width))
    medians = {}
    for name, runs in results.items():
        good = [t for t in runs if "failed" not in t]
        medians[name] = {p: statistics.median(t[p] for t in good) if good else float("nan") for p in PHASES}
        medians[name]["failed"] = len(runs) - len(good)
    params = 2 * width * width + 10 * width
    print(f"restart latency after SIGKILL of 1 of 2 workers (median of {trials}; model {params / 1e6:.1f}M params"
          " + Adam state), seconds")
    print(f"{'phase':<16}" + "".join(f"{name:>14}" for name in medians))
    for phase in PHASES:
        print(f"{phase:<16}" + "".join(f"{medians[name][phase]:>14.2f}" for name in medians))
    print(f"{'failed to resume':<16}" + "".join(f"{medians[name]['failed']:>11d}/{trials:<2d}" for name in medians))
    ratio = medians["adaptive-run"]["total"] / medians["torchrun"]["total"]
    print(f"total ratio adaptive-run / torchrun: {ratio:.2f} (nan: a launcher never resumed)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": results, "median": medians, "ratio_total": ratio,
                                           "params": params}, indent=2))


if __name__ == "__main__":
    main()
