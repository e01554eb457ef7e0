"""Seeded sequences of joins, leaves and kills on one live job (``adaptive-run --live``), checked as a whole.

The other live tests each set up one change; here a seeded random generator
draws a sequence of them, one after another on the same job, as a cluster
would deal them:

* **join**: another launcher (a node of one or two workers) starts;
* **leave**: SIGTERM to a launcher other than the first (which hosts the
  store); its workers leave at their next agreed step and it exits 143;
* **kill**: SIGKILL of one worker; its launcher starts it again and it joins;
* **kill two**: SIGKILL of two workers of different nodes at once;
* **kill and join**: a SIGKILL and a new launcher at the same moment.

Odd seeds run the script with the usual extras besides its DataLoader
worker: a barrier while rank 0 prepares the data, a validation loop per
epoch, and autoscale with gradient accumulation (the batch size changes as
the members do).

After each change the test waits until the job trains at the size it should
have, with a process started after the change among the members where one
was.  At the end every step must have been trained, in its newest
generation, by all its members from one state, every sample once per epoch
(in validation too); the killed PIDs and their DataLoader workers are gone;
every worker never killed ended in its own process (0, or 143 for those that
left, or 1 for those that took the restart path because a kill broke a
collective between the loader's loops, at an epoch's end: the fallback
docs/live.md names); the steps a member trained again after a rollback drew
the random numbers they drew the first time.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import portpicker
import psutil
import pytest

from elastic_harness import live_pids, wait_exit
from live_harness import check_after_rollbacks, exits, launch, logs, steps, wait_steps, worker_pids
from live_harness import jobs  # noqa: F401  (the fixture)

SETTINGS = {"WORKER_EPOCHS": "30", "WORKER_STEP_SLEEP": "0.05", "WORKER_LOADER_WORKERS": "1",
            "ADAPTIVE_CHECKPOINT_INTERVAL": "0"}
EPOCHS = int(SETTINGS["WORKER_EPOCHS"])
#: Changes per sequence, and the most workers the job may have.
CHANGES, MOST = 5, 4
#: Restarts each launcher allows (a kill uses one).
RESTARTS = 3
#: The script's extras on odd seeds: a barrier and a validation loop, autoscale with accumulation.
EXTRAS = {"WORKER_EVAL": "1", "WORKER_AUTOSCALE": "48,4,16,1,3"}
#: Loaders sized otherwise: a ramp-up of the global batch (in samples consumed over the job, 480 an epoch) that
#: grows while the changes are dealt, and a token budget (samples of 1-5 tokens, 40 per micro-batch, 2 micro-batches).
SIZINGS = {"ramp-up": {"WORKER_RAMPUP": "0:8 1500:16 4000:24"}, "tokens": {"WORKER_TOKENS": "40,2"}}


class Cluster:
    """The launchers of one live job and what the test did to them."""

    def __init__(self, jobs, out: Path, port: int, settings: dict[str, str]) -> None:
        self.jobs, self.out, self.port, self.settings = jobs, out, port, settings
        self.nodes: dict[str, dict] = {}  # name -> {"launcher", "workers", "restarts"} of running launchers
        self.ended: dict[str, tuple] = {}  # name -> (launcher, expected exit status)
        self.killed: dict[int, float] = {}  # PID -> when it was killed
        self.orphans: set[int] = set()  # the DataLoader workers of the killed workers
        self.left: set[int] = set()  # PIDs of workers that left with their node

    def start(self, workers: int) -> str:
        name = f"node{len(self.nodes) + len(self.ended)}"
        launcher = launch(self.jobs, self.out, self.port, name, per_node=workers, restarts=RESTARTS, **self.settings)
        self.nodes[name] = {"launcher": launcher, "workers": workers, "restarts": RESTARTS}
        return name

    def size(self) -> int:
        return sum(node["workers"] for node in self.nodes.values())

    def worker_pids(self, name: str) -> list[int]:
        return worker_pids(self.nodes[name]["launcher"].pid)

    def kill_one(self, name: str, rng: random.Random) -> int:
        pid = rng.choice(self.worker_pids(name))
        self.orphans.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        os.kill(pid, signal.SIGKILL)
        self.nodes[name]["restarts"] -= 1
        self.killed[pid] = time.time()
        return pid

    def leave(self, name: str) -> None:
        node = self.nodes.pop(name)
        self.left.update(worker_pids(node["launcher"].pid))
        node["launcher"].send_signal(signal.SIGTERM)
        self.ended[name] = (node["launcher"], 143)


def _changes(cluster: Cluster) -> list[str]:
    """The changes that can be dealt now."""
    size, can_kill = cluster.size(), [n for n, node in cluster.nodes.items() if node["restarts"] > 0]
    possible = []
    if size < MOST:
        possible.append("join")
    if len(cluster.nodes) > 1:
        possible.append("leave")
    if size > 1 and can_kill:
        possible.append("kill")
    if size > 2 and len(can_kill) > 1:
        possible.append("kill two")
    if size > 1 and size < MOST and can_kill:
        possible.append("kill and join")
    return possible


def _deal(cluster: Cluster, change: str, rng: random.Random) -> bool:
    """Make ``change``; returns whether a new process must be among the members afterwards."""
    can_kill = sorted(n for n, node in cluster.nodes.items() if node["restarts"] > 0)
    if change == "join":
        cluster.start(rng.choice([1, 2]) if cluster.size() <= MOST - 2 else 1)
    elif change == "leave":
        cluster.leave(rng.choice(sorted(set(cluster.nodes) - {"node0"})))
    elif change == "kill":
        cluster.kill_one(rng.choice(can_kill), rng)
    elif change == "kill two":
        for name in rng.sample(can_kill, 2):
            cluster.kill_one(name, rng)
    else:  # kill and join
        cluster.kill_one(rng.choice(can_kill), rng)
        cluster.start(1)
    return change != "leave"


def _trains_at(out: Path, size: int, since: float, fresh: bool, what: str) -> None:
    """Wait until three steps after ``since`` were trained at ``size`` members (a process that trained
    nothing before ``since`` among them when ``fresh``)."""
    before = {r["pid"] for r in steps(out) if r["time"] <= since}

    def settled(records):
        at_size = [r for r in records if r["time"] > since and r["world"] == size and not r["discarded"]]
        if fresh and not any(r["pid"] not in before for r in at_size):
            return False
        return len({(r["epoch"], r["step"]) for r in at_size}) >= 3

    wait_steps(out, settled, what, timeout=90)


def _restart_path_after_a_kill(out: Path, killed: dict[int, float]) -> set[int]:
    """The workers that took the restart path (exit 1, their launcher starts them again) because a kill broke a
    collective outside the loader's loops (the epoch's end, ``Accumulator.synchronized``: docs/live.md), within
    30 s of a kill the test dealt."""
    said = re.compile(r"^\[pid (\d+)\] adaptive\.runtime\.peer_failure: rank \d+: a peer replica failed .*"
                      r"the live job's members restart from it", re.MULTILINE)
    pids = {int(pid) for log in out.glob("*.log") for pid in said.findall(log.read_text(errors="replace"))}
    ended = {r["pid"]: r["time"] for r in map(json.loads, (out / "exits.jsonl").read_text().splitlines())}
    return {pid for pid in pids if any(0 <= ended.get(pid, 0.0) - at <= 30 for at in killed.values())}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.ci_sample), pytest.param(1, marks=pytest.mark.ci_sample),
                                  *range(2, 12)])
def test_a_seeded_sequence_of_joins_leaves_and_kills(jobs, tmp_path, seed):
    _run_sequence(jobs, tmp_path, seed, dict(SETTINGS, **(EXTRAS if seed % 2 else {})))


@pytest.mark.slow
@pytest.mark.parametrize("sizing", [pytest.param(name, marks=pytest.mark.ci_sample) for name in sorted(SIZINGS)])
def test_a_sequence_with_a_ramp_up_or_a_token_budget(jobs, tmp_path, sizing):
    """The same, with the batch sized by a ramp-up schedule (it grows during the changes) or by a token budget
    (every step holds another number of samples, different on each replica)."""
    _run_sequence(jobs, tmp_path, 3, dict(SETTINGS, **SIZINGS[sizing]))


def _run_sequence(jobs, tmp_path: Path, seed: int, settings: dict[str, str]) -> None:
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    rng = random.Random(seed)
    cluster = Cluster(jobs, out, port, settings)
    cluster.start(1)  # node0 first: its launcher hosts the job's store (a node that leaves must not)
    _trains_at(out, 1, 0.0, False, "the first member to train")
    cluster.start(1)
    _trains_at(out, 2, 0.0, False, "two members to train")
    dealt = []
    for _ in range(CHANGES):
        change = rng.choice(_changes(cluster))
        since = time.time()
        fresh = _deal(cluster, change, rng)
        dealt.append((change, cluster.size()))
        _trains_at(out, cluster.size(), since, fresh, f"the job to train at {cluster.size()} after {dealt}")
    trained_to = max(r["epoch"] for r in steps(out))
    assert trained_to < EPOCHS - 1, f"the job was near its end before the changes were dealt: {dealt}"

    for name, (launcher, code) in cluster.ended.items():
        assert wait_exit(launcher, 60, out / f"{name}.log") == code, f"{dealt}\n{logs(out)}"
    for name, node in cluster.nodes.items():
        assert wait_exit(node["launcher"], 180, out / f"{name}.log") == 0, f"{dealt}\n{logs(out)}"

    check_after_rollbacks(out, epochs=EPOCHS)
    if "WORKER_EVAL" in settings:  # each epoch validated; the last time (after a rollback) every sample once
        validation = {r["epoch"]: r for r in map(json.loads, (out / "val.jsonl").read_text().splitlines())}
        assert sorted(validation) == list(range(EPOCHS)), validation
        assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in validation.values()), validation
    assert live_pids(list(cluster.killed)) == []
    if cluster.killed:  # each killed worker had a DataLoader worker; none outlived it
        assert cluster.orphans and live_pids(sorted(cluster.orphans)) == [], "a DataLoader worker outlived its parent"
    assert not [r for r in steps(out) if r["time"] > cluster.killed.get(r["pid"], float("inf"))], \
        "a killed worker logged a step after its kill"
    trained = {r["pid"] for r in steps(out)}
    ended = exits(out)
    fell_back = _restart_path_after_a_kill(out, cluster.killed)
    for pid in trained - set(cluster.killed):
        expected = 1 if pid in fell_back else 143 if pid in cluster.left else 0
        assert ended.get(pid) == expected, f"worker {pid} ended with {ended.get(pid)}, not {expected}: {dealt}"
