"""Real torchrun jobs on 127.0.0.1 (gloo) that are killed, stopped and rescaled."""

from __future__ import annotations

import json
import os
import signal

import portpicker
import pytest

from adaptive.hints import read_hints
from elastic_harness import Jobs, assert_exact_counts, progress, tail, wait_exit, wait_for

pytestmark = pytest.mark.distributed


@pytest.fixture
def jobs(tmp_path):
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


def test_sigkill_one_worker_rolls_back_and_finishes_exactly(jobs, tmp_path):
    out = tmp_path / "crash"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=3"], out, "job.log",
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.3", WORKER_EPOCHS="3")
    victim = wait_for(lambda: (p := progress(out, 1)) and p["epoch"] >= 1 and p["step"] % 25 > 5 and p,
                      120, "rank 1 to reach the middle of epoch 1")
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_exit(proc, 240, out / "job.log") == 0, tail(out / "job.log")
    log = (out / "job.log").read_text()
    assert "resuming from checkpoint" in log
    assert_exact_counts(out, 3, out / "job.log")


def test_graceful_stop_then_relaunch_at_1_and_3_replicas_resumes_exactly(jobs, tmp_path):
    out = tmp_path / "rescale"
    stops = []
    for nproc, stop_after in ((2, 8), (1, 8), (3, None)):
        proc = jobs.launch(["--standalone", f"--nproc-per-node={nproc}"], out, f"job{nproc}.log",
                           ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="2")
        if stop_after is None:
            assert wait_exit(proc, 240, out / f"job{nproc}.log") == 0, tail(out / f"job{nproc}.log")
            break
        start = (progress(out, 0) or {}).get("step", 0)
        wait_for(lambda: (p := progress(out, 0)) and p["world"] == nproc and p["step"] >= start + stop_after,
                 120, f"{nproc} replicas to take {stop_after} steps")
        os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler or Ctrl-C does to torchrun
        wait_exit(proc, 60, out / f"job{nproc}.log")
        stops.append(progress(out, 0)["step"])
        assert "stopped gracefully" in (out / f"job{nproc}.log").read_text(), tail(out / f"job{nproc}.log")
    assert_exact_counts(out, 2, out / "job3.log")
    for name in ("job1.log", "job3.log"):
        assert "resuming from checkpoint" in (out / name).read_text()


def test_membership_change_with_c10d_agents_join_and_leave(jobs, tmp_path):
    out = tmp_path / "membership"
    port = portpicker.pick_unused_port()
    common = ["--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=5", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=membership"]
    knobs = dict(ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="3", WORKER_STEP_SLEEP="0.1")
    host = jobs.launch(common + ["--rdzv-conf=is_host=1"], out, "agent0.log", **knobs)  # hosts the store: stays
    wait_for(lambda: (out / "agent0.log").exists(), 30, "the host agent to start")
    guest = common + ["--rdzv-conf=is_host=0"]
    leaver = jobs.launch(guest, out, "agent1.log", **knobs)
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 and p["step"] >= 3, 120, "2 nodes training")
    joiner = jobs.launch(guest, out, "agent2.log", **knobs)
    wait_for(lambda: (p := progress(out, 2)) and p["world"] == 3, 120, "a third node to join")
    steps_at_three = progress(out, 0)["step"]
    os.killpg(leaver.pid, signal.SIGTERM)  # one node leaves
    wait_exit(leaver, 60, out / "agent1.log")
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 and p["step"] > steps_at_three + 2,
             120, "training to continue on 2 nodes")
    for proc, name in ((host, "agent0.log"), (joiner, "agent2.log")):
        assert wait_exit(proc, 240, out / name) == 0, tail(out / name)
    records = assert_exact_counts(out, 3, out / "agent0.log")
    assert {record["world"] for record in records.values()} <= {2, 3}


def _batches(out):
    return [json.loads(line) for line in (out / "batches.jsonl").read_text().splitlines()]


def test_autoscale_changes_batch_mid_epoch_and_redecides_after_rescale(jobs, tmp_path):
    out = tmp_path / "autoscale"
    knobs = dict(ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="3", WORKER_SAMPLES="1200", WORKER_BATCH="16",
                 WORKER_AUTOSCALE="256,4,64,1,3", WORKER_STEP_SLEEP="0.02")
    for nproc, stop_at_epoch in ((2, 1), (1, 2), (3, None)):
        proc = jobs.launch(["--standalone", f"--nproc-per-node={nproc}"], out, f"job{nproc}.log", **knobs)
        log = out / f"job{nproc}.log"
        if stop_at_epoch is None:
            assert wait_exit(proc, 240, log) == 0, tail(log)
            break
        wait_for(lambda: (p := progress(out, 0)) and p["world"] == nproc and p["epoch"] >= stop_at_epoch
                 and p["step"] > 0, 180, f"epoch {stop_at_epoch} on {nproc} replicas")
        os.killpg(proc.pid, signal.SIGTERM)
        wait_exit(proc, 60, log)
    assert_exact_counts(out, 3, out / "job3.log")
    batches = _batches(out)
    sizes_by_epoch = {e: {b["batch_size"] for b in batches if b["epoch"] == e and b["world"] == 2} for e in (0, 1)}
    assert any(len(sizes) > 1 for sizes in sizes_by_epoch.values()), \
        f"the batch size never changed within an epoch on 2 replicas: {sizes_by_epoch}"
    hints = read_hints(out / "checkpoints")  # what the job tells a cluster scheduler
    assert hints.current.num_replicas == 3 and hints.max_profiled_replicas >= 2
    assert hints.perf_params is not None and hints.grad_params is not None
    for name, replicas in (("job1.log", 1), ("job3.log", 3)):
        text = (out / name).read_text()
        assert f"replica count changed from 2 to {replicas}" in text or \
               f"replica count changed from 1 to {replicas}" in text, tail(out / name)
