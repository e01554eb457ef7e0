"""Sharded and asynchronous checkpoints through torch.distributed.checkpoint (DCP).

In process (a gloo group of one): round trips, staging of asynchronous saves, failures in the background,
hostile ``.metadata`` and bytes items, manifest version 1, keep-K, the stop waiting for a save in flight.
Under real torchrun (gloo, CPU, workers/sharded_ckpt_worker.py): save on 2 ranks, load on 3 and on 1 with
exactly the saved full state; a rank SIGKILLed inside a sharded save and inside an asynchronous one.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import portpicker
import pytest
import torch
import torch.distributed as dist

import adaptive
from adaptive.checkpoint import _dcp_io, _format, _saving, _staging, states
from adaptive.checkpoint.store import CheckpointError, CheckpointStore
from adaptive.runtime import env
from adaptive.runtime import step as step_records
from adaptive.elastic import stopping, sync_points
from adaptive.runtime.job import current_job, reset_job
from adaptive.runtime.process_tree import kill_process_tree
from workers.sharded_ckpt_common import FSDPState, assert_equal_states, build, full_state, train

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "sharded_ckpt_worker.py"
NAME = "test.fsdp"


# ------------------------------------------------------------------ helpers


@pytest.fixture
def group(job: Path):
    """A job of one replica with a gloo process group of one (FSDP2 and DCP need a group)."""
    adaptive.init_process_group("gloo")
    yield job
    _saving.wait_for_pending_save()
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_job()


def restart() -> None:
    """As if the process restarted, keeping the process group (the saved checkpoints stay on disk)."""
    _saving.wait_for_pending_save()
    groups = current_job().groups
    reset_job().groups = groups


def store(root: Path) -> CheckpointStore:
    return CheckpointStore(root / "checkpoints")


def checkpoint_dirs(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root / "checkpoints") if name.startswith("checkpoint-"))


def rewrite_sharded_record(directory: Path, file: str) -> None:
    """Make the manifest agree with the current bytes of sharded file ``file`` (a consistent, hostile checkpoint)."""
    data = (directory / _format.SHARDED_DIR / file).read_bytes()
    path = directory / _format.MANIFEST_NAME
    body = json.loads(path.read_text())
    for entry in body["sharded"]["files"]:
        if entry["file"] == file:
            entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    body["checksum"] = _format.manifest_checksum(body)
    path.write_text(json.dumps(body))


def saved_and_restored(group_root: Path, *, blocking: bool = True) -> tuple[dict, dict, FSDPState]:
    """Train, save, restart, restore into a model from another seed: (full state saved, restored, new state)."""
    model, optimizer = build(1, seed=1)
    state = FSDPState(model, optimizer)
    train(model, optimizer, 3, seed=5)
    state.steps = 3
    expected = full_state(model, optimizer)
    adaptive.save_all_states({"note": "x"}, blocking=blocking)
    restart()
    model, optimizer = build(1, seed=2)
    restored = FSDPState(model, optimizer)
    return expected, full_state(model, optimizer), restored


def _touch(path: str) -> None:
    Path(path).write_text("code ran")


class Malicious:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return _touch, (self.marker,)


# ------------------------------------------------------------ in process


@pytest.mark.parametrize("blocking", [True, False])
def test_round_trip_restores_model_optimizer_and_small_part_exactly(group: Path, blocking: bool) -> None:
    expected, actual, restored = saved_and_restored(group, blocking=blocking)
    assert restored.restored and restored.steps == 3
    assert expected["optim"]["state"], "Adam has moments to compare"
    assert_equal_states(actual, expected)
    latest = store(group).latest()
    assert NAME in latest.names()
    assert latest.sharded_names() == [NAME]
    files = sorted(os.listdir(latest.info.path / _format.SHARDED_DIR))
    assert files == [".metadata", "__0_0.distcp"]
    manifest = json.loads((latest.info.path / _format.MANIFEST_NAME).read_text())
    assert manifest["version"] == 2 and [f["file"] for f in manifest["sharded"]["files"]] == files


def test_asynchronous_save_writes_the_state_of_the_call_not_later_changes(
        group: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = build(1, seed=1)
    state = FSDPState(model, optimizer)
    train(model, optimizer, 2, seed=5)
    state.steps = 2
    expected = full_state(model, optimizer)
    release, entered = threading.Event(), threading.Event()
    real = _dcp_io.write_shards

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(_dcp_io, "write_shards", held)
    seq = adaptive.save_all_states(blocking=False)
    assert entered.wait(30), "the background thread writes"
    assert store(group).list() == []  # not published yet
    train(model, optimizer, 2, seed=6)  # the live parameters and moments move on
    state.steps = 99
    release.set()
    assert adaptive.wait_for_pending_save() == seq
    assert adaptive.wait_for_pending_save() is None  # nothing in flight any more
    restart()
    model, optimizer = build(1, seed=2)
    restored = FSDPState(model, optimizer)
    assert restored.steps == 2
    assert_equal_states(full_state(model, optimizer), expected)


def test_a_failed_background_save_is_logged_and_the_previous_checkpoint_stays_latest(
        group: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    first = adaptive.save_all_states()

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    real = _dcp_io.write_shards
    monkeypatch.setattr(_dcp_io, "write_shards", disk_full)
    with caplog.at_level(logging.ERROR, logger="adaptive.checkpoint._saving"):
        adaptive.save_all_states({"reason": "periodic"}, blocking=False)
        assert adaptive.wait_for_pending_save() is None
    assert "was not saved" in caplog.text and "No space left" in caplog.text
    assert store(group).latest().info.seq == first
    assert not [name for name in os.listdir(group / "checkpoints") if name.startswith(".tmp-")]
    events = (env.share_path() + "/metrics.jsonl")
    assert any(json.loads(line).get("event") == "checkpoint_failed" for line in Path(events).read_text().splitlines())
    monkeypatch.setattr(_dcp_io, "write_shards", real)
    assert adaptive.save_all_states() == first + 1  # the next save works again


def test_a_synchronous_sharded_save_that_fails_raises_and_publishes_nothing(
        group: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    adaptive.save_all_states()

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_dcp_io, "write_shards", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        adaptive.save_all_states()
    assert checkpoint_dirs(group) == [_format.dir_name(1)]
    assert not [name for name in os.listdir(group / "checkpoints") if name.startswith(".tmp-")]


def test_unsafe_values_in_the_sharded_part_are_refused_before_anything_is_written(group: Path) -> None:
    model, optimizer = build(1, seed=1)
    state = FSDPState(model, optimizer)
    state.sharded_state_dict = lambda: {"model": {"w": torch.zeros(2)}, "extra": Malicious("/nonexistent")}
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        adaptive.save_all_states()
    assert not (group / "checkpoints").exists() or checkpoint_dirs(group) == []


def test_hostile_dcp_metadata_is_refused_without_running_code(group: Path, tmp_path: Path) -> None:
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    adaptive.save_all_states()
    directory = store(group).latest().info.path
    marker = tmp_path / "pwned"
    with open(directory / _format.SHARDED_DIR / ".metadata", "wb") as file:
        pickle.dump({"x": Malicious(str(marker))}, file)
    rewrite_sharded_record(directory, ".metadata")
    restart()
    model, optimizer = build(1, seed=2)
    with pytest.raises(CheckpointError, match=r"\.metadata.*needs the Python object .*_touch"):
        FSDPState(model, optimizer)
    assert not marker.exists()


def test_hostile_bytes_item_is_refused_without_running_code(group: Path, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    model, optimizer = build(1, seed=1)
    state = FSDPState(model, optimizer)
    adaptive.save_all_states()
    directory = store(group).latest().info.path
    target = directory / _format.SHARDED_DIR
    honest = _dcp_io.flatten({NAME: state.sharded_state_dict()})
    marker = tmp_path / "pwned"
    key = next(key for key, value in honest.items() if not isinstance(value, torch.Tensor))
    honest[key] = Malicious(str(marker))  # stock DCP pickles it as a bytes item
    for name in os.listdir(target):
        (target / name).unlink()
    dcp.save(honest, storage_writer=_dcp_io._ShardWriter(target), planner=DefaultSavePlanner(flatten_state_dict=False))
    for name in os.listdir(target):
        rewrite_sharded_record(directory, name)
    restart()
    model, optimizer = build(1, seed=2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp item .*needs the Python object .*_touch"):
        FSDPState(model, optimizer)
    assert not marker.exists()


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(group: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, optimizer = build(1, seed=1)
    state = FSDPState(model, optimizer)
    adaptive.save_all_states()
    train(model, optimizer, 1, seed=3)
    adaptive.save_all_states()
    shard = store(group).latest().info.path / _format.SHARDED_DIR / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="adaptive.checkpoint.store"):
        latest = store(group).latest()
    assert latest.info.seq == 1
    assert "__0_0.distcp does not match its sha256" in caplog.text
    del state


def test_a_shard_changed_after_latest_is_caught_when_read(group: Path) -> None:
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    adaptive.save_all_states()
    checkpoint = store(group).latest()
    shard = checkpoint.info.path / _format.SHARDED_DIR / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01
    shard.write_bytes(bytes(data))
    model, optimizer = build(1, seed=2)
    target = {"model": model.state_dict()}
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        checkpoint.read_sharded(NAME, target)


def test_manifest_version_1_is_still_read(tmp_path: Path) -> None:
    root = CheckpointStore(tmp_path)
    root.save({"model": {"w": torch.arange(3.0)}, "misc": {"n": 1}}, metadata={"epoch": 2})
    path = tmp_path / _format.dir_name(1) / _format.MANIFEST_NAME
    body = json.loads(path.read_text())
    body["version"] = 1
    del body["sharded"]
    body["checksum"] = _format.manifest_checksum(body)
    path.write_text(json.dumps(body))
    latest = root.latest()
    assert latest is not None and latest.info.metadata == {"epoch": 2}
    assert torch.equal(latest.load("model")["w"], torch.arange(3.0)) and latest.sharded_names() == []


def test_keep_k_prunes_sharded_checkpoints_whole(group: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_KEEP", "2")
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    for blocking in (True, False, True, False):
        adaptive.save_all_states(blocking=blocking)
    adaptive.wait_for_pending_save()
    assert checkpoint_dirs(group) == [_format.dir_name(3), _format.dir_name(4)]
    assert [name for name in os.listdir(group / "checkpoints") if name.startswith(".tmp-")] == []
    assert [c.seq for c in store(group).list()] == [3, 4] and store(group).latest().sharded_names() == [NAME]


def test_the_graceful_stop_waits_for_the_save_in_flight(group: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    release = threading.Event()
    real = _dcp_io.write_shards

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(_dcp_io, "write_shards", held)
    adaptive.save_all_states({"reason": "periodic"}, blocking=False)
    threading.Timer(0.3, release.set).start()
    with pytest.raises(SystemExit) as stopped:
        stopping.stop_and_exit({"reason": "stop"})
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    infos = store(group).list()
    assert [(i.seq, i.metadata["reason"]) for i in infos] == [(1, "periodic"), (2, "stop")]


def test_periodic_saves_are_asynchronous_by_setting(group: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ADAPTIVE_ASYNC_CHECKPOINT", raising=False)
    assert env.async_checkpoint() is None and not states.periodic_saves_asynchronous()  # auto, no sharded state
    model, optimizer = build(1, seed=1)
    FSDPState(model, optimizer)
    assert states.periodic_saves_asynchronous()
    for raw, expected in (("0", False), ("1", True), ("auto", True), (" AUTO ", True)):
        monkeypatch.setenv("ADAPTIVE_ASYNC_CHECKPOINT", raw)
        assert states.periodic_saves_asynchronous() is expected
    monkeypatch.setenv("ADAPTIVE_ASYNC_CHECKPOINT", "yes")
    with pytest.raises(ValueError, match="ADAPTIVE_ASYNC_CHECKPOINT='yes' must be auto, 1 or 0"):
        env.async_checkpoint()
    calls: list[dict] = []
    monkeypatch.setattr(states, "save_all_states", lambda info, **kw: calls.append(kw))
    current_job().part(sync_points.Agreement).decided.checkpoint_due = True
    sync_points._act(dict)
    assert calls == []  # nothing trained since the last save: a due save would repeat it
    for raw in ("1", "0"):
        step_records.stream().steps_committed += 1  # a step was trained since
        current_job().part(sync_points.Agreement).decided.checkpoint_due = True
        monkeypatch.setenv("ADAPTIVE_ASYNC_CHECKPOINT", raw)
        sync_points._act(dict)
    assert calls == [{"blocking": False}, {"blocking": True}]


def test_asynchronous_saves_of_plain_states_work_too(job: Path) -> None:
    weights = torch.arange(6.0)

    class Plain(states.State):
        def state_dict(self) -> dict:
            return {"w": weights}

        def load_state_dict(self, state: dict) -> None:
            weights.copy_(state["w"])

    Plain("plain")
    seq = adaptive.save_all_states(blocking=False)
    weights.add_(100)  # after the call: not in the checkpoint
    assert adaptive.wait_for_pending_save() == seq
    checkpoint = CheckpointStore(job / "checkpoints").latest()
    assert torch.equal(checkpoint.load("plain")["w"], torch.arange(6.0)) and checkpoint.sharded_names() == []


def test_staging_copies_to_the_cpu_keeping_shared_storage_types_and_attributes() -> None:
    base = torch.arange(10.0)
    tied = collections.OrderedDict(a=base, b=base[2:5], p=torch.nn.Parameter(torch.ones(2), requires_grad=False))
    tied._metadata = {"": {"version": 3}}
    staged = _staging.stage_states({"m": tied, "other": {"n": 1, "t": (torch.zeros(1), [torch.ones(1)])}})
    copy = staged["m"]
    assert type(copy) is collections.OrderedDict and copy._metadata == {"": {"version": 3}}
    assert copy["a"].untyped_storage().data_ptr() == copy["b"].untyped_storage().data_ptr()
    assert copy["a"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert torch.equal(copy["b"], torch.tensor([2.0, 3.0, 4.0]))
    assert type(copy["p"]) is torch.nn.Parameter and not copy["p"].requires_grad
    base.add_(1)
    assert torch.equal(copy["a"], torch.arange(10.0))
    assert isinstance(staged["other"]["t"], tuple) and staged["other"]["n"] == 1


# ------------------------------------------------------------- torchrun


class Torchrun:
    """Starts torchrun jobs of sharded_ckpt_worker.py in their own sessions; kills what is left."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, out: Path, nproc: int, **extra: str) -> subprocess.Popen:
        out.mkdir(parents=True, exist_ok=True)
        environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                       WORKER_OUT=str(out), ADAPTIVE_CHECKPOINT_PATH=str(out.parent / "checkpoints"),
                       ADAPTIVE_SHARE_PATH=str(out / "share"), ADAPTIVE_COLLECTIVE_TIMEOUT="30",
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", OMP_NUM_THREADS="1", **extra)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            environ.pop(name, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{portpicker.pick_unused_port()}",
               "--max-restarts", "0", str(WORKER)]
        log = open(out / "log.txt", "ab")
        proc = subprocess.Popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen, out: Path, timeout: float = 90) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"torchrun did not finish in {timeout} s:\n{tail(out)}") from None

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_process_tree(proc.pid)
            proc.wait(timeout=30)


