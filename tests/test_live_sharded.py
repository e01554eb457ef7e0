"""Live membership with a sharded model (AdaptiveFSDP: FSDP2 and HSDP) under ``adaptive-run --live``.

The worker (``tests/workers/live_fsdp_worker.py``) logs, per step and per
process, the mesh, the generation, its sample indices and digests of the
whole (gathered) model, optimizer and LR scheduler state before and after
the step.  A change that resharded the state exactly shows as an unbroken
chain: each step starts from the state the step before it ended with,
across generations and meshes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import portpicker
import psutil
import pytest

from elastic_harness import live_pids, wait_exit
from live_harness import SAMPLES, exits, jobs, launch, logs, replayed_draws, steps, wait_steps  # noqa: F401 (jobs)
from live_harness import worker_pids

REPO = Path(__file__).resolve().parent.parent
FSDP_WORKER = REPO / "tests" / "workers" / "live_fsdp_worker.py"


def _by_step(out: Path) -> list[list[dict]]:
    """The records of each trained step (epoch, loader step), in the order trained."""
    grouped: dict[tuple[int, int], list[dict]] = collections.defaultdict(list)
    for record in steps(out):
        grouped[(record["epoch"], record["step"])].append(record)
    return [grouped[key] for key in sorted(grouped, key=lambda key: grouped[key][0]["time"])]


def _check_exact(out: Path, epochs: int) -> list[list[dict]]:
    """Every step trained once by exactly its world's members from one state, in an unbroken chain of states,
    every sample once per epoch."""
    trained = _by_step(out)
    previous_after = None
    for records in trained:
        first = records[0]
        assert len(records) == first["world"], f"step {first['epoch']}/{first['step']} has {len(records)} records"
        assert sorted(r["rank"] for r in records) == list(range(first["world"]))
        assert len({(r["generation"], tuple(r["mesh"])) for r in records}) == 1
        assert len({r["before"] for r in records}) == 1 and len({r["after"] for r in records}) == 1
        if previous_after is not None:
            assert first["before"] == previous_after, \
                f"step {first['epoch']}/{first['step']} (generation {first['generation']}) does not start from the " \
                "state the step before it ended with"
        previous_after = first["after"]
    for epoch in range(epochs):
        seen = collections.Counter(i for records in trained if records[0]["epoch"] == epoch
                                   for r in records for i in r["indices"])
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, f"epoch {epoch} is not exact"
    done = json.loads((out / "done.json").read_text())
    assert done["model_steps"] == len(trained)
    return trained


def _settings(**extra: str) -> dict[str, str]:
    return {"WORKER_EPOCHS": "4", "WORKER_STEP_SLEEP": "0.1", "ADAPTIVE_COLLECTIVE_TIMEOUT": "30", **extra}


def _join_then_leave(jobs, out: Path, port: int, per_node: int, settings: dict[str, str],
                     **first_only: str) -> list[tuple[int, ...]]:
    """A first node of ``per_node`` workers trains; a second joins, trains with it (steps at twice the world)
    and leaves on a real SIGTERM to its launcher (143); the first finishes (0). The leaver's workers are gone
    (by PID), every step is exact (:func:`_check_exact`); returns each trained step's mesh, in order."""
    first = launch(jobs, out, port, "first", per_node=per_node, script=FSDP_WORKER, **first_only, **settings)
    wait_steps(out, lambda rs: len(rs) >= 4 * per_node, "the first node to train")
    second = launch(jobs, out, port, "second", per_node=per_node, script=FSDP_WORKER, **settings)
    wait_steps(out, lambda rs: sum(r["world"] == 2 * per_node for r in rs) >= 8 * per_node,
               "the second node to train with the first")
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)
    leavers = {r["pid"] for r in steps(out) if r["world"] == 2 * per_node} - {r["pid"] for r in steps(out)
                                                                            if r["generation"] == 1}
    assert len(leavers) == per_node and live_pids(sorted(leavers)) == []
    return [tuple(records[0]["mesh"]) for records in _check_exact(out, epochs=int(settings["WORKER_EPOCHS"]))]


@pytest.mark.parametrize("order", ["model-first", pytest.param("loaders-first", marks=[pytest.mark.slow,
                                                                                       pytest.mark.ci_sample])])
