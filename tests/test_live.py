"""Live membership (``adaptive-run --live``) with real launchers, workers and signals on 127.0.0.1.

Each case starts launchers of one job on one TCPStore, changes the
membership while it trains, and checks what the workers logged
(``tests/workers/live_worker.py``): which processes trained which steps
(PIDs), that every member of a step held the same model, optimizer and LR
scheduler state before it (so a joiner's state equals its donor's bit for
bit), and that every sample was trained once per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import portpicker
import pytest
import psutil

from elastic_harness import live_pids, wait_exit, wait_for
from live_harness import BATCH, LIVE_WORKER, REPO, SAMPLES, check_after_rollbacks, check_steps, exits, launch, logs
from live_harness import replayed_draws, steps, wait_steps, without_debug_traceback, worker_pids
from live_harness import jobs  # noqa: F401  (the fixture)


def test_a_joiner_takes_the_state_from_its_peers_and_a_leaver_goes_while_the_survivor_keeps_running(jobs, tmp_path):
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "4", "WORKER_STEP_SLEEP": "0.08", "WORKER_LOADER_WORKERS": "1", "WORKER_EVAL": "1"}
    first = launch(jobs, out, port, "first", **settings)
    records = wait_steps(out, lambda rs: len(rs) >= 6, "the first node to train")
    survivor = records[0]["pid"]
    second = launch(jobs, out, port, "second", **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 12, "the joiner to train")
    joiner = next(r["pid"] for r in records if r["pid"] != survivor)
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)

    by_step = check_steps(out, epochs=4)
    pids = [r["pid"] for r in steps(out)]
    assert set(pids) == {survivor, joiner}, f"a worker was restarted: {set(pids)}\n{logs(out)}"
    assert exits(out) == {survivor: 0, joiner: 143}
    worlds = [records[0]["world"] for _, records in sorted(by_step.items())]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1, worlds
    changes = [i for i in range(1, len(worlds)) if worlds[i] != worlds[i - 1]]
    assert len(changes) == 2, worlds  # one join, one leave, nothing else
    generations = sorted({r["generation"] for r in steps(out)})
    assert generations == [1, 2, 3]
    joined = min(r["step"] + 1000 * r["epoch"] for r in steps(out) if r["pid"] == joiner)
    assert joined > 0, "the joiner started at the first step: it did not join a running job"
    assert live_pids([survivor, joiner]) == []
    validation = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in validation] == list(range(4)), validation  # each epoch's validation loop, once
    assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in validation), validation


def test_a_drained_node_leaves_at_the_next_step_without_a_signal_and_is_not_started_again(jobs, tmp_path):
    """``adaptive drain`` (the job's store, no signal to the node): the drained node's worker leaves with nothing
    lost, its launcher ends with 143 without starting it again, the other member keeps its PID and finishes."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "6", "WORKER_STEP_SLEEP": "0.08"}
    first = launch(jobs, out, port, "first", **settings)
    wait_steps(out, lambda rs: len(rs) >= 4, "the first node to train")
    second = launch(jobs, out, port, "second", **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 6, "the second node to join")
    survivor = records[0]["pid"]
    drained = next(r["pid"] for r in records if r["pid"] != survivor)
    asked = subprocess.run([sys.executable, "-m", "adaptive", "drain", "--endpoint", f"127.0.0.1:{port}",
                            "--job-id", "live_worker", "--node", "2"], capture_output=True, text=True, timeout=60)
    assert asked.returncode == 0 and "node 2" in asked.stdout, asked.stderr
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert live_pids([drained]) == [], "the drained worker still runs"
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)

    by_step = check_steps(out, epochs=6)  # every sample once per epoch, the members equal
    assert {r["pid"] for r in steps(out)} == {survivor, drained}, f"a worker was restarted\n{logs(out)}"
    assert exits(out) == {survivor: 0, drained: 143}
    worlds = [records[0]["world"] for _, records in sorted(by_step.items())]
    assert worlds[-1] == 1 and [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [1, 2, 1], worlds
    assert "node 2 was drained" in (out / "second.log").read_text()
    assert "started worker" not in (out / "second.log").read_text().split("was asked to drain")[-1]


def test_a_script_that_builds_its_loaders_before_its_model_joins_leaves_and_loses_a_worker(jobs, tmp_path):
    """pytorch/examples' mnist order: loaders (with autoscale and a DataLoader worker), a validation loader and
    an accumulator before the model wrapper, rank 0 preparing the data behind a barrier.  A joiner builds all
    of it on a group of its own and is admitted at its first loop; its worker is SIGKILLed (it and its
    DataLoader worker are gone, by PID) and started again (admitted again), then its node leaves.  The
    survivor keeps its PID, no one waits for a joiner's start-up, and every sample is trained once per
    epoch."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    epochs = 6  # room for a joiner that starts slowly on a loaded machine
    settings = {"WORKER_EPOCHS": str(epochs), "WORKER_STEP_SLEEP": "0.08", "WORKER_ORDER": "loaders-first",
                "WORKER_EVAL": "1", "WORKER_AUTOSCALE": "48,4,24,1,5", "WORKER_LOADER_WORKERS": "1",
                "ADAPTIVE_CHECKPOINT_INTERVAL": "0"}
    first = launch(jobs, out, port, "first", restarts=1, **settings)
    records = wait_steps(out, lambda rs: len(rs) >= 6, "the first node to train")
    survivor = records[0]["pid"]
    second = launch(jobs, out, port, "second", restarts=1, **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 8, "the joiner to train")
    joiner = next(r["pid"] for r in records if r["pid"] != survivor)
    loader_workers = [child.pid for child in psutil.Process(joiner).children(recursive=True)]
    assert loader_workers, "the joiner had no DataLoader worker process"
    killed = time.time()
    os.kill(joiner, signal.SIGKILL)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 and r["time"] > killed and r["pid"] != joiner
                                             for r in rs) >= 8, "the killed joiner's restart to train")
    rejoined = next(r["pid"] for r in records if r["time"] > killed and r["pid"] not in (survivor, joiner))
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)

    check_after_rollbacks(out, epochs=epochs)
    assert {r["pid"] for r in steps(out)} == {survivor, joiner, rejoined}
    assert exits(out) == {survivor: 0, rejoined: 143}, exits(out)
    assert live_pids([survivor, joiner, rejoined] + loader_workers) == []
    said = (out / "first.log").read_text(errors="replace")
    assert "lost a member" in said and "live membership change" in said, logs(out)
    worlds = [r["world"] for r in steps(out) if r["pid"] == survivor and not r["discarded"]]
    assert worlds[0] == 1 and worlds[-1] == 1 and 2 in worlds, worlds
    validation = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in validation] == list(range(epochs)), validation
    assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in validation), validation


def test_two_joiners_at_once_with_autoscale_and_accumulation(jobs, tmp_path):
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "3", "WORKER_STEP_SLEEP": "0.08", "WORKER_AUTOSCALE": "48,4,16,1,3"}
    first = launch(jobs, out, port, "first", **settings)
    records = wait_steps(out, lambda rs: len(rs) >= 6, "the first node to train")
    survivor = records[0]["pid"]
    second = launch(jobs, out, port, "second", per_node=2, **settings)
    assert wait_exit(second, 120, out / "second.log") == 0, logs(out)
    assert wait_exit(first, 60, out / "first.log") == 0, logs(out)

    by_step = check_steps(out, epochs=3)
    worlds = [records[0]["world"] for _, records in sorted(by_step.items())]
    assert worlds[0] == 1 and worlds[-1] == 3 and set(worlds) == {1, 3}, worlds  # both joined at one boundary
    pids = {r["pid"] for r in steps(out)}
    assert len(pids) == 3 and survivor in pids and set(exits(out).values()) == {0}


def test_a_lost_worker_is_left_behind_in_memory_and_started_again_as_a_joiner(jobs, tmp_path):
    """SIGKILL of one of two workers: the survivor keeps running (same PID), trains again at most the step in
    flight (when the killed one had not applied it), and the killed worker's agent starts it again, which joins
    and takes the state from the survivor; every sample is still trained once per epoch."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "3", "WORKER_STEP_SLEEP": "0.08",
                "ADAPTIVE_CHECKPOINT_INTERVAL": "0"}
    first = launch(jobs, out, port, "first", restarts=2, **settings)
    second = launch(jobs, out, port, "second", restarts=2, **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 16, "both nodes to train")
    victim = next(r["pid"] for r in reversed(records) if r["rank"] == 1)
    survivor = next(r["pid"] for r in reversed(records) if r["rank"] == 0)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)
    assert wait_exit(second, 60, out / "second.log") == 0, logs(out)

    check_after_rollbacks(out, epochs=3)
    # The step in flight at the loss is the only one trained again (none when every member applied it).
    assert len([key for key in replayed_draws(out) if key[0] == survivor]) <= 1, replayed_draws(out)
    assert live_pids([victim]) == []
    after = [r for r in steps(out) if r["time"] > killed]
    # It re-formed alone and trained on in its process (alone for some steps, or at once with the replacement
    # when that one already asked to join at the re-formed generation's first boundary).
    assert any(r["pid"] == survivor for r in after), "the survivor did not train on"
    assert any(r["pid"] not in (survivor, victim) and r["world"] == 2 for r in after), "no worker rejoined"
    assert exits(out)[survivor] == 0, "the survivor was restarted"