def tail(out: Path) -> str:
    try:
        return "\n".join((out / "log.txt").read_text(errors="replace").splitlines()[-40:])
    except FileNotFoundError:
        return "(no log)"


@pytest.fixture
def torchrun():
    runs = Torchrun()
    yield runs
    runs.cleanup()


def wait_file(path: Path, proc: subprocess.Popen, out: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"torchrun exited ({proc.returncode}) before {path.name}:\n{tail(out)}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s:\n{tail(out)}"
        time.sleep(0.05)


def load_in_process(root: Path) -> tuple[dict, FSDPState]:
    """Restore the newest checkpoint under ``root`` on one rank, here: (full state, the state)."""
    model, optimizer = build(1, seed=3)
    state = FSDPState(model, optimizer)
    return full_state(model, optimizer), state


def test_saved_on_2_ranks_loads_exactly_on_3_and_on_1(group: Path, torchrun: Torchrun, monkeypatch) -> None:
    root = group
    saved = root / "save"
    proc = torchrun.start(saved, 2, SHARDED_CKPT_MODE="save", SHARDED_CKPT_SAVES="2", SHARDED_CKPT_ASYNC="alternate")
    assert torchrun.finish(proc, saved) == 0, tail(saved)
    checkpoints = CheckpointStore(root / "checkpoints")
    assert [info.seq for info in checkpoints.list()] == [1, 2]
    files = sorted(os.listdir(checkpoints.latest().info.path / _format.SHARDED_DIR))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # every rank wrote its own shards
    expected = torch.load(saved / "full-2.pt", weights_only=True)  # the asynchronous one

    loaded3 = root / "load3"
    proc = torchrun.start(loaded3, 3, SHARDED_CKPT_MODE="load")
    assert torchrun.finish(proc, loaded3) == 0, tail(loaded3)
    assert json.loads((loaded3 / "loaded.json").read_text()) == {"seq": 2, "steps": 4, "restored": True, "world": 3}
    assert_equal_states(torch.load(loaded3 / "loaded.pt", weights_only=True), expected)

    actual, state = load_in_process(root)
    assert state.restored and state.steps == 4
    assert_equal_states(actual, expected)


@pytest.mark.parametrize("killed, asynchronous", [(1, "0"), (0, "1")], ids=["rank1-in-sharded-save", "rank0-in-async-save"])
def test_a_rank_killed_inside_a_save_leaves_the_previous_checkpoint_newest(
        group: Path, torchrun: Torchrun, monkeypatch, killed: int, asynchronous: str) -> None:
    root = group
    out = root / "save"
    proc = torchrun.start(out, 2, SHARDED_CKPT_MODE="save", SHARDED_CKPT_SAVES="2", SHARDED_CKPT_ASYNC=asynchronous,
                          SHARDED_CKPT_BLOCK=f"{killed}:2")
    wait_file(out / f"blocked.rank{killed}", proc, out, timeout=90)
    os.kill(int((out / f"pid.rank{killed}").read_text()), 9)
    assert torchrun.finish(proc, out) != 0
    checkpoints = CheckpointStore(root / "checkpoints")
    assert [info.seq for info in checkpoints.list()] == [1]
    assert checkpoints.latest().info.seq == 1
    actual, state = load_in_process(root)
    assert state.restored and state.steps == 2
    assert_equal_states(actual, torch.load(out / "full-1.pt", weights_only=True))