def test_a_sharded_model_is_resharded_in_memory_for_a_joiner_and_after_a_leaver(jobs, tmp_path, order):
    """1-D FSDP: 1 -> 2 -> 1 replicas live; the first worker keeps its PID and each change keeps the state.
    With the loaders built first, the joiner shards its model on a group of its own and shards it anew for
    the generation it joins when it is admitted, at its first loop."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    meshes = _join_then_leave(jobs, out, port, 1, _settings(WORKER_ORDER=order))
    assert meshes[0] == (1,) and (2,) in meshes and meshes[-1] == (1,), meshes
    generations = sorted({r["generation"] for r in steps(out)})
    assert generations == [1, 2, 3], generations
    (first_pid,) = {r["pid"] for r in steps(out) if r["generation"] == 1}
    assert all(r["pid"] == first_pid for r in steps(out) if r["rank"] == 0), "the first worker was restarted"
    assert sorted(exits(out).values()) == [0, 143], exits(out)


@pytest.mark.slow
@pytest.mark.ci_sample
def test_hsdp_gains_and_loses_a_replica_group_live(jobs, tmp_path):
    """HSDP with shard groups of 2: a second node of 2 joins (mesh (1, 2) -> (2, 2)) and leaves again."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = _settings(WORKER_SHARD_SIZE="2", WORKER_EPOCHS="4", WORKER_STEP_SLEEP="0.15")
    meshes = _join_then_leave(jobs, out, port, 2, settings, ADAPTIVE_LIVE_MIN="2")
    assert meshes[0] == (1, 2) and (2, 2) in meshes and meshes[-1] == (1, 2), meshes
    survivors = {r["pid"] for r in steps(out) if r["generation"] == 1}
    assert len(survivors) == 2
    assert {r["pid"] for r in steps(out) if r["rank"] < 2} == survivors, "a worker of the first node was restarted"
    assert sorted(exits(out).values()) == [0, 0, 143, 143], exits(out)


def _newest(out: Path) -> list[list[dict]]:
    """The records of each step as last trained (a step discarded or trained again after a rollback counts as
    its newest generation trained it), in training order: (epoch, loader step)."""
    newest: dict[tuple[int, int], list[dict]] = {}
    for record in sorted(steps(out), key=lambda r: r["time"]):
        if record["discarded"]:
            continue
        key = (record["epoch"], record["step"])
        group = newest.get(key, [])
        newest[key] = group + [record] if group and group[0]["generation"] == record["generation"] else [record]
    return [newest[key] for key in sorted(newest)]


