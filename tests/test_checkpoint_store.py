"""Tests for adaptive.checkpoint.store (and its parts): atomicity, verification, safe loading."""

from __future__ import annotations

import json
import logging
import collections
import os
import pickle
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive._utils.files import fsync_dir
from adaptive._utils.text import format_bytes
from adaptive.checkpoint import _disk, _format, _pruning, _safe_load, _writing
from adaptive.checkpoint import store as cs
from adaptive.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore
from state_equality import assert_same

REPO = Path(__file__).resolve().parents[1]
LOGGER = "adaptive.checkpoint.store"


# ------------------------------------------------------------------ helpers


def load_all(checkpoint: Checkpoint) -> dict[str, Any]:
    return {name: checkpoint.load(name) for name in checkpoint.names()}


def states_for(tag: int) -> dict[str, Any]:
    """Small but varied states whose content identifies ``tag``."""
    return {
        "model": {"weight": torch.full((3, 4), float(tag)), "bias": torch.arange(4) + tag},
        "optimizer": {"step": tag, "lr": 0.1 * tag, "groups": [{"params": [0, 1]}]},
        "loader/epoch #1": {"position": tag, "note": f"tag-{tag}", "done": None},
    }


def temp_dirs(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith(".tmp-"))


def checkpoint_dirs(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("checkpoint-"))


def newest_dir(root: Path) -> Path:
    return root / checkpoint_dirs(root)[-1]


def state_file(directory: Path, name: str) -> Path:
    manifest = json.loads((directory / _format.MANIFEST_NAME).read_text())
    (entry,) = [e for e in manifest["states"] if e["name"] == name]
    return directory / entry["file"]


def rewrite_manifest(directory: Path, mutate: Callable[[dict], None], reseal: bool = True) -> None:
    """Edit a manifest; with ``reseal`` recompute its checksum so it stays self-consistent."""
    path = directory / _format.MANIFEST_NAME
    body = json.loads(path.read_text())
    mutate(body)
    if reseal:
        body["checksum"] = _format.manifest_checksum(body)
    path.write_text(json.dumps(body))


def reseal_file(directory: Path, name: str) -> None:
    """Make the manifest agree with the current content of state ``name``'s file."""
    import hashlib

    data = state_file(directory, name).read_bytes()

    def mutate(body: dict) -> None:
        for entry in body["states"]:
            if entry["name"] == name:
                entry["bytes"] = len(data)
                entry["sha256"] = hashlib.sha256(data).hexdigest()

    rewrite_manifest(directory, mutate)


# ---------------------------------------------------------- basic behaviour


def test_round_trip_of_nested_states(tmp_path: Path) -> None:
    states = {
        "model": {
            "w": torch.randn(5, 3),
            "half": torch.randn(4, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 7),
            "empty_bf16": torch.ones(0, dtype=torch.bfloat16),
            "ints": torch.arange(10, dtype=torch.int64),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(3.5),
            "param": torch.nn.Parameter(torch.ones(2)),
            "big": torch.randn(1 << 18),  # larger than the write buffer
            "view": torch.arange(100.0)[10:20],
        },
        "misc": {
            "int": 7, "big": 2**80, "float": -1.25, "str": "héllo", "none": None,
            "bool": True, "complex": 1 - 2j, "set": {1, "a"}, "list": [1, [2, [3]], {"k": None}],
            "tuple": (1, "a"), "dtype": torch.float16, "size": torch.Size([2, 3]),
        },
        "": [],
        "weird/../name with spaces": {"x": 1},
    }
    store = CheckpointStore(tmp_path / "ckpt")
    info = store.save(states, metadata={"epoch": 3, "tags": ("a", "b")})
    assert info.seq == 1 and info.metadata == {"epoch": 3, "tags": ["a", "b"]}
    latest = store.latest()
    assert latest is not None and latest.info == info
    assert latest.names() == list(states)
    for name, expected in states.items():
        assert_same(latest.load(name), expected, name)
    assert info.size == sum(p.stat().st_size for p in info.path.glob("*.pt"))
    assert all(_format.SAFE_FILE.fullmatch(p.name) for p in info.path.iterdir())


