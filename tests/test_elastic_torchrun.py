"""Real torchrun jobs on 127.0.0.1 (gloo) that are killed, stopped and rescaled."""

from __future__ import annotations

import json
import os
import signal
import time

import portpicker
import pytest

from adaptive.checkpoint.generation import newest_generation
from adaptive.goodput import read_hints
from elastic_harness import (Jobs, assert_exact_counts, live_pids, assert_resumed, assert_resumed_newest, assert_state_applied,
                             assert_stopped_gracefully, exit_codes, newest_checkpoint_step, progress,
                             resume_records, store, tail, wait_exit, wait_for)

pytestmark = pytest.mark.distributed


@pytest.fixture
def jobs(tmp_path):
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


def test_sigkill_one_worker_rolls_back_and_finishes_exactly(jobs, tmp_path):
    out = tmp_path / "crash"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=3"], out, "job.log",
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.3", WORKER_EPOCHS="3",
                       ADAPTIVE_CHECKPOINT_KEEP="1000")  # keep the checkpoint the restart resumed, to compare
    victim = wait_for(lambda: (p := progress(out, 1)) and p["epoch"] >= 1 and p["step"] % 25 > 5
                      and newest_checkpoint_step(out) > 12 and p, 120, "rank 1 to reach the middle of epoch 1")
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.time()
    assert wait_exit(proc, 240, out / "job.log") == 0, tail(out / "job.log")
    log = (out / "job.log").read_text()
    assert "resuming from checkpoint" in log
    assert_exact_counts(out, 3, out / "job.log")
    first, restarted = resume_records(out)[:2], resume_records(out, since=killed_at)
    assert [r["seq"] for r in first] == [None, None], first  # a fresh start...
    assert len(restarted) == 2 and all(r["seq"] is not None for r in restarted), restarted
    assert restarted[0]["seq"] == restarted[1]["seq"]
    assert_resumed_newest(out, restarted, out / "job.log")  # ...then the newest periodic checkpoint, applied
    assert all(r["model"] != first[0]["model"] for r in restarted)
    assert restarted[0]["loader_step"] > 10  # rolled back a few steps, not to the start
    # the restart round is a new incarnation: it took generation 2 after the kill, and from then on only it
    # published (a save the first incarnation had agreed on may still land between the kill and that moment)
    newest = newest_generation(out / "checkpoints")
    assert newest.number == 2 and newest.taken_at > killed_at
    generations = [(info.created > newest.taken_at, info.metadata["generation"]) for info in store(out).list()]
    assert {g for after, g in generations if not after} == {1} and {g for after, g in generations if after} == {2}, \
        generations


@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s: CI runs it after the default suite
def test_graceful_stop_then_relaunch_at_1_and_3_replicas_resumes_exactly(jobs, tmp_path):
    out = tmp_path / "rescale"
    stops = []
    resumed_from = None  # the checkpoint the next launch must resume
    for nproc, stop_after in ((2, 8), (1, 8), (3, None)):
        log = out / f"job{nproc}.log"
        started = time.time()
        proc = jobs.launch(["--standalone", f"--nproc-per-node={nproc}"], out, f"job{nproc}.log",
                           ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="2")
        if stop_after is None:
            assert wait_exit(proc, 240, log) == 0, tail(log)
            assert_resumed(out, started, resumed_from, nproc, log)
            break
        start = (progress(out, 0) or {}).get("step", 0)
        wait_for(lambda: (p := progress(out, 0)) and p["world"] == nproc and p["step"] >= start + stop_after,
                 120, f"{nproc} replicas to take {stop_after} steps")
        os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does to torchrun
        assert wait_exit(proc, 60, log) == 143, tail(log)  # 128 + SIGTERM: stopped after a checkpoint
        stopped = progress(out, 0)
        stops.append(stopped["step"])
        assert "stopped gracefully" in log.read_text(), tail(log)
        assert "finish_training" not in log.read_text(), tail(log)  # a stop is not a break out of the epoch loop
        if resumed_from is None:
            assert [r["seq"] for r in resume_records(out, started)] == [None] * nproc  # a fresh start
        else:
            assert_resumed(out, started, resumed_from, nproc, log)
        resumed_from = assert_stopped_gracefully(out, started, stopped, log)
    # each launch continued where the previous one stopped: no step retrained, none skipped
    assert len(stops) == 2 and 8 <= stops[0] and stops[0] + 8 <= stops[1] < 50, stops
    assert_exact_counts(out, 2, out / "job3.log")
    done = json.loads((out / "done.json").read_text())
    assert done["step"] == 50 and done["world"] == 3  # 2 epochs of 600 samples, 24 per step


def test_sigint_stops_like_ctrl_c_and_the_relaunch_resumes(jobs, tmp_path):
    """Ctrl-C: SIGINT to torchrun, which forwards SIGINT to its workers (torch.distributed.elastic
    handles SIGTERM, SIGINT, SIGHUP, SIGQUIT alike).  The workers stop after the same step,
    checkpoint and exit 143; ``adaptive-run`` exits 130 (128 + SIGINT, docs/api.md)."""
    out = tmp_path / "sigint"
    log = out / "job2.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log",
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="2")
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 6, 120, "2 replicas to take 6 steps")
    os.killpg(proc.pid, signal.SIGINT)
    assert wait_exit(proc, 60, log) == 130, tail(log)
    text = log.read_text()
    assert "received SIGINT" in text and "stopped gracefully" in text, tail(log)
    checkpoint = assert_stopped_gracefully(out, started, progress(out, 0), log)
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=1"], out, "job1.log",
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="2")
    assert wait_exit(proc, 240, out / "job1.log") == 0, tail(out / "job1.log")
    assert_resumed(out, started, checkpoint, 1, out / "job1.log")
    assert exit_codes(out, started) == [0]
    assert_exact_counts(out, 2, out / "job1.log")


