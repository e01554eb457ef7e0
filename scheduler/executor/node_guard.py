"""Runs one node's launcher so that it cannot outlive the process that started it.

    python -m scheduler.executor.node_guard --parent PID -- COMMAND...

The Ray backend's node actor starts this guard as the leader of a new
session; the guard starts ``COMMAND`` (the elastic launcher) in the same
process group and exits with its exit status (``128 + N`` if signal ``N``
ended it). Signals for the whole incarnation go to that group: SIGTERM (a
graceful stop) reaches the launcher and its workers while the guard itself
only waits; SIGKILL ends everything.

If the parent (the actor) dies, for example because its Ray node was removed,
the guard kills its process group, so no training process is left behind.
It watches the parent with ``prctl(PR_SET_PDEATHSIG)`` *and* by polling
``getppid()``: the death signal fires when the parent's *thread* that forked
the guard exits, which in an actor may be a worker thread, so the guard only
acts on it after checking that the parent is really gone.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys

from scheduler.executor.backend import exit_status

logger = logging.getLogger(__name__)

#: Seconds between checks that the parent is still alive.
PARENT_POLL = 0.5
_PR_SET_PDEATHSIG = 1


def _parent_gone(parent: int) -> bool:
    return os.getppid() != parent


def _kill_group_and_exit() -> None:
    logger.error("node_guard: the parent process is gone; killing process group %d", os.getpgrp())
    os.killpg(os.getpgrp(), signal.SIGKILL)  # includes this process
    os._exit(137)  # pragma: no cover - not reached


def _set_death_signal(sig: signal.Signals) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            logger.warning("node_guard: prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as exc:  # not Linux: polling alone
        logger.warning("node_guard: no prctl (%s); watching the parent by polling only", exc)


def run(parent: int, command: list[str]) -> int:
    """Run ``command`` in this process group; its exit status, or kill the group if ``parent`` dies."""
    def on_parent_signal(*_: object) -> None:
        if _parent_gone(parent):
            _kill_group_and_exit()

    signal.signal(signal.SIGUSR1, on_parent_signal)
    _set_death_signal(signal.SIGUSR1)
    if _parent_gone(parent):  # died before the death signal was armed
        _kill_group_and_exit()
    signal.signal(signal.SIGTERM, lambda *_: None)  # the launcher in our group gets it too; we keep waiting
    signal.signal(signal.SIGINT, lambda *_: None)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    while True:
        try:
            code = child.wait(timeout=PARENT_POLL)
            break
        except subprocess.TimeoutExpired:
            if _parent_gone(parent):
                _kill_group_and_exit()
    return exit_status(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.executor.node_guard", description=__doc__.split("\n")[0])
    parser.add_argument("--parent", type=int, required=True, help="pid whose death ends the command")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a COMMAND after -- is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args.parent, command)


if __name__ == "__main__":
    sys.exit(main())
