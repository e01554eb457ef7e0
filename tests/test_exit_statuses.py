"""The exit statuses a supervisor reads, with real launchers and workers on 127.0.0.1 (docs/live.md, "Exit
statuses"): 2, a usage or configuration error, ends a node at once without spending its restarts, plain or
live; 75, a live job's store lost with the node that hosted it, is relaunched by the scheduler's local backend,
and the job finishes with every sample trained once per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import portpicker
import pytest

from adaptive.checkpoint.generation import CheckpointFolderError, Generation
from adaptive.checkpoint.store import CheckpointError, CheckpointStore
from elastic_harness import Jobs, wait_exit
from live_harness import BATCH, LIVE_WORKER, REPO, SAMPLES, logs, steps

pytestmark = pytest.mark.distributed


@pytest.fixture
def jobs(tmp_path):
    """Launchers started by a test, every one of them and its workers killed after it."""
    started = Jobs(tmp_path)
    yield started
    started.cleanup()


def test_a_folder_under_a_file_is_a_checkpoint_folder_error_that_names_it_and_why(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    folder = tmp_path / "a-file" / "checkpoints"
    with pytest.raises(CheckpointFolderError) as error:
        Generation.take(folder)
    assert isinstance(error.value, CheckpointError) and error.value.folder == str(folder)
    assert str(error.value) == f"cannot create the checkpoint folder {folder}: Not a directory (a part of the path " \
                               "is a file)"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_a_folder_under_a_read_only_parent_is_a_checkpoint_folder_error(tmp_path):
    parent = tmp_path / "read-only"
    parent.mkdir(mode=0o500)
    with pytest.raises(CheckpointFolderError, match="Permission denied"):
        Generation.take(parent / "checkpoints")


def uncreatable(tmp_path: Path) -> str:
    """A checkpoint folder that cannot be created: its parent is a file."""
    (tmp_path / "a-file").write_text("not a folder")
    return str(tmp_path / "a-file" / "checkpoints")


def exit_records(out: Path) -> list[dict]:
    """Every worker process's exit record (tests/workers/worker_common.py: run_main)."""
    return [json.loads(line) for path in out.glob("exits*.jsonl") for line in path.read_text().splitlines()]


def test_an_uncreatable_checkpoint_folder_ends_a_plain_node_with_2_after_one_try(jobs, tmp_path):
    """Two workers, three restarts allowed: each worker says once why it ends (the folder and the reason), the
    launcher ends the node with 2 at once, and nothing prints a traceback."""
    out, folder = tmp_path / "job", uncreatable(tmp_path)
    started = time.monotonic()
    node = jobs.launch(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"], out, "node.log",
                       ADAPTIVE_CHECKPOINT_PATH=folder)
    assert wait_exit(node, 90, out / "node.log") == 2, logs(out)
    said = (out / "node.log").read_text(errors="replace")
    assert said.count(f"checkpoint folder {folder}: Not a directory") <= 2, said  # once per worker at most
    assert f"cannot create the checkpoint folder {folder}: Not a directory" in said, said
    assert "Traceback" not in said and "ending this node with 2 without restarting" in said, said
    records = exit_records(out)
    assert records and all(r["code"] == 2 for r in records) and len({r["pid"] for r in records}) <= 2, records
    assert time.monotonic() - started < 90


def test_an_uncreatable_checkpoint_folder_ends_a_live_node_with_2_after_one_try(jobs, tmp_path):
    out, folder, port = tmp_path / "job", uncreatable(tmp_path), portpicker.pick_unused_port()
    node = jobs.launch(["--live", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
                        "--rdzv-endpoint", f"127.0.0.1:{port}"], out, "node.log", script=LIVE_WORKER,
                       ADAPTIVE_CHECKPOINT_PATH=folder)
    assert wait_exit(node, 90, out / "node.log") == 2, logs(out)
    said = (out / "node.log").read_text(errors="replace")
    assert said.count(f"cannot create the checkpoint folder {folder}: Not a directory") == 1, said
    assert "Traceback" not in said and "starting it again" not in said, said


