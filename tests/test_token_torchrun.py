"""Token budgets and a token ramp-up under real torchrun jobs (gloo on 127.0.0.1): killed, stopped, rescaled."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from adaptive.batchsize.rampup import StagedSchedule
from elastic_harness import (REPO, Jobs, assert_exact_counts, assert_resumed, assert_resumed_newest,
                             assert_stopped_gracefully, newest_checkpoint_step, progress, resume_records, tail,
                             wait_exit, wait_for)

pytestmark = pytest.mark.distributed

WORKER = REPO / "tests" / "workers" / "token_worker.py"
SCHEDULE = "0:96 1500:192 4000:384"
MAX_TOKENS = 64


@pytest.fixture
def jobs(tmp_path):
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


def _steps(out):
    """The step records that count: a step replayed after a crash replaces its rolled-back run."""
    records: dict[int, dict] = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return [records[step] for step in sorted(records)]


@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_kill_then_rescale_mid_epoch_and_mid_ramp_continues_the_schedule_exactly(jobs, tmp_path):
    out = tmp_path / "tokens"
    knobs = dict(WORKER_SCHEDULE=SCHEDULE, WORKER_MAX_TOKENS=str(MAX_TOKENS), WORKER_EPOCHS="2")
    log2 = out / "job2.log"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=2"], out, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.2", ADAPTIVE_CHECKPOINT_KEEP="1000", **knobs)
    victim = wait_for(lambda: (p := progress(out, 1)) and p["step"] >= 6 and newest_checkpoint_step(out) >= 2 and p,
                      120, "rank 1 to take 6 steps in the first stage of the ramp, after a periodic checkpoint")
    os.kill(victim["pid"], signal.SIGKILL)  # a crash: torchrun restarts both workers from the last checkpoint
    killed_at = time.time()
    wait_for(lambda: (p := progress(out, 0)) and p["pid"] != victim["pid"] and p["consumed"] >= 2000 and p,
             120, "the restarted workers to reach the second stage of the ramp")
    os.killpg(proc.pid, signal.SIGTERM)  # a scheduler takes the job away: graceful stop
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    text = log2.read_text()
    assert "resuming from checkpoint" in text and "stopped gracefully" in text, tail(log2)
    assert [r["seq"] for r in resume_records(out)[:2]] == [None, None]
    restarted = resume_records(out, since=killed_at)
    assert len(restarted) == 2 and len({r["seq"] for r in restarted}) == 1 and restarted[0]["seq"], restarted
    assert_resumed_newest(out, restarted, log2)  # the crash rolled back to the newest checkpoint, applied
    stopped_at = progress(out, 0)
    checkpoint = assert_stopped_gracefully(out, min(r["time"] for r in restarted), stopped_at, log2)
    log3 = out / "job3.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", **knobs)
    assert wait_exit(proc, 180, log3) == 0, tail(log3)
    assert "resuming from checkpoint" in log3.read_text()
    assert_resumed(out, started, checkpoint, 3, log3)

    records = assert_exact_counts(out, 2, log3)
    assert {record["world"] for record in records.values()} <= {2, 3}
    schedule, steps = StagedSchedule(SCHEDULE, unit="tokens"), _steps(out)
    consumed = 0
    for step in steps:  # the sequence continues the schedule across the crash and the rescale
        assert step["consumed"] == consumed, f"a gap or a repeat before step {step}"
        scheduled = schedule.batch_size_at(consumed)
        assert step["budget"] <= MAX_TOKENS and step["padded"] <= step["planned"] <= scheduled
        if not step["final"]:
            replicas, micro = step["world"], step["micro_steps"]  # micro-steps of at most MAX_TOKENS
            assert micro == -(-scheduled // (replicas * MAX_TOKENS))
            assert step["budget"] == scheduled // (replicas * micro)
        consumed += step["tokens"]
    after = [s for s in steps if s["step"] > stopped_at["step"]]  # progress names the last step trained
    assert after and {s["world"] for s in after} == {3}
    assert {schedule.batch_size_at(s["consumed"]) for s in after} >= {192, 384}, "the ramp did not continue"
    done = json.loads((out / "done.json").read_text())
    assert done["consumed"] == consumed