def test_real_module_and_optimizer_state_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    states = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "scheduler": scheduler.state_dict(),
              "rng": {"torch": torch.get_rng_state(), "python": random.Random(1).getstate()}}
    store = CheckpointStore(tmp_path)
    store.save(states)
    latest = store.latest()
    assert latest is not None
    loaded = load_all(latest)
    assert loaded["model"]._metadata == states["model"]._metadata
    for name in states:
        assert_same(loaded[name], states[name], name)
    clone = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    clone.load_state_dict(loaded["model"])
    torch.optim.AdamW(clone.parameters(), lr=0.01).load_state_dict(loaded["optimizer"])


def test_python_attributes_are_validated_too(tmp_path: Path) -> None:
    """Attributes on OrderedDicts and tensors are pickled, so they are checked."""
    state = torch.nn.Linear(2, 2).state_dict()
    state.hook = _Opaque()
    with pytest.raises(TypeError, match=r"states\['model'\]\.hook is a .*_Opaque"):
        CheckpointStore(tmp_path).save({"model": state})
    tensor = torch.ones(2)
    tensor.note = _Opaque()
    with pytest.raises(TypeError, match=r"states\['t'\]\[0\]\.note is a .*_Opaque"):
        CheckpointStore(tmp_path).save({"t": [tensor]})
    tensor.note = {"plain": 1}
    CheckpointStore(tmp_path).save({"t": [tensor]})
    latest = CheckpointStore(tmp_path).latest()
    assert latest is not None and latest.load("t")[0].note == {"plain": 1}


def test_open_a_given_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    for tag in (1, 2, 3):
        store.save(states_for(tag))
    opened = store.open(2)
    assert opened.info.seq == 2
    assert_same(load_all(opened), states_for(2))
    with pytest.raises(CheckpointError, match="checkpoint 7 does not exist"):
        store.open(7)
    _flip_byte(tmp_path / _format.dir_name(1))
    with pytest.raises(CheckpointError, match="checkpoint 1 at .* cannot be used: .*sha256"):
        store.open(1)
    for bad, error in ((0, ValueError), (-1, ValueError), ("2", TypeError), (True, TypeError)):
        with pytest.raises(error, match="seq must be"):
            store.open(bad)


