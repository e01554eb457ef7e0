"""Executor logic with a fake backend, the local process backend, job specs and the CLI spool."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from scheduler.cluster import ClusterSpec, make_allocation
from scheduler.executor import (Assignment, Backend, Executor, JobSpec, JobState, LocalBackend, Spool,
                                load_job_spec)
from scheduler.executor.__main__ import main as executor_main
from scheduler.executor.backend import CONFIG_ERROR_EXIT, LOST_NODE_EXIT, STORE_LOST_EXIT, live_job_status
from scheduler.policies import TiresiasPolicy
from scheduler.policies.base import Policy
from policy_cases import ScriptedPolicy
from scheduler.supervisor.state import SupervisorState


class EqualShare(Policy):
    """Test policy: split the slots of one node evenly (earliest jobs get the remainder)."""

    name = "equal"
    adaptive = False  # use the jobs' max_replicas as given, no hints needed

    def optimize(self, jobs, cluster, current, now):
        names = sorted(jobs, key=lambda n: (jobs[n].submission_time, n))
        left, out = cluster.gpus_per_node, {}
        for i, name in enumerate(names):
            share = -(-left // (len(names) - i))
            take = min(jobs[name].max_replicas, share, left)
            if take:
                out[name] = make_allocation([0] * take)
                left -= take
        return out


class FakeHandle:
    def __init__(self, name, assignment):
        self.name, self.assignment = name, assignment
        self.exit_code = None
        self.stop_requested = self.killed = False


class FakeBackend(Backend):
    """Records launches; incarnations exit when the test says (or 143 when stopped, if ``obedient``)."""

    def __init__(self, obedient=True):
        self.obedient = obedient
        self.launched = []

    def launch(self, spec, assignment, attempt):
        handle = FakeHandle(spec.name, assignment)
        self.launched.append((spec.name, assignment.num_replicas, assignment.devices, attempt))
        return handle

    def poll(self, handle):
        if handle.exit_code is None and handle.stop_requested and self.obedient:
            handle.exit_code = 143
        return handle.exit_code

    def stop(self, handle):
        handle.stop_requested = True

    def kill(self, handle):
        handle.killed = True
        handle.exit_code = 137


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def spec(name, tmp_path, max_replicas=3, **kw):
    return JobSpec(name=name, command=("train.py",), checkpoint_dir=str(tmp_path / name),
                   max_replicas=max_replicas, **kw)


def make_executor(backend, policy=None, slots=3, **kw):
    clock = Clock()
    ex = Executor(backend, policy or EqualShare(), ClusterSpec(1, slots), interval=60, grace_period=30,
                  clock=clock, **kw)
    return ex, clock


def handle_of(ex, name):
    return ex.jobs[name].handle


def test_first_job_finishes_second_is_scaled_up(tmp_path):
    backend = FakeBackend()
    ex, clock = make_executor(backend)
    ex.submit(spec("a", tmp_path))
    clock.now += 1
    ex.submit(spec("b", tmp_path))
    ex.step()
    assert sorted(backend.launched) == [("a", 2, (0, 1), 1), ("b", 1, (2,), 1)]
    handle_of(ex, "a").exit_code = 0
    clock.now += 5
    ex.step()  # a is done: rescheduled at once, b is asked to stop
    assert ex.jobs["a"].state is JobState.SUCCEEDED
    assert ex.jobs["b"].state is JobState.STOPPING and ex.jobs["b"].target == (0, 0, 0)
    ex.step()  # b exited with 143 and is relaunched on all slots
    assert backend.launched[-1] == ("b", 3, (0, 1, 2), 2)
    handle_of(ex, "b").exit_code = 0
    ex.step()
    assert ex.done and ex.jobs["b"].state is JobState.SUCCEEDED
    status = {s["name"]: s for s in ex.status()}
    assert status["b"]["restarts"] == 1 and status["b"]["launches"] == 2 and status["a"]["restarts"] == 0
    assert ex.state.job_ids() == []  # finished jobs leave the scheduler


def test_relaunch_waits_until_devices_are_free(tmp_path):
    backend = FakeBackend(obedient=False)
    ex, clock = make_executor(backend)
    ex.submit(spec("a", tmp_path))
    ex.step()
    assert backend.launched == [("a", 3, (0, 1, 2), 1)]
    clock.now += 1
    ex.submit(spec("b", tmp_path))
    ex.step()  # a must shrink to 2; it has not exited yet, so b cannot start
    assert ex.jobs["a"].state is JobState.STOPPING and len(backend.launched) == 1
    clock.now += 31
    ex.step()  # past the grace period: killed
    assert handle_of(ex, "a").killed
    ex.step()
    assert sorted(backend.launched[1:]) == [("a", 2, (0, 1), 2), ("b", 1, (2,), 1)]


def test_crashed_jobs_are_relaunched_with_backoff_then_failed(tmp_path):
    backend = FakeBackend()
    ex, clock = make_executor(backend, slots=1)
    ex.submit(spec("a", tmp_path, max_replicas=1, max_failures=2))
    ex.step()
    for failure in (1, 2):
        handle_of(ex, "a").exit_code = 1
        ex.step()
        assert ex.jobs["a"].state is JobState.PENDING and ex.jobs["a"].failures == failure
        clock.now += 2 ** (failure - 1) - 0.5
        ex.step()
        assert ex.jobs["a"].state is JobState.PENDING  # still backing off
        clock.now += 0.5
        ex.step()
        assert ex.jobs["a"].state is JobState.RUNNING and len(backend.launched) == failure + 1
    handle_of(ex, "a").exit_code = 1
    ex.step()
    assert ex.jobs["a"].state is JobState.FAILED and ex.done
    assert ex.status()[0]["last_exit"] == 1


def test_fixed_gang_policy_and_duplicate_names(tmp_path):
    backend = FakeBackend()
    ex, _ = make_executor(backend, policy=TiresiasPolicy(), slots=4)
    ex.submit(spec("a", tmp_path, max_replicas=3))
    ex.submit(spec("b", tmp_path, max_replicas=2))
    ex.step()
    assert backend.launched == [("a", 3, (0, 1, 2), 1)]  # b's gang does not fit yet
    with pytest.raises(ValueError, match="already submitted"):
        ex.submit(spec("a", tmp_path))


class EchoHints:
    """Hints parser double: accepts dicts with a job_id and a numeric progress."""

    def __init__(self, data):
        if not isinstance(data.get("progress"), (int, float)):
            raise ValueError("progress must be a number")
        self.data = dict(data)

    def state_dict(self):
        return dict(self.data)


def test_hints_files_are_read_into_the_state(tmp_path):
    backend = FakeBackend()
    ex, _ = make_executor(backend, state=SupervisorState(hints_parser=EchoHints))
    job = spec("a", tmp_path)
    ex.submit(job)
    ex.step()
    os.makedirs(job.share_dir, exist_ok=True)
    with open(job.hints_paths[1], "w") as f:
        json.dump({"job_id": "a", "progress": 12.5}, f)
    ex.step()
    assert ex.state.job("a").hints == {"job_id": "a", "progress": 12.5}
    assert ex.status()[0]["progress"] == 12.5
    with open(job.hints_paths[0], "w") as f:
        json.dump({"job_id": "a", "progress": "lots"}, f)
    os.utime(job.hints_paths[0], (time.time() + 5, time.time() + 5))
    ex.step()  # invalid hints are ignored with a warning; the old ones stay
    assert ex.state.job("a").hints["progress"] == 12.5


# ------------------------------------------------------ nodes that come and go
class NodeHandle:
    def __init__(self, name, assignment):
        self.name, self.assignment, self.code, self.stopping = name, assignment, None, False


class NodesBackend(Backend):
    """A backend over nodes 0..2 that reports which are alive, as the Ray backend's pool does.

    ``fail_on_poll[name] = node`` makes the next poll of that job's incarnation end it with
    LOST_NODE_EXIT and take ``node`` out of the alive nodes *during* that poll, as the Ray backend
    does when a node's actor stops answering (the node becomes suspect).
    """

    def __init__(self):
        self.alive, self.launched, self.killed, self.fail_on_poll = [0, 1, 2], [], [], {}

    def launch(self, spec, assignment, attempt):
        self.launched.append((spec.name, assignment.nodes, attempt))
        return NodeHandle(spec.name, assignment)

    def poll(self, handle):
        node = self.fail_on_poll.pop(handle.name, None)
        if node is not None:
            self.alive = [n for n in self.alive if n != node]
            handle.code = LOST_NODE_EXIT
        return 143 if handle.stopping and handle.code is None else handle.code

    def stop(self, handle):
        handle.stopping = True

    def kill(self, handle):
        self.killed.append(handle.assignment.nodes)
        handle.code = 137

    def alive_nodes(self):
        return self.alive


def nodes_executor(tmp_path, backend, plan, names=("a", "b"), **spec_kw):
    clock = Clock()
    ex = Executor(backend, ScriptedPolicy(plan), ClusterSpec(3, 2), interval=600, grace_period=30, clock=clock)
    for name in names:
        ex.submit(JobSpec(name=name, command=("t.py",), checkpoint_dir=str(tmp_path / name), max_replicas=2,
                          **spec_kw))
    return ex, clock


def test_executor_drops_a_lost_node_and_maps_the_policy_onto_the_alive_ones(tmp_path):
    backend = NodesBackend()
    seen = []

    def plan(jobs, num_nodes):
        seen.append(num_nodes)
        return {"a": (0, 1), "b": (2, 2)} if num_nodes == 3 else {"a": (0, 1), "b": (1,)}

    ex, _ = nodes_executor(tmp_path, backend, plan)
    ex.step()
    assert sorted(backend.launched) == [("a", (0, 1), 1), ("b", (2, 2), 1)]
    backend.alive = [0, 2]  # node 1 is lost: a (on nodes 0, 1) is killed; the policy now sees 2 nodes
    ex.step()
    assert backend.killed == [(0, 1)] and seen[-1] == 2
    # the kill was the lost node's doing: an infrastructure failure, relaunched at once, not charged
    assert ex.jobs["a"].failures == 0 and ex.jobs["a"].infra_failures == 1
    assert ex.jobs["b"].state is JobState.STOPPING  # policy node 1 is real node 2: b shrinks to (2,)
    ex.step()  # policy nodes (0, 1) are real nodes (0, 2); no back-off for a
    assert sorted(backend.launched[2:]) == [("a", (0, 2), 2), ("b", (2,), 2)]
    assert {s["name"]: s["placement"] for s in ex.status()} == {"a": [0, 2], "b": [2]}
    assert {s["name"]: (s["failures"], s["infra_failures"]) for s in ex.status()} == {"a": (0, 1), "b": (0, 0)}


def test_a_node_the_backend_saw_fail_is_not_used_for_the_relaunch(tmp_path):
    """The Ray case of the issue: the backend sees the node's actor fail before Ray marks the node dead.
    The relaunch, in the same step, goes to the nodes left: one launch after the loss, not two."""
    backend = NodesBackend()
    ex, _ = nodes_executor(tmp_path, backend, lambda jobs, n: {"a": (0, 1)}, names=("a",), max_failures=0)
    ex.step()
    assert backend.launched == [("a", (0, 1), 1)]
    backend.fail_on_poll["a"] = 1  # its node 1 stops answering: the incarnation ends, node 1 is left out
    ex.step()
    assert backend.launched[1:] == [("a", (0, 2), 2)]  # policy nodes (0, 1) are now real nodes (0, 2)
    job = ex.jobs["a"]
    assert job.state is JobState.RUNNING and job.failures == 0 and job.infra_failures == 1
    assert job.last_exit == LOST_NODE_EXIT and job.last_error is None
    backend.alive = [0, 1, 2]  # a probe answered: node 1 is usable again (a keeps running where it is)
    ex.step()
    assert len(backend.launched) == 2 and backend.killed == []


class ResizingBackend(NodesBackend):
    """A NodesBackend that resizes running incarnations in place (as the live backends do), recording each."""

    def __init__(self):
        super().__init__()
        self.resized = []

    def resize(self, handle, assignment):
        self.resized.append(assignment.nodes)
        handle.assignment = assignment
        return True


def test_a_live_job_is_resized_once_even_when_its_nodes_come_out_in_another_order(tmp_path):
    """A live resize keeps the replicas the job has and adds the others after them, so its nodes can be
    (1, 0) where the policy's allocation is (0, 1): that is the same allocation, not another resize."""
    backend = ResizingBackend()
    plans = iter([{"a": (1,)}, {"a": (0, 1)}, {"a": (0, 1)}])
    ex, clock = nodes_executor(tmp_path, backend, lambda jobs, n: next(plans), names=("a",))
    ex.step()
    for _ in range(2):
        clock.now += 601  # the next decisions
        ex.step()
    assert backend.launched == [("a", (1,), 1)] and backend.resized == [(1, 0)]
    assert ex.jobs["a"].state is JobState.RUNNING


