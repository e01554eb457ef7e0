"""The actor that runs one node's share of a job incarnation on a Ray node.

One :class:`NodeLauncher` per node of an assignment, placed in that node's
placement-group bundle so it holds the node's slots (and, with GPUs, Ray
tells it which devices they are). It starts
``python -m scheduler.executor.node_guard --parent <its pid> -- <launcher>``
as a new session: the guard and the elastic launcher form one process group
that it signals as a whole, and everything below the guard (the launcher,
the training workers, their DataLoader workers) dies with the actor (see
:mod:`scheduler.executor.node_guard`). In live mode
(:mod:`scheduler.executor.ray_live`) the actor of a job's first replica
also says when its launcher's store listens (:meth:`NodeLauncher.serves`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

import psutil

from adaptive.runtime import process_tree
from scheduler.executor.backend import exit_status
from scheduler.executor.ray_import import import_ray

logger = logging.getLogger(__name__)

ray = import_ray()


class NodeLauncher:
    """Runs and signals one node's launcher process group (the body of a Ray actor)."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP address and a port that is free on it now (for the rendezvous)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ip, 0))
            return ip, int(sock.getsockname()[1])

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray assigned to this actor (its bundle), as ``CUDA_VISIBLE_DEVICES`` entries."""
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]

    def serves(self, port: int) -> bool:
        """Whether a process on this node listens on TCP ``port`` now (a live job's store, once the agent
        hosting it is up)."""
        return any(conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
                   for conn in psutil.net_connections("tcp"))

    def start(self, command: list[str], env: dict[str, str], log_path: str) -> int:
        """Start ``command`` under the guard with ``env`` added, output appended to ``log_path``; its pid."""
        if self._process is not None:
            raise RuntimeError("this NodeLauncher already started its command")
        full_env = dict(os.environ)
        full_env.update(env)
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        guard = [sys.executable, "-m", "scheduler.executor.node_guard", "--parent", str(os.getpid()), "--"]
        with open(log_path, "ab") as log:
            self._process = subprocess.Popen([*guard, *command], stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        logger.info("started %s (pid %d, log %s)", command[:6], self._process.pid, log_path)
        return self._process.pid

    def poll(self) -> int | None:
        """The guard's exit status (the launcher's), or ``None`` while it runs."""
        if self._process is None:
            return None
        code = self._process.poll()
        return None if code is None else exit_status(code)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the guard's process group (guard and launcher; the launcher forwards a stop
        to its workers); SIGKILL goes to every process below the guard as well, read before any dies."""
        if self._process is None:
            return
        below = 0
        if signum == signal.SIGKILL:
            below = process_tree.kill_group_and_tree(self._process.pid)
        else:
            try:
                os.killpg(self._process.pid, signum)
            except (ProcessLookupError, PermissionError):
                return
        logger.info("sent %s to process group %d%s", signal.Signals(signum).name, self._process.pid,
                    f" and {below} process(es) below it" if below else "")