def test_missing_root_means_no_checkpoint_and_is_created_lazily(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    store = CheckpointStore(root)
    assert not root.exists()
    assert store.latest() is None and store.list() == []
    store.save({"s": {"x": 1}})
    assert root.is_dir()


def test_root_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_text("not a directory")
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointStore(root)
    ok = tmp_path / "later"
    store = CheckpointStore(ok)
    ok.write_text("replaced by a file")
    with pytest.raises(CheckpointError, match="not a directory"):
        store.latest()
    with pytest.raises(CheckpointError, match="not a directory"):
        store.save({"s": 1})


@pytest.mark.parametrize(("keep", "error"), [(0, ValueError), (-1, ValueError), ("2", TypeError),
                                             (True, TypeError), (1.5, TypeError)])
def test_keep_is_validated(tmp_path: Path, keep: Any, error: type) -> None:
    with pytest.raises(error, match="keep"):
        CheckpointStore(tmp_path, keep=keep)


def test_keep_k_pruning_and_monotonic_sequence(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    seqs = [store.save(states_for(i)).seq for i in range(7)]
    assert seqs == list(range(1, 8))
    assert [info.seq for info in store.list()] == [5, 6, 7]
    assert checkpoint_dirs(tmp_path) == [_format.dir_name(s) for s in (5, 6, 7)]
    latest = store.latest()
    assert latest is not None and latest.info.seq == 7
    assert_same(load_all(latest), states_for(6))
    single = CheckpointStore(tmp_path, keep=1)
    assert single.save(states_for(9)).seq == 8
    assert [info.seq for info in single.list()] == [8]


def test_sequence_continues_after_damaged_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    store.save(states_for(1))
    (tmp_path / _format.dir_name(5)).mkdir()  # junk with a checkpoint name, no manifest
    assert store.save(states_for(2)).seq == 6
    assert checkpoint_dirs(tmp_path) == [_format.dir_name(1), _format.dir_name(6)]  # junk pruned


def test_stale_temp_dirs_are_removed_but_live_writers_are_not(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(states_for(1))
    host = _format.host_tag()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f".tmp-{host}-{dead}-abc123"
    stale.mkdir()
    (stale / "000-model.pt").write_bytes(b"half written")
    other_host = tmp_path / ".tmp-elsewhere-1-abcdef"
    other_host.mkdir()
    live = tmp_path / f".tmp-{host}-{os.getppid()}-fedcba"  # our parent is alive
    live.mkdir()
    old_live = tmp_path / f".tmp-{host}-{os.getppid()}-0ddba11"
    old_live.mkdir()
    past = time.time() - 2 * _pruning.STALE_TEMP_AGE_S
    os.utime(old_live, (past, past))
    assert store.latest() is not None  # readers ignore temp dirs
    store.save(states_for(2))
    assert temp_dirs(tmp_path) == [live.name]


def test_unrelated_entries_in_root_are_ignored(tmp_path: Path) -> None:
    for name in ("notes.txt", "checkpoint-latest", "checkpoint-12a"):
        (tmp_path / name).write_text("user data")
    (tmp_path / "runs").mkdir()
    store = CheckpointStore(tmp_path, keep=1)
    assert store.latest() is None
    for tag in range(3):
        store.save(states_for(tag))
    latest = store.latest()
    assert latest is not None and latest.info.seq == 3
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["notes.txt", "checkpoint-latest", "checkpoint-12a", "runs", _format.dir_name(3)])


def test_missing_state_name_is_a_key_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(states_for(1))
    latest = store.latest()
    assert latest is not None and "model" in latest and "nope" not in latest
    with pytest.raises(KeyError, match="no state named 'nope'.*'model'"):
        latest.load("nope")


def test_save_logs_size_and_time(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The store's own line is DEBUG: a job's one INFO line per save is adaptive.checkpoint.states'."""
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        CheckpointStore(tmp_path).save(states_for(1))
    (record,) = [r for r in caplog.records if "saved checkpoint 1" in r.getMessage()]
    assert record.levelno == logging.DEBUG
    assert "B in " in record.getMessage() and " s (" in record.getMessage()


def test_a_job_logs_one_info_line_per_checkpoint(job: Path, caplog: pytest.LogCaptureFixture) -> None:
    """seq, reason, size and seconds in one INFO line per save, pruning included (keep=2, 4 saves)."""
    from adaptive.checkpoint.states import State, save_all_states

    class Counter(State):
        def state_dict(self) -> dict[str, Any]:
            return {"version": 1, "value": 7}

        def load_state_dict(self, state: Any) -> None:
            pass

    Counter("log-test-counter")
    with caplog.at_level(logging.DEBUG, logger="adaptive"):
        seqs = [save_all_states(metadata={"reason": "test"}) for _ in range(4)]
    lines = [r.getMessage() for r in caplog.records
             if r.name.startswith("adaptive.checkpoint") and r.levelno >= logging.INFO]
    assert len(lines) == len(seqs) == 4, lines
    for seq, line in zip(seqs, lines):
        assert line.startswith(f"checkpoint {seq} saved (test, ") and " MB in " in line and line.endswith(" s)")


class _Opaque:
    pass


@pytest.mark.parametrize(("states", "match"), [
    ({"m": {"a": [1, _Opaque()]}}, r"states\['m'\]\['a'\]\[1\] is a .*_Opaque"),
    ({"m": {"rng": np.zeros(3)}}, r"numpy.ndarray.*torch.from_numpy"),
    ({"m": {"f": frozenset([1])}}, "frozenset"),
    ({"m": {"d": collections.defaultdict(int)}}, "defaultdict"),
    ({"m": {_Opaque(): 1}}, r"key .*_Opaque"),
    ({1: {}}, "state names must be str"),
    ([("m", 1)], "states must be a mapping"),
])
def test_unsupported_state_values_are_rejected_before_writing(
        tmp_path: Path, states: Any, match: str) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(TypeError, match=match):
        store.save(states)
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


def test_values_torch_loads_with_weights_only_are_accepted(tmp_path: Path) -> None:
    """What torch's own state dicts hold (MultiStepLR's Counter, bytes) saves and loads back."""
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), milestones=[3, 3, 5])
    states = {"sched": scheduler.state_dict(), "blob": {"b": b"\x00\x01", "ba": bytearray(b"xy")},
              "counter": collections.Counter("abca")}
    store = CheckpointStore(tmp_path)
    store.save(states)
    latest = store.latest()
    assert latest.load("sched")["milestones"] == collections.Counter({3: 2, 5: 1})
    assert latest.load("blob") == {"b": b"\x00\x01", "ba": bytearray(b"xy")}
    assert latest.load("counter") == collections.Counter("abca")


@pytest.mark.parametrize(("metadata", "match"), [
    ({"x": float("nan")}, "JSON"), ({1: "a"}, "keys must be str"),
    ({"x": object()}, "JSON"), (["x"], "mapping"),
])
def test_bad_metadata_is_rejected(tmp_path: Path, metadata: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        CheckpointStore(tmp_path).save({"s": 1}, metadata=metadata)


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8),
    st.complex_numbers(allow_nan=False),
    st.builds(
        lambda values, dtype: torch.tensor(values, dtype=torch.float64).to(dtype),
        st.lists(st.floats(-100, 100, width=16), max_size=5),
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8]),
    ),
)
_tree = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=5), children, max_size=3),
        st.sets(st.integers(), max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=10), _tree, max_size=3))
