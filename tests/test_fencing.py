"""Guarantee G6, fencing: only the newest generation of a job publishes checkpoints.

Unit tests of the generation record and the fenced store, in-process tests of
a stale job's agreed stop, and real ``adaptive-run`` incarnations: one frozen
with SIGSTOP while a second finishes the job, and two running at once.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from adaptive.checkpoint import fencing, states
from adaptive.checkpoint.generation import (GENERATION_FILE, LOCK_FILE, Generation, StaleGenerationError,
                                            newest_generation)
from adaptive.checkpoint.store import CheckpointError, CheckpointStore
from adaptive.elastic import stopping, sync_points
from adaptive.runtime.process_tree import descendants
from elastic_harness import Jobs, live_pids, progress, tail, wait_exit, wait_for

STALE = sync_points.STALE_GENERATION_EXIT_CODE


# ------------------------------------------------------------------ the record


def _take_many(root: str, count: int, queue) -> None:
    queue.put([Generation.take(root).number for _ in range(count)])


def test_generations_are_monotonic_unique_and_durable_across_processes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert newest_generation(root) is None
    first = Generation.take(root)
    assert first.number == 1 and first.is_newest()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_take_many, args=(str(root), 10, queue)) for _ in range(4)]
    for worker in workers:
        worker.start()
    taken = [number for _ in workers for number in queue.get(timeout=60)]
    for worker in workers:
        worker.join(timeout=60)
    assert sorted(taken) == list(range(2, 42))  # no number twice, none skipped
    newest = newest_generation(root)
    assert newest.number == 41 and newest.host and newest.pid > 0
    assert not first.is_newest()
    with pytest.raises(StaleGenerationError, match=r"holds generation 1 .* but generation 41 \(taken at .* is newer"):
        first.check()


def test_a_damaged_record_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / GENERATION_FILE).write_text('{"number": "x"}')
    with pytest.raises(CheckpointError, match="generation record .* is damaged"):
        Generation.take(tmp_path)


def _hold_lock(root: str, ready, release) -> None:
    import fcntl

    fd = os.open(os.path.join(root, LOCK_FILE), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    release.wait(60)


def test_a_lock_held_too_long_fails_with_the_lock_named(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(CheckpointError, match=r"generation lock .*\.generation\.lock was held .* more than 0 s"):
            Generation.take(tmp_path, timeout=0.3)
    finally:
        release.set()
        holder.join(timeout=60)
    assert Generation.take(tmp_path).number == 1  # released with its holder


# ---------------------------------------------------------------- the store


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a hash of its content (the lock file is empty and never changes)."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


def test_a_stale_store_publishes_nothing_and_changes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old = CheckpointStore(root, keep=5, generation=Generation.take(root))
    old.save({"w": torch.ones(3)})
    early = old.reserve()  # a save in progress when the newer incarnation starts
    new_generation = Generation.take(root)
    before = {path.name for path in root.iterdir()}
    with pytest.raises(StaleGenerationError, match="holds generation 1 .* generation 2"):
        old.save({"w": torch.zeros(3)})
    with pytest.raises(StaleGenerationError):
        old.reserve()
    assert {path.name for path in root.iterdir()} == before  # not even a temporary directory
    with pytest.raises(StaleGenerationError):
        old.publish(early, {"w": torch.zeros(3)})
    assert not early.temp.exists()  # its own reservation is cleaned up, nothing is renamed into place
    assert [info.seq for info in CheckpointStore(root).list()] == [1]
    new = CheckpointStore(root, keep=5, generation=new_generation)
    assert new.save({"w": torch.full((3,), 2.0)}).seq == 2
    assert torch.equal(CheckpointStore(root).latest().load("w"), torch.full((3,), 2.0))
    with pytest.raises(ValueError, match="generation must be a Generation taken in"):
        CheckpointStore(tmp_path / "other", generation=new_generation)


# ------------------------------------------------------- a job, in one process


class _Weights(states.State):
    def __init__(self) -> None:
        super().__init__("fencing-test-weights")
        self.value = torch.arange(4.0)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_each_incarnation_takes_a_generation_and_records_it_in_its_checkpoints(job: Path) -> None:
    _Weights()
    assert states.resumed_checkpoint() is None and fencing.generation().number == 1
    states.save_all_states({"step": 1})
    assert CheckpointStore(job / "checkpoints").latest().info.metadata["generation"] == 1
    from conftest import restart_process_state

    restart_process_state()  # a relaunch
    _Weights()
    assert states.resumed_checkpoint().info.seq == 1 and fencing.generation().number == 2


@pytest.mark.parametrize("how", ["agreement", "periodic", "stop", "asynchronous"])
def test_a_stale_job_stops_with_one_clear_line_and_writes_nothing(job: Path, how: str, monkeypatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    _Weights()
    states.save_all_states({"step": 1})
    Generation.take(job / "checkpoints")  # another incarnation starts
    before = _snapshot(job / "checkpoints")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stopped:
        if how == "agreement":  # rank 0 reads the record at most every second
            monkeypatch.setattr(fencing, "GENERATION_CHECK_INTERVAL", 0.0)
            for _ in range(3):
                sync_points.step_boundary(lambda: {"step": 2})
        elif how == "periodic":
            stopping.save_or_exit({"reason": "periodic"})
        elif how == "stop":
            sync_points.request_stop()
            sync_points.settle(lambda: {"step": 2})
        else:
            stopping.save_or_exit({"reason": "periodic"}, blocking=False)
    assert stopped.value.code == STALE
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert lines == [f"folder generation 1 of this job is stale: folder generation 2 took over the checkpoint folder "
                     f"{job / 'checkpoints'} (a relaunch, or the same job launched twice); this incarnation "
                     f"publishes nothing and exits with {STALE}"], lines
    assert _snapshot(job / "checkpoints") == before


def test_a_sharded_save_of_a_stale_job_is_refused_before_any_shard_is_written(job: Path) -> None:
    class Sharded(states.ShardedState):
        def __init__(self) -> None:
            super().__init__("fencing-test-sharded")
            self.shard = torch.arange(6.0)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def sharded_state_dict(self):
            return {"shard": self.shard}

        def load_sharded_state_dict(self, read):
            self.shard = read({"shard": torch.empty(6)})["shard"]

    Sharded()
    states.save_all_states({"step": 1})
    assert CheckpointStore(job / "checkpoints").latest().sharded_names() == ["fencing-test-sharded"]
    Generation.take(job / "checkpoints")
    before = _snapshot(job / "checkpoints")
    with pytest.raises(StaleGenerationError):
        states.save_all_states({"step": 2})
    with pytest.raises(StaleGenerationError):
        states.save_all_states({"step": 2}, blocking=False)
    assert _snapshot(job / "checkpoints") == before


# ------------------------------------------------------- real incarnations


def _tree(pid: int) -> list[int]:
    return [pid, *(process.pid for process in descendants(pid))] if psutil.pid_exists(pid) else []


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


LAUNCH = ["--standalone", "--nproc-per-node=2"]


def _common(ckpt: Path, **extra: str) -> dict[str, str]:
    return {"ADAPTIVE_CHECKPOINT_PATH": str(ckpt), "ADAPTIVE_CHECKPOINT_KEEP": "1000", "WORKER_SAMPLES": "240",
            "WORKER_BATCH": "24", **extra}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_a_frozen_incarnation_wakes_up_stale_publishes_nothing_and_exits(tmp_path: Path) -> None:
    """SIGSTOP the first incarnation, let a second resume and finish the job, SIGCONT the first."""
    jobs = Jobs(tmp_path)
    ckpt = tmp_path / "ckpt"
    env = _common(ckpt, WORKER_EPOCHS="6", WORKER_STEP_SLEEP="0.1", WORKER_SAMPLES="480",
                  ADAPTIVE_CHECKPOINT_INTERVAL="0.5")
    try:
        first = jobs.launch(LAUNCH, tmp_path / "first", "log.txt", **env)
        wait_for(lambda: len(CheckpointStore(ckpt).list()) >= 2 and (progress(tmp_path / "first", 1) or {})
                 .get("epoch", 0) >= 1, 120, f"the first incarnation to checkpoint\n{tail(tmp_path / 'first/log.txt')}")
        frozen = _tree(first.pid)
        assert len(frozen) >= 3  # launcher and two workers
        _signal_all(frozen, signal.SIGSTOP)
        second = jobs.launch(LAUNCH, tmp_path / "second", "log.txt", **dict(env, WORKER_STEP_SLEEP="0.01"))
        assert wait_exit(second, 240, tmp_path / "second" / "log.txt") == 0
        finished = CheckpointStore(ckpt).latest()
        assert finished.info.metadata["reason"] == "finished" and finished.info.metadata["generation"] == 2
        before = _snapshot(ckpt)
        woke = time.monotonic()
        _signal_all(frozen, signal.SIGCONT)
        code = wait_exit(first, 30, tmp_path / "first" / "log.txt")
        log = (tmp_path / "first" / "log.txt").read_text()
        assert code == STALE, tail(tmp_path / "first" / "log.txt")
        assert time.monotonic() - woke < 30
        assert "folder generation 1 of this job is stale: folder generation 2 took over the checkpoint folder" in log, log[-3000:]
        assert _snapshot(ckpt) == before  # published nothing, changed nothing
        wait_for(lambda: not live_pids(frozen), 10, f"every process of the first incarnation to be gone: "
                                                 f"{live_pids(frozen)}")
        third = jobs.launch(LAUNCH, tmp_path / "third", "log.txt", **env)
        assert wait_exit(third, 120, tmp_path / "third" / "log.txt") == 0
        assert "all 6 epochs already finished" in (tmp_path / "third" / "log.txt").read_text()
        assert not (tmp_path / "third" / "epochs.jsonl").exists()  # trained nothing
        assert CheckpointStore(ckpt).latest().info.seq == finished.info.seq
    finally:
        jobs.cleanup()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s: CI runs it after the default suite
def test_of_two_incarnations_running_at_once_only_the_newer_publishes(tmp_path: Path) -> None:
    """A partition: the older incarnation stops at its next agreement; from then on only the newer publishes.

    The older incarnation trains epoch 0 (checkpointing as it goes), then each of its steps waits at a gate
    that opens only once the newer incarnation has taken its generation, so it is certainly still training
    when it is fenced, however slowly the newer one starts on a loaded machine.
    """
    jobs = Jobs(tmp_path)
    ckpt = tmp_path / "ckpt"
    gate = tmp_path / "older-may-go-on"
    env = _common(ckpt, WORKER_EPOCHS="8", WORKER_STEP_SLEEP="0.05", ADAPTIVE_CHECKPOINT_INTERVAL="0.5",
                  WORKER_LOADER_WORKERS="1")
    try:
        older = jobs.launch(LAUNCH, tmp_path / "older", "log.txt",
                            **dict(env, WORKER_GATE=str(gate), WORKER_GATE_EPOCH="1"))
        wait_for(lambda: CheckpointStore(ckpt).list() and (tmp_path / "older" / "epochs.jsonl").exists(), 120,
                 f"the older incarnation to checkpoint and finish epoch 0\n{tail(tmp_path / 'older/log.txt')}")
        older_pids = _tree(older.pid)
        newer = jobs.launch(LAUNCH, tmp_path / "newer", "log.txt", **dict(env, WORKER_STEP_SLEEP="0.02"))
        wait_for(lambda: getattr(newest_generation(ckpt), "number", 0) == 2, 60, "the newer incarnation to start")
        took_over = time.time()
        assert older.poll() is None, "the older incarnation must still be training when it is fenced"
        gate.touch()
        assert wait_exit(older, 30, tmp_path / "older" / "log.txt") == STALE
        assert "folder generation 1 of this job is stale: folder generation 2" in (tmp_path / "older" / "log.txt").read_text()
        wait_for(lambda: not live_pids(older_pids), 10, f"the older incarnation's processes to be gone: "
                                                     f"{live_pids(older_pids)}")
        assert wait_exit(newer, 240, tmp_path / "newer" / "log.txt") == 0
    finally:
        jobs.cleanup()
    infos = CheckpointStore(ckpt).list()
    assert {info.metadata["generation"] for info in infos if info.created > took_over + 0.5} == {2}, \
        [(info.seq, info.created - took_over, info.metadata.get("generation")) for info in infos]
    assert infos[-1].metadata["reason"] == "finished" and infos[-1].metadata["generation"] == 2


@pytest.mark.distributed
def test_a_script_option_that_prefixes_a_launcher_option_reaches_the_script(tmp_path: Path) -> None:
    script = tmp_path / "echo_args.py"
    script.write_text("import json, sys\nprint('ARGS=' + json.dumps(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-m", "adaptive.elastic.launcher", "--standalone",
                             "--nproc-per-node=1", str(script), "--n", "3", "--nnodes", "x", "--max-restarts=2"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'ARGS=["--n", "3", "--nnodes", "x", "--max-restarts=2"]' in result.stdout, result.stdout