def test_infrastructure_failures_are_not_charged_to_max_failures(tmp_path):
    backend = NodesBackend()
    ex, _ = nodes_executor(tmp_path, backend, lambda jobs, n: {"a": (0,)}, names=("a",), max_failures=0)
    ex.step()
    for lost in (1, 2):  # the node it runs on is lost, twice: each time it goes on at once on the next node
        backend.fail_on_poll["a"] = lost - 1
        ex.step()
        assert ex.jobs["a"].state is JobState.RUNNING, ex.status()
        assert (ex.jobs["a"].failures, ex.jobs["a"].infra_failures) == (0, lost)
    assert backend.launched == [("a", (0,), 1), ("a", (1,), 2), ("a", (2,), 3)]
    ex.jobs["a"].handle.code = 1  # a crash of its own: max_failures=0, so it fails now
    ex.step()
    assert ex.jobs["a"].state is JobState.FAILED and ex.status()[0]["failures"] == 1


def test_a_lost_store_is_relaunched_at_once_up_to_max_relaunches_and_a_usage_error_not_at_all(tmp_path):
    """Exit 75 (a live job's store lost with its host): relaunched in the same step, uncharged, at most
    max_relaunches times; exit 2 (a usage or configuration error): failed at once, never relaunched."""
    backend = FakeBackend()
    ex, _ = make_executor(backend, slots=2)
    ex.submit(spec("a", tmp_path, max_replicas=1, max_failures=3, max_relaunches=2))
    ex.step()
    for lost in (1, 2):
        handle_of(ex, "a").exit_code = STORE_LOST_EXIT
        ex.step()
        assert ex.jobs["a"].state is JobState.RUNNING, ex.status()  # no back-off
        assert (ex.jobs["a"].failures, ex.jobs["a"].infra_failures) == (0, lost)
    handle_of(ex, "a").exit_code = STORE_LOST_EXIT
    ex.step()
    assert ex.jobs["a"].state is JobState.FAILED and ex.jobs["a"].infra_failures == 3
    assert [launch[0] for launch in backend.launched] == ["a"] * 3
    ex.submit(spec("b", tmp_path, max_replicas=1, max_failures=3))
    ex.step()
    handle_of(ex, "b").exit_code = CONFIG_ERROR_EXIT
    ex.step()
    assert ex.jobs["b"].state is JobState.FAILED and ex.jobs["b"].failures == 1, ex.status()
    assert [launch[0] for launch in backend.launched].count("b") == 1
    assert spec("c", tmp_path).max_relaunches == 20 and "max_relaunches" in spec("c", tmp_path).to_dict()
    with pytest.raises(ValueError, match="max_relaunches"):
        spec("d", tmp_path, max_relaunches=-1)