def test_property_round_trip(states: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointStore(root, keep=1)
        store.save(states)
        latest = store.latest()
        assert latest is not None
        assert_same(load_all(latest), states)


# ----------------------------------------------------------- fault injection


class InjectedFault(OSError):
    """An I/O error raised on purpose at one write point."""


class SimulatedCrash(BaseException):
    """Stands in for the process dying at one write point (no cleanup runs)."""


WRITE_POINTS: dict[str, tuple[Any, str]] = {
    "mkdir": (_disk, "make_dir"),
    "write": (_writing.HashingWriter, "write"),
    "flush": (_writing.HashingWriter, "flush"),
    "fsync": (_disk, "fsync_fd"),
    "manifest": (_writing, "write_manifest"),
    "fsync_dir": (_disk, "fsync_dir"),
    "rename": (_disk, "rename"),
    "prune": (cs.CheckpointStore, "_prune"),
    "remove": (_disk, "remove_tree"),
}


class FaultPlan:
    """Records every write-point call in order; fails the one at ``fail_at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.trace: list[str] = []
        self.fail_at: int | None = None
        self.exception: Callable[[str], BaseException] = InjectedFault
        for label, (owner, attribute) in WRITE_POINTS.items():
            monkeypatch.setattr(owner, attribute, self._wrap(label, getattr(owner, attribute)))

    def _wrap(self, label: str, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            index = len(self.trace)
            self.trace.append(label)
            if index == self.fail_at:
                raise self.exception(f"injected failure at {label} (call {index})")
            return original(*args, **kwargs)
        return wrapper

    def run(self, action: Callable[[], Any], fail_at: int | None) -> list[str]:
        self.trace, self.fail_at = [], fail_at
        try:
            action()
        finally:
            self.fail_at = None
        return list(self.trace)


@pytest.mark.parametrize("mode", ["error", "crash"])
def test_failure_at_every_write_point_keeps_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Fail each write-point call of a save in turn, as an error or a crash.

    In "crash" mode the failed save's cleanup is disabled, as if the
    process died there. Either way the newest checkpoint must be the
    previous one (or the new one, once it has been renamed into place)
    with exactly its content, and the next save must tidy up.
    """
    store = CheckpointStore(tmp_path, keep=2)
    plan = FaultPlan(monkeypatch)
    small = {"model": {"w": torch.arange(6.0)}, "opt": {"step": 0, "m": torch.ones(2)}}
    store.save(small)
    store.save(small)  # so that the next save prunes
    trace = plan.run(lambda: store.save(small), fail_at=None)
    assert set(WRITE_POINTS) <= set(trace), f"uncovered points: {set(WRITE_POINTS) - set(trace)}"
    rename_at, prune_at = trace.index("rename"), trace.index("prune")
    if mode == "crash":
        plan.exception = SimulatedCrash
        monkeypatch.setattr(cs, "_discard_temp", lambda temp: None)

    def content(tag: int) -> dict[str, Any]:
        return {"model": {"w": torch.arange(6.0) + tag}, "opt": {"step": tag, "m": torch.ones(2)}}

    previous = content(0)
    store.save(previous)
    for index in range(len(trace)):
        tag = index + 1
        failed = False
        try:
            plan.run(lambda: store.save(content(tag), metadata={"tag": tag}), fail_at=index)
        except (CheckpointError, SimulatedCrash):
            failed = True
        published = index > rename_at
        assert failed == (mode == "crash" or index < prune_at), (index, trace[index])
        latest = store.latest()
        assert latest is not None
        expected = content(tag) if published else previous
        assert_same(load_all(latest), expected, f"fault at {trace[index]} #{index}")
        if mode == "error" and index < rename_at:
            assert temp_dirs(tmp_path) == [], "a failed save left its temp dir behind"
        previous = content(-tag)
        info = store.save(previous)  # a clean save tidies up whatever was left
        assert temp_dirs(tmp_path) == []
        assert [i.seq for i in store.list()][-1] == info.seq
        assert len(store.list()) <= store.keep


def test_failure_is_reported_with_the_underlying_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path)

    def broken(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_disk, "fsync_fd", broken)
    with pytest.raises(CheckpointError, match="could not save checkpoint 1.*No space left") as err:
        store.save(states_for(1))
    assert isinstance(err.value.__cause__, OSError)
    assert store.latest() is None and temp_dirs(tmp_path) == []


