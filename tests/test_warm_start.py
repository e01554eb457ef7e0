"""Workers forked from the pre-warmed process of ``adaptive-run --live`` (``adaptive.elastic.warm_start``).

Real launchers on 127.0.0.1 run ``tests/workers/warm_probe.py``, which says
how it was started; proven by the probes' records, the PIDs and their
parents, and the launchers' exit statuses.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_harness import Jobs, REPO, live_pids, tail, wait_exit, wait_for

PROBE = REPO / "tests" / "workers" / "warm_probe.py"


@pytest.fixture
def jobs(tmp_path):
    started = Jobs(tmp_path)
    yield started
    started.cleanup()


def launch(jobs: Jobs, out: Path, *options: str, script_args: tuple[str, ...] = (), **settings: str):
    """One standalone ``adaptive-run --live`` node running the probe with ``script_args``; logs to out/node.log."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "adaptive.elastic.launcher", "--live", "--standalone", "--nnodes", "1",
               *options, str(PROBE), *script_args]
    with open(out / "node.log", "ab") as log:
        proc = subprocess.Popen(command, env=jobs.env(out, **settings), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(out))
    jobs.procs.append(proc)
    return proc


def probes(out: Path) -> list[dict]:
    return sorted((json.loads(path.read_text()) for path in out.glob("probe.*.json")), key=lambda p: p["restart"])


def wait_probes(out: Path, count: int, what: str) -> list[dict]:
    """The probes once ``count`` workers have started."""
    return wait_for(lambda: (lambda found: found if len(found) == count else None)(probes(out)), 120, what)


def test_workers_are_forks_that_run_the_script_as_python_would(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "2", script_args=("--flag", "x"))
    assert wait_exit(launcher, 120, out / "node.log") == 0, tail(out / "node.log")
    first, second = probes(out)
    server = first["ppid"]
    assert second["ppid"] == server != launcher.pid  # both forked by one process, not by the agent
    assert first["parent_var"] == second["parent_var"] == str(server)  # they die with the process that forked them
    for probe in (first, second):
        assert {"torch", "torch._dynamo", "adaptive.parallel.data_parallel"} <= set(probe["preloaded"])
        assert probe["argv"] == [str(PROBE), "--flag", "x"]
        assert " ".join(probe["cmdline"]).rstrip() == f"{sys.executable} -u {PROBE} --flag x"  # as ps shows it
        assert probe["name"] == "__main__"
        assert probe["path0"] == str(PROBE.parent)
        assert probe["cwd"] == str(out)
        assert (out / f"atexit.{probe['pid']}").read_text() == "ran"
    assert {first["local_rank"], second["local_rank"]} == {"0", "1"}
    assert first["random"] != second["random"]  # reseeded in each fork
    assert live_pids([server, first["pid"], second["pid"]]) == []


def test_a_killed_worker_is_forked_again(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "1", "--max-restarts", "1", PROBE_KILL_FIRST="1")
    assert wait_exit(launcher, 120, out / "node.log") == 0, tail(out / "node.log")
    killed, restarted = probes(out)
    assert (killed["restart"], restarted["restart"]) == ("0", "1")
    assert killed["pid"] != restarted["pid"] and killed["ppid"] == restarted["ppid"]
    assert "torch._dynamo" in restarted["preloaded"]
    assert not (out / f"atexit.{killed['pid']}").exists() and (out / f"atexit.{restarted['pid']}").exists()
    assert live_pids([killed["pid"], restarted["pid"], restarted["ppid"]]) == []  # gone, with the pre-warmed process


def test_a_script_error_reads_as_under_python(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "1", PROBE_RAISE="1")
    assert wait_exit(launcher, 120, out / "node.log") == 1
    log = (out / "node.log").read_text()
    trace = log[log.index("Traceback (most recent call last):"):]
    assert trace.splitlines()[1].strip().startswith(f'File "{PROBE}"'), trace  # the script's frames first
    assert "ValueError: the probe failed on purpose" in trace and "_warm_server" not in trace


