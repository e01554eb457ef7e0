"""The scheduler's console commands as a user runs them: ``adaptive-supervisor --policy`` and
``adaptive-executor submit / run / status``, each a real process (the executor's jobs are real
``adaptive-run`` jobs on 127.0.0.1), every wait bounded, every process killed by pid afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adaptive.runtime.process_tree import kill_process_tree
from elastic_harness import (REPO, assert_exact_counts, assert_resumed, progress, resume_records, store, tail,
                             wait_for)
from scheduler.supervisor import SupervisorClient, SupervisorState

TOKEN = "cli-test-token-0123456789abcdef"
WORKER = REPO / "tests" / "workers" / "elastic_worker.py"


def console(name: str) -> str:
    """The console script ``pip install -e .`` put next to this Python."""
    path = Path(sys.executable).with_name(name)
    assert path.exists(), f"{name} is not installed next to {sys.executable}: pip install -e ."
    return str(path)


def environment() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "ADAPTIVE_JOB_ID", "ADAPTIVE_CHECKPOINT_PATH", "ADAPTIVE_SHARE_PATH", "SCHEDULER_TOKEN"):
        env.pop(name, None)
    return env


class Processes:
    """Commands started here, each in its own session with its output in a file; all killed (by pid) at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_process_tree(proc.pid)
            proc.wait(timeout=30)


@pytest.fixture
def processes():
    started = Processes()
    yield started
    started.cleanup()


def wait_for_line(proc: subprocess.Popen, log: Path, start: str, timeout: float) -> str:
    """The first line of ``log`` that starts with ``start``."""
    def find():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(start)]
        if not lines and proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before printing {start!r}:\n{tail(log)}")
        return lines[-1] if lines else None
    return wait_for(find, timeout, f"{start!r} in {log}")


def hints(job_id: str) -> dict:
    """Hints as a job posts them (adaptive.goodput.hints format): profiled on 2 replicas."""
    return {
        "version": 2, "job_id": job_id, "timestamp": 1.0, "init_batch_size": 128, "max_batch_size": 4096,
        "local_bsz_bounds": [32, 1024], "gradient_accumulation": True,
        "perf_params": {"alpha_c": 0.02, "beta_c": 0.0006, "alpha_n": 0.1, "beta_n": 0.002,
                        "alpha_r": 0.01, "beta_r": 0.001, "gamma": 1.2},
        "grad_params": {"sqr": 1.0, "var": 20.0}, "max_profiled_replicas": 2, "max_profiled_nodes": 1,
        "progress": 10.0, "current": {"num_nodes": 1, "num_replicas": 2, "local_bsz": 64, "accum_steps": 1},
        "completed_fraction": None,
    }


def start_supervisor(processes: Processes, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, SupervisorClient]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    log = tmp_path / f"supervisor-{len(processes.procs)}.log"
    proc = processes.start([console("adaptive-supervisor"), "--state", str(tmp_path / "state.json"),
                            "--port", "0", "--token-file", str(token_file), *args], log)
    line = wait_for_line(proc, log, "supervisor listening on http://127.0.0.1:", 60)
    return proc, SupervisorClient(line.rsplit(" ", 1)[1], TOKEN)


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def test_supervisor_with_goodput_policy_allocates_from_hints_and_keeps_them_across_restarts(processes, tmp_path):
    proc, client = start_supervisor(processes, tmp_path, "--policy", "goodput", "--nodes", "1",
                                    "--gpus-per-node", "4", "--interval", "0.2")
    client.register_job("job-a", min_replicas=1, max_replicas=8)
    client.post_hints("job-a", hints("job-a"))
    allocation, version = wait_for(lambda: (got := client.get_allocation("job-a")) and len(got[0]) == 4 and got,
                                   30, "a scheduling round to give job-a the 4 GPUs")
    assert set(allocation) == {0} and version >= 1  # one node; 2 replicas profiled, explores 4 x 1 node
    assert stop(proc) == 0
    assert SupervisorState(str(tmp_path / "state.json")).allocation("job-a")[0] == allocation  # persisted

    proc, client = start_supervisor(processes, tmp_path)  # without --policy: serves the saved decisions
    assert client.get_allocation("job-a")[0] == allocation
    assert client.get_hints("job-a")["max_profiled_replicas"] == 2
    assert stop(proc) == 0