@pytest.mark.parametrize(("host", "others", "status"), [
    (137, [75], 75), (137, [143, 75], 75), (1, [75], 75),  # the store went with a failed host: relaunch
    (137, [], 137), (137, [143], 137),  # no launcher said the store was lost
    (0, [75], 0), (143, [75], 143), (2, [75], 2), (3, [75], 3), (75, [], 75)])  # the host's status stands
def test_a_live_jobs_status_is_75_once_its_store_went_with_its_failed_host(host, others, status):
    assert live_job_status(host, others) == status


class FakeLauncher:
    """A live launcher for :class:`LiveLocalBackend`'s poll: its exit status is set by the test."""

    def __init__(self, returncode=None):
        self.returncode, self.pid = returncode, None

    def poll(self):
        return self.returncode


def test_the_local_live_backend_reads_75_once_the_store_hosts_loss_ended_the_others(tmp_path, monkeypatch):
    """The host's launcher SIGKILLed (-9): the job waits for the others, which end with 75: the job's status is
    75; another that still runs after local_live.STORE_LOSS_WAIT is killed."""
    from scheduler.executor import local_live

    backend = local_live.LiveLocalBackend(str(tmp_path / "logs"))
    host, other = FakeLauncher(-9), FakeLauncher()
    handle = local_live.LiveLocalHandle(spec("a", tmp_path), port=1, attempt=1, launchers=[host, other])
    assert backend.poll(handle) is None and handle.host_failed_at is not None
    other.returncode = 75
    assert backend.poll(handle) == 75
    lingering = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        handle = local_live.LiveLocalHandle(spec("b", tmp_path), port=1, attempt=1,
                                            launchers=[FakeLauncher(-9), lingering])
        assert backend.poll(handle) is None
        monkeypatch.setattr(local_live, "STORE_LOSS_WAIT", 0.0)
        assert backend.poll(handle) == 137  # it was killed: no launcher said the store was lost
        assert lingering.wait(timeout=10) == -9
    finally:
        lingering.kill()
        lingering.wait(timeout=10)


