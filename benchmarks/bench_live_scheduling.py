"""What live resizing is worth to the cluster: average JCT with restart costs and with live costs.

The trace simulator charges a job ``restart_penalty`` seconds without
progress at every reallocation, and the goodput policy weighs that cost
when it considers moving a job.  This benchmark runs the Pollux workloads
under ``goodput`` (ours) and ``pollux`` twice each: with the restart cost
Pollux assumes (30 s, the default: a checkpoint-restart on GPUs), and with
the cost of a live change (``--live-penalty``; default: the planned-rescale
time measured by ``benchmarks/bench_live.py`` in
``benchmarks/results/bench_live.json``, at least 1 s).

    python benchmarks/bench_live_scheduling.py [--quick] [--live-penalty S] [--json PATH]

Prints a table of average JCT, makespan and reallocations per job; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from scheduler.simulate import run_simulation  # noqa: E402

RESTART_PENALTY = 30.0
POLICIES = ("goodput", "pollux")


def measured_live_penalty() -> float | None:
    """The planned-rescale seconds ``bench_live.py`` measured, if it ran."""
    path = HERE / "results" / "bench_live.json"
    try:
        median = json.loads(path.read_text())["median"]
        return float(median["planned rescale (change to first step at 2)"])
    except (OSError, KeyError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="workload 1 only")
    parser.add_argument("--live-penalty", type=float, default=None,
                        help="seconds a live change costs (default: bench_live.py's measurement, at least 1 s)")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_live_scheduling.json"))
    args = parser.parse_args()
    measured = measured_live_penalty()
    live = args.live_penalty if args.live_penalty is not None else max(1.0, math.ceil(measured or 1.0))
    if not live >= 0:
        raise SystemExit(f"--live-penalty must be >= 0 seconds, got {args.live_penalty}")
    workloads = [1] if args.quick else [1, 2, 3, 4, 5]
    rows = []
    for workload in workloads:
        for policy in POLICIES:
            for kind, penalty in (("restart", RESTART_PENALTY), ("live", live)):
                result = run_simulation(f"workload-{workload}", policy, restart_penalty=penalty)
                rows.append({"workload": workload, "policy": policy, "cost": kind, "penalty_s": penalty,
                             "avg_jct": result.avg_jct, "makespan": result.makespan,
                             "reallocations_per_job": sum(result.restarts.values()) / max(result.jobs, 1)})
    print(f"average JCT (s) on the Pollux workloads, reallocation cost {RESTART_PENALTY:.0f} s (restart) vs "
          f"{live:.1f} s (live{'' if measured is None else f'; bench_live measured {measured:.2f} s'})")
    print(f"{'workload':>8} {'policy':>8} {'restart':>9} {'live':>9} {'live/restart':>13} {'realloc/job r->l':>17}")
    for workload in workloads:
        for policy in POLICIES:
            pair = {r["cost"]: r for r in rows if r["workload"] == workload and r["policy"] == policy}
            print(f"{workload:>8} {policy:>8} {pair['restart']['avg_jct']:>9.0f} {pair['live']['avg_jct']:>9.0f} "
                  f"{pair['live']['avg_jct'] / pair['restart']['avg_jct']:>13.3f} "
                  f"{pair['restart']['reallocations_per_job']:>8.2f}->{pair['live']['reallocations_per_job']:<6.2f}")
    for policy in POLICIES:
        for kind in ("restart", "live"):
            values = [r["avg_jct"] for r in rows if r["policy"] == policy and r["cost"] == kind]
            print(f"mean over workloads: {policy:>8} {kind:>8} {sum(values) / len(values):9.0f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"live_penalty_s": live, "restart_penalty_s": RESTART_PENALTY,
                                           "rows": rows}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