def test_the_executor_resizes_a_live_job_without_stopping_it(tmp_path):
    """The scheduler's decisions 1 -> 2 -> 1 replicas reach a running job as a join and a leave."""
    from policy_cases import ScriptedPolicy
    from scheduler.cluster import ClusterSpec
    from scheduler.executor.executor import Executor
    from scheduler.executor.jobspec import JobSpec
    from scheduler.executor.local_live import LiveLocalBackend

    out = tmp_path / "job"
    out.mkdir()
    replicas = {"n": 1}
    spec = JobSpec(name="live", command=(str(LIVE_WORKER),), checkpoint_dir=str(tmp_path / "ckpt"), max_replicas=2,
                   max_failures=0, env={"WORKER_OUT": str(out), "WORKER_SAMPLES": str(SAMPLES),
                                        "WORKER_BATCH": str(BATCH), "WORKER_EPOCHS": "4",
                                        "WORKER_STEP_SLEEP": "0.08", "OMP_NUM_THREADS": "1",
                                        "ADAPTIVE_COLLECTIVE_TIMEOUT": "60", "PYTHONPATH": str(REPO)})
    ex = Executor(LiveLocalBackend(str(tmp_path / "logs")), ScriptedPolicy(lambda jobs, nodes: {
        name: [0] * replicas["n"] for name in jobs}), ClusterSpec(1, 2), interval=0.2, grace_period=60)
    ex.submit(spec)
    deadline = time.monotonic() + 240
    phase = "alone"
    try:
        while not ex.done:
            assert time.monotonic() < deadline, f"the job did not finish: {ex.status()}\n{logs(tmp_path / 'logs')}"
            ex.step()
            records = steps(out)
            if phase == "alone" and len(records) >= 8:
                replicas["n"], phase = 2, "growing"
            elif phase == "growing" and sum(r["world"] == 2 for r in records) >= 16:
                replicas["n"], phase = 1, "shrinking"
            time.sleep(0.1)
    finally:
        ex.shutdown(timeout=30)
    (status,) = ex.status()
    assert status["state"] == "succeeded" and status["launches"] == 1, status
    by_step = check_steps(out, epochs=4)
    worlds = [records[0]["world"] for _, records in sorted(by_step.items())]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1, worlds
    first = steps(out)[0]["pid"]
    assert all(r["pid"] == first for r in steps(out) if r["rank"] == 0), "the first worker was restarted"
    assert sorted(exits(out).values()) == [0, 143]


