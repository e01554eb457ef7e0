"""Process ownership: every process an incarnation starts ends with it (guarantee G6).

An incarnation is a chain of processes: the scheduler's node guard (or the
executor), ``adaptive-run`` (torchrun's agent runs inside it), the training
workers, and their DataLoader workers. Any link can die by SIGKILL (a lost
node, the OOM killer, a kill of one PID), and a SIGKILLed process runs no
cleanup, so each link is tied to the one above it by the kernel:

* :func:`bind_to_parent`: a process started with :data:`PARENT_PID_VAR` in
  its environment asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), and exits at once if the parent is already
  gone. ``adaptive-run`` does this first thing, and a training worker when it
  imports :mod:`adaptive`; the one who starts them puts
  :func:`child_environment` into their environment. torchrun starts workers
  in sessions of their own, so signals to the launcher's process group never
  reached them; this does not depend on groups.
* DataLoader workers bind to their trainer the same way
  (:mod:`adaptive.data._workers`).
* :func:`become_subreaper`: the node guard adopts whatever is orphaned below
  it, so that :func:`kill_process_tree` from it reaches every descendant,
  even those whose parent already died.

Linux only (``prctl``); elsewhere binding is a no-op and a warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time

import psutil

from adaptive.runtime import env

__all__ = ["PARENT_PID_VAR", "bind_to_parent", "child_environment", "set_death_signal", "become_subreaper",
           "kill_group_and_tree", "kill_process_tree", "descendants"]

logger = logging.getLogger(__name__)

#: Environment variable with the PID of the process whose death must end this one.
PARENT_PID_VAR = env.PARENT_PID_VAR
#: Exit status of a process that found its parent already gone when it started.
ORPHAN_EXIT_CODE = 137

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: a copy of this process's) naming this process as the parent to die with."""
    env = dict(os.environ if env is None else env)
    env[PARENT_PID_VAR] = str(os.getpid())
    return env


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(option, value, 0, 0, 0) == 0:
            return True
        logger.warning("prctl(%d) failed (errno %d)", option, ctypes.get_errno())
    except (OSError, AttributeError) as error:  # not Linux
        logger.warning("prctl is not available here (%s): processes do not die with their parent", error)
    return False


def bind_to_parent(parent: int | None = None) -> bool:
    """Die (SIGKILL) when ``parent`` dies; exit now if it is already gone. Returns whether a binding was made.

    ``parent`` defaults to :data:`PARENT_PID_VAR`; without it nothing is done.
    A process whose parent is not ``parent`` (a grandchild that inherited the
    variable) is left alone while ``parent`` lives: it is not a direct child,
    and its own parent is responsible for it. If ``parent`` is dead, the
    process is an orphan of an ended incarnation and exits at once.
    """
    if parent is None:
        try:
            parent = env.parent_pid()
        except ValueError as error:
            logger.warning("ignoring %s", error)
            return False
        if parent is None:
            return False
    if os.getppid() != parent:
        if psutil.pid_exists(parent):
            return False
        _exit_orphan(parent)
    if not set_death_signal(signal.SIGKILL):
        return False
    if os.getppid() != parent:  # died between the check and the prctl
        _exit_orphan(parent)
    return True


def _exit_orphan(parent: int) -> None:
    logger.error("process %d that started this one (pid %d) is gone: its incarnation has ended; exiting",
                 parent, os.getpid())
    logging.shutdown()
    os._exit(ORPHAN_EXIT_CODE)


def set_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (the thread that forked it) dies."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Adopt the orphaned descendants of this process (``PR_SET_CHILD_SUBREAPER``); whether it worked."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty if it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_group_and_tree(leader: int) -> int:
    """SIGKILL the process group led by ``leader`` and every descendant of ``leader``; returns at once.

    The descendants are read before any signal is sent, so those that the
    group kill orphans (torchrun's workers live in sessions of their own) are
    still reached. Returns how many descendants were signalled.
    """
    below = descendants(leader)
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _send(below, signal.SIGKILL)
    return len(below)


def kill_process_tree(pid: int, sig: int = signal.SIGKILL, timeout: float = 30.0,
                      include_root: bool = True) -> None:
    """Send ``sig`` to ``pid`` (unless ``include_root`` is False) and all its descendants.

    The tree is read before any signal is sent, so children that the first
    signals orphan are still reached. With SIGKILL, waits until they are gone
    (or dead and waiting to be reaped), without reaping any: the exit status
    of a child belongs to whoever started it. (Reaping a child of this
    process here would hide its status from its owner: Python's
    ``subprocess`` reads a child that someone else reaped as exit status 0,
    so torchrun's agent would take SIGKILLed workers for finished ones.)
    """
    try:
        root = psutil.Process(pid)
        processes = ([root] if include_root else []) + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    _send(processes, sig)
    if sig == signal.SIGKILL:
        for process in _wait_until_dead(processes, timeout):
            logger.warning("process %d survived SIGKILL for %.0f s", process.pid, timeout)


def _wait_until_dead(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process is gone or a zombie (dead, not yet reaped); those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    alive = processes
    while True:
        alive = [process for process in alive if _is_alive(process)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _send(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