@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_membership_change_with_c10d_agents_join_and_leave(jobs, tmp_path):
    out = tmp_path / "membership"
    port = portpicker.pick_unused_port()
    common = ["--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=5", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=membership"]
    knobs = dict(ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="3", WORKER_STEP_SLEEP="0.1",
                 ADAPTIVE_CHECKPOINT_KEEP="1000")  # keep every resumed checkpoint, to compare
    host = jobs.launch(common + ["--rdzv-conf=is_host=1"], out, "agent0.log", **knobs)  # hosts the store: stays
    wait_for(lambda: (out / "agent0.log").exists(), 30, "the host agent to start")
    guest = common + ["--rdzv-conf=is_host=0"]
    leaver = jobs.launch(guest, out, "agent1.log", **knobs)
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 and p["step"] >= 3, 120, "2 nodes training")
    joiner = jobs.launch(guest, out, "agent2.log", **knobs)
    wait_for(lambda: (p := progress(out, 2)) and p["world"] == 3, 120, "a third node to join")
    steps_at_three = progress(out, 0)["step"]
    os.killpg(leaver.pid, signal.SIGTERM)  # one node leaves
    assert wait_exit(leaver, 60, out / "agent1.log") == 143, tail(out / "agent1.log")
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 and p["step"] > steps_at_three + 2,
             120, "training to continue on 2 nodes")
    for proc, name in ((host, "agent0.log"), (joiner, "agent2.log")):
        assert wait_exit(proc, 240, out / name) == 0, tail(out / name)
    records = assert_exact_counts(out, 3, out / "agent0.log")
    assert {record["world"] for record in records.values()} <= {2, 3}
    # the join and the leave each restarted the workers from a stop checkpoint, with its state applied
    resumes = [r for r in resume_records(out) if r["seq"] is not None]
    assert len({r["seq"] for r in resumes}) >= 2, resumes
    for seq in {r["seq"] for r in resumes}:
        assert store(out).open(seq).info.metadata.get("reason") == "stop"
    assert_state_applied(out, resumes, out / "agent0.log")


def _batches(out):
    return [json.loads(line) for line in (out / "batches.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_autoscale_changes_batch_mid_epoch_and_redecides_after_rescale(jobs, tmp_path):
    out = tmp_path / "autoscale"
    knobs = dict(ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_EPOCHS="3", WORKER_SAMPLES="1200", WORKER_BATCH="16",
                 WORKER_AUTOSCALE="256,4,64,1,3", WORKER_STEP_SLEEP="0.02")
    resumed_from = None
    for nproc, stop_at_epoch in ((2, 1), (1, 2), (3, None)):
        started = time.time()
        proc = jobs.launch(["--standalone", f"--nproc-per-node={nproc}"], out, f"job{nproc}.log", **knobs)
        log = out / f"job{nproc}.log"
        if stop_at_epoch is None:
            assert wait_exit(proc, 240, log) == 0, tail(log)
            assert_resumed(out, started, resumed_from, nproc, log)
            break
        wait_for(lambda: (p := progress(out, 0)) and p["world"] == nproc and p["epoch"] >= stop_at_epoch
                 and p["step"] > 0, 180, f"epoch {stop_at_epoch} on {nproc} replicas")
        os.killpg(proc.pid, signal.SIGTERM)
        assert wait_exit(proc, 60, log) == 143, tail(log)
        if resumed_from is not None:
            assert_resumed(out, started, resumed_from, nproc, log)
        resumed_from = assert_stopped_gracefully(out, started, progress(out, 0), log)
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


@pytest.mark.parametrize("loader_workers", [0, pytest.param(1, marks=[pytest.mark.slow, pytest.mark.ci_sample])])
def test_a_killed_peer_is_one_line_per_survivor_without_tracebacks(jobs, tmp_path, loader_workers):
    """SIGKILL of one worker in the middle of DDP's gradient all-reduce: the survivors each say so in one line
    (their traceback goes to the DEBUG log), write nothing, and the restarted group finishes exactly."""
    out = tmp_path / "peer"
    proc = jobs.launch(["--standalone", "--nproc-per-node=3", "--max-restarts=2"], out, "job.log",
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.5", WORKER_EPOCHS="2", WORKER_STEP_SLEEP="0.02",
                       WORKER_LOADER_WORKERS=str(loader_workers))
    victim = wait_for(lambda: (p := progress(out, 2)) and p["step"] >= 8 and newest_checkpoint_step(out) > 2 and p,
                      120, "rank 2 to train")
    survivors = [progress(out, rank)["pid"] for rank in (0, 1)]
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not live_pids(survivors), 60, "the survivors to exit")  # torchrun SIGKILLs after 30 s of grace
    exit_seconds = time.monotonic() - killed_at
    assert wait_exit(proc, 240, out / "job.log") == 0, tail(out / "job.log")
    log = (out / "job.log").read_text()
    assert "Traceback" not in log, log[-6000:]
    lines = [line for line in log.splitlines() if "a peer replica failed" in line]
    assert 1 <= len(lines) <= 2 and all("exiting without writing a checkpoint" in line for line in lines), lines
    assert_exact_counts(out, 2, out / "job.log")
    print(f"survivors exited {exit_seconds:.2f} s after the kill ({loader_workers} DataLoader worker(s) each)")
