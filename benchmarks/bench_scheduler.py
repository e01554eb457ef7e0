"""Benchmark the cluster scheduler in the trace simulator.

For each workload (default: the five bundled ones, then the generated set
of :data:`scheduler.sim.generate.GENERATED_SET`: resampled jobs, arrival
rates 0.5-2x, 8-32 nodes) and policy (default: ``goodput``, the ``pollux``
reproduction it improves on and the ``tiresias`` baseline, simulated in the
same run), the table shows average JCT, p99 JCT and makespan next to the
published Pollux numbers (OSDI'21: Pollux p=-1, Tiresias+TunedJobs), the
ratios to ``pollux`` and ``tiresias`` measured here, restarts per job,
simulation wall time and per-round decision time. A separate stress test
times one decision for 160 jobs on 64 GPUs. Results go to JSON; with
matplotlib installed, a PNG shows the GPUs each job holds over time in one
workload.

    python benchmarks/bench_scheduler.py              # everything (about 15 minutes)
    python benchmarks/bench_scheduler.py --quick      # workload 1 only
    python benchmarks/bench_scheduler.py --no-generated
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Union

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler.cluster import ClusterSpec  # noqa: E402
from scheduler.job_info import JobInfo  # noqa: E402
from scheduler.policies import make_policy  # noqa: E402
from scheduler.policies import POLICIES  # noqa: E402
from scheduler.profiles import load_profiles  # noqa: E402
from scheduler.sim.generate import GENERATED_SET, GeneratedCase  # noqa: E402
from scheduler.sim.job import ThroughputModels  # noqa: E402
from scheduler.simulate import run_simulation  # noqa: E402
from scheduler.sim.simulator import SimulationResult, Simulator  # noqa: E402
from scheduler.speedup import SpeedupFunction  # noqa: E402

from adaptive.goodput import GoodputFunction, GradParams  # noqa: E402

#: Average JCT (s) published in the Pollux paper, per workload and policy.
PUBLISHED = {
    "goodput": {1: 2089, 2: 3323, 3: 2188, 4: 2721, 5: 2674},   # Pollux (p = -1): what ours must beat
    "pollux": {1: 2089, 2: 3323, 3: 2188, 4: 2721, 5: 2674},    # Pollux (p = -1)
    "tiresias": {1: 2474, 2: 5145, 3: 3876, 4: 3280, 5: 3501},  # Tiresias + TunedJobs
    "optimus": {1: 4087, 2: 6914, 3: 3944, 4: 5968, 5: 5656},   # Optimus + Oracle + TunedJobs
}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_scheduler.json")


Workload = Union[int, GeneratedCase]


def label(workload: Workload) -> str:
    return workload.name if isinstance(workload, GeneratedCase) else str(workload)


def simulate(workload: Workload, policy: str, timeline: bool) -> SimulationResult:
    """One run: a bundled workload on 16 x 4 GPUs, or a generated case on its cluster."""
    if not isinstance(workload, GeneratedCase):
        return run_simulation(f"workload-{workload}", policy, record_timeline=timeline)
    profiles = load_profiles()
    jobs = workload.jobs()
    options = {"restart_penalty": 30.0} if POLICIES[policy].adaptive else {}
    return Simulator(jobs, profiles, make_policy(policy, **options), cluster=ClusterSpec(workload.nodes, 4),
                     record_timeline=timeline).run()


def row(workload: Workload, policy: str, result: SimulationResult,
        baselines: Dict[str, Optional[SimulationResult]]) -> Dict[str, Any]:
    times = np.array(result.decision_times)
    published = PUBLISHED.get(policy, {}).get(workload) if isinstance(workload, int) else None
    out = {
        "workload": label(workload), "policy": policy, "jobs": result.jobs,
        "avg_jct": result.avg_jct, "p99_jct": result.p99_jct, "makespan": result.makespan,
        "published_avg_jct": published,
        "vs_published": result.avg_jct / published if published else None,
    }
    for name, base in baselines.items():
        out[f"vs_{name}"] = result.avg_jct / base.avg_jct if base is not None else None
    restarts = int(sum(result.restarts.values()))
    return {
        **out,
        "restarts": restarts, "restarts_per_job": restarts / max(result.jobs, 1), "rounds": result.num_rounds,
        "sim_wall_s": result.wall_time,
        "decision_mean_ms": float(times.mean() * 1e3), "decision_max_ms": float(times.max() * 1e3),
    }


def decision_stress(policy: str = "goodput", num_jobs: int = 160, repeats: int = 3) -> Dict[str, Any]:
    """Time one ``policy`` decision for ``num_jobs`` jobs on 16 x 4 GPUs.

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
        make_policy(policy).optimize(jobs, cluster, {}, now=0.0)
        samples.append(time.perf_counter() - start)
    return {"policy": policy, "jobs": num_jobs, "gpus": cluster.total_gpus, "decision_s_min": min(samples),
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


#: Policies a row is compared with (``vs_<name>``: avg JCT ratio), when simulated.
REFERENCES = ("pollux", "tiresias")


def print_table(rows: List[Dict[str, Any]]) -> None:
    header = (f"{'workload':18} {'policy':9} {'avg JCT':>8} {'published':>9} {'ratio':>6} {'vs pollux':>9} "
              f"{'vs tires.':>9} {'p99 JCT':>8} {'makespan':>9} {'rst/job':>7} {'wall s':>7} {'dec ms':>7} "
              f"{'max ms':>7}")
    print(header)
    print("-" * len(header))

    def cell(value: Optional[float], width: int) -> str:
        return f"{value:{width}.3f}" if value else f"{'-':>{width}}"

    for r in rows:
        pub = f"{r['published_avg_jct']:>9}" if r["published_avg_jct"] else f"{'-':>9}"
        print(f"{r['workload']:18} {r['policy']:9} {r['avg_jct']:8.0f} {pub} {cell(r['vs_published'], 6)} "
              f"{cell(r.get('vs_pollux'), 9)} {cell(r.get('vs_tiresias'), 9)} {r['p99_jct']:8.0f} "
              f"{r['makespan']:9.0f} {r['restarts_per_job']:7.2f} {r['sim_wall_s']:7.1f} "
              f"{r['decision_mean_ms']:7.1f} {r['decision_max_ms']:7.1f}")


def summarise(rows: List[Dict[str, Any]], policies: List[str]) -> Dict[str, Any]:
    """Per policy and set (bundled, generated): means of the metrics and of the ratios."""
    summary: Dict[str, Any] = {}
    for policy in policies:
        for kind in ("bundled", "generated"):
            generated = kind == "generated"
            mine = [r for r in rows if r["policy"] == policy and r["workload"].startswith("gen-") == generated]
            if not mine:
                continue
            entry: Dict[str, Any] = {"workloads": len(mine)}
            for key in ("avg_jct", "p99_jct", "makespan", "restarts_per_job", "decision_max_ms",
                        "vs_published", *(f"vs_{name}" for name in REFERENCES)):
                values = [r[key] for r in mine if r.get(key)]
                entry[f"mean_{key}"] = float(np.mean(values)) if values else None
                if key.startswith("vs_"):
                    entry[f"max_{key}"] = float(max(values)) if values else None
            entry["max_sim_wall_s"] = float(max(r["sim_wall_s"] for r in mine))
            summary[f"{policy}/{kind}"] = entry
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="workload 1 only")
    parser.add_argument("--workloads", default="1,2,3,4,5",
                        help="comma-separated bundled workload numbers ('' for none)")
    parser.add_argument("--no-generated", action="store_true", help="skip the generated workloads")
    parser.add_argument("--policies", default="goodput,pollux,tiresias", help="comma-separated policies")
    parser.add_argument("--plot-workload", type=int, default=1, help="workload drawn in the PNG")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    workloads: List[Workload] = [1] if args.quick else [int(w) for w in args.workloads.split(",") if w.strip()]
    if not (args.quick or args.no_generated):
        workloads += list(GENERATED_SET)
    policies = args.policies.split(",")
    references = [name for name in REFERENCES if name in policies]
    order = references + [p for p in policies if p not in references]
    rows, results = [], {}
    for w in workloads:
        for policy in order:
            timeline = w == args.plot_workload and policy == order[-1]
            results[label(w), policy] = simulate(w, policy, timeline=timeline)
            baselines = {name: results.get((label(w), name)) for name in references if name != policy}
            rows.append(row(w, policy, results[label(w), policy], baselines))
            print(f"workload {label(w)} {policy}: avg JCT {results[label(w), policy].avg_jct:.0f} s "
                  f"({results[label(w), policy].wall_time:.1f} s)", flush=True)
    summary = summarise(rows, order)
    stress = [decision_stress(p) for p in order if POLICIES[p].adaptive]
    print()
    print_table(rows)
    print()
    for key, s in summary.items():
        ratios = ", ".join(f"{name} {s[f'mean_vs_{name}']:.3f} (worst {s[f'max_vs_{name}']:.3f})"
                           for name in ("published", *REFERENCES) if s.get(f"mean_vs_{name}"))
        print(f"{key}: mean avg JCT {s['mean_avg_jct']:.0f} s, p99 {s['mean_p99_jct']:.0f} s, "
              f"makespan {s['mean_makespan']:.0f} s, {s['mean_restarts_per_job']:.2f} restarts/job"
              + (f"; avg JCT vs {ratios}" if ratios else ""))
    for st in stress:
        print(f"{st['policy']}: decision for {st['jobs']} jobs on {st['gpus']} GPUs (cold speedup tables): "
              f"{st['decision_s_min'] * 1e3:.0f}-{st['decision_s_max'] * 1e3:.0f} ms")
    plot_path = os.path.splitext(args.out)[0] + f"_allocations_w{args.plot_workload}.png"
    plotted = results.get((str(args.plot_workload), order[-1]))
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
