"""Command line: replay a workload in the trace simulator.

    python -m scheduler.simulate WORKLOAD.csv --policy goodput \\
        [--traces DIR] [--interval 60] [--restart-penalty 30] [--json OUT] [--seed 0]

``WORKLOAD.csv`` may also name a bundled workload (``workload-1`` ...
``workload-5``). Prints a summary; with ``--json`` writes
``{"avg_jct", "p99_jct", "makespan", "jobs", "policy", "jct": {job: s}, ...}``.
"""

from __future__ import annotations

import argparse
import logging
import sys

from adaptive.goodput import write_json_atomic
from scheduler.cluster import ClusterSpec
from scheduler.policies import POLICIES
from scheduler.profiles import DEFAULT_TRACES_DIR
from scheduler.sim.simulator import resolve_workload, run_simulation

__all__ = ["main", "resolve_workload", "run_simulation"]

logger = logging.getLogger(__name__)


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


def main(argv: list[str] | None = None) -> int:
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
        write_json_atomic(args.json, summary, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
