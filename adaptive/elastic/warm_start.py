"""Workers forked from a pre-warmed process, for ``adaptive-run --live``.

:class:`WarmStarter` starts this node's pre-warmed process
(:mod:`adaptive.elastic._warm_server`) when the agent starts, while the agent
joins the job; from then on a worker started or restarted on this node is a
fork of it, with torch, ``torch._dynamo`` and the library already imported,
instead of a new interpreter that imports them again.  A worker restarted
after a loss, or started on a joining node, is back in the job that much
sooner.  Each :class:`WarmWorker` answers the part of
:class:`subprocess.Popen` the agent uses (``pid``, ``poll()``,
``send_signal()``).

The pre-warmed process is a child of the agent; the workers are its
children, so it reaps them and reports their exit status.  When it cannot
serve (it refused because CUDA was initialised by a preloaded module, or it
died), :meth:`WarmStarter.start` returns None and the agent starts workers
as new interpreters, saying why once; a worker asked for and not forked yet
is started as one by its :class:`WarmWorker` (no restart is spent on it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

from adaptive.runtime import process_tree

__all__ = ["WarmStarter", "WarmWorker", "worker_command"]

logger = logging.getLogger(__name__)


def worker_command(target: str, module: bool, args: list[str]) -> list[str]:
    """The command line of a worker as a new interpreter: ``python -u [-m] TARGET ARGS``."""
    return [sys.executable, "-u", *(["-m"] if module else []), target, *args]


class WarmWorker:
    """A worker forked by the pre-warmed process; its PID is known once the fork is reported.

    One the pre-warmed process could not fork (it refused, or was lost,
    first) runs ``command`` as a new interpreter instead, with ``env``.
    """

    def __init__(self, starter: WarmStarter, request_id: int, command: list[str], env: dict[str, str]) -> None:
        self._starter = starter
        self.request_id = request_id
        self.command, self.env = command, env
        self.pid: int | None = None
        self.returncode: int | None = None
        self._signals: list[int] = []
        self._cold: subprocess.Popen[bytes] | None = None

    def poll(self) -> int | None:
        """The exit status once the worker has exited (negative: the signal that ended it), else None."""
        if self._cold is None:
            self._starter.read_reports()  # which starts this worker cold if the pre-warmed process was lost first
        return self.returncode if self._cold is None else self._cold.poll()

    def send_signal(self, sig: int) -> None:
        """Signal the worker; before its fork is reported, as soon as it is."""
        if self._cold is not None:
            self._cold.send_signal(sig)
        elif self.pid is None:
            self._signals.append(sig)
        elif self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _started(self, pid: int) -> None:
        self.pid = pid
        for sig in self._signals:
            self.send_signal(sig)
        self._signals.clear()

    def _start_cold(self) -> None:
        self._cold = subprocess.Popen(self.command, env=self.env)
        logger.info("adaptive-run --live: started a worker as a new interpreter instead (pid %d)", self._cold.pid)
        self._started(self._cold.pid)


class WarmStarter:
    """This node's pre-warmed process and the workers forked from it (see the module docstring)."""

    def __init__(self) -> None:
        requests_read, self._requests = os.pipe()
        self._reports, reports_write = os.pipe()
        os.set_blocking(self._reports, False)
        command = [sys.executable, "-u", "-m", "adaptive.elastic._warm_server", "--requests", str(requests_read),
                   "--reports", str(reports_write)]
        self.process = subprocess.Popen(command, env=process_tree.child_environment(),
                                        pass_fds=(requests_read, reports_write))
        os.close(requests_read)
        os.close(reports_write)
        self.refused: str | None = None
        self._buffer = b""
        self._next_id = 0
        self._waiting: dict[int, WarmWorker] = {}
        self._running: dict[int, WarmWorker] = {}
        logger.debug("adaptive-run --live: pre-warmed process started (pid %d)", self.process.pid)

    @property
    def serving(self) -> bool:
        """Whether workers can be forked: the pre-warmed process lives and has not refused."""
        self.read_reports()
        return self.refused is None

    def preload(self, modules: list[str]) -> None:
        """Have the pre-warmed process import ``modules`` too, before it forks the next worker."""
        if modules:
            self._send({"preload": list(modules)})

    def start(self, target: str, module: bool, args: list[str], env: dict[str, str]) -> WarmWorker | None:
        """Ask for a worker running ``target`` (a script, or a module when ``module``) with ``args`` and ``env``;
        None when the pre-warmed process cannot serve (the caller starts a new interpreter)."""
        if not self.serving:
            return None
        self._next_id += 1
        command = worker_command(target, module, args)
        worker = self._waiting[self._next_id] = WarmWorker(self, self._next_id, command, env)
        request = {"id": worker.request_id, "target": target, "module": module, "args": list(args),
                   "title": " ".join(command),
                   "env": {**env, process_tree.PARENT_PID_VAR: str(self.process.pid)}, "cwd": os.getcwd()}
        if not self._send(request):
            del self._waiting[worker.request_id]
            return None
        return worker

    def _send(self, message: dict[str, Any]) -> bool:
        try:
            os.write(self._requests, (json.dumps(message) + "\n").encode())
        except BrokenPipeError:
            self._lost("its request pipe is closed")
            return False
        return True

    def read_reports(self) -> None:
        """Take in what the pre-warmed process reported since the last look."""
        if self.refused is not None:
            return
        ended = False
        while not ended:
            try:
                chunk = os.read(self._reports, 1 << 16)
            except BlockingIOError:
                break
            ended = not chunk
            self._buffer += chunk
        while b"\n" in self._buffer and self.refused is None:  # its last words first: an exit, a refusal
            line, self._buffer = self._buffer.split(b"\n", 1)
            self._take(json.loads(line))
        if ended and self.refused is None:
            self._lost(f"it exited with {self.process.wait()}")

    def _take(self, report: dict[str, Any]) -> None:
        if "ready" in report:
            logger.info("adaptive-run --live: pre-warmed process ready in %.1f s; workers start as its forks",
                        report["ready"])
        elif "warning" in report:
            logger.warning("adaptive-run --live: pre-warmed process: %s", report["warning"])
        elif "refused" in report:
            self._lost(report["refused"])
        elif "id" in report:
            worker = self._waiting.pop(report["id"])
            self._running[report["pid"]] = worker
            worker._started(report["pid"])
        elif "code" in report and report["pid"] in self._running:
            self._running.pop(report["pid"]).returncode = report["code"]

    def _lost(self, why: str) -> None:
        """The pre-warmed process cannot serve: the workers it forked are gone with it (they die with their
        parent); those it had not forked yet start as new interpreters."""
        if self.refused is None:
            logger.warning("adaptive-run --live: workers start as new interpreters from now on; the pre-warmed "
                           "process cannot serve: %s", why)
        self.refused = why
        for worker in self._running.values():
            worker.returncode = -int(signal.SIGKILL)
        waiting = list(self._waiting.values())
        self._waiting.clear()
        self._running.clear()
        for worker in waiting:
            worker._start_cold()

    def close(self) -> None:
        """End the pre-warmed process, once its workers are done (or not wanted after all)."""
        os.close(self._requests)
        self.process.kill()  # it may still be importing; it holds nothing to save
        self.process.wait()
        os.close(self._reports)


def start_early(argv: list[str]) -> WarmStarter | None:
    """The pre-warmed process, started before the launcher imports torch to read ``argv``, when ``argv`` asks for
    ``--live`` without ``--cold-start``: both imports then run at once.  A guess from the raw arguments (a script's
    own ``--live`` counts too): the launcher closes the process once the parsed arguments say it is not wanted."""
    if "--live" in argv and "--cold-start" not in argv:
        return WarmStarter()
    return None
