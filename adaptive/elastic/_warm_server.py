"""The pre-warmed process of ``adaptive-run --live``: it imports torch once, then forks each worker.

A training worker started as a new interpreter spends seconds importing
before its script does anything: torch, then ``torch._dynamo`` (which every
``torch.optim`` optimizer pulls in when it is built), then the library.  A
worker restarted after a loss, or started on a joining node, pays that again
while the job waits for it.  This process pays it once per node: it imports
those modules (and any named with ``--preload``), then waits for requests
from its agent (:mod:`adaptive.elastic.warm_start`) and forks one worker per
request.  The fork runs the training script as ``python -u SCRIPT ARGS``
would (``runpy``: ``__main__``, ``sys.argv``, ``sys.path[0]``; that command
line as its process title), with the worker's own environment and working
directory, and exits as that
interpreter would (atexit handlers, then the interpreter's teardown).

Protocol, one JSON object per line: the agent writes
``{"id", "target", "module", "args", "title", "env", "cwd"}`` on the request pipe
for a worker, ``{"preload": [modules]}`` for more modules to import;
this process writes ``{"ready": seconds}`` once preloaded (or
``{"refused": why}`` and exits when forking is not safe: CUDA initialised by
a preloaded module), ``{"id", "pid"}`` for each fork, ``{"pid", "code"}``
when a worker exits (``code`` as :attr:`subprocess.Popen.returncode`:
negative for a signal) and ``{"warning": text}`` for a module that could not
be preloaded.  It never configures logging (a worker inherits the logging
state it sees), so the agent logs on its behalf.

It dies with its agent (``PR_SET_PDEATHSIG``, like every process an agent
starts) and ends when the request pipe closes; its workers die with it.
Forking is done from its only Python thread, before a worker has touched
CUDA, so the children start from a clean state.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import runpy
import selectors
import signal
import sys
import time
from types import TracebackType
from typing import Any

import setproctitle

from adaptive.runtime import process_tree

__all__ = ["DEFAULT_PRELOAD", "main"]

#: Modules every pre-warmed process imports: torch, what building an optimizer imports, the library's wrappers.
DEFAULT_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "adaptive.data.dataloader",
                   "adaptive.elastic.epoch", "adaptive.elastic.live", "adaptive.parallel.data_parallel",
                   "adaptive.parallel.fully_sharded")
#: Why this process stops serving when a preloaded module initialised CUDA.
CUDA_REFUSAL = "a preloaded module initialised CUDA, which a forked process cannot use"
#: Seconds between looks for exited workers when no request arrives.
REAP_POLL = 0.01


def _say(reports: int, **message: Any) -> None:
    os.write(reports, (json.dumps(message) + "\n").encode())


def _preload(modules: list[str], reports: int) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as error:  # a module the script needs and cannot import fails in the script, as it would
            _say(reports, warning=f"could not preload {name!r}: {type(error).__name__}: {error}")


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _reap(reports: int) -> None:
    """Report every worker that has exited (and reap it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(reports, pid=pid, code=os.waitstatus_to_exitcode(status))


def _serve(requests: int, reports: int) -> dict[str, Any] | None:
    """Take requests until the request pipe closes; returns the worker's request in each forked child."""
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    pending = b""
    while True:
        if selector.select(REAP_POLL):
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return None
            pending += chunk
        _reap(reports)
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "preload" in request:
                _preload(request["preload"], reports)
                if _cuda_initialised():
                    _say(reports, refused=CUDA_REFUSAL)
                    return None
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                os.close(requests)
                os.close(reports)
                return request
            _say(reports, id=request["id"], pid=pid)


def _become_worker(request: dict[str, Any]) -> None:
    """In the fork: take the worker's environment, signals, directory and process identity."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    process_tree.bind_to_parent()  # the environment names this process's parent: die with it
    # What a new interpreter would not share with its siblings: the seeds drawn from the system at import.
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_script(request: dict[str, Any]) -> None:
    """Run the training script as ``python -u [-m] TARGET ARGS`` would.

    An exception the script raises is printed as the interpreter prints it,
    from the script's own frames (not this module's or runpy's), and exits
    with 1; ``SystemExit`` and ``KeyboardInterrupt`` end the process as there.
    """
    target, args = request["target"], request["args"]
    sys.argv = [target, *args]
    # ps, top and whoever looks a worker up by its command line see the command a new interpreter would have
    setproctitle.setproctitle(request["title"])
    try:
        if request["module"]:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
    except Exception as error:
        error.__traceback__ = _script_frames(error.__traceback__)  # the hook prints the exception's own
        sys.excepthook(type(error), error, error.__traceback__)
        raise SystemExit(1) from None


def _script_frames(trace: TracebackType | None) -> TracebackType | None:
    """``trace`` without its leading frames of this module and of runpy."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or "")}
    while trace is not None and (trace.tb_frame.f_code.co_filename in ours
                                 or trace.tb_frame.f_code.co_filename.startswith("<frozen runpy>")):
        trace = trace.tb_next
    return trace


def main(argv: list[str] | None = None) -> None:
    """``python -m adaptive.elastic._warm_server --requests FD --reports FD``."""
    parser = argparse.ArgumentParser(prog="python -m adaptive.elastic._warm_server")
    parser.add_argument("--requests", type=int, required=True, help="file descriptor the agent writes requests to")
    parser.add_argument("--reports", type=int, required=True, help="file descriptor this process reports on")
    args = parser.parse_args(argv)
    process_tree.bind_to_parent()  # die with the agent, before the long imports
    # the process title takes over the memory of argv and the environment: claim it while both are as at start
    setproctitle.setproctitle(setproctitle.getproctitle())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C reaches the agent and the workers; the agent ends us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started = time.monotonic()
    _preload(list(DEFAULT_PRELOAD), args.reports)
    if _cuda_initialised():
        _say(args.reports, refused=CUDA_REFUSAL)
        return
    _say(args.reports, ready=time.monotonic() - started)
    request = _serve(args.requests, args.reports)
    if request is None:  # the agent closed the pipe: it is done, and so are we
        return
    _become_worker(request)
    _run_script(request)


if __name__ == "__main__":
    main()
