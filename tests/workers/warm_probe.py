"""Says how it was started, for ``test_warm_start.py``: a worker of ``adaptive-run --live`` that trains nothing.

Before importing anything heavy it records, in ``WORKER_OUT/probe.<pid>.json``:
the modules already imported (a fork of the pre-warmed process has torch and
``torch._dynamo``), its command line as ps shows it, ``sys.argv``, ``__name__``, ``sys.path[0]``, the working
directory, its parent, the parent it was told to die with, its local rank and
start count, and a number from :mod:`random` (a fork must not share its
siblings' seed).  An atexit handler writes ``atexit.<pid>``.

``PROBE_KILL_FIRST=1``: the first start of local rank 0 SIGKILLs itself (its
restart must be a fork too).  ``PROBE_RAISE=1``: raises ``ValueError`` from a
function.  ``PROBE_WAIT=1``: waits for SIGTERM, exits 143 on it.
"""
import atexit
import json
import os
import random
import signal
import sys
import time

OUT = os.environ["WORKER_OUT"]
PROBE = {"argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(),
         "ppid": os.getppid(), "parent_var": os.environ.get("ADAPTIVE_PARENT_PID"),
         "local_rank": os.environ.get("LOCAL_RANK"), "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
         "preloaded": sorted(name for name in ("torch", "torch._dynamo", "adaptive.parallel.data_parallel",
                                               "xml.dom.minidom") if name in sys.modules),
         "random": random.random(),
         "cmdline": open(f"/proc/{os.getpid()}/cmdline", "rb").read().decode().strip("\0").split("\0")}
with open(os.path.join(OUT, f"probe.{os.getpid()}.json"), "w") as handle:
    json.dump(PROBE, handle)


def _at_exit() -> None:
    with open(os.path.join(OUT, f"atexit.{os.getpid()}"), "w") as handle:
        handle.write("ran")


atexit.register(_at_exit)


def fail() -> None:
    raise ValueError("the probe failed on purpose")


if os.environ.get("PROBE_KILL_FIRST") and PROBE["local_rank"] == "0" and PROBE["restart"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("PROBE_RAISE"):
    fail()
if os.environ.get("PROBE_WAIT"):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(1)
