"""Signal a launcher and every process under it.

torchrun starts each worker in a session of its own, so signalling the
launcher's process group does not reach the workers.  Tests, benchmarks
and the scheduler's executor use this to stop exactly the processes they
started, workers included.
"""

from __future__ import annotations

import logging
import signal

import psutil

__all__ = ["kill_process_tree"]

logger = logging.getLogger(__name__)


def kill_process_tree(pid: int, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
    """Send ``sig`` to ``pid`` and all its descendants; with SIGKILL, wait until they are gone."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if sig == signal.SIGKILL:
        _, alive = psutil.wait_procs(processes, timeout=timeout)
        for process in alive:
            logger.warning("process %d survived SIGKILL for %.0f s", process.pid, timeout)
