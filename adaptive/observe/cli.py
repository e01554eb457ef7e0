"""The ``adaptive`` command (also ``python -m adaptive``).

Subcommands:

``adaptive report RUN_DIR [--output PATH] [--no-png] [--json]``
    Summarise a job's metrics file and draw it as a PNG (default
    ``RUN_DIR/report.png``); see :mod:`adaptive.observe.report`.  ``RUN_DIR`` is the
    job's ``ADAPTIVE_SHARE_PATH``, the folder above it, or the metrics file.

``adaptive drain --endpoint HOST:PORT --job-id JOB --node N``
    Ask the members of node ``N`` of a live job (``adaptive-run --live``) to
    leave at the job's next agreed step, with nothing lost, before a planned
    stop of that machine; the others go on, and the node's launcher ends
    with 143.  See :mod:`adaptive.runtime.draining`.

Exit status: 0 on success, 1 when the metrics cannot be read or drawn
(``drain``: when the job's store cannot be reached), 2 for bad arguments, 3
when the summary was printed but matplotlib (the ``report`` extra) is
missing for the PNG.

The launcher has its own command, ``adaptive-run`` (:mod:`adaptive.elastic.launcher`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from adaptive.observe import report

__all__ = ["main", "EXIT_MISSING_DEPENDENCY"]

logger = logging.getLogger(__name__)

#: Exit status when the summary was printed but the PNG needs matplotlib.
EXIT_MISSING_DEPENDENCY = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive", description="Tools for adaptive-elastic training jobs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser("report", help="summarise a job's metrics and draw them as a PNG",
                              description="Summarise a job's metrics.jsonl and draw batch sizes, noise scale, "
                                          "gain, LR factor and throughput against step and wall time.")
    run.add_argument("run_dir", metavar="RUN_DIR",
                     help="the job's ADAPTIVE_SHARE_PATH (default ./.adaptive/<job id>/share), the folder "
                          "above it, or a metrics.jsonl file")
    run.add_argument("--output", "-o", metavar="PATH",
                     help="where to write the PNG (default: RUN_DIR/report.png, or next to RUN_DIR if it is "
                          "a file)")
    run.add_argument("--no-png", action="store_true", help="print the summary only")
    run.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    drain = commands.add_parser("drain", help="let a node's members leave a live job before a planned stop",
                                description="Ask the members of one node of a live job (adaptive-run --live) to "
                                            "leave at its next agreed step; the other members go on.")
    drain.add_argument("--endpoint", required=True, metavar="HOST:PORT",
                       help="the job's store: the --rdzv-endpoint its launchers were given")
    drain.add_argument("--job-id", required=True, metavar="JOB",
                       help="the live job's id (ADAPTIVE_JOB_ID, else its script's name)")
    drain.add_argument("--node", required=True, type=int, metavar="N",
                       help="the node number, as its launcher's log says it ('node N')")
    drain.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                       help="how long to try to reach the store (default 10)")
    return parser


def _default_output(run_dir: str) -> str:
    folder = run_dir if os.path.isdir(run_dir) else os.path.dirname(os.path.abspath(run_dir))
    return os.path.join(folder, "report.png")


def _report(args: argparse.Namespace) -> int:
    try:
        run = report.load_run(args.run_dir)
    except (FileNotFoundError, IsADirectoryError, PermissionError) as error:
        print(f"adaptive report: {error}", file=sys.stderr)
        return 1
    summary = report.summarize(run)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else report.format_summary(summary))
    if args.no_png:
        return 0
    output = args.output or _default_output(args.run_dir)
    try:
        report.render_png(run, output, summary)
    except report.MissingDependencyError as error:
        print(f"adaptive report: no PNG: {error}", file=sys.stderr)
        return EXIT_MISSING_DEPENDENCY
    except (ValueError, OSError) as error:
        print(f"adaptive report: no PNG: {error}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"report: {output}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    import datetime

    import torch.distributed as dist

    from adaptive.runtime import draining, env, membership

    try:
        host, port = env.parse_endpoint("--endpoint", args.endpoint)
        env.live_secret()  # a job with a secret signs its drain requests: a bad secret is an argument error
    except ValueError as error:
        print(f"adaptive drain: {error}", file=sys.stderr)
        return 2
    if args.node < 1:
        print(f"adaptive drain: --node must be a node number >= 1, got {args.node}", file=sys.stderr)
        return 2
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=args.timeout))
        draining.request_drain(membership.job_store(store, args.job_id), args.node)
    except (RuntimeError, OSError) as error:
        print(f"adaptive drain: cannot reach the job's store at {args.endpoint}: {error}", file=sys.stderr)
        return 1
    print(f"asked node {args.node} of job {args.job_id!r} to drain")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``adaptive`` console command; returns the exit status."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.command == "report":
        return _report(args)
    if args.command == "drain":
        return _drain(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse only accepts known commands


if __name__ == "__main__":
    sys.exit(main())
