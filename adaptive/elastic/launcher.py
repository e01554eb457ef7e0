"""``adaptive-run``: torchrun with the settings that make elastic restarts reliable.

It takes exactly torchrun's arguments and runs torchrun's own agent in this
process; only defaults change:

* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agent's environment.  In
  torch 2.13 the rendezvous' TCP store is shared with the workers by default,
  and after a restart workers can pick up stale gloo addresses, hang, or
  deadlock on scale-up; a store per round avoids that.
* c10d rendezvous settings that notice membership changes quickly:
  ``last_call_timeout=5`` (torchrun: 30 s wait for more nodes once the minimum
  is there), ``keep_alive_interval=2`` and ``keep_alive_max_attempt=3`` (a
  vanished node is dropped after ~6 s instead of 15 s).  Values given with
  ``--rdzv-conf`` win.

The plain torchrun equivalent of ``adaptive-run ARGS`` is::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun \\
        --rdzv-conf last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3 ARGS

When ``adaptive-run`` itself is stopped (SIGTERM, SIGINT), torchrun forwards
the signal and the workers checkpoint and exit.  Each worker confirms how its
stop went in a folder the launcher gives it (``ADAPTIVE_STOP_STATUS_DIR``);
``adaptive-run`` exits with 143 only when every local worker confirmed a
durable checkpoint, and otherwise says which did not, and why, and exits
with 1.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

from adaptive._utils.files import read_json

__all__ = ["main", "RDZV_DEFAULTS", "build_args"]

logger = logging.getLogger(__name__)

#: Rendezvous settings added unless the user's ``--rdzv-conf`` sets them.
RDZV_DEFAULTS = {"last_call_timeout": "5", "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}


def _merge_rdzv_conf(user_conf: str) -> str:
    merged = dict(RDZV_DEFAULTS)
    for item in filter(None, (part.strip() for part in user_conf.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"adaptive-run: --rdzv-conf item {item!r} must look like key=value")
        merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())


def build_args(argv: list[str]):
    """torchrun's parsed arguments with our defaults applied."""
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    args.rdzv_conf = _merge_rdzv_conf(args.rdzv_conf or "")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``adaptive-run`` and ``python -m adaptive.elastic.launcher``."""
    from adaptive.elastic.sync_points import STOP_STATUS_DIR_VAR

    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = build_args(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import run

    status_dir = tempfile.mkdtemp(prefix="adaptive-run-")
    os.environ[STOP_STATUS_DIR_VAR] = status_dir  # the workers inherit the agent's environment
    try:
        run(args)
    except SignalException as stop:
        # torchrun forwarded the signal to the workers, which checkpointed and exited.
        problems = stop_problems(status_dir, _local_workers(args))
        shutil.rmtree(status_dir, ignore_errors=True)
        if problems:
            logger.error("adaptive-run: stopped by %s, but the stop could not write its checkpoint: %s; the job "
                         "will resume from the last complete checkpoint", stop.sigval.name, "; ".join(problems))
            _exit_now(1)
        logger.warning("adaptive-run: stopped by %s; every worker checkpointed; relaunch the same command "
                       "to resume", stop.sigval.name)
        _exit_now(128 + int(stop.sigval))
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _exit_now(code: int) -> None:
    """Exit with ``code`` once the logs are out, skipping the interpreter's teardown.

    After a stop the agent's rendezvous store threads may still be running;
    tearing them down at interpreter exit can abort the process in C++
    ("terminate called without an active exception", exit -6), which would
    turn a clean stop into a crash for whoever launched us.  The workers are
    gone and everything was reported, so nothing is left to clean up.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _local_workers(args) -> int | None:
    """How many workers this agent runs, when a number was given (not "auto"/"gpu")."""
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):
        return None


def stop_problems(status_dir: str, workers: int | None) -> list[str]:
    """What went wrong with the local workers' stop, from what they confirmed (empty: all checkpointed)."""
    found: dict[int, dict] = {}
    problems = []
    for entry in sorted(os.listdir(status_dir)):
        if not (entry.startswith("local-rank-") and entry.endswith(".json")):
            continue
        try:
            record = read_json(os.path.join(status_dir, entry))
            found[int(entry[len("local-rank-"):-len(".json")])] = record
        except (OSError, ValueError) as error:
            problems.append(f"{entry} is unreadable ({error})")
    for local_rank, record in sorted(found.items()):
        if not record.get("ok"):
            problems.append(f"worker {local_rank} (rank {record.get('rank')}): {record.get('reason')}")
    expected = range(workers) if workers is not None else sorted(found) or [0]
    missing = [rank for rank in expected if rank not in found]
    if missing:
        problems.append(f"worker(s) {', '.join(map(str, missing))} did not confirm a checkpoint (killed before "
                        "they reached a step boundary, or crashed)")
    return problems


if __name__ == "__main__":
    main()