class TailBackend(FakeBackend):
    """A fake backend that can read its incarnations' output, like the local and Ray backends."""

    def __init__(self, output):
        super().__init__()
        self.output = output

    def log_tail(self, handle, lines=20):
        return "\n".join(self.output.splitlines()[-lines:])


def test_a_crash_keeps_the_end_of_its_output_and_logs_it_once(tmp_path, caplog, capsys):
    output = "Traceback (most recent call last):\n  File \"train.py\", line 1\nNameError: name 'modle' is not defined"
    backend = TailBackend("lots of noise\n" * 30 + output)
    ex, clock = make_executor(backend, slots=1)
    ex.submit(spec("a", tmp_path, max_replicas=1, max_failures=3))
    caplog.set_level(logging.WARNING, logger="scheduler.executor.executor")
    ex.step()
    for _ in range(4):
        handle_of(ex, "a").exit_code = 1
        ex.step()
        clock.now += 60
        ex.step()
    job = ex.jobs["a"]
    assert job.state is JobState.FAILED and job.failures == 4
    (status,) = ex.status()
    assert status["last_error"].endswith("NameError: name 'modle' is not defined")
    assert len(status["last_error"].splitlines()) == 20
    with_tail = [r for r in caplog.records if "NameError" in r.getMessage()]
    assert [r.levelname for r in with_tail] == ["WARNING", "ERROR"], [r.getMessage() for r in caplog.records]
    assert "failure 1 of 3" in with_tail[0].getMessage() and "giving up" in with_tail[1].getMessage()
    repeats = [r.getMessage() for r in caplog.records if "same output as the previous failure" in r.getMessage()]
    assert len(repeats) == 2 and all("\n" not in m for m in repeats)
    backend.output = "a different error"  # a new output is shown again
    ex2, _ = make_executor(backend, slots=1)
    ex2.submit(spec("b", tmp_path, max_replicas=1, max_failures=0))
    ex2.step()
    handle_of(ex2, "b").exit_code = 2
    ex2.step()
    assert ex2.status()[0]["last_error"] == "a different error"
    spool = Spool(str(tmp_path / "work"))
    spool.write_status(ex.status() + ex2.status(), slots=1)
    assert executor_main(["status", "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert "last exit 1; its output ended with:" in out and "      NameError: name 'modle'" in out
    assert out.splitlines()[-1] == "      a different error"


def test_a_backend_without_log_tail_still_reports_failures(tmp_path):
    backend = FakeBackend()
    ex, _ = make_executor(backend, slots=1)
    ex.submit(spec("a", tmp_path, max_replicas=1, max_failures=0))
    ex.step()
    handle_of(ex, "a").exit_code = 2
    ex.step()
    assert ex.jobs["a"].state is JobState.FAILED and ex.status()[0]["last_error"] is None


def test_status_command_shows_nodes_placements_and_infrastructure_failures(tmp_path, capsys):
    spool = Spool(str(tmp_path / "work"))
    spool.write_status([{"name": "j1", "state": "running", "replicas": 3, "target_replicas": 3, "restarts": 1,
                         "failures": 0, "infra_failures": 1, "progress": 2.0, "placement": [0, 1, 1]}],
                       slots=4, backend="ray",
                       nodes=[{"index": 0, "node_id": "a" * 40, "address": "10.0.0.1", "slots": 2, "alive": True,
                               "state": "alive"},
                              {"index": 1, "node_id": "b" * 40, "address": "10.0.0.2", "slots": 2, "alive": True,
                               "state": "suspect"},
                              {"index": 2, "node_id": "c" * 40, "address": "10.0.0.3", "slots": 2,
                               "alive": False}])
    assert executor_main(["status", "--workdir", str(tmp_path / "work")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("node 0") and "alive" in lines[0] and "10.0.0.1" in lines[0]
    assert lines[1].startswith("node 1") and "SUSPECT" in lines[1]
    assert lines[2].startswith("node 2") and "LOST" in lines[2]
    assert "infra" in lines[3]
    assert lines[-1].startswith("j1") and lines[-1].endswith("0,1,1")
    assert lines[-1].split()[5:7] == ["0", "1"]  # failures, infra failures


# ------------------------------------------------------------------ job specs
def test_job_spec_yaml_validation(tmp_path):
    good = tmp_path / "job.yaml"
    good.write_text("name: j1\ncommand: train.py --epochs 3\nmax_replicas: 4\ncheckpoint_dir: ck\n")
    job = load_job_spec(str(good))
    assert job.command == ("train.py", "--epochs", "3")
    assert job.checkpoint_dir == str(tmp_path / "ck") and job.min_replicas == 1 and job.max_replicas == 4
    cases = {
        "name: j1\ncommand: [a.py]\ncheckpoint_dir: c\ncolor: red\n": "unknown job spec field",
        "name: j1\ncheckpoint_dir: c\n": "missing",
        "name: j1\ncommand: [a.py]\ncheckpoint_dir: c\nmin_replicas: 3\nmax_replicas: 2\n": "max_replicas",
        "name: 'bad name'\ncommand: [a.py]\ncheckpoint_dir: c\n": "job_id must match",
        "name: j1\ncommand: []\ncheckpoint_dir: c\n": "command must be",
        "name: j1\ncommand: [a.py]\ncheckpoint_dir: c\nenv: [1]\n": "env must be a mapping",
        "[unclosed": "not valid YAML",
    }
    for text, message in cases.items():
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_job_spec(str(path))


def test_spool_submit_take_and_cli_status(tmp_path, capsys):
    workdir = tmp_path / "work"
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: j1\ncommand: [train.py]\ncheckpoint_dir: ck\n")
    assert executor_main(["submit", "--workdir", str(workdir), str(job_file)]) == 0
    assert "submitted j1" in capsys.readouterr().out
    spool = Spool(str(workdir))
    bad = workdir / "inbox" / "broken.yaml"
    bad.write_text("name: j2\n")
    taken = spool.take_new()
    assert [s.name for s in taken] == ["j1"] and taken[0].checkpoint_dir == str(tmp_path / "ck")
    assert "job spec is missing" in (workdir / "rejected" / "broken.yaml.reason").read_text()
    assert executor_main(["submit", "--workdir", str(workdir), str(job_file)]) == 2
    assert "already submitted" in capsys.readouterr().err
    spool.write_status([{"name": "j1", "state": "running", "replicas": 2, "target_replicas": 2,
                         "restarts": 0, "failures": 0, "progress": 3.0}], slots=4)
    assert executor_main(["status", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "j1" in out and "running" in out
    assert executor_main(["status", "--workdir", str(workdir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["slots"] == 4


# ------------------------------------------------------------- local backend
HELPER = textwrap.dedent("""
    import json, os, signal, sys, time
    ignore = os.environ.get("IGNORE_TERM") == "1"
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else (lambda *a: sys.exit(143)))
    with open(os.environ["OUT_FILE"], "w") as f:
        json.dump({"argv": sys.argv[1:], "job": os.environ["ADAPTIVE_JOB_ID"],
                   "ckpt": os.environ["ADAPTIVE_CHECKPOINT_PATH"],
                   "share": os.environ["ADAPTIVE_SHARE_PATH"]}, f)
    print("ready", flush=True)
    time.sleep(30)
""")


def wait_exit(backend, handle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = backend.poll(handle)
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError("process did not exit in time")


def wait_file(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) or not open(path).read():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.parametrize("ignore_term", [False, True])
def test_local_backend_runs_stops_and_kills_process_groups(tmp_path, ignore_term):
    helper = tmp_path / "helper.py"
    helper.write_text(HELPER)
    backend = LocalBackend(str(tmp_path / "logs"), launcher=[sys.executable, str(helper)])
    out = tmp_path / "out.json"
    job = JobSpec(name="j1", command=("train.py", "--x", "1"), checkpoint_dir=str(tmp_path / "ck"),
                  env={"OUT_FILE": str(out), "IGNORE_TERM": "1" if ignore_term else "0"})
    handle = backend.launch(job, Assignment((0, 0), (0, 1)), attempt=1)
    try:
        wait_file(str(out))
        seen = json.loads(out.read_text())
        assert seen["argv"] == ["--standalone", "--nproc-per-node=2", "train.py", "--x", "1"]
        assert seen["job"] == "j1" and seen["ckpt"] == job.checkpoint_dir and seen["share"] == job.share_dir
        assert backend.poll(handle) is None
        backend.stop(handle)
        if ignore_term:
            time.sleep(0.3)
            assert backend.poll(handle) is None
            backend.kill(handle)
            assert wait_exit(backend, handle) == 137
        else:
            assert wait_exit(backend, handle) == 143
    finally:
        backend.kill(handle)
        handle.process.wait(timeout=10)
    assert "ready" in open(handle.log_path).read()
    with pytest.raises(ValueError, match="one node"):
        backend.launch(job, Assignment((0, 1), (0, 0)), attempt=2)


# ------------------------------------------------------ real training processes
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The multi-process tests' worker: counts every sample per epoch into epochs.jsonl.
WORKER = os.path.join(REPO, "tests", "workers", "elastic_worker.py")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s: CI runs it after the default suite
def test_real_jobs_first_finishes_second_scales_up_with_exact_data(tmp_path):
    if not hasattr(pytest.importorskip("adaptive"), "AdaptiveDataLoader"):
        pytest.skip("the elastic core (adaptive.AdaptiveDataLoader) is not available")
    # The order of events is fixed by gates (tests/workers/elastic_worker.py, WORKER_GATE), not by timing:
    # "short" (2 replicas) trains only once "long" (1 replica) has finished epoch 0, and "long" holds at
    # the start of epoch 1 until "short" has succeeded and the executor has asked "long" to stop (the
    # stop releases the gate); the gate is opened for its relaunch on 3 replicas.
    long_gate = tmp_path / "long-may-continue"
    gates = {"short": {"WORKER_GATE": str(tmp_path / "long" / "epochs.jsonl")},
             "long": {"WORKER_GATE": str(long_gate), "WORKER_GATE_EPOCH": "1"}}
    specs = []
    for name, epochs, sleep in (("short", 2, 0.02), ("long", 6, 0.05)):
        out = tmp_path / name
        out.mkdir()
        specs.append(JobSpec(name=name, command=(WORKER,), checkpoint_dir=str(tmp_path / f"{name}-ckpt"),
                             max_replicas=3, max_failures=0,
                             env={"WORKER_OUT": str(out), "WORKER_SAMPLES": "240", "WORKER_BATCH": "24",
                                  "WORKER_EPOCHS": str(epochs), "WORKER_STEP_SLEEP": str(sleep),
                                  "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **gates[name]}))
    backend = LocalBackend(str(tmp_path / "logs"))
    ex = Executor(backend, EqualShare(), ClusterSpec(1, 3), interval=600, grace_period=60)
    for spec_ in specs:
        ex.submit(spec_)
    deadline = time.monotonic() + 300
    try:
        while not ex.done:
            assert time.monotonic() < deadline, f"jobs did not finish: {ex.status()}"
            ex.step()
            if ex.jobs["short"].state is JobState.SUCCEEDED and not long_gate.exists():
                assert ex.jobs["long"].state is JobState.STOPPING, ex.status()  # asked to stop in that step
                long_gate.touch()
            time.sleep(0.2)
    finally:
        ex.shutdown(timeout=30)
    status = {s["name"]: s for s in ex.status()}
    assert status["short"]["state"] == "succeeded" and status["long"]["state"] == "succeeded", status
    assert status["short"]["launches"] == 1
    assert status["long"]["launches"] == 2 and status["long"]["failures"] == 0  # stopped once to scale up
    for name, epochs in (("short", 2), ("long", 6)):
        records = [json.loads(line) for line in open(tmp_path / name / "epochs.jsonl")]
        assert [r["epoch"] for r in records] == list(range(epochs)), records
        assert all(r["missing"] == 0 and r["extra"] == 0 for r in records), records
    worlds = [json.loads(line)["world"] for line in open(tmp_path / "long" / "epochs.jsonl")]
    assert worlds == [1, 3, 3, 3, 3, 3], worlds  # epoch 0 on its first share, the rest after the scale-up
    logs = sorted((tmp_path / "logs" / "long").glob("attempt-*.log"))
    assert len(logs) == 2 and "resuming from checkpoint" in logs[1].read_text()
    resumes = [json.loads(line) for line in open(tmp_path / "long" / "resume.rank0.jsonl")]
    assert [r["seq"] is None for r in resumes] == [True, False]  # the relaunch resumed the stop's checkpoint
    assert resumes[1]["loader_step"] >= 10  # epoch 0 (10 steps) was not trained again