def test_a_join_request_whose_process_stopped_waiting_is_not_admitted(monkeypatch):
    """Rank 0 admits only joiners that renewed their request lately: a joiner that died while waiting
    would otherwise hold the whole job in the new group's rendezvous."""
    import datetime

    import torch.distributed as dist

    from adaptive.runtime import admitting, env, membership
    from adaptive.runtime.job import reset_job

    port = portpicker.pick_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv(env.LIVE_STORE_VAR, f"127.0.0.1:{port}")
    monkeypatch.setenv("ADAPTIVE_JOB_ID", "membership-unit")
    reset_job()
    try:
        first = membership.join(10.0)  # forms generation 1 alone (ADAPTIVE_LIVE_MIN defaults to 1)
        assert first is not None and first.number == 1 and len(first.members) == 1
        store = membership.membership().store
        for position, (wid, said) in enumerate([(101, time.time()), (102, time.time() - 60)], start=1):
            store.add("gen/1/joins", 1)
            store.set(f"gen/1/join/{position}/waiting", repr(said))
            store.set(f"gen/1/join/{position}", json.dumps({"wid": wid, "node": 9, "local": 0}))
        assert admitting.pending_joins() == 2
        following = admitting.close_generation([first.members[0].wid], joins=2)
        assert [m.wid for m in following.members] == [first.members[0].wid, 101]
        assert following.joiners == (101,) and following.number == 2
        assert store.get("gen").decode() == "2" and store.get("gen/1/state").decode() == "closed"
    finally:
        reset_job()
        del server


