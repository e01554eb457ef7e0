"""AdaptiveFSDP in real torchrun jobs on 127.0.0.1 (gloo, CPU): gradients, kills, stops, reshards."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from adaptive.checkpoint import _format

from elastic_harness import (REPO, Jobs, assert_exact_counts, assert_stopped_gracefully, newest_checkpoint_step,
                             progress, resume_records, store, tail, wait_exit, wait_for)
from workers.sharded_ckpt_common import assert_equal_states

pytestmark = pytest.mark.distributed

WORKER = REPO / "tests" / "workers" / "fsdp_worker.py"
GRADIENT_WORKER = REPO / "tests" / "workers" / "fsdp_gradient_worker.py"
MODEL_STATE = "adaptive.parallel.model"


@pytest.fixture
def jobs(tmp_path):
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


def _gradient_errors(jobs, out: Path, nproc: int, **knobs: str) -> dict:
    proc = jobs.launch(["--standalone", f"--nproc-per-node={nproc}"], out, "job.log", script=GRADIENT_WORKER,
                       **knobs)
    assert wait_exit(proc, 180, out / "job.log") == 0, tail(out / "job.log")
    return json.loads((out / "gradients.json").read_text())


@pytest.mark.parametrize("nproc, mode, accum", [(2, "samples", 1), (2, "tokens", 2),
                                               pytest.param(3, "tokens", 2, marks=pytest.mark.slow)])
def test_sharded_step_gradient_is_the_single_process_gradient(jobs, tmp_path, nproc, mode, accum):
    result = _gradient_errors(jobs, tmp_path / "grad", nproc, WORKER_MODE=mode, WORKER_ACCUM=str(accum))
    assert result["micro_steps"] == accum
    assert result["unique"] == result["samples"] > 0  # every replica trained other samples
    worst = max(result["errors"].values())
    assert worst < 1e-5, result["errors"]


@pytest.mark.slow
def test_hsdp_step_gradient_is_the_single_process_gradient(jobs, tmp_path):
    result = _gradient_errors(jobs, tmp_path / "hsdp", 4, WORKER_MODE="tokens", WORKER_ACCUM="2",
                              WORKER_SHARD_SIZE="2")
    assert max(result["errors"].values()) < 1e-5, result["errors"]


def _saved_full_state(out: Path, seq: int) -> dict:
    """The model and optimizer state of checkpoint ``seq``, its shards gathered into full tensors.

    Read with DCP's own converter (a test reads its own files; the library's reader is the safe one).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = store(out).open(seq)
    converted = out / f"full-checkpoint-{seq}.pt"
    dcp_to_torch_save(checkpoint.info.path / _format.SHARDED_DIR, converted)
    nested: dict = {}
    for key, value in torch.load(converted, weights_only=False).items():
        path = json.loads(key)  # the library's flat keys are JSON paths: [state name, key, key, ...]
        if path[0] != MODEL_STATE:
            continue
        node = nested
        for part in path[1:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return nested


def _assert_resumed_exactly(out: Path, since: float, replicas: int, log: Path) -> int:
    """Every worker started after ``since`` resumed the same checkpoint, at its loader step, and
    rank 0's full (gathered) model and optimizer state equals the checkpoint's shards exactly."""
    records = resume_records(out, since)
    assert len(records) == replicas and {r["world"] for r in records} == {replicas}, f"{records}\n{tail(log)}"
    (seq,) = {r["seq"] for r in records}
    assert seq is not None, f"a fresh start after a checkpoint: {records}\n{tail(log)}"
    checkpoint = store(out).open(seq)
    (loader,) = [name for name in checkpoint.names() if name.startswith("adaptive.dataloader.")]
    step = checkpoint.load(loader)["step"]
    assert {r["loader_step"] for r in records} == {r["model_steps"] for r in records} == {step}, records
    (rank0,) = [r for r in records if r["rank"] == 0]
    live = torch.load(out / f"full-state-{rank0['pid']}.pt", weights_only=True)
    saved = _saved_full_state(out, seq)
    assert saved["optimizer"]["state"], "the checkpoint has no optimizer state"
    assert_equal_states(live["model"], saved["model"], "model")
    assert_equal_states(live["optimizer"]["state"], saved["optimizer"]["state"], "optimizer.state")
    return seq


def _stop(jobs, proc, out: Path, started: float, log: Path) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does to torchrun
    assert wait_exit(proc, 90, log) == 143, tail(log)
    assert_stopped_gracefully(out, started, progress(out, 0), log)


@pytest.mark.parametrize("meta", [False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.ci_sample])],
                         ids=["built", "meta-device"])
