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
"""

from __future__ import annotations

import logging
import os
import sys

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
    """Entry point of ``adaptive-run`` and ``python -m adaptive.launcher``."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = build_args(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import run

    try:
        run(args)
    except SignalException as stop:
        # torchrun forwarded the signal to the workers, which checkpointed and exited.
        logger.warning("adaptive-run: stopped by %s; relaunch the same command to resume", stop.sigval.name)
        raise SystemExit(128 + int(stop.sigval)) from None


if __name__ == "__main__":
    main()
