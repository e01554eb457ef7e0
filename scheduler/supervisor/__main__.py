"""Command line: run the supervisor service.

    python -m scheduler.supervisor --state STATE.json [--host 127.0.0.1] [--port 8470]
        [--token-file FILE] [--policy goodput --nodes N --gpus-per-node G --interval 60]

The token comes from ``--token-file``, else ``$SCHEDULER_TOKEN``, else a new
random one written to ``STATE.json.token`` (mode 0600). With ``--policy``
the service also runs the policy every ``--interval`` seconds and publishes
the allocations that jobs read from ``GET /v1/jobs/<id>/allocation``.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading

from scheduler.allocator import Allocator
from scheduler.cluster import ClusterSpec
from scheduler.policies import POLICIES, make_policy
from scheduler.supervisor.server import SupervisorServer
from scheduler.supervisor.state import SupervisorState

logger = logging.getLogger("scheduler.supervisor")


def load_or_create_token(token_file: str | None, state_path: str) -> str:
    """The shared token: from ``token_file``, ``$SCHEDULER_TOKEN``, or a new one saved beside the state."""
    if token_file:
        with open(token_file, encoding="utf-8") as f:
            return f.read().strip()
    if os.environ.get("SCHEDULER_TOKEN"):
        return os.environ["SCHEDULER_TOKEN"].strip()
    path = state_path + ".token"
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    logger.info("wrote a new token to %s", path)
    return token


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.supervisor", description=__doc__.split("\n")[0])
    parser.add_argument("--state", required=True, help="JSON file that keeps the state across restarts")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback)")
    parser.add_argument("--port", type=int, default=8470, help="TCP port (0 = any free port)")
    parser.add_argument("--token-file", help="file holding the shared bearer token")
    parser.add_argument("--policy", choices=sorted(POLICIES), help="also allocate with this policy")
    parser.add_argument("--nodes", type=int, default=1, help="nodes to allocate (with --policy)")
    parser.add_argument("--gpus-per-node", type=int, default=4, help="GPUs per node (with --policy)")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between scheduling rounds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.interval <= 0:
        print("error: --interval must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        state = SupervisorState(args.state)
        server = SupervisorServer(state, load_or_create_token(args.token_file, args.state),
                                  host=args.host, port=args.port)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    allocator = None
    if args.policy:
        allocator = Allocator(make_policy(args.policy), ClusterSpec(args.nodes, args.gpus_per_node), state)
    with server:
        print(f"supervisor listening on {server.url}", flush=True)
        while not stop.is_set():
            if allocator is not None:
                try:
                    allocator.step()
                except ValueError:
                    logger.exception("scheduling round failed; keeping the previous allocations")
            stop.wait(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
