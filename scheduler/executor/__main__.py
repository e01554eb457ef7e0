"""Command line: run jobs on this machine, submit them, see their status.

    python -m scheduler.executor run    --workdir DIR --slots 4 [--policy goodput] [--interval 60] [--live]
    python -m scheduler.executor run    --workdir DIR --backend ray --ray-address HOST:PORT
                                        [--ray-resource GPU] [--slots-per-node N] [--live]
    python -m scheduler.executor submit --workdir DIR job.yaml [...]
    python -m scheduler.executor status --workdir DIR [--json]

``run`` keeps going until interrupted (SIGINT/SIGTERM stop every job
gracefully first), or with ``--exit-when-done`` until all jobs ended. With
``--live`` running jobs are resized in place (``adaptive-run --live``, see
docs/live.md), on either backend.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from scheduler.cluster import ClusterSpec
from scheduler.executor.backend import Backend
from scheduler.executor.executor import Executor, JobState
from scheduler.executor.local import LocalBackend
from scheduler.executor.local_live import LiveLocalBackend
from scheduler.executor.spool import Spool
from scheduler.policies import POLICIES, make_policy
from scheduler.supervisor.state import SupervisorState

logger = logging.getLogger("scheduler.executor")


def _backend(args: argparse.Namespace, spool: Spool) -> tuple[Backend, ClusterSpec, Callable[[], dict[str, Any]]]:
    """The backend, the cluster it offers, and the extra status fields it reports."""
    if args.backend == "local":
        if args.slots is None:
            raise ValueError("--slots is required with --backend local")
        local = LiveLocalBackend if args.live else LocalBackend
        return (local(spool.log_dir, cuda=args.cuda), ClusterSpec(1, args.slots),
                lambda: {"slots": args.slots, "live": bool(args.live)})
    from scheduler.executor.ray_import import import_ray

    ray = import_ray()
    from scheduler.executor.ray_backend import RayBackend
    from scheduler.executor.ray_live import LiveRayBackend
    from scheduler.executor.ray_pool import RayPool

    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    pool = RayPool(args.ray_resource, slots_per_node=args.slots_per_node)
    backend = LiveRayBackend(spool.log_dir, pool) if args.live else RayBackend(spool.log_dir, pool)
    cluster = pool.cluster_spec()
    logger.info("Ray cluster: %d node(s) x %d %s slot(s)%s", cluster.num_nodes, cluster.gpus_per_node,
                args.ray_resource, "; jobs are resized live" if args.live else "")
    return backend, cluster, lambda: {"slots": cluster.total_gpus, "backend": "ray", "live": bool(args.live),
                                      "nodes": backend.describe()}


def _run(args: argparse.Namespace) -> int:
    spool = Spool(args.workdir)
    backend, cluster, extra = _backend(args, spool)
    executor = Executor(backend, make_policy(args.policy), cluster, state=SupervisorState(spool.state_path),
                        interval=args.interval, grace_period=args.grace_period)
    previous = {j["name"]: j["state"] for j in spool.read_status()[0]}
    for spec in spool.accepted_specs():
        if previous.get(spec.name) not in (JobState.SUCCEEDED.value, JobState.FAILED.value):
            executor.submit(spec)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    finished = [j for j in spool.read_status()[0] if j["name"] not in executor.jobs]
    while not stop.is_set():
        for spec in spool.take_new():
            executor.submit(spec)
        executor.step()
        spool.write_status(finished + executor.status(), policy=args.policy, **extra())
        if args.exit_when_done and executor.jobs and executor.done:
            break
        stop.wait(args.poll)
    executor.shutdown(timeout=args.grace_period)
    spool.write_status(finished + executor.status(), policy=args.policy, **extra())
    return 0 if all(j.state is not JobState.FAILED for j in executor.jobs.values()) else 1


def _submit(args: argparse.Namespace) -> int:
    spool = Spool(args.workdir)
    for path in args.specs:
        spec = spool.submit(path)
        print(f"submitted {spec.name} ({spec.min_replicas}..{spec.max_replicas} replicas)")
    return 0


def _status(args: argparse.Namespace) -> int:
    jobs, extra = Spool(args.workdir).read_status()
    if args.json:
        print(json.dumps({"jobs": jobs, **extra}, indent=2))
        return 0
    for node in extra.get("nodes", []):
        print(f"node {node['index']:<3} {_node_state(node):7} {node['slots']} slot(s)  "
              f"{node['address']}  {node['node_id'][:16]}")
    print(f"{'job':24} {'state':10} {'replicas':>8} {'target':>6} {'restarts':>8} {'failures':>8} {'infra':>5} "
          f"progress  placement (node per replica)")
    for job in jobs:
        progress = "-" if job.get("progress") is None else f"{job['progress']:.1f}"
        placement = ",".join(str(n) for n in job.get("placement", [])) or "-"
        print(f"{job['name']:24} {job['state']:10} {job['replicas']:>8} {job['target_replicas']:>6} "
              f"{job['restarts']:>8} {job['failures']:>8} {job.get('infra_failures', 0):>5} {progress:8}  "
              f"{placement}")
        if job["state"] == JobState.FAILED.value and job.get("last_error"):
            print(f"    last exit {job.get('last_exit')}; its output ended with:")
            print("\n".join(f"      {line}" for line in job["last_error"].splitlines()))
    return 0


def _node_state(node: dict[str, Any]) -> str:
    """alive, SUSPECT (an actor there failed; waiting for a probe) or LOST (Ray reports it dead)."""
    state = node.get("state") or ("alive" if node["alive"] else "lost")
    return state if state == "alive" else state.upper()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.executor", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the executor in the foreground")
    run.add_argument("--workdir", required=True, help="executor working folder")
    run.add_argument("--slots", type=int, help="devices (processes) to share (local backend)")
    run.add_argument("--backend", default="local", choices=("local", "ray"),
                     help="where jobs run: this machine, or a Ray cluster")
    run.add_argument("--ray-address", default="auto", help="Ray cluster to join (ray backend; default: auto)")
    run.add_argument("--ray-resource", default="GPU",
                     help="Ray resource a slot takes one unit of: GPU, CPU or a custom one (ray backend)")
    run.add_argument("--slots-per-node", type=int, default=None,
                     help="use at most this many slots per Ray node (ray backend)")
    run.add_argument("--policy", default="goodput", choices=sorted(POLICIES))
    run.add_argument("--interval", type=float, default=60.0, help="seconds between scheduling rounds")
    run.add_argument("--grace-period", type=float, default=120.0, help="seconds to stop before a kill")
    run.add_argument("--poll", type=float, default=0.5, help="seconds between executor steps")
    run.add_argument("--cuda", action="store_true", help="map slots to CUDA_VISIBLE_DEVICES")
    run.add_argument("--live", action="store_true",
                     help="resize running jobs in place, without restarting them (docs/live.md)")
    run.add_argument("--exit-when-done", action="store_true", help="exit once every job has ended")
    submit = sub.add_parser("submit", help="submit YAML job specs to a workdir")
    submit.add_argument("--workdir", required=True)
    submit.add_argument("specs", nargs="+", help="job spec files")
    status = sub.add_parser("status", help="show job states")
    status.add_argument("--workdir", required=True)
    status.add_argument("--json", action="store_true", help="print the raw status JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"run": _run, "submit": _submit, "status": _status}[args.command](args)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
