"""Stop latency of ordinary scripts: SIGTERM to ``adaptive-run`` -> checkpoint written -> exit 143.

Runs each script of the test corpus (``tests/corpus/``: AdaptDL's MNIST
tutorial, pytorch-cifar, linear regression and DCGAN ports, and
``lr_schedules.py`` with a few scheduler/optimizer pairs) under
``adaptive-run --standalone --nproc-per-node=2`` and sends SIGTERM to the
launcher, as a scheduler does, while rank 0 is

* ``train``: a few steps into the training loop (epoch 1 or later);
* ``valid``: in the validation loop (its steps slowed to 0.1 s so that the
  signal lands inside it);
* ``epoch-end``: in 2 s of plain code at an epoch end (a slow log or save);
  the stop waits for that code to finish, so subtract the 2 s for the
  library's own part;
* ``between-loops`` (pytorch-cifar only): in 2 s of plain code between
  the training and the validation loop.

Measured per trial: seconds from the signal to the stop checkpoint's
creation time (its manifest), and to the launcher's exit.  Every stop
must exit with 143 and write a "stop" checkpoint (the checks of
tests/corpus_harness.py); a failed one is counted and its reason kept.

    python benchmarks/bench_stop_latency.py [--quick] [--trials N] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from corpus_harness import PORTS, CorpusRun, Script, scheduler_script, stop_at  # noqa: E402
from elastic_harness import Jobs  # noqa: E402

logger = logging.getLogger("bench_stop_latency")

SCHEDULER_PATTERNS = [("steplr", "sgd", {}), ("onecyclelr", "adamw", {"amp": True, "clip": True}),
                      ("reducelronplateau", "adam", {"clip": True}), ("cycliclr", "sgd", {})]


def patterns(quick: bool) -> list[Script]:
    """The scripts measured: every AdaptDL port, and lr_schedules.py with a few scheduler/optimizer pairs."""
    chosen = list(PORTS.values()) + [scheduler_script(s, o, **opts) for s, o, opts in SCHEDULER_PATTERNS]
    return chosen[:2] + chosen[4:5] if quick else chosen


def places(script: Script) -> list[str]:
    """Where each script is signalled."""
    found = ["train"] + ["valid"] * ("valid" in script.loops) + ["epoch-end"]
    return found + ["between-loops"] if script.id == "cifar" else found


def trial(script: Script, where: str) -> dict:
    """One launch on 2 replicas, stopped at ``where``; its latencies, or why the stop failed."""
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as tmp:
        jobs = Jobs(Path(tmp))
        run = CorpusRun(jobs, script, Path(tmp) / "job")
        try:
            _, latency = stop_at(run, 2, where, min_epoch=1, sequence="bench")
            return latency
        except AssertionError as error:
            saved = HERE / "results" / f"bench_stop_latency-{script.id}-{where}-failure.log"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(run.log_text())
            return {"failed": str(error).splitlines()[0][:300], "log": str(saved)}
        finally:
            jobs.cleanup()


def summarise(runs: list[dict]) -> dict:
    good = [r for r in runs if "failed" not in r]
    out = {"trials": len(runs), "failed": len(runs) - len(good),
           "landed_elsewhere": sum(1 for r in good if r["landed"] != r["where"])}
    for key in ("to_checkpoint_s", "to_exit_s"):
        values = [r[key] for r in good]
        out[key] = {"median": statistics.median(values) if values else float("nan"),
                    "max": max(values) if values else float("nan")}
    return out


def print_table(summary: dict[str, dict[str, dict]], trials: int) -> None:
    print(f"SIGTERM -> stop checkpoint -> exit 143, 2 replicas (gloo, CPU), median / max of {trials} trial(s), s")
    print(f"{'script':<40}{'where':<15}{'checkpoint':>16}{'exit':>16}{'failed':>8}{'missed':>8}")
    for script_id, by_place in summary.items():
        for where, s in by_place.items():
            ck, ex = s["to_checkpoint_s"], s["to_exit_s"]
            print(f"{script_id:<40}{where:<15}{ck['median']:>8.2f} /{ck['max']:>6.2f}{ex['median']:>8.2f} /"
                  f"{ex['max']:>6.2f}{s['failed']:>6d}/{s['trials']}{s['landed_elsewhere']:>8d}")
    print("epoch-end and between-loops include the script's own 2 s of plain code; 'missed': the signal "
          "landed elsewhere than intended (still measured)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three scripts, one trial")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--json", default=str(HERE / "results" / "bench_stop_latency.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    trials = 1 if args.quick else args.trials
    results: dict[str, dict[str, list[dict]]] = {}
    for _ in range(trials):  # interleave, so machine noise hits every pattern alike
        for script in patterns(args.quick):
            for where in places(script):
                outcome = trial(script, where)
                logger.info("%s at %s: %s", script.id, where, outcome)
                results.setdefault(script.id, {}).setdefault(where, []).append(outcome)
    summary = {sid: {where: summarise(runs) for where, runs in by_place.items()} for sid, by_place in results.items()}
    print_table(summary, trials)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"trials": results, "summary": summary, "replicas": 2}, indent=2))


if __name__ == "__main__":
    main()
