"""Runs one node's launcher so that nothing it starts can outlive the process that started it.

    python -m scheduler.executor.node_guard --parent PID -- COMMAND...

The Ray backend's node actor starts this guard as the leader of a new
session; the guard starts ``COMMAND`` (the elastic launcher) in the same
process group and exits with its exit status (``128 + N`` if signal ``N``
ended it). Signals for the whole incarnation go to that group: SIGTERM (a
graceful stop) reaches the launcher, which forwards it to its workers, while
the guard itself only waits.

Every process below the guard ends with it, by three mechanisms that do not
depend on any one process getting to run cleanup code:

* the launcher, its workers and their DataLoader workers are each bound to
  their parent by a kernel death signal (:mod:`adaptive.runtime.process_tree`):
  when Ray SIGKILLs the actor and the guard (as it does when a node is
  removed), the launcher gets SIGKILL, then its workers, then theirs;
* the guard adopts every orphaned descendant (``PR_SET_CHILD_SUBREAPER``) and,
  when the launcher exits for any reason, kills whatever is left below it;
* if the actor dies and the guard survives, the guard kills every
  descendant and exits. It watches the actor with ``PR_SET_PDEATHSIG`` *and*
  by polling ``getppid()``: the death signal fires when the actor's *thread*
  that forked the guard exits, which may be a worker thread, so the guard
  acts on it only after checking that the actor is really gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

from adaptive.runtime import process_tree
from scheduler.executor.backend import exit_status

logger = logging.getLogger(__name__)

#: Seconds between checks that the parent is still alive.
PARENT_POLL = 0.5


def _parent_gone(parent: int) -> bool:
    return os.getppid() != parent


def _kill_group_and_exit() -> None:
    logger.error("node_guard: the parent process is gone; killing every process below pid %d", os.getpid())
    process_tree.kill_process_tree(os.getpid(), include_root=False, timeout=10.0)
    os.killpg(os.getpgrp(), signal.SIGKILL)  # includes this process
    os._exit(137)  # pragma: no cover - not reached


def _die_with_guard() -> None:
    """In the launcher's process, before exec: SIGKILL when the guard dies (Ray SIGKILLs the guard with
    the actor when a node is removed)."""
    process_tree.set_death_signal(signal.SIGKILL)


def run(parent: int, command: list[str]) -> int:
    """Run ``command`` in this process group; its exit status, or kill the group if ``parent`` dies."""
    def on_parent_signal(*_: object) -> None:
        if _parent_gone(parent):
            _kill_group_and_exit()

    signal.signal(signal.SIGUSR1, on_parent_signal)
    process_tree.set_death_signal(signal.SIGUSR1)
    if _parent_gone(parent):  # died before the death signal was armed
        _kill_group_and_exit()
    signal.signal(signal.SIGTERM, lambda *_: None)  # the launcher in our group gets it too; we keep waiting
    signal.signal(signal.SIGINT, lambda *_: None)
    process_tree.become_subreaper()
    # The death signal is set in the child before exec, so any command dies with this guard (the guard is
    # single-threaded: preexec_fn is safe here); adaptive-run also binds itself (ADAPTIVE_PARENT_PID).
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=process_tree.child_environment(),
                             preexec_fn=_die_with_guard)
    while True:
        try:
            code = child.wait(timeout=PARENT_POLL)
            break
        except subprocess.TimeoutExpired:
            if _parent_gone(parent):
                _kill_group_and_exit()
    left = process_tree.descendants(os.getpid())
    if left:  # orphans adopted from the launcher's tree: they end with it
        logger.warning("node_guard: the launcher exited (%d); killing %d process(es) left below it: %s", code,
                       len(left), [p.pid for p in left])
        process_tree.kill_process_tree(os.getpid(), include_root=False, timeout=10.0)
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
