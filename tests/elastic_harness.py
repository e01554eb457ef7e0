"""Helpers for tests that start real torchrun jobs on 127.0.0.1.

Every process is started in its own session so that cleanup can signal the
whole tree it started, and nothing else.  Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from adaptive.process_tree import kill_process_tree

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "elastic_worker.py"


class Jobs:
    """Starts torchrun jobs and guarantees they are gone afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def env(self, out: Path, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        env["WORKER_OUT"] = str(out)
        env["ADAPTIVE_CHECKPOINT_PATH"] = str(out / "checkpoints")
        env["ADAPTIVE_COLLECTIVE_TIMEOUT"] = "60"
        env["OMP_NUM_THREADS"] = "1"
        env.update(extra)
        return env

    def launch(self, args: list[str], out: Path, log_name: str, script: Path = WORKER, **extra: str) -> subprocess.Popen:
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / log_name, "ab")
        cmd = [sys.executable, "-m", "adaptive.launcher", *args, str(script)]
        proc = subprocess.Popen(cmd, env=self.env(out, **extra), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(out))
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        """SIGKILL every launcher started here and its workers (they run in sessions of their own)."""
        for proc in self.procs:
            kill_process_tree(proc.pid)
            proc.wait(timeout=30)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def progress(out: Path, rank: int) -> dict | None:
    try:
        return json.loads((out / f"progress.rank{rank}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def wait_exit(proc: subprocess.Popen, timeout: float, log: Path) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"job did not finish within {timeout:.0f} s; log:\n{tail(log)}") from None


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def epoch_records(out: Path) -> dict[int, dict]:
    """The last record written for each epoch (a replayed epoch end may write twice)."""
    records: dict[int, dict] = {}
    path = out / "epochs.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["epoch"]] = record
    return records


def assert_exact_counts(out: Path, epochs: int, log: Path) -> dict[int, dict]:
    """Each epoch saw every sample, and repeated fewer samples than it had replicas."""
    records = epoch_records(out)
    assert sorted(records) == list(range(epochs)), f"epochs recorded: {sorted(records)}\n{tail(log)}"
    for epoch, record in records.items():
        assert record["missing"] == 0, f"epoch {epoch} missed samples: {record}"
        assert record["extra"] < record["world"], f"epoch {epoch} repeated samples: {record}"
    done = json.loads((out / "done.json").read_text())
    assert done["model_steps"] == done["step"], f"model and loader disagree on the step count: {done}"
    return records