def test_disk_full_during_a_large_write_keeps_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing write of a chunk larger than the write buffer aborts cleanly."""
    store = CheckpointStore(tmp_path)
    big = {"model": {"w": torch.randn(1 << 19)}}
    store.save(big)

    class FullDisk:
        def __init__(self, file: Any) -> None:
            self._file = file

        def write(self, data: Any) -> int:
            if memoryview(data).nbytes >= _writing.WRITE_BUFFER:
                raise OSError(28, "No space left on device")
            return self._file.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

        def __enter__(self) -> "FullDisk":
            return self

        def __exit__(self, *exc: Any) -> None:
            self._file.close()

    monkeypatch.setattr(_writing, "open", lambda *a, **k: FullDisk(open(*a, **k)), raising=False)
    with pytest.raises(CheckpointError, match="No space left on device"):
        store.save({"model": {"w": torch.zeros(1 << 19)}})
    monkeypatch.undo()
    latest = store.latest()
    assert latest is not None and latest.info.seq == 1
    assert_same(load_all(latest), big)
    assert temp_dirs(tmp_path) == []


def test_prune_failure_does_not_fail_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    store.save(states_for(1))

    def broken(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(_disk, "remove_tree", broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = store.save(states_for(2))
    assert "could not prune" in caplog.text
    latest = store.latest()
    assert latest is not None and latest.info.seq == info.seq == 2


# ------------------------------------------------------------- corruption


def _flip_byte(directory: Path) -> None:
    path = state_file(directory, "model")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(directory: Path) -> None:
    path = state_file(directory, "model")
    path.write_bytes(path.read_bytes()[:-100])


def _delete(directory: Path) -> None:
    state_file(directory, "optimizer").unlink()


def _replace_with_same_size_torch_file(directory: Path) -> None:
    path = state_file(directory, "model")
    size = path.stat().st_size
    with open(path, "wb") as file:  # a file object, as the store writes them
        torch.save({"weight": torch.full((3, 4), -1.0), "bias": torch.arange(4) - 99}, file)
    assert path.stat().st_size == size  # only the hash can tell


def _garbage_manifest(directory: Path) -> None:
    (directory / _format.MANIFEST_NAME).write_bytes(b"\x00\x01not json{")


def _no_manifest(directory: Path) -> None:
    (directory / _format.MANIFEST_NAME).unlink()


def _edited_manifest(directory: Path) -> None:
    rewrite_manifest(directory, lambda body: body["metadata"].update(tag=999), reseal=False)


def _unknown_version(directory: Path) -> None:
    rewrite_manifest(directory, lambda body: body.update(version=_format.FORMAT_VERSION + 1))


def _foreign_manifest(directory: Path) -> None:
    (directory / _format.MANIFEST_NAME).write_text(json.dumps({"format": "other-tool", "files": []}))


def _escaping_file_name(directory: Path) -> None:
    rewrite_manifest(directory, lambda body: body["states"][0].update(file="../../etc/passwd"))


def _wrong_seq(directory: Path) -> None:
    rewrite_manifest(directory, lambda body: body.update(seq=body["seq"] + 100))


def _symlinked_state(directory: Path) -> None:
    path = state_file(directory, "model")
    target = directory.parent / "elsewhere.pt"
    path.rename(target)
    path.symlink_to(target)


def _file_instead_of_dir(directory: Path) -> None:
    import shutil

    shutil.rmtree(directory)
    directory.write_text("a file named like a checkpoint")


def test_a_version_1_manifest_is_still_read_without_a_sharded_part(tmp_path: Path) -> None:
    """Format 1 manifests (no sharded part) are migrated; a "sharded" key in one means nothing."""
    store = CheckpointStore(tmp_path, keep=3)
    store.save(states_for(1), metadata={"tag": 1})
    directory = tmp_path / _format.dir_name(1)

    def as_version_1(body: dict) -> None:
        body["version"] = 1
        del body["sharded"]

    rewrite_manifest(directory, as_version_1)
    latest = store.latest()
    assert latest.info.seq == 1 and latest.info.metadata == {"tag": 1} and latest.sharded_names() == []
    rewrite_manifest(directory, lambda body: body.update(sharded={"states": ["model"], "files": "junk"}))
    assert store.latest().sharded_names() == []
    assert _format.READABLE_VERSIONS == (1, 2)


DAMAGE = {
    "flipped byte": (_flip_byte, "sha256"),
    "truncated": (_truncate, "truncated"),
    "deleted file": (_delete, "missing"),
    "other valid torch file": (_replace_with_same_size_torch_file, "sha256"),
    "garbage manifest": (_garbage_manifest, "not valid JSON"),
    "no manifest": (_no_manifest, "no manifest.json"),
    "edited manifest": (_edited_manifest, "checksum mismatch"),
    "unknown version": (_unknown_version, f"unsupported format version {_format.FORMAT_VERSION + 1}"),
    "foreign manifest": (_foreign_manifest, "other-tool"),
    "escaping file name": (_escaping_file_name, "unsafe file name"),
    "wrong seq": (_wrong_seq, "does not match directory"),
    "symlinked state": (_symlinked_state, "model.pt"),
    "file instead of dir": (_file_instead_of_dir, "not a directory"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_falls_back_to_previous(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    corrupt, reason = DAMAGE[damage]
    store = CheckpointStore(tmp_path, keep=3)
    for tag in (1, 2):
        store.save(states_for(tag), metadata={"tag": tag})
    corrupt(tmp_path / _format.dir_name(2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        latest = store.latest()
    assert latest is not None and latest.info.seq == 1
    assert_same(load_all(latest), states_for(1))
    (warning,) = [r for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert _format.dir_name(2) in warning.getMessage() and reason in warning.getMessage()
    assert store.save(states_for(3)).seq == 3  # saving goes on past the damage


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_when_nothing_verifies_the_error_lists_every_checkpoint(
        tmp_path: Path, damage: str) -> None:
    corrupt, reason = DAMAGE[damage]
    store = CheckpointStore(tmp_path, keep=3)
    store.save(states_for(1))
    store.save(states_for(2))
    corrupt(tmp_path / _format.dir_name(2))
    _garbage_manifest(tmp_path / _format.dir_name(1))
    with pytest.raises(CheckpointError) as err:
        store.latest()
    message = str(err.value)
    assert _format.dir_name(2) in message and reason in message
    assert _format.dir_name(1) in message and "not valid JSON" in message
    assert "ADAPTIVE_CHECKPOINT_PATH" in message


def test_file_changed_after_latest_is_caught_at_load(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(states_for(1))
    latest = store.latest()
    assert latest is not None
    _replace_with_same_size_torch_file(latest.info.path)
    with pytest.raises(CheckpointError, match="cannot load state 'model'.*sha256"):
        latest.load("model")
    _delete(latest.info.path)
    with pytest.raises(CheckpointError, match="missing"):
        latest.load("optimizer")


# ------------------------------------------------------------ G4: no code


def _touch(path: str) -> None:
    Path(path).write_text("code from the checkpoint ran")


class Malicious:
    """Unpickling this would call _touch(marker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (_touch, (str(self.marker),))


@pytest.mark.parametrize(("how", "detail"), [
    ("torch.save", "needs the Python object .*_touch"),
    ("pickle protocol 2", "needs the Python object .*_touch"),
    ("pickle protocol 5", "not accepted by the safe unpickler"),
])
def test_arbitrary_objects_are_refused_without_running_code(
        tmp_path: Path, how: str, detail: str) -> None:
    marker = tmp_path / "marker"
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    store.save({"model": {"w": torch.ones(2)}, "evil": {"x": 1}})
    directory = newest_dir(root)
    with open(state_file(directory, "evil"), "wb") as file:
        if how == "torch.save":
            torch.save({"x": Malicious(marker)}, file)
        else:
            pickle.dump({"x": Malicious(marker)}, file, protocol=int(how[-1]))
    reseal_file(directory, "evil")  # a perfectly consistent, hostile checkpoint
    latest = store.latest()
    assert latest is not None and latest.info.seq == 1
    assert_same(latest.load("model"), {"w": torch.ones(2)})
    with warnings.catch_warnings():  # torch warns about the unusual pickle protocol
        warnings.simplefilter("ignore", UserWarning)
        refusal = f"refusing to load state 'evil'.*{detail}"
        with pytest.raises(CheckpointError, match=refusal) as err:
            latest.load("evil")
    assert err.value.__cause__ is None and "weights_only=False" not in str(err.value)
    assert not marker.exists()


def test_objects_smuggled_past_validation_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setattr(_safe_load, "validate_states", lambda states: list(states.items()))
    store = CheckpointStore(tmp_path / "ckpt")
    store.save({"evil": [Malicious(marker)]})
    latest = store.latest()
    assert latest is not None
    with pytest.raises(CheckpointError, match="refusing"):
        latest.load("evil")
    assert not marker.exists()


# ----------------------------------------------------------------- real kills

# A fork server: imports torch once, then per request forks a child that
# saves checkpoints in a tight loop, SIGKILLs it after the requested delay
# and reports how it died. Each checkpoint carries its own seq in its content.
_FORK_SERVER = r"""
import os, signal, sys, time
import torch
from adaptive.checkpoint.store import CheckpointStore

ROOT, NUMEL = sys.argv[1], int(sys.argv[2])

def writer():
    store = CheckpointStore(ROOT, keep=2)
    infos = store.list()
    seq = infos[-1].seq + 1 if infos else 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = {
            "model": {"w": torch.full((NUMEL,), float(seq)), "seq": seq},
            "optimizer": {"m": torch.full((NUMEL // 2,), -float(seq)), "step": seq,
                          "tag": "seq-%d" % seq},
        }
        if store.save(states, metadata={"seq": seq}).seq != seq:
            os._exit(3)
        seq += 1
    os._exit(4)

print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            writer()
        finally:
            os._exit(5)
    time.sleep(float(line))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status),
          flush=True)
"""


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"fork server silent for {timeout} s")
    return proc.stdout.readline().strip()


