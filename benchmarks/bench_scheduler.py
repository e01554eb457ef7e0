"""Benchmark the cluster scheduler in the trace simulator.

For each workload (default: the five bundled ones) and policy (default:
``goodput`` and the ``tiresias`` baseline, simulated in the same run), the
table shows average JCT, p99 JCT and makespan next to the published Pollux
numbers (OSDI'21: Pollux p=-1, Tiresias+TunedJobs), the ratio to the
baseline measured here, restarts, simulation wall time and per-round
decision time. A separate stress test times one decision for 160 jobs on
64 GPUs. Results go to JSON; with matplotlib installed, a PNG shows the
GPUs each job holds over time in one workload.

    python benchmarks/bench_scheduler.py            # everything (several minutes)
    python benchmarks/bench_scheduler.py --quick    # workload 1 only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler.cluster import ClusterSpec  # noqa: E402
from scheduler.job_info import JobInfo  # noqa: E402
from scheduler.policies import make_policy  # noqa: E402
from scheduler.profiles import load_profiles  # noqa: E402
from scheduler.sim.job import ThroughputModels  # noqa: E402
from scheduler.simulate import run_simulation  # noqa: E402
from scheduler.sim.simulator import SimulationResult  # noqa: E402
from scheduler.speedup import SpeedupFunction  # noqa: E402

from adaptive.batchsize.goodput import GoodputFunction, GradParams  # noqa: E402

#: Average JCT (s) published in the Pollux paper, per workload and policy.
PUBLISHED = {
    "goodput": {1: 2089, 2: 3323, 3: 2188, 4: 2721, 5: 2674},   # Pollux (p = -1)
    "tiresias": {1: 2474, 2: 5145, 3: 3876, 4: 3280, 5: 3501},  # Tiresias + TunedJobs
    "optimus": {1: 4087, 2: 6914, 3: 3944, 4: 5968, 5: 5656},   # Optimus + Oracle + TunedJobs
}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_scheduler.json")


def simulate(workload: int, policy: str, timeline: bool) -> SimulationResult:
    return run_simulation(f"workload-{workload}", policy, record_timeline=timeline)


def row(workload: int, policy: str, result: SimulationResult, baseline: Optional[SimulationResult]) -> Dict[str, Any]:
    times = np.array(result.decision_times)
    published = PUBLISHED.get(policy, {}).get(workload)
    return {
        "workload": workload, "policy": policy, "jobs": result.jobs,
        "avg_jct": result.avg_jct, "p99_jct": result.p99_jct, "makespan": result.makespan,
        "published_avg_jct": published,
        "vs_published": result.avg_jct / published if published else None,
        "vs_baseline": result.avg_jct / baseline.avg_jct if baseline is not None else None,
        "restarts": int(sum(result.restarts.values())), "rounds": result.num_rounds,
        "sim_wall_s": result.wall_time,
        "decision_mean_ms": float(times.mean() * 1e3), "decision_max_ms": float(times.max() * 1e3),
    }


def decision_stress(num_jobs: int = 160, repeats: int = 3) -> Dict[str, float]:
    """Time one ``goodput`` decision for ``num_jobs`` jobs on 16 x 4 GPUs.

    Jobs cycle through the six models, each with a throughput model fitted
    to its measured profile on 1, 4 and 8 GPUs and its gradient statistics
    halfway through training; every repeat builds fresh speedup tables
    (nothing memoised), as when all jobs report new hints at once.
    """
    profiles = load_profiles()
    models = ThroughputModels()
    names = sorted(profiles)
    fits = {n: models.get(profiles[n], frozenset({(1, 1), (1, 4), (2, 8)})) for n in names}
    cluster = ClusterSpec(16, 4)
    samples = []
    for _ in range(repeats):
        jobs = {}
        for i in range(num_jobs):
            prof = profiles[names[i % len(names)]]
            sqr, var = prof.grad_stats(prof.init_batch_size * 4, prof.max_epochs // 2)
            fn = GoodputFunction(fits[prof.name], GradParams(sqr=sqr, var=var), prof.init_batch_size)
            speedup = SpeedupFunction(fn, prof.max_batch_size, (prof.min_local_bsz, prof.max_local_bsz), True)
            jobs[f"job-{i}"] = JobInfo(f"job-{i}", submission_time=-600.0 * (i % 7), max_replicas=16,
                                       attained_service=100.0 * i, speedup_fn=speedup)
        start = time.perf_counter()
        make_policy("goodput").optimize(jobs, cluster, {}, now=0.0)
        samples.append(time.perf_counter() - start)
    return {"jobs": num_jobs, "gpus": cluster.total_gpus, "decision_s_min": min(samples),
            "decision_s_max": max(samples)}


def plot_timeline(result: SimulationResult, path: str) -> Optional[str]:
    """Stacked GPUs per model over time; returns why not if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib, or the 'report' extra): no plot"
    times = np.array([t for t, _ in result.timeline]) / 3600.0
    models = sorted({name.rsplit("-", 1)[0] for _, alloc in result.timeline for name in alloc})
    stacks = np.array([[sum(n for job, n in alloc.items() if job.rsplit("-", 1)[0] == m)
                        for _, alloc in result.timeline] for m in models])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(times, stacks, labels=models, step="post")
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("GPUs allocated")
    ax.set_title(f"GPUs by model over time ({result.policy}, avg JCT {result.avg_jct:.0f} s)")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_xlim(0, times.max() if len(times) else 1)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def print_table(rows: List[Dict[str, Any]]) -> None:
    header = (f"{'wl':>2} {'policy':9} {'avg JCT':>8} {'published':>9} {'ratio':>6} {'vs tires.':>9} "
              f"{'p99 JCT':>8} {'makespan':>9} {'restarts':>8} {'wall s':>7} {'dec ms':>7} {'max ms':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        pub = f"{r['published_avg_jct']:>9}" if r["published_avg_jct"] else f"{'-':>9}"
        ratio = f"{r['vs_published']:6.3f}" if r["vs_published"] else f"{'-':>6}"
        base = f"{r['vs_baseline']:9.3f}" if r["vs_baseline"] else f"{'-':>9}"
        print(f"{r['workload']:>2} {r['policy']:9} {r['avg_jct']:8.0f} {pub} {ratio} {base} {r['p99_jct']:8.0f} "
              f"{r['makespan']:9.0f} {r['restarts']:8d} {r['sim_wall_s']:7.1f} {r['decision_mean_ms']:7.1f} "
              f"{r['decision_max_ms']:7.1f}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="workload 1 only")
    parser.add_argument("--workloads", default="1,2,3,4,5", help="comma-separated bundled workload numbers")
    parser.add_argument("--policies", default="goodput,tiresias", help="comma-separated policies")
    parser.add_argument("--plot-workload", type=int, default=1, help="workload drawn in the PNG")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    workloads = [1] if args.quick else [int(w) for w in args.workloads.split(",")]
    policies = args.policies.split(",")
    baseline_name = "tiresias" if "tiresias" in policies else None
    order = ([baseline_name] if baseline_name else []) + [p for p in policies if p != baseline_name]
    rows, results = [], {}
    for w in workloads:
        for policy in order:
            results[w, policy] = simulate(w, policy, timeline=(w == args.plot_workload and policy == order[-1]))
            baseline = results.get((w, baseline_name)) if policy != baseline_name else None
            rows.append(row(w, policy, results[w, policy], baseline))
            print(f"workload {w} {policy}: avg JCT {results[w, policy].avg_jct:.0f} s "
                  f"({results[w, policy].wall_time:.1f} s)", flush=True)
    summary: Dict[str, Any] = {}
    for policy in order:
        mine = [r for r in rows if r["policy"] == policy]
        ratios = [r["vs_published"] for r in mine if r["vs_published"]]
        summary[policy] = {"mean_avg_jct": float(np.mean([r["avg_jct"] for r in mine])),
                           "mean_ratio_vs_published": float(np.mean(ratios)) if ratios else None,
                           "max_sim_wall_s": float(max(r["sim_wall_s"] for r in mine))}
    stress = decision_stress()
    print()
    print_table(rows)
    print()
    for policy, s in summary.items():
        ratio = f"{s['mean_ratio_vs_published']:.3f}" if s["mean_ratio_vs_published"] else "-"
        print(f"{policy}: mean avg JCT {s['mean_avg_jct']:.0f} s, mean ratio to published {ratio}, "
              f"slowest simulation {s['max_sim_wall_s']:.1f} s")
    print(f"decision for {stress['jobs']} jobs on {stress['gpus']} GPUs (cold speedup tables): "
          f"{stress['decision_s_min'] * 1e3:.0f}-{stress['decision_s_max'] * 1e3:.0f} ms")
    plot_path = os.path.splitext(args.out)[0] + f"_allocations_w{args.plot_workload}.png"
    plotted = results.get((args.plot_workload, order[-1]))
    plot_note = plot_timeline(plotted, plot_path) if plotted is not None else "plot workload not simulated"
    print(plot_note or f"allocation plot: {plot_path}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"rows": rows, "summary": summary, "decision_stress": stress,
                   "plot": None if plot_note else plot_path, "plot_note": plot_note}, f, indent=2)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
