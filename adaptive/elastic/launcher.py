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

The training script's own arguments (everything after the script or
module) reach it untouched: unlike plain torchrun on Python 3.11, an option
of the script that is a prefix of a launcher option (``--n``) is not taken
for an abbreviation of one (``--nnodes``).

When ``adaptive-run`` itself is stopped (SIGTERM, SIGINT), torchrun forwards
the signal and the workers checkpoint and exit.  Each worker confirms how its
stop went in a folder the launcher gives it (:mod:`.launch_status`);
``adaptive-run`` exits with 143 only when every local worker confirmed a
durable checkpoint, and otherwise says which did not, and why, and exits
with 1.

One incarnation at a time (guarantee G6):

* the workers die with ``adaptive-run`` whatever kills it, SIGKILL included,
  and ``adaptive-run`` dies with the process that started it when that one
  named itself in ``ADAPTIVE_PARENT_PID`` (the scheduler's backends do); see
  :mod:`.process_tree`;
* when a newer incarnation of the job has taken the checkpoint folder, the
  workers stop and report it (:mod:`adaptive.checkpoint.generation`);
  ``adaptive-run`` then ends the whole incarnation instead of letting
  torchrun restart the workers, and exits with
  :data:`~adaptive.runtime.launch_status.STALE_GENERATION_EXIT_CODE` (3).

A worker that exits with :data:`CONFIG_ERROR_EXIT_CODE` (2: a usage or
configuration error, such as a bad argument, a script that cannot be opened
or a checkpoint folder that cannot be created) would fail the same way at
every restart: ``adaptive-run`` ends its workers and exits with 2 at once,
without spending ``--max-restarts`` (torchrun's agent would restart the
workers on any failure; see :func:`_end_node_on_usage_errors`). ``adaptive-run
--live`` does the same (:mod:`.live_agent`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import argparse
from argparse import Namespace
from typing import Any

from adaptive.elastic import warm_start
from adaptive.runtime import launch_status, process_tree

__all__ = ["main", "RDZV_DEFAULTS", "build_args", "CONFIG_ERROR_EXIT_CODE"]

logger = logging.getLogger(__name__)

#: Rendezvous settings added unless the user's ``--rdzv-conf`` sets them.
RDZV_DEFAULTS = {"last_call_timeout": "5", "keep_alive_interval": "2", "keep_alive_max_attempt": "3"}
#: Seconds between the launcher's looks for a worker's report of a stale generation.
STALE_POLL = 0.1
#: Exit status of a worker, and then of ``adaptive-run``, after a usage or configuration error that a restart
#: cannot fix (Python's status for a bad argument or a script that cannot be opened; the library's for a
#: checkpoint folder that cannot be created); the same as ``adaptive.elastic.live_store.CONFIG_ERROR_EXIT_CODE``.
CONFIG_ERROR_EXIT_CODE = 2


def _merge_rdzv_conf(user_conf: str) -> str:
    merged = dict(RDZV_DEFAULTS)
    for item in filter(None, (part.strip() for part in user_conf.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"adaptive-run: --rdzv-conf item {item!r} must look like key=value")
        merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())


def build_args(argv: list[str]) -> Namespace:
    """torchrun's parsed arguments with our defaults applied.

    Parsed without abbreviations: the script's own options (after the script)
    are never matched against the launcher's, and launcher options must be
    spelled out (``--nproc-per-node``, not ``--nproc``).
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog, parser.allow_abbrev = "adaptive-run", False
    parser.add_argument("--live", action="store_true",
                        help="change membership without restarting the workers (adaptive.elastic.live_agent)")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE[,MODULE...]",
                        help="with --live: more modules for the pre-warmed process to import ahead (the script's "
                             "heavy imports), so that a (re)started worker does not wait for them")
    parser.add_argument("--cold-start", action="store_true",
                        help="with --live: start each worker as a new interpreter, not as a fork of the "
                             "pre-warmed process")
    args = parser.parse_args(argv)
    if (args.preload or args.cold_start) and not args.live:
        parser.error("--preload and --cold-start apply to --live only")
    if args.preload and args.cold_start:
        parser.error("--preload has nothing to preload into with --cold-start")
    args.preload = [name.strip() for value in args.preload for name in value.split(",") if name.strip()]
    for name in args.preload:
        if not all(part.isidentifier() for part in name.split(".")):
            parser.error(f"--preload takes module names such as 'transformers', got {name!r}")
    if args.live:
        unused = _unused_in_live_mode(parser, args)
        if unused:
            parser.error(f"--live runs its own agent, which does not use {', '.join(unused)}; leave "
                         f"{'it' if len(unused) == 1 else 'them'} out (see docs/live.md)")
    args.rdzv_conf = _merge_rdzv_conf(args.rdzv_conf or "")
    return args


#: torchrun's options that ``adaptive-run --live`` does not use (its agent and the job's store replace
#: torchrun's agent and rendezvous); given with another value than their default, they are refused.
LIVE_UNUSED = ("rdzv_conf", "monitor_interval", "start_method", "event_log_handler", "role", "no_python",
               "run_path", "log_dir", "redirects", "tee", "local_ranks_filter", "duplicate_stdout_filters",
               "duplicate_stderr_filters", "node_rank", "master_addr", "master_port", "local_addr", "logs_specs",
               "numa_binding", "signals_to_handle", "shutdown_timeout", "virtual_local_rank")
#: The rendezvous backends live mode accepts (its store takes the rendezvous' place either way).
LIVE_RDZV_BACKENDS = ("static", "c10d")


def _unused_in_live_mode(parser: argparse.ArgumentParser, args: Namespace) -> list[str]:
    """The options given that live mode would silently ignore, as the user spelled them."""
    given = [name for name in LIVE_UNUSED
             if hasattr(args, name) and getattr(args, name) != parser.get_default(name)]
    if args.rdzv_backend not in LIVE_RDZV_BACKENDS:
        given.append("rdzv_backend")
    return ["--" + name.replace("_", "-") + (f"={getattr(args, name)}" if name == "rdzv_backend" else "")
            for name in given]


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``adaptive-run`` and ``python -m adaptive.elastic.launcher``."""
    process_tree.bind_to_parent()  # when a backend named itself: die with it
    os.environ[process_tree.PARENT_PID_VAR] = str(os.getpid())  # the workers, inheriting it, die with us
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = sys.argv[1:] if argv is None else argv
    if "--live" in argv:
        # torch's C++ warnings (a stack of 50 frames for each call to a store that is gone) would bury the one
        # line live mode says when the job's store is lost; the user's own level wins.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warm = warm_start.start_early(argv)  # its imports run beside ours: parsing the arguments imports torch
    args = build_args(argv)
    if warm is not None and (not args.live or args.cold_start):
        warm.close()
        warm = None
    from torch.distributed.run import run

    status_dir = tempfile.mkdtemp(prefix="adaptive-run-")
    os.environ[launch_status.STATUS_DIR_VAR] = status_dir  # the workers inherit the agent's environment
    if args.live:
        from adaptive.elastic import live_agent

        try:
            status = live_agent.run(args, status_dir, warm)
        finally:
            shutil.rmtree(status_dir, ignore_errors=True)
        _exit_now(status)
    _watch_for_stale_generation(status_dir)
    _end_node_on_usage_errors()
    try:
        run(args)
    except Exception as error:
        stop = _signal_behind(error)
        _end_if_stale(status_dir)  # the workers failed because a newer generation fenced them: say that
        if isinstance(error, _UsageError):
            logger.error("adaptive-run: %s", error)
            shutil.rmtree(status_dir, ignore_errors=True)
            _exit_now(CONFIG_ERROR_EXIT_CODE)
        if stop is None:
            raise
        # torchrun forwarded the signal to the workers, which checkpointed and exited.
        problems = launch_status.stop_problems(status_dir, _local_workers(args))
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


class _UsageError(Exception):
    """A worker exited with :data:`CONFIG_ERROR_EXIT_CODE`: raised in torchrun's agent to end it, not restart."""


def _end_node_on_usage_errors() -> None:
    """Have torchrun's agent end this node when a worker exits with 2, instead of restarting every worker.

    torchrun's agent restarts the worker group on any failure while
    ``--max-restarts`` allows. Through the adapter
    (:func:`~adaptive._utils.torch_internals.end_elastic_agent_on_exit_code`),
    the agent that torchrun's ``launch_agent`` builds in this process, at the
    first failure with exit status 2, kills the workers left and raises
    :class:`_UsageError`, which ends the agent (it shuts its workers and its
    rendezvous down) and :func:`main` exits with 2.
    """
    from adaptive._utils.torch_internals import end_elastic_agent_on_exit_code

    def usage_error(ranks: list[int]) -> _UsageError:
        return _UsageError(
            f"worker (rank {', '.join(map(str, ranks))}) exited with {CONFIG_ERROR_EXIT_CODE}, a usage "
            "or configuration error (a bad argument, a script that cannot be opened, a checkpoint "
            "folder that cannot be created) that a restart cannot fix; ending this node with "
            f"{CONFIG_ERROR_EXIT_CODE} without restarting its workers")

    def kill_workers() -> None:
        process_tree.kill_process_tree(os.getpid(), include_root=False, timeout=10.0)

    end_elastic_agent_on_exit_code(CONFIG_ERROR_EXIT_CODE, usage_error, kill_workers)


def _signal_behind(error: BaseException) -> Any:
    """The stop signal (torchrun's ``SignalException``) that ``error`` is, or arose while handling; else None.

    torchrun turns SIGTERM and SIGINT into that exception wherever its agent
    is; when it lands in the middle of torchrun's own bookkeeping (its metrics
    wrapper, before the wrapper's start time is set) it surfaces as another
    error, an ``UnboundLocalError`` raised while handling it.  The stop is
    the same, and so are the workers' checkpoints.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, SignalException):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


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


def _local_workers(args: Namespace) -> int | None:
    """How many workers this agent runs, when a number was given (not "auto"/"gpu")."""
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):
        return None


def _watch_for_stale_generation(status_dir: str) -> None:
    """End this incarnation as soon as a worker reports that a newer generation fenced it.

    torchrun would restart the failed workers as a new round, and that round
    would take a generation newer still and fence the incarnation that
    rightly runs: the job would pass from one to the other at every
    checkpoint. Instead every process under the launcher is killed and it
    exits with the stale-generation status.
    """
    def watch() -> None:
        while True:
            _end_if_stale(status_dir)
            time.sleep(STALE_POLL)

    threading.Thread(target=watch, name="adaptive-run-stale-watch", daemon=True).start()


_ending = threading.Lock()


def _end_if_stale(status_dir: str) -> None:
    """If a worker reported a stale generation: kill every process below, say why once, exit 3."""
    report = launch_status.stale_report(status_dir)
    if report is None:
        return
    _ending.acquire()  # a second caller waits here for the first one to exit the process
    logger.error("adaptive-run: %s", report.get("message", "a newer generation of this job took over"))
    process_tree.kill_process_tree(os.getpid(), include_root=False, timeout=10.0)
    shutil.rmtree(status_dir, ignore_errors=True)
    _exit_now(launch_status.STALE_GENERATION_EXIT_CODE)


if __name__ == "__main__":
    main()