def _kill_trials(root: Path, kills: int, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORK_SERVER, str(root), str(1 << 19)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    rng = random.Random(seed)
    store = CheckpointStore(root, keep=2)
    newest = 0
    try:
        assert _read_line(proc, 120) == "ready"
        for trial in range(kills):
            # The first writer lives long enough to complete checkpoints even
            # on a loaded machine; later ones die at random points.
            delay = rng.uniform(0.01, 0.4) + (1.5 if trial == 0 else 0.0)
            proc.stdin.write(f"{delay:.3f}\n")
            proc.stdin.flush()
            assert _read_line(proc, 30) == str(int(signal.SIGKILL)), f"writer died early ({trial})"
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                latest = store.latest()
            assert "skipping" not in caplog.text, "a kill produced a damaged checkpoint"
            if latest is None:
                assert newest == 0, "checkpoints vanished after a kill"
                continue
            seq = latest.info.seq
            assert seq >= newest and latest.info.metadata == {"seq": seq}
            model, optimizer = latest.load("model"), latest.load("optimizer")
            assert model["seq"] == seq and optimizer["step"] == seq
            assert optimizer["tag"] == f"seq-{seq}"
            assert torch.equal(model["w"], torch.full((1 << 19,), float(seq)))
            assert torch.equal(optimizer["m"], torch.full((1 << 18,), -float(seq)))
            newest = seq
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert newest > 0, "no checkpoint was ever completed"
    CheckpointStore(root, keep=2).save({"after": {"x": 1}})
    assert temp_dirs(root) == [] and len(checkpoint_dirs(root)) == 2


def test_sigkill_during_saves_never_exposes_a_partial_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _kill_trials(tmp_path / "ckpt", kills=12, seed=1, caplog=caplog)


@pytest.mark.slow
@pytest.mark.ci_sample
def test_sigkill_soak(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _kill_trials(tmp_path / "ckpt", kills=150, seed=2, caplog=caplog)


# ------------------------------------------------------------ shared helpers


@pytest.mark.parametrize(("count", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 << 20, "5.0 MiB"),
    (3 << 30, "3.0 GiB"), (5000 << 30, "5000.0 GiB"),
])
def test_byte_counts_in_log_lines_read_as_before(count: int, text: str) -> None:
    assert format_bytes(count) == text


def test_fsync_dir_is_strict_for_checkpoints_and_best_effort_for_json(tmp_path: Path) -> None:
    fsync_dir(tmp_path, strict=True)
    fsync_dir(tmp_path, strict=False)
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError):
        fsync_dir(missing, strict=True)
    fsync_dir(missing, strict=False)  # ignored
    with pytest.raises(FileNotFoundError):
        _disk.fsync_dir(missing)  # the store's hook is the strict one