@pytest.mark.slow
def test_hsdp_loses_a_member_and_the_others_recover_in_memory(jobs, tmp_path):
    """HSDP (2, 2), with a DataLoader worker per rank, rank 0 preparing the data behind a barrier and a
    validation loop per epoch: SIGKILL of one worker of the second node. Every replica group holds every
    shard, so the three that are left keep their PIDs, join a whole copy from their shards, reshard for
    three and go on; the killed worker (and its DataLoader worker) is gone, its launcher starts it again and
    it joins. Then the second node leaves (SIGTERM to its launcher) and the first goes on alone. Each step as
    last trained starts from the state the step before it ended with (an unbroken chain across the rollback
    and both changes), every sample once per epoch in training and in validation, and the steps trained
    again drew the random numbers they drew the first time."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    epochs = 6
    settings = _settings(WORKER_SHARD_SIZE="2", WORKER_EPOCHS=str(epochs), WORKER_STEP_SLEEP="0.15",
                         WORKER_LOADER_WORKERS="1", WORKER_EVAL="1",
                         ADAPTIVE_CHECKPOINT_INTERVAL="0")
    first = launch(jobs, out, port, "first", per_node=2, restarts=2, script=FSDP_WORKER, ADAPTIVE_LIVE_MIN="4",
                   **settings)
    second = launch(jobs, out, port, "second", per_node=2, restarts=2, script=FSDP_WORKER, **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 4 for r in rs) >= 24, "four members to train")
    before = {r["rank"]: r["pid"] for r in records if r["world"] == 4}
    first_node = set(worker_pids(first.pid, FSDP_WORKER.name)) & set(before.values())
    second_node = set(worker_pids(second.pid, FSDP_WORKER.name)) & set(before.values())
    assert len(first_node) == len(second_node) == 2, (first_node, second_node, before)
    victim = max(second_node)
    victim_loader_workers = [child.pid for child in psutil.Process(victim).children()]
    assert victim_loader_workers, "the worker has no DataLoader worker process"
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    rejoined = wait_steps(out, lambda rs: any(r["time"] > killed and r["world"] == 4 and r["pid"] not in
                                              before.values() for r in rs), "the killed worker's restart to join")
    assert max(r["epoch"] for r in rejoined) < epochs - 1, "too little training left for the leave"
    left = time.time()
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert wait_exit(first, 150, out / "first.log") == 0, logs(out)

    assert live_pids([victim] + victim_loader_workers) == []
    after = [r for r in steps(out) if r["time"] > killed and not r["discarded"]]
    survivors = set(before.values()) - {victim}
    # (they may admit the restarted worker at their first boundary, before training a step as three)
    assert survivors <= {r["pid"] for r in after}, "the members that were left did not go on"
    replacement = {r["pid"] for r in after if r["pid"] not in before.values()}
    assert len(replacement) == 1, f"not one worker rejoined: {replacement}"
    ended = exits(out)
    assert all(ended[pid] == 0 for pid in first_node), "a member of the first node was restarted"
    assert all(ended[pid] == 143 for pid in (second_node | replacement) - {victim}), \
        "the second node's workers did not leave in their own processes"
    assert {r["pid"] for r in steps(out) if r["time"] > left + 10} <= first_node
    said = "".join(log.read_text(errors="replace") for log in out.glob("*.log"))
    assert "back to after the step in flight" in said or "back to before the step in flight" in said, said
    assert "restarting from the checkpoint" not in said
    previous_after = None
    for trained in _newest(out):
        first_record = trained[0]
        assert len(trained) == first_record["world"] and len({r["before"] for r in trained}) == 1
        assert previous_after is None or first_record["before"] == previous_after, \
            f"step {first_record['epoch']}/{first_record['step']} does not start from the state before it"
        # (None: a member was lost in the gather of the digest, after every member applied the step)
        previous_after = next((r["after"] for r in trained if r["after"] is not None), None)
    assert [tuple(trained[0]["mesh"]) for trained in _newest(out)][-1] == (1, 2)
    for epoch in range(epochs):
        seen = collections.Counter(i for trained in _newest(out) if trained[0]["epoch"] == epoch
                                   for r in trained for i in r["indices"])
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, f"epoch {epoch} is not exact"
    validation = [json.loads(line) for line in (out / "val.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in validation] == list(range(epochs)), validation
    assert all(r["missing"] == 0 and r["extra"] < r["world"] for r in validation), validation
    # Only the step in flight is trained again (when no member had applied it), drawing what it drew first.
    replayed = replayed_draws(out)
    assert all(len(set(draws)) == 1 for draws in replayed.values()), replayed
    assert len({(epoch, step) for _, epoch, step in replayed}) <= 1, replayed


@pytest.mark.slow
@pytest.mark.ci_sample
def test_a_lost_member_of_a_sharded_job_restarts_everyone_from_the_checkpoint(jobs, tmp_path):
    """1-D FSDP: a SIGKILLed member's shards have no other copy, so every member restarts from the checkpoint
    (logged why), and the job still trains each sample once per epoch."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    settings = _settings(ADAPTIVE_CHECKPOINT_INTERVAL="0.5", WORKER_EPOCHS="6")
    first = launch(jobs, out, port, "first", restarts=2, script=FSDP_WORKER, **settings)
    wait_steps(out, lambda rs: len(rs) >= 2, "the first node to train")
    second = launch(jobs, out, port, "second", restarts=2, script=FSDP_WORKER, **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 8, "two members to train")
    victim = next(r["pid"] for r in reversed(records) if r["world"] == 2 and r["rank"] == 1)
    survivor = next(r["pid"] for r in reversed(records) if r["world"] == 2 and r["rank"] == 0)
    os.kill(victim, signal.SIGKILL)
    assert wait_exit(first, 150, out / "first.log") == 0, logs(out)
    assert wait_exit(second, 60, out / "second.log") == 0, logs(out)
    assert live_pids([victim, survivor]) == [], "the survivor's process was not ended for the restart"
    assert exits(out)[survivor] == 1, "the survivor did not take the restart path"
    assert any(r["pid"] not in (victim, survivor) for r in steps(out)), "no restarted worker trained"
    said = "".join(log.read_text(errors="replace") for log in out.glob("*.log"))
    # The log says why every member restarted: at a boundary of a loop, that a sharded job restarts after a loss;
    # in a collective that cannot be discarded (a checkpoint being written, the end of an epoch), that.
    assert ("of a sharded job; restarting every member from the checkpoint" in said
            or "since the loss broke a collective that cannot be discarded in memory" in said), logs(out)
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert {(e["missing"], e["extra"]) for e in epochs} == {(0, 0)} and {e["epoch"] for e in epochs} == set(range(6))