def test_a_joiner_killed_while_joining_leaves_the_job_exact(jobs, tmp_path):
    """The joiner's worker is SIGKILLed as soon as it asked to join (while it is admitted and receives
    the state): whatever that interrupts, its agent starts it again and every step is still trained by
    all its members from one state, each sample once per epoch.  The running member does not wait for the
    dead joiner (its launcher reported the death): it pauses less than 2 s."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "3", "WORKER_STEP_SLEEP": "0.08", "ADAPTIVE_CHECKPOINT_INTERVAL": "0.5",
                "ADAPTIVE_COLLECTIVE_TIMEOUT": "20"}
    first = launch(jobs, out, port, "first", restarts=2, **settings)
    wait_steps(out, lambda rs: len(rs) >= 6, "the first node to train")
    second = launch(jobs, out, port, "second", restarts=2, **settings)
    wait_for(lambda: "asks the running generation" in (out / "second.log").read_text(errors="replace"), 60,
             "the joiner to ask to join")
    (victim,) = worker_pids(second.pid)
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)
    assert wait_exit(second, 60, out / "second.log") == 0, logs(out)
    assert live_pids([victim]) == []
    survivor = [r["time"] for r in steps(out) if r["pid"] == steps(out)[0]["pid"]]
    pauses = [b - a for a, b in zip(survivor, survivor[1:]) if b > killed and a < killed + 10]
    assert max(pauses) < 2.0, f"the running member paused {max(pauses):.1f} s for a dead joiner"

    # A rollback (if the kill broke a step) trains the steps since the last checkpoint again.
    check_after_rollbacks(out, epochs=3)


@pytest.mark.parametrize("case", [
    # about 20 s each: the joiner's case (the one that failed in CI) in every run, the others in CI's slow sample
    pytest.param("alone", marks=[pytest.mark.slow, pytest.mark.ci_sample]),
    "joiner-waiting",
    pytest.param("both-members", marks=[pytest.mark.slow, pytest.mark.ci_sample])])
def test_every_member_killed_is_started_again_and_forms_the_next_generation(jobs, tmp_path, case):
    """SIGKILL to every member of a live job at once (they cannot mark their generation failed): the only
    member, alone or while a joiner waits to be admitted, or both members of a two-node job.  Their agents
    start them again and, the generation's every member being dead, they form the next one from the
    checkpoint rather than asking the dead one to admit them; a waiting joiner is never a member of that
    formation with them (it asks the new generation).  Every node ends with 0, every step is trained by all
    its members from one state, each sample once per epoch."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "8", "WORKER_STEP_SLEEP": "0.08", "ADAPTIVE_CHECKPOINT_INTERVAL": "0.5",
                "ADAPTIVE_COLLECTIVE_TIMEOUT": "20"}
    launchers = {"first": launch(jobs, out, port, "first", restarts=1, **settings)}
    wait_steps(out, lambda rs: len(rs) >= 6, "the first node to train")
    if case != "alone":
        launchers["second"] = launch(jobs, out, port, "second", restarts=int(case == "both-members"), **settings)
    if case == "joiner-waiting":
        wait_for(lambda: "asks the running generation" in (out / "second.log").read_text(errors="replace"), 60,
                 "the joiner to ask to join", interval=0.005)
    if case == "both-members":
        wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 6, "the two members to train")
    victims = [pid for name in (["first", "second"] if case == "both-members" else ["first"])
               for pid in worker_pids(launchers[name].pid)]
    killed_at = time.time()
    assert not any(r["epoch"] == 7 for r in steps(out)), "training came too near its end before the kill"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    for name, launcher in launchers.items():
        assert wait_exit(launcher, 120, out / f"{name}.log") == 0, logs(out)
    assert live_pids(victims) == []
    check_after_rollbacks(out, epochs=8)
    after = {r["pid"] for r in steps(out) if r["time"] > killed_at + 1}
    assert not after & set(victims) and len(after) == len(launchers), f"trained after the kill: {after}\n{logs(out)}"