# ------------------------------------------------- reserved saves, sharded part


def _sharded_files(reservation: cs.Reservation, contents: dict[str, bytes]) -> _format.ShardedPart:
    """Files standing in for what the ranks write through DCP, with their manifest records."""
    entries = []
    for name, data in contents.items():
        (reservation.sharded_dir / name).write_bytes(data)
        size, digest = _format.hash_file(reservation.sharded_dir / name)
        entries.append(_format.FileEntry(file=name, size=size, sha256=digest))
    return _format.ShardedPart(states=("model",), files=tuple(entries))


def test_a_reserved_save_publishes_the_sharded_part_and_latest_verifies_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.save(states_for(1))
    reservation = store.reserve(sharded=True)
    assert reservation.seq == 2 and reservation.temp.name.startswith(".tmp-") and reservation.sharded_dir.is_dir()
    part = _sharded_files(reservation, {".metadata": b"meta", "__0_0.distcp": b"rank0", "__1_0.distcp": b"rank1"})
    info = store.publish(reservation, states_for(2), {"tag": 2}, part)
    assert info.seq == 2 and info.size > sum(e.size for e in part.files)
    manifest = json.loads((info.path / _format.MANIFEST_NAME).read_text())
    assert manifest["version"] == _format.FORMAT_VERSION == 2
    assert manifest["sharded"]["states"] == ["model"]
    assert sorted(f["file"] for f in manifest["sharded"]["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    latest = store.latest()
    assert latest.info.seq == 2 and latest.sharded_names() == ["model"]
    (info.path / _format.SHARDED_DIR / "__1_0.distcp").write_bytes(b"RANK1")  # same size, other bytes
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.latest().info.seq == 1
    assert "__1_0.distcp does not match its sha256" in caplog.text


def test_a_sharded_part_that_does_not_match_its_directory_is_not_published(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    reservation = store.reserve(sharded=True)
    part = _sharded_files(reservation, {".metadata": b"meta", "__0_0.distcp": b"rank0"})
    (reservation.sharded_dir / "__1_0.distcp").write_bytes(b"a rank's file the records miss")
    with pytest.raises(CheckpointError, match="incomplete or has extra files"):
        store.publish(reservation, states_for(1), None, part)
    assert checkpoint_dirs(tmp_path) == [] and temp_dirs(tmp_path) == []


def test_an_abandoned_reservation_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    reservation = store.reserve(sharded=True)
    (reservation.sharded_dir / "__0_0.distcp").write_bytes(b"half written")
    store.abandon(reservation)
    assert temp_dirs(tmp_path) == [] and store.latest() is None
    assert store.reserve().seq == 1  # the number was never used


@pytest.mark.parametrize("mutate, reason", [
    (lambda part: part.update(files=[{"file": "../escape", "bytes": 1, "sha256": "0" * 64}]), "unsafe"),
    (lambda part: part.update(files=[f for f in part["files"] if f["file"] != ".metadata"]), "no .metadata"),
    (lambda part: part.update(states=["not-saved"]), "without its state file"),
    (lambda part: part.update(files="x"), "bad sharded part"),
])
def test_bad_sharded_records_make_the_checkpoint_invalid(tmp_path: Path, mutate: Callable, reason: str) -> None:
    store = CheckpointStore(tmp_path)
    reservation = store.reserve(sharded=True)
    part = _sharded_files(reservation, {".metadata": b"meta", "__0_0.distcp": b"rank0"})
    info = store.publish(reservation, {"model": {"w": torch.ones(1)}}, None, part)
    rewrite_manifest(info.path, lambda body: mutate(body["sharded"]))
    with pytest.raises(CheckpointError, match=reason):
        store.latest()