def test_a_mesh_built_for_a_new_generation_is_not_mistaken_for_an_equal_one_of_an_earlier_generation():
    """DeviceMesh compares equal by layout, whatever groups it names, and DTensor caches operations' output
    sharding: an operation on a DTensor of a new generation's mesh came back on the earlier generation's mesh
    (whose groups are gone). Building a live job's mesh empties those caches first. (In a fresh interpreter:
    the two generations' default groups are its own.)"""
    script = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from adaptive.parallel import _sharding

def generation():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))

earlier = generation()
distribute_tensor(torch.ones(4), earlier, [Shard(0)]).detach()  # the operation's output sharding is cached
dist.destroy_process_group()
later = generation()
assert later == earlier and later is not earlier
tensor = distribute_tensor(torch.ones(4), later, [Shard(0)])
print("stale", tensor.detach().device_mesh is earlier)  # what torch does on its own
_sharding._forget_earlier_meshes()
print("fresh", tensor.detach().device_mesh is later)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["stale", "True", "fresh", "True"], done.stdout


FSDP2_EXAMPLE = REPO / "tests" / "workers" / "fsdp2_example.py"


@pytest.mark.slow
@pytest.mark.ci_sample
def test_pytorch_fsdp2_example_joins_leaves_and_restarts_everyone_after_a_kill(jobs, tmp_path):
    """PyTorch's FSDP2 example (a Transformer built on the meta device, 1-D mesh), ported: a second node joins
    and leaves live, a third joins, and its worker is SIGKILLed.  Its shards had no other copy, so every member
    takes the restart path within seconds (no one waits for the dead one), the job resumes from the checkpoint
    and finishes with every sample once per epoch; the killed worker is gone."""
    out, port = tmp_path / "job", portpicker.pick_unused_port()
    # Enough epochs that the third node (its start takes seconds on a loaded machine) joins with steps left.
    settings = _settings(ADAPTIVE_CHECKPOINT_INTERVAL="0.5", WORKER_EPOCHS="12", WORKER_STEP_SLEEP="0.05")
    first = launch(jobs, out, port, "first", restarts=2, script=FSDP2_EXAMPLE, **settings)
    wait_steps(out, lambda rs: len(rs) >= 4, "the first node to train")
    second = launch(jobs, out, port, "second", restarts=2, script=FSDP2_EXAMPLE, **settings)
    wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 8, "the second node to train with the first")
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    third = launch(jobs, out, port, "third", restarts=2, script=FSDP2_EXAMPLE, **settings)
    records = wait_steps(out, lambda rs: sum(r["world"] == 2 for r in rs) >= 24, "the third node to train with it")
    victim = next(r["pid"] for r in reversed(records) if r["world"] == 2 and r["rank"] == 1)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    wait_steps(out, lambda rs: any(r["time"] > killed and not r["discarded"] and r["pid"] != victim for r in rs),
               "the job to train again after the kill", timeout=30)
    assert wait_exit(first, 150, out / "first.log") == 0, logs(out)
    assert wait_exit(third, 60, out / "third.log") == 0, logs(out)
    assert live_pids([victim]) == []
    said = "".join(log.read_text(errors="replace") for log in out.glob("*.log"))
    assert "Traceback" not in said.replace("the failed collective", ""), logs(out)
    epochs = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    newest = {e["epoch"]: e for e in epochs}  # an epoch ended twice (rolled back) counts as last ended
    assert sorted(newest) == list(range(12)) and {(e["missing"], e["extra"]) for e in newest.values()} == {(0, 0)}, \
        epochs
