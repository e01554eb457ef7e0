"""Guarantee G6, ownership: every process an incarnation starts ends with it, checked by PID.

An incarnation here is the real chain: (node guard or executor) -> adaptive-run
(torchrun's agent) -> two training workers -> one DataLoader worker each. It is
ended in each way the scheduler or the machine ends one: the executor's kill,
a SIGKILL of adaptive-run alone, the death of the process that launched it
(the executor, or a Ray node actor together with its guard, as Ray does when
a node is removed). Nothing may be left: the only right number of orphans is 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from adaptive.runtime.process_tree import kill_process_tree
from elastic_harness import REPO, WORKER, live_pids, progress, tail, wait_for
from scheduler.executor import Assignment, JobSpec
from scheduler.executor.local import LocalBackend

pytestmark = pytest.mark.distributed

#: Seconds within which every process of an ended incarnation must be gone.
GONE_WITHIN = 5.0


def _env(out: Path) -> dict[str, str]:
    return {"WORKER_OUT": str(out), "WORKER_SAMPLES": "480", "WORKER_BATCH": "24", "WORKER_EPOCHS": "50",
            "WORKER_STEP_SLEEP": "0.05", "WORKER_LOADER_WORKERS": "1", "OMP_NUM_THREADS": "1",
            "ADAPTIVE_COLLECTIVE_TIMEOUT": "60", "ADAPTIVE_CHECKPOINT_PATH": str(out / "checkpoints"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}


def _training_tree(root: int, out: Path, log: Path) -> list[int]:
    """Wait until both workers train with their DataLoader workers; every PID under ``root`` (root included)."""
    wait_for(lambda: (progress(out, 1) or {}).get("step", 0) >= 2, 120, f"both workers to train\n{tail(log)}")

    def full_tree():
        tree = [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
        return tree if len(tree) >= 5 else None  # launcher, 2 workers, 2 DataLoader workers (+ guard)

    return wait_for(full_tree, 30, f"the DataLoader workers to start\n{tail(log)}")


def _assert_all_gone(pids: list[int], log: Path, what: str) -> float:
    started = time.monotonic()
    try:
        wait_for(lambda: not live_pids(pids), GONE_WITHIN, f"every process of the incarnation to end after {what}")
    except AssertionError:
        orphans = live_pids(pids)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"{len(orphans)} orphan(s) after {what}: {orphans}\n{tail(log)}") from None
    return time.monotonic() - started


def test_the_executors_kill_ends_every_process_of_the_incarnation(tmp_path: Path) -> None:
    backend = LocalBackend(str(tmp_path / "logs"))
    out = tmp_path / "out"
    out.mkdir()
    spec = JobSpec(name="owned", command=(str(WORKER),), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=2,
                   env=_env(out))
    handle = backend.launch(spec, Assignment((0, 0), (0, 1)), attempt=1)
    try:
        pids = _training_tree(handle.pid, out, Path(handle.log_path))
        backend.kill(handle)
        _assert_all_gone(pids, Path(handle.log_path), "the executor's kill")
        # (a multi-threaded process shows as a zombie while its other threads still exit: poll a moment)
        codes = []
        wait_for(lambda: codes.append(backend.poll(handle)) or codes[-1] is not None, 10, "the launcher's status")
        assert codes[-1] == 137
    finally:
        kill_process_tree(handle.pid)


def test_killing_adaptive_run_alone_ends_its_workers_and_their_data_workers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    log = out / "log.txt"
    with open(log, "wb") as sink:
        launcher = subprocess.Popen([sys.executable, "-m", "adaptive.elastic.launcher", "--standalone",
                                     "--nproc-per-node=2", str(WORKER)], env={**os.environ, **_env(out)},
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        pids = _training_tree(launcher.pid, out, log)
        os.kill(launcher.pid, signal.SIGKILL)  # no cleanup code runs in it
        launcher.wait(timeout=30)
        _assert_all_gone(pids[1:], log, "a SIGKILL of adaptive-run")
    finally:
        kill_process_tree(launcher.pid)


_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from scheduler.executor import Assignment, JobSpec
    from scheduler.executor.local import LocalBackend

    how, out, log_dir, worker, env = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], eval(sys.argv[5])
    if how == "guard":  # a stand-in for Ray's node actor: it starts the guard as a new session
        command = [sys.executable, "-m", "scheduler.executor.node_guard", "--parent", str(__import__("os").getpid()),
                   "--", sys.executable, "-m", "adaptive.elastic.launcher", "--standalone", "--nproc-per-node=2",
                   worker]
        with open(log_dir + "/guard.log", "ab") as log:
            child = subprocess.Popen(command, env={**__import__("os").environ, **env}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        print(child.pid, flush=True)
    else:  # an executor with the local backend
        handle = LocalBackend(log_dir).launch(JobSpec(name="owned", command=(worker,), checkpoint_dir=out + "/ckpt",
                                                      max_replicas=2, env=env), Assignment((0, 0), (0, 1)), 1)
        print(handle.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["guard", "executor"])
def test_the_death_of_the_launching_process_ends_the_incarnation(tmp_path: Path, how: str) -> None:
    """``guard``: Ray removes a node by SIGKILLing the actor and its direct child, the guard, at once.
    ``executor``: the executor that ran the local backend is SIGKILLed."""
    out = tmp_path / "out"
    out.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    env = _env(out)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, how, str(out), str(logs), str(WORKER), repr(env)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": env["PYTHONPATH"]}, cwd=str(REPO))
    log = logs / ("guard.log" if how == "guard" else "owned/attempt-1.log")
    try:
        child = int(parent.stdout.readline())
        pids = _training_tree(child, out, log)
        os.kill(parent.pid, signal.SIGKILL)
        if how == "guard":
            os.kill(child, signal.SIGKILL)
        parent.wait(timeout=30)
        _assert_all_gone(pids, log, f"a SIGKILL of the {how}")
    finally:
        kill_process_tree(parent.pid)
        parent.stdout.close()



_OWNER = """
import json, subprocess, sys, time
import psutil
from adaptive.runtime.process_tree import kill_process_tree

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
parent = subprocess.Popen([sys.executable, "-c",
                           "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                           "'import time; time.sleep(60)']); time.sleep(60)"])
deadline = time.monotonic() + 30
while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
    time.sleep(0.05)
grandchild = psutil.Process(parent.pid).children()[0]
kill_process_tree(psutil.Process().pid, include_root=False, timeout=10.0)
print(json.dumps({"child": child.wait(timeout=10), "parent": parent.wait(timeout=10),
                  "grandchild_running": grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE}))
"""


def test_killing_a_tree_leaves_each_childs_exit_status_to_its_owner() -> None:
    """``kill_process_tree`` waits for the processes to die without reaping them: the owner of a child still
    reads that it was killed.  (Reaped by someone else, a child reads as exit status 0 in ``subprocess``, and
    torchrun's agent took fenced workers that adaptive-run had killed for finished ones, so adaptive-run exited 0.)
    """
    result = subprocess.run([sys.executable, "-c", _OWNER], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "child": -signal.SIGKILL, "parent": -signal.SIGKILL, "grandchild_running": False}