@pytest.mark.slow
@pytest.mark.ci_sample  # about 25 s (a 3 s hang timeout, a restart): CI runs it after the default suite
def test_a_joiner_takes_out_the_only_member_when_it_is_stopped(jobs, tmp_path):
    """SIGSTOP to the only member while a joiner waits to be admitted: once the member gave no sign of life for
    the hang timeout, the joiner takes it out (its launcher kills the stopped process, by PID, and starts it
    again), the worker started again forms the next generation from the checkpoint and admits the joiner; the
    job ends exact, and the stopped process never trains again."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "8", "WORKER_STEP_SLEEP": "0.08", "ADAPTIVE_CHECKPOINT_INTERVAL": "0.5",
                "ADAPTIVE_LIVE_HANG_TIMEOUT": "3"}
    first = launch(jobs, out, port, "first", restarts=1, **settings)
    wait_steps(out, lambda rs: len(rs) >= 6, "the first node to train")
    second = launch(jobs, out, port, "second", **settings)
    wait_for(lambda: "asks the running generation" in (out / "second.log").read_text(errors="replace"), 60,
             "the joiner to ask to join", interval=0.005)
    (stopped,) = worker_pids(first.pid)
    os.kill(stopped, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        wait_for(lambda: not live_pids([stopped]), 60, "the stopped member's launcher to kill it")
    finally:
        if live_pids([stopped]):
            os.kill(stopped, signal.SIGCONT)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)
    assert wait_exit(second, 60, out / "second.log") == 0, logs(out)
    check_after_rollbacks(out, epochs=8)
    assert not [r for r in steps(out) if r["pid"] == stopped and r["time"] > stopped_at]
    assert len({r["pid"] for r in steps(out) if r["time"] > stopped_at}) == 2, logs(out)


def test_a_launcher_stopped_while_its_worker_waits_to_be_admitted_ends_at_once(jobs, tmp_path):
    """SIGTERM to a joining node whose worker waits to be admitted (the running member is held with SIGSTOP,
    so no one answers): the worker has nothing to save and leaves at once (143), and so does its launcher;
    the running member, woken, trains on alone and finishes exact."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "2", "WORKER_STEP_SLEEP": "0.05"}
    first = launch(jobs, out, port, "first", **settings)
    records = wait_steps(out, lambda rs: len(rs) >= 4, "the first node to train")
    member = records[0]["pid"]
    os.kill(member, signal.SIGSTOP)
    try:
        second = launch(jobs, out, port, "second", **settings)
        wait_for(lambda: "asks the running generation" in (out / "second.log").read_text(errors="replace"), 60,
                 "the joiner to ask to join")
        (joiner,) = worker_pids(second.pid)
        stopped = time.monotonic()
        second.send_signal(signal.SIGTERM)
        assert wait_exit(second, 10, out / "second.log") == 143, logs(out)
        assert time.monotonic() - stopped < 5, "the joining node took more than 5 s to stop"
        assert live_pids([joiner]) == [] and exits(out)[joiner] == 143
    finally:
        os.kill(member, signal.SIGCONT)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)
    by_step = check_steps(out, epochs=2)
    assert {r["pid"] for records in by_step.values() for r in records} == {member}


def test_only_an_agent_on_the_endpoints_machine_hosts_the_store():
    """An agent hosts the job's store only when ``--rdzv-endpoint`` names an address of its own machine:
    one on another machine, whose own port is free, must connect instead of hosting a store of its own."""
    from adaptive.elastic.live_store import is_this_machine as _is_this_machine

    assert _is_this_machine("127.0.0.1") and _is_this_machine("localhost")
    assert not _is_this_machine("192.0.2.1")  # TEST-NET-1: no machine's address
    assert not _is_this_machine("no-such-host.invalid")