def test_sigkill_then_stops_and_relaunches_at_2_1_3_replicas_reshard_exactly(jobs, tmp_path, meta):
    out = tmp_path / "reshard"
    knobs = dict(WORKER_EPOCHS="3", ADAPTIVE_CHECKPOINT_KEEP="1000",  # keep every resumed checkpoint, to compare
                 WORKER_META="1" if meta else "0")
    log = out / "job2.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=3"], out, "job2.log",
                       script=WORKER, ADAPTIVE_CHECKPOINT_INTERVAL="0.3", **knobs)
    victim = wait_for(lambda: (p := progress(out, 1)) and p["epoch"] >= 1 and p["step"] % 20 > 4
                      and newest_checkpoint_step(out) > 8 and p, 150, "rank 1 to reach the middle of epoch 1")
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: len(resume_records(out, killed_at)) == 2, 120, "both ranks to restart")
    _assert_resumed_exactly(out, killed_at, 2, log)
    started = min(r["time"] for r in resume_records(out, killed_at))  # the surviving rank's exit was before
    wait_for(lambda: (p := progress(out, 0)) and p["pid"] != victim["pid"] and p["step"] >= 2
             and (out / "progress.rank0.json").stat().st_mtime > killed_at + 1, 120, "training after the restart")
    _stop(jobs, proc, out, started, log)
    for nproc in (1, 3):
        log = out / f"job{nproc}.log"
        started = time.time()
        proc = jobs.launch(["--standalone", f"--nproc-per-node={nproc}"], out, f"job{nproc}.log",
                           script=WORKER, ADAPTIVE_CHECKPOINT_INTERVAL="0", **knobs)
        wait_for(lambda: len(resume_records(out, started)) == nproc, 120, f"{nproc} replicas to start")
        _assert_resumed_exactly(out, started, nproc, log)
        if nproc == 3:
            assert wait_exit(proc, 240, log) == 0, tail(log)
            break
        start = resume_records(out, started)[0]["loader_step"]
        wait_for(lambda: (p := progress(out, 0)) and p["world"] == nproc and p["step"] >= start + 6, 120,
                 f"{nproc} replicas to take 6 steps")
        _stop(jobs, proc, out, started, log)
    assert_exact_counts(out, 3, log)
    done = json.loads((out / "done.json").read_text())
    assert done["world"] == 3 and done["step"] == done["model_steps"]


@pytest.mark.slow
def test_hsdp_mesh_stop_then_resume_on_a_1d_mesh_reshards_exactly(jobs, tmp_path):
    out = tmp_path / "mesh"
    knobs = dict(WORKER_EPOCHS="1", ADAPTIVE_CHECKPOINT_INTERVAL="0")
    log = out / "job4.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=4"], out, "job4.log", script=WORKER,
                       WORKER_SHARD_SIZE="2", **knobs)
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 4 and p["step"] >= 5, 150, "4 replicas on a 2x2 mesh")
    assert {tuple(r["mesh"]) for r in resume_records(out, started)} == {(2, 2)}
    _stop(jobs, proc, out, started, log)
    log = out / "job2.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER, **knobs)
    assert wait_exit(proc, 240, log) == 0, tail(log)
    _assert_resumed_exactly(out, started, 2, log)
    assert {tuple(r["mesh"]) for r in resume_records(out, started)} == {(2,)}
    assert_exact_counts(out, 1, log)


@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_token_lm_example_trains_sharded_and_a_relaunch_on_1_replica_reshards(jobs, tmp_path):
    """``examples/token_lm.py --shard``: 2 replicas train a few steps and finish; the same command on
    1 replica restores the sharded checkpoint (2 -> 1) and trains nothing more."""
    import subprocess
    import sys

    out = tmp_path / "token_lm"
    args = ["--shard", "--files", "12", "--steps", "4", "--epochs", "1", "--dim", "16", "--max-tokens", "1024"]
    logs = []
    for nproc in (2, 1):
        log = out / f"job{nproc}.log"
        out.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as sink:
            proc = subprocess.Popen([sys.executable, "-m", "adaptive.elastic.launcher", "--standalone",
                                     f"--nproc-per-node={nproc}", str(REPO / "examples" / "token_lm.py"), *args],
                                    env=jobs.env(out), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=str(out))
        jobs.procs.append(proc)
        assert wait_exit(proc, 240, log) == 0, tail(log)
        logs.append(log.read_text())
    first, second = logs
    assert "epoch 0: train loss" in first and "stopping after 4 optimizer steps" in first, first[-3000:]
    assert "restored the sharded model" in second and "mesh (1,)" in second, second[-3000:]
    assert "train loss" not in second
    latest = store(out).latest()
    assert latest.info.metadata["reason"] == "finished" and latest.sharded_names() == [MODEL_STATE]