def test_a_usage_error_ends_a_plain_node_with_2_without_spending_its_restarts(jobs, tmp_path):
    out = tmp_path / "job"
    script = tmp_path / "bad_arguments.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args(['--no-such-option'])\n")
    node = jobs.launch(["--standalone", "--nproc-per-node", "1", "--max-restarts", "3"], out, "node.log",
                       script=script)
    assert wait_exit(node, 90, out / "node.log") == 2, logs(out)
    said = (out / "node.log").read_text(errors="replace")
    assert said.count("unrecognized arguments") == 1 and "Traceback" not in said, said


def checkpointed(spec) -> bool:
    """Whether the job of ``spec`` has a complete checkpoint."""
    return bool(CheckpointStore(spec.checkpoint_dir).list())


@pytest.mark.slow
@pytest.mark.ci_sample  # about 30 s: CI runs it after the default suite
def test_the_local_backend_relaunches_a_live_job_whose_store_host_was_killed(tmp_path):
    """Two live replicas under the executor; SIGKILL of the launcher hosting the job's store: the other ends with
    75 within seconds, the executor relaunches the job at once (an infrastructure failure, not charged) and it
    finishes from its newest checkpoint with every sample trained once per epoch."""
    from policy_cases import ScriptedPolicy
    from scheduler.cluster import ClusterSpec
    from scheduler.executor.executor import Executor, JobState
    from scheduler.executor.jobspec import JobSpec
    from scheduler.executor.local_live import LiveLocalBackend

    out = tmp_path / "job"
    out.mkdir()
    spec = JobSpec(name="live", command=(str(LIVE_WORKER),), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=2,
                   max_failures=0, env={"WORKER_OUT": str(out), "WORKER_SAMPLES": str(SAMPLES),
                                        "WORKER_BATCH": str(BATCH), "WORKER_EPOCHS": "4",
                                        "WORKER_STEP_SLEEP": "0.08", "OMP_NUM_THREADS": "1",
                                        "ADAPTIVE_CHECKPOINT_INTERVAL": "1", "ADAPTIVE_COLLECTIVE_TIMEOUT": "60",
                                        "PYTHONPATH": str(REPO)})
    backend = LiveLocalBackend(str(tmp_path / "logs"))
    ex = Executor(backend, ScriptedPolicy(lambda names, nodes: {name: [0, 0] for name in names}), ClusterSpec(1, 2),
                  interval=0.2, grace_period=60)
    ex.submit(spec)
    deadline, killed_at, relaunched_in = time.monotonic() + 240, None, None
    try:
        while not ex.done:
            assert time.monotonic() < deadline, f"the job did not finish: {ex.status()}\n{logs(tmp_path / 'logs')}"
            ex.step()
            job = ex.jobs["live"]
            if killed_at is None and sum(r["world"] == 2 for r in steps(out)) >= 8 and checkpointed(spec):
                os.kill(job.handle.pid, signal.SIGKILL)  # the first launcher, which hosts the store
                killed_at = time.monotonic()
            elif killed_at is not None and relaunched_in is None and job.launches == 2:
                relaunched_in = time.monotonic() - killed_at
            time.sleep(0.1)
    finally:
        ex.shutdown(timeout=30)
    (status,) = ex.status()
    assert status["state"] == JobState.SUCCEEDED.value, (status, logs(tmp_path / "logs"))
    assert (status["launches"], status["infra_failures"], status["failures"]) == (2, 1, 0), status
    assert relaunched_in is not None and relaunched_in < 20, relaunched_in
    said = (tmp_path / "logs" / "live" / "attempt-1.node-1.log").read_text(errors="replace")
    assert "has not answered" in said and "ending node 2 with 75" in said, said
    last = {r["epoch"]: r for r in map(json.loads, (out / "epochs.jsonl").read_text().splitlines())}
    assert sorted(last) == list(range(4))
    assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in last.values()), last
    relaunched = "".join(path.read_text() for path in (tmp_path / "logs" / "live").glob("attempt-2.node-*.log"))
    assert "resuming from checkpoint" in relaunched, relaunched