def test_cold_start_starts_new_interpreters(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "1", "--cold-start")
    assert wait_exit(launcher, 120, out / "node.log") == 0, tail(out / "node.log")
    (probe,) = probes(out)
    assert probe["ppid"] == launcher.pid and probe["preloaded"] == []


def test_preload_imports_more_modules_and_warns_of_missing_ones(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "1", "--preload", "xml.dom.minidom,no_such_module_here")
    assert wait_exit(launcher, 120, out / "node.log") == 0, tail(out / "node.log")
    (probe,) = probes(out)
    assert "xml.dom.minidom" in probe["preloaded"]
    assert "could not preload 'no_such_module_here'" in (out / "node.log").read_text()


@pytest.mark.parametrize("options, message", [
    (["--preload", "json"], "--preload and --cold-start apply to --live only"),
    (["--live", "--cold-start", "--preload", "json"], "--preload has nothing to preload into with --cold-start"),
    (["--live", "--preload", "not a module"], "--preload takes module names"),
    (["--live", "--rdzv-conf", "is_host=1"], "--live runs its own agent, which does not use --rdzv-conf"),
    (["--live", "--log-dir", "logs", "--redirects", "3"], "does not use --log-dir, --redirects; leave them out"),
    (["--live", "--rdzv-backend", "etcd"], "does not use --rdzv-backend=etcd"),
])
def test_bad_warm_start_options_are_refused(options, message, tmp_path):
    command = [sys.executable, "-m", "adaptive.elastic.launcher", "--standalone", *options, str(PROBE)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                          env={**os.environ, "WORKER_OUT": str(tmp_path)})
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not list(tmp_path.glob("probe.*.json"))


def test_the_pre_warmed_process_and_its_workers_die_with_the_launcher(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "2", PROBE_WAIT="1")
    found = wait_probes(out, 2, "both workers to start")
    server = found[0]["ppid"]
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    wait_for(lambda: live_pids([server, *(p["pid"] for p in found)]) == [], 30, "the forks to die with the launcher")


def test_a_stopped_node_passes_the_stop_to_its_forked_workers(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "2", PROBE_WAIT="1")
    found = wait_probes(out, 2, "both workers to start")
    os.kill(launcher.pid, signal.SIGTERM)
    assert wait_exit(launcher, 60, out / "node.log") == 143
    assert all((out / f"atexit.{p['pid']}").exists() for p in found)
    assert live_pids([found[0]["ppid"], *(p["pid"] for p in found)]) == []


def test_workers_start_as_new_interpreters_once_the_pre_warmed_process_is_lost(jobs, tmp_path):
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "1", "--max-restarts", "1", PROBE_WAIT="1")
    (forked,) = wait_probes(out, 1, "the worker to start")
    os.kill(forked["ppid"], signal.SIGKILL)  # the pre-warmed process; its worker dies with it
    found = wait_probes(out, 2, "the worker's restart")
    restarted = next(p for p in found if p["pid"] != forked["pid"])
    assert restarted["ppid"] == launcher.pid and restarted["restart"] == "1"
    assert live_pids([forked["pid"], forked["ppid"]]) == []
    os.kill(launcher.pid, signal.SIGTERM)
    assert wait_exit(launcher, 60, out / "node.log") == 143
    assert "workers start as new interpreters from now on" in (out / "node.log").read_text()


def test_a_preloaded_module_that_initialises_cuda_makes_the_workers_new_interpreters(jobs, tmp_path):
    """A fork cannot use CUDA initialised before it: the pre-warmed process refuses to serve, and the worker
    asked for meanwhile starts as a new interpreter without spending a restart."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "initialises_cuda.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    out = tmp_path / "out"
    launcher = launch(jobs, out, "--nproc-per-node", "1", "--max-restarts", "0", "--preload", "initialises_cuda",
                      PYTHONPATH=os.pathsep.join([str(REPO), str(modules)]))
    assert wait_exit(launcher, 120, out / "node.log") == 0, tail(out / "node.log")
    (probe,) = probes(out)
    assert probe["ppid"] == launcher.pid and "torch" not in probe["preloaded"]
    assert "cannot serve: a preloaded module initialised CUDA" in (out / "node.log").read_text()
