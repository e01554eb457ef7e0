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
from typing import Callable, Iterator

import pytest

from adaptive.checkpoint.store import CheckpointInfo, CheckpointStore
from adaptive.runtime.process_tree import kill_process_tree
from workers.worker_common import state_digest

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "elastic_worker.py"
#: The checkpointed state of ``AdaptiveDataParallel`` (default name): model, optimizer, ...
MODEL_STATE = "adaptive.parallel.model"


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
        cmd = [sys.executable, "-m", "adaptive.elastic.launcher", *args, str(script)]
        proc = subprocess.Popen(cmd, env=self.env(out, **extra), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(out))
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        """SIGKILL every launcher started here and its workers (they run in sessions of their own)."""
        for proc in self.procs:
            kill_process_tree(proc.pid)
            proc.wait(timeout=30)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    """The launchers a test starts (:class:`Jobs`), killed with their workers when it ends.  Import it into a
    test module as ``from elastic_harness import jobs  # noqa: F401  (the fixture)``."""
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


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


def live_pids(pids) -> list[int]:
    """The processes of ``pids`` that still run (a zombie has ended: it only waits to be reaped)."""
    import psutil

    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


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


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (none when it does not exist yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def resume_records(out: Path, since: float = 0.0) -> list[dict]:
    """What each worker process started from (``record_resume`` in the workers), oldest first."""
    records = [r for path in sorted(out.glob("resume.rank*.jsonl")) for r in read_jsonl(path)]
    return sorted((r for r in records if r["time"] >= since), key=lambda r: r["time"])


def exit_codes(out: Path, since: float = 0.0) -> list[int]:
    """Exit statuses of the worker processes that exited since ``since`` (``run_main`` in the workers)."""
    return [r["code"] for path in sorted(out.glob("exits.rank*.jsonl")) for r in read_jsonl(path) if r["time"] >= since]


def store(out: Path) -> CheckpointStore:
    return CheckpointStore(out / "checkpoints")


def newest_checkpoint_step(out: Path) -> int:
    """The loader step of the newest complete checkpoint (-1 when there is none yet)."""
    infos = store(out).list()
    return int(infos[-1].metadata.get("step", -1)) if infos else -1


def assert_state_applied(out: Path, records: list[dict], log: Path) -> None:
    """Each worker that resumed a checkpoint holds exactly that checkpoint's model and optimizer
    state (digests of the live state right after AdaptiveDataParallel was built), the optimizer has
    state (momentum buffers), and the loader and the model's step counter continue at its step."""
    checkpoints = store(out)
    for record in records:
        if record["seq"] is None:
            continue
        checkpoint = checkpoints.open(record["seq"])
        saved = checkpoint.load(MODEL_STATE)
        where = f"rank {record['rank']} (pid {record['pid']}) resumed checkpoint {record['seq']}"
        assert saved["optimizer"]["state"], f"{where}: the checkpoint has no optimizer state"
        assert record["model"] == state_digest(saved["model"]), f"{where} but not its model weights\n{tail(log)}"
        assert record["optimizer"] == state_digest(saved["optimizer"]), \
            f"{where} but not its optimizer state\n{tail(log)}"
        (loader,) = [name for name in checkpoint.names() if name.startswith("adaptive.dataloader.")]
        step = checkpoint.load(loader)["step"]
        assert record["loader_step"] == step == record["model_steps"] > 0, \
            f"{where}: loader at step {record['loader_step']}, model at {record['model_steps']}, saved {step}"


def assert_resumed(out: Path, since: float, expected: CheckpointInfo, replicas: int, log: Path) -> list[dict]:
    """Every worker started after ``since`` resumed checkpoint ``expected`` and applied its state."""
    records = resume_records(out, since)
    assert len(records) == replicas, f"expected {replicas} workers to start, got {records}\n{tail(log)}"
    assert {r["seq"] for r in records} == {expected.seq}, \
        f"workers resumed {[r['seq'] for r in records]}, not checkpoint {expected.seq}\n{tail(log)}"
    assert {r["world"] for r in records} == {replicas}
    assert_state_applied(out, records, log)
    return records


def assert_resumed_newest(out: Path, records: list[dict], log: Path) -> None:
    """Workers restarted after a crash resumed the newest checkpoint that existed when they started."""
    infos = store(out).list()
    for record in records:
        older = [info.seq for info in infos if info.created <= record["time"]]
        assert older and record["seq"] == max(older), \
            f"pid {record['pid']} resumed {record['seq']}; checkpoints before it started: {older}\n{tail(log)}"
    assert_state_applied(out, records, log)


def assert_stopped_gracefully(out: Path, since: float, stopped: dict, log: Path) -> CheckpointInfo:
    """After a graceful stop: every worker exited 143, the newest checkpoint is the stop's, taken
    after the last step the workers reported (``stopped``: rank 0's last progress record)."""
    codes = exit_codes(out, since)
    assert codes and set(codes) == {143}, f"worker exit statuses {codes}\n{tail(log)}"
    latest = store(out).latest()
    assert latest is not None, f"no checkpoint after the stop\n{tail(log)}"
    assert latest.info.metadata.get("reason") == "stop", latest.info.metadata
    step = latest.load([n for n in latest.names() if n.startswith("adaptive.dataloader.")][0])["step"]
    assert step == stopped["step"] + 1, f"the stop checkpoint is at step {step}, the last step trained was " \
                                         f"{stopped['step']} (0-based)\n{tail(log)}"
    return latest.info
