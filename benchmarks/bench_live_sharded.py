"""A lost member of a sharded live job (HSDP): recovered in memory, against the restart path, in one run.

The model of ``bench_restart.py`` (a 2.1M-parameter MLP with Adam;
``--quick``: 0.5M) sharded by ``AdaptiveFSDP`` on an HSDP mesh ``(2, 2)``:
two nodes of two workers under ``adaptive-run --live``, gloo.  Once the four
train, one worker of the second node is SIGKILLed, and measured are:

* **in memory** (the default): the survivors' pause (from their last step
  before the kill to their first one after it, less the median step; the
  step in flight, trained again, is not counted), the kill
  to the first step of the members that are left (they re-form, join a whole
  copy from their shards and shard it anew on ``(1, 3)``; a restarted worker
  that asks to join by their first boundary is admitted there, before it)
  and the kill to the first step with the killed worker's restart (four
  again: it joins and takes the state from its peers);
* **restart path**, the baseline, the same job with
  ``ADAPTIVE_LIVE_RECOVERY=restart`` (no votes before the optimizer steps,
  and the loss ends every member and the agents start them again from the
  checkpoint on disk, resharded): the kill to the job's first step again, at
  four.

Trials alternate the two modes.  The step in flight trained again in memory,
and the steps since the last checkpoint (2 s) trained again after a restart,
are not counted in either.

    python benchmarks/bench_live_sharded.py [--quick] [--trials N] [--json PATH]

Prints a table; writes JSON (default ``benchmarks/results/bench_live_sharded.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_live import WORKER, _environment, _start, _steps, _wait  # noqa: E402

from adaptive.runtime.process_tree import kill_process_tree  # noqa: E402

MODES = ("in memory", "restart path")


def trial(width: int, mode: str) -> dict:
    """One job of two nodes of two workers, one SIGKILL; the figures of ``mode`` (module docstring)."""
    import portpicker

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = _environment(out, width, BENCH_SHARD_SIZE="2", ADAPTIVE_LIVE_MIN="4",
                           ADAPTIVE_LIVE_RECOVERY="memory" if mode == "in memory" else "restart")
        port = portpicker.pick_unused_port()
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", "--live", "--nnodes", "1:4", "--nproc-per-node",
               "2", "--max-restarts", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER)]
        nodes = [_start(cmd, env, out / "first.log"), _start(cmd, env, out / "second.log")]
        try:
            _wait(lambda: sum(s["world"] == 4 for v in _steps(out).values() for s in v) >= 120, 180,
                  "four workers to train")
            started = {pid: v for pid, v in _steps(out).items() if v}
            first = min(started, key=lambda pid: started[pid][0]["time"])
            victim = next(pid for pid in sorted(started, reverse=True) if pid != first)  # any other: HSDP holds
            # every shard in each replica group, so any single member can be lost
            generation = max(s["generation"] for v in started.values() for s in v)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)

            def first_step(world: int | None) -> float | None:
                """The first step after the kill of a later generation (the step in flight was discarded)."""
                times = [s["time"] for pid, v in _steps(out).items() if pid != victim for s in v
                         if s["time"] > killed and s["generation"] > generation
                         and (world is None or s["world"] == world)]
                return min(times) if times else None

            figures = {}
            if mode == "in memory":
                # the three left train again, or first admit the killed worker's restart if it asks in time
                again = _wait(lambda: first_step(None), 120, "the members left to train again")
                figures["kill to the first step of those left"] = again - killed
                last = max(s["time"] for pid, v in _steps(out).items() if pid != victim for s in v
                           if s["time"] <= killed)
                figures["survivors' pause"] = again - last - _median_step(out, first, killed)
            else:
                figures["kill to the first step again"] = _wait(lambda: first_step(None), 180,
                                                                "the job to train again") - killed
            figures["kill to four training again"] = _wait(lambda: first_step(4), 180,
                                                           "four workers to train again") - killed
            figures["step time, 4 members"] = _median_step(out, first, killed)
            return figures
        except (RuntimeError, StopIteration) as error:
            return {"failed": str(error) or type(error).__name__,
                    "log": (out / "first.log").read_text(errors="replace")[-3000:]}
        finally:
            for node in nodes:
                kill_process_tree(node.pid)
                node.wait()


def _median_step(out: Path, pid: int, before: float) -> float:
    """The median step time of ``pid`` with four members, before ``before``."""
    mine = [s for s in _steps(out).get(pid, []) if s["time"] < before and s["world"] == 4]
    return statistics.median(b["time"] - a["time"] for a, b in zip(mine, mine[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 0.5M-parameter model")
    parser.add_argument("--trials", type=int, default=2, help="trials of each mode (default 2)")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_live_sharded.json"))
    args = parser.parse_args()
    width = 512 if args.quick else 1024
    trials: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.trials):
        for mode in MODES:
            trials[mode].append(trial(width, mode))
            print(f"{mode}: {json.dumps({k: v for k, v in trials[mode][-1].items() if k != 'log'})}", flush=True)
    summary = {mode: {key: statistics.median(t[key] for t in runs if key in t)
                      for key in sorted({k for t in runs for k in t if k not in ("failed", "log")})}
               for mode, runs in trials.items()}
    failed = {mode: sum("failed" in t for t in runs) for mode, runs in trials.items()}
    rows = [("survivors' pause", summary["in memory"].get("survivors' pause"), None),
            ("kill to the first step of those left", summary["in memory"].get("kill to the first step of those left"),
             summary["restart path"].get("kill to the first step again")),
            ("kill to four training again", summary["in memory"].get("kill to four training again"),
             summary["restart path"].get("kill to four training again")),
            ("step time, 4 members", summary["in memory"].get("step time, 4 members"),
             summary["restart path"].get("step time, 4 members"))]
    print(f"\nHSDP (2, 2), width {width}, a worker SIGKILLed; median of {args.trials} trials per mode "
          f"(failed: {failed})")
    print(f"{'measure':40s} {'in memory':>10s} {'restart':>10s} {'ratio':>7s}")
    for name, live, restart in rows:
        cell = lambda v: f"{v:10.3f}" if v is not None else f"{'-':>10s}"  # noqa: E731
        ratio = f"{live / restart:7.2f}" if live is not None and restart else f"{'':7s}"
        print(f"{name:40s} {cell(live)} {cell(restart)} {ratio}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"width": width, "summary": summary, "failed": failed,
                                           "trials": trials}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
