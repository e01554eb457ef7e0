"""Command line: replay a workload in the trace simulator.

    python -m scheduler.simulate WORKLOAD.csv --policy goodput \\
        [--traces DIR] [--interval 60] [--restart-penalty 30] [--json OUT] [--seed 0]

``WORKLOAD.csv`` may also name a bundled workload (``workload-1`` ...
``workload-5``). Prints a summary; with ``--json`` writes
``{"avg_jct", "p99_jct", "makespan", "jobs", "policy", "jct": {job: s}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
from typing import List, Optional

import numpy as np

from scheduler.cluster import ClusterSpec
from scheduler.policies import POLICIES, make_policy
from scheduler.profiles import DEFAULT_TRACES_DIR, DEFAULT_WORKLOADS_DIR, load_profiles
from scheduler.simulator import SimulationResult, Simulator
from scheduler.workload import load_workload

logger = logging.getLogger(__name__)


def resolve_workload(path: str) -> str:
    """``path`` itself if it exists, else the bundled workload of that name."""
    if os.path.exists(path):
        return path
    name = os.path.basename(path)
    bundled = os.path.join(DEFAULT_WORKLOADS_DIR, name if name.endswith(".csv") else name + ".csv")
    if os.path.exists(bundled):
        return bundled
    available = sorted(f[:-4] for f in os.listdir(DEFAULT_WORKLOADS_DIR) if f.endswith(".csv"))
    raise FileNotFoundError(f"workload not found: {path} (bundled: {available})")


def run_simulation(workload: str, policy: str, traces: str = DEFAULT_TRACES_DIR,
                   interval: float = 60.0, restart_penalty: float = 30.0,
                   cluster: Optional[ClusterSpec] = None, seed: int = 0,
                   record_timeline: bool = False) -> SimulationResult:
    """Load inputs, simulate, return the result (the CLI without printing).

    ``seed`` seeds Python's and NumPy's global generators before the run so
    that any randomised policy is reproducible; the simulator and the
    built-in policies are deterministic.
    """
    random.seed(seed)
    np.random.seed(seed)
    profiles = load_profiles(traces)
    jobs = load_workload(resolve_workload(workload), applications=profiles)
    options = {"restart_penalty": restart_penalty} if POLICIES[policy].adaptive else {}
    sim = Simulator(jobs, profiles, make_policy(policy, **options), cluster=cluster,
                    interval=interval, restart_penalty=restart_penalty,
                    record_timeline=record_timeline)
    return sim.run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.simulate", description=__doc__.split("\n")[0])
    parser.add_argument("workload", help="workload CSV (name,time,application,num_replicas,batch_size)")
    parser.add_argument("--policy", required=True, choices=sorted(POLICIES))
    parser.add_argument("--traces", default=DEFAULT_TRACES_DIR, help="folder of model traces")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds per scheduling round")
    parser.add_argument("--restart-penalty", type=float, default=30.0, help="seconds lost per reallocation")
    parser.add_argument("--nodes", type=int, default=16, help="nodes in the cluster")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node")
    parser.add_argument("--json", metavar="OUT", help="write the summary and per-job JCTs here")
    parser.add_argument("--timeline", action="store_true", help="include replicas per job per round in --json")
    parser.add_argument("--seed", type=int, default=0, help="random seed (runs are deterministic per seed)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        result = run_simulation(args.workload, args.policy, traces=args.traces, interval=args.interval,
                                restart_penalty=args.restart_penalty,
                                cluster=ClusterSpec(args.nodes, args.gpus_per_node), seed=args.seed,
                                record_timeline=args.timeline)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = result.to_dict(include_timeline=args.timeline)
    print(f"policy {result.policy}: {result.jobs} jobs, avg JCT {result.avg_jct:.0f} s, "
          f"p99 JCT {result.p99_jct:.0f} s, makespan {result.makespan:.0f} s, "
          f"{summary['total_restarts']} restarts, {result.num_rounds} rounds "
          f"(decision {summary['decision_time_mean'] * 1e3:.1f} ms mean, "
          f"{summary['decision_time_max'] * 1e3:.1f} ms max), wall {result.wall_time:.1f} s")
    if args.json:
        parent = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(parent, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