def _live_args(port: int, *extra: str) -> list[str]:
    return ["--live", "--nnodes", "1:4", "--nproc-per-node", "1", "--max-restarts", "1",
            "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]


def test_the_store_listens_on_the_endpoints_address_only_and_refuses_another_job(jobs, tmp_path):
    """The hosting launcher's store listens on 127.0.0.1 (the endpoint), not on every interface; a launcher
    of another job (another --rdzv-id) on the same endpoint is refused before it starts a worker, with exit 2,
    and the running job goes on alone."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "5", "WORKER_STEP_SLEEP": "0.05", "WORKER_SAMPLES": str(SAMPLES),
                "WORKER_BATCH": str(BATCH)}
    first = jobs.launch(_live_args(port), out, "first.log", script=LIVE_WORKER, **settings)
    records = wait_steps(out, lambda rs: len(rs) >= 3, "the first node to train")
    listening = [c.laddr for c in psutil.Process(first.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and {address.ip for address in listening} == {"127.0.0.1"}, listening
    other = jobs.launch(_live_args(port, "--rdzv-id", "another-job"), out, "other.log", script=LIVE_WORKER,
                        **settings)
    assert wait_exit(other, 60, out / "other.log") == 2, logs(out)
    said = (out / "other.log").read_text()
    assert "serves another job" in said and "another-job" in said and "Traceback" not in said, said
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)
    assert {r["pid"] for r in steps(out)} == {records[0]["pid"]} and {r["world"] for r in steps(out)} == {1}


@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s: CI runs it after the default suite
def test_losing_the_node_that_hosts_the_store_ends_the_others_with_75_and_a_relaunch_resumes(jobs, tmp_path):
    """SIGKILL of the launcher that hosts the job's store while two nodes train: the other node ends within
    seconds with 75 (relaunch) and one line, no traceback, its worker gone; a relaunch resumes from the newest
    checkpoint and every sample is trained once per epoch."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = {"WORKER_EPOCHS": "5", "WORKER_STEP_SLEEP": "0.08", "ADAPTIVE_CHECKPOINT_INTERVAL": "1"}
    host = launch(jobs, out, port, "host", restarts=1, **settings)
    wait_steps(out, lambda rs: len(rs) >= 4, "the first node to train")
    other = launch(jobs, out, port, "other", restarts=1, **settings)
    wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 8, "the second node to join")
    workers = worker_pids(host.pid) + worker_pids(other.pid)
    assert len(workers) == 2, workers
    host.send_signal(signal.SIGKILL)
    started = time.monotonic()
    assert wait_exit(other, 30, out / "other.log") == 75, logs(out)
    ended_in = time.monotonic() - started
    assert wait_for(lambda: live_pids(workers) == [], 10, "the workers to be gone"), live_pids(workers)
    said = (out / "other.log").read_text(errors="replace")
    assert "has not answered" in said and "Traceback" not in without_debug_traceback(said), said
    assert ended_in < 20, ended_in
    again = launch(jobs, out, portpicker.pick_unused_port(), "again", **settings)
    assert wait_exit(again, 120, out / "again.log") == 0, logs(out)
    last = {r["epoch"]: r for r in map(json.loads, (out / "epochs.jsonl").read_text().splitlines())}
    assert sorted(last) == list(range(5))
    assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in last.values()), last


def test_a_job_identity_names_what_differs_and_the_store_keeps_the_first_one():
    import datetime

    import torch.distributed as dist

    from adaptive.elastic import live_store

    port = portpicker.pick_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    first = live_store.JobIdentity("train", "none", "train.py", ("--lr", "0.1"))
    live_store.claim_identity(store, first)
    live_store.claim_identity(store, first)  # the same job: welcome
    other = live_store.JobIdentity("train", "none", "train.py", ("--lr", "0.2"))
    assert other.differences(first) == ["args: ('--lr', '0.2') here, ('--lr', '0.1') in the job"]
    with pytest.raises(live_store.IdentityMismatch) as refused:
        live_store.claim_identity(store, other)
    assert refused.value.code == live_store.CONFIG_ERROR_EXIT_CODE


def test_a_worker_that_exits_with_a_usage_error_ends_its_node_without_spending_restarts(jobs, tmp_path):
    """Exit status 2 (a bad argument, argparse's usage error) cannot be fixed by a restart: the node ends with 2
    at once, its worker started once, although it had restarts to spend."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    script = tmp_path / "bad_arguments.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args(['--no-such-option'])\n")
    started = time.monotonic()
    node = jobs.launch(["--live", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
                        "--rdzv-endpoint", f"127.0.0.1:{port}"], out, "node.log", script=script)
    assert wait_exit(node, 60, out / "node.log") == 2, logs(out)
    said = (out / "node.log").read_text()
    assert "a usage or configuration error" in said and "starting it again" not in said, said
    assert said.count("unrecognized arguments") == 1, said
    assert time.monotonic() - started < 60