def test_supervisor_with_tiresias_policy_reallocates_every_interval(processes, tmp_path):
    proc, client = start_supervisor(processes, tmp_path, "--policy", "tiresias", "--nodes", "1",
                                    "--gpus-per-node", "4", "--interval", "0.2")
    client.register_job("job-a", max_replicas=2, submission_time=1.0)
    client.register_job("job-b", max_replicas=3, submission_time=2.0)
    wait_for(lambda: len(client.get_allocation("job-a")[0]) == 2, 30, "job-a to get its gang of 2")
    assert client.get_allocation("job-b")[0] == ()  # its gang of 3 does not fit in the 2 GPUs left
    client.remove_job("job-a")
    wait_for(lambda: len(client.get_allocation("job-b")[0]) == 3, 30, "job-b to get 3 GPUs once job-a left")
    assert stop(proc) == 0


def test_supervisor_rejects_a_bad_interval(tmp_path):
    result = subprocess.run([console("adaptive-supervisor"), "--state", str(tmp_path / "s.json"), "--policy",
                             "goodput", "--interval", "0"], env=environment(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "--interval must be > 0" in result.stderr


def _executor(processes: Processes, workdir: Path, log: Path, *extra: str) -> subprocess.Popen:
    return processes.start([console("adaptive-executor"), "run", "--workdir", str(workdir), "--slots", "2",
                            "--policy", "tiresias", "--interval", "5", "--poll", "0.2", "--grace-period", "60",
                            *extra], log)


def _status(workdir: Path) -> dict:
    result = subprocess.run([console("adaptive-executor"), "status", "--workdir", str(workdir), "--json"],
                            env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {job["name"]: job for job in json.loads(result.stdout)["jobs"]}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s: CI runs it after the default suite
def test_executor_run_stops_its_job_gracefully_and_a_second_run_resumes_it_to_the_end(processes, tmp_path):
    workdir, out = tmp_path / "executor", tmp_path / "job"
    out.mkdir()
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({  # JSON is YAML
        "name": "lin", "command": [str(WORKER)], "min_replicas": 1, "max_replicas": 2,
        "checkpoint_dir": str(out / "checkpoints"), "max_failures": 0,
        "env": {"WORKER_OUT": str(out), "WORKER_SAMPLES": "240", "WORKER_BATCH": "24", "WORKER_EPOCHS": "4",
                "WORKER_STEP_SLEEP": "0.05", "ADAPTIVE_CHECKPOINT_INTERVAL": "0", "PYTHONPATH": str(REPO)}}))
    submit = subprocess.run([console("adaptive-executor"), "submit", "--workdir", str(workdir), str(spec)],
                            env=environment(), capture_output=True, text=True, timeout=120)
    assert submit.returncode == 0 and "submitted lin (1..2 replicas)" in submit.stdout, submit.stderr

    log = tmp_path / "executor.log"
    executor = _executor(processes, workdir, log)
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 and p["epoch"] >= 1, 180,
             "the job to train on its 2 slots into epoch 1")
    stopped_at = time.time()
    executor.send_signal(signal.SIGTERM)  # stops every job gracefully first
    assert executor.wait(timeout=90) == 0, tail(log)
    job_log = workdir / "logs" / "lin" / "attempt-1.log"
    status = _status(workdir)["lin"]
    assert status["state"] == "pending" and status["last_exit"] == 143, (status, tail(job_log))
    checkpoint = store(out).latest()
    assert checkpoint is not None and checkpoint.info.metadata["reason"] == "stop", tail(job_log)
    assert not (out / "done.json").exists()

    executor = _executor(processes, workdir, log, "--exit-when-done")
    assert executor.wait(timeout=240) == 0, tail(log)
    status = _status(workdir)["lin"]
    assert status["state"] == "succeeded" and status["last_exit"] == 0, status
    resumed_log = workdir / "logs" / "lin" / "attempt-1.log"  # a new executor counts attempts anew
    assert_resumed(out, stopped_at, checkpoint.info, 2, resumed_log)
    assert_exact_counts(out, 4, resumed_log)
    assert len(resume_records(out)) == 4  # two launches of 2 replicas
