"""Scheduler hints: validation, JSON round trip, atomic file, HTTP post."""

from __future__ import annotations

import http.server
import json
import os
import threading

import pytest

from adaptive.batchsize.hint_posting import post_hints
from adaptive.checkpoint.versions import StateFormatError
from adaptive.goodput import (HINTS_FILENAME, HINTS_VERSION, CurrentConfig, GoodputFunction, GradParams, Hints,
                              PerfParams, read_hints, read_json, write_hints, write_json_atomic)

PERF = {"alpha_c": 0.02, "beta_c": 0.001, "alpha_n": 0.08, "beta_n": 0.01, "alpha_r": 0.03, "beta_r": 0.004,
        "gamma": 2.0}


def _valid() -> dict:
    return {
        "version": 2, "job_id": "job-1", "timestamp": 1767225600.5, "init_batch_size": 128,
        "max_batch_size": 4096, "local_bsz_bounds": [16, 512], "gradient_accumulation": True,
        "perf_params": dict(PERF), "grad_params": {"sqr": 0.5, "var": 12.0},
        "max_profiled_replicas": 4, "max_profiled_nodes": 1, "progress": 321.5,
        "current": {"num_nodes": 1, "num_replicas": 4, "local_bsz": 64, "accum_steps": 2},
        "completed_fraction": 0.25,
    }


def _valid_v1() -> dict:
    """The same document as a job of the previous release wrote it (format 1: no completed_fraction)."""
    data = dict(_valid(), version=1)
    del data["completed_fraction"]
    return data


def test_round_trip_and_types():
    hints = Hints.from_state_dict(_valid())
    assert hints.state_dict() == _valid()
    assert Hints.from_json(hints.to_json()) == hints
    assert list(json.loads(hints.to_json())) == list(_valid())  # field order as in the contract
    assert hints.perf_params == PerfParams.from_state_dict(PERF)
    assert hints.local_bsz_bounds == (16, 512)
    assert hints.completed_fraction == 0.25 and HINTS_VERSION == 2
    assert hints.current.num_replicas == 4 and hints.current["accum_steps"] == 2
    assert dict(hints.current) == _valid()["current"]
    fn = hints.goodput_function()
    assert isinstance(fn, GoodputFunction) and fn.init_batch_size == 128
    assert fn.grad_params == GradParams(0.5, 12.0)


def test_nullable_fields():
    data = dict(_valid(), max_batch_size=None, local_bsz_bounds=None, perf_params=None, grad_params=None,
                current=None, max_profiled_replicas=0, max_profiled_nodes=0, completed_fraction=None)
    hints = Hints.from_state_dict(data)
    assert hints.state_dict() == data
    assert hints.goodput_function() is None
    assert Hints.from_state_dict(dict(_valid(), grad_params=None)).goodput_function() is None


@pytest.mark.parametrize("field,value", [
    ("version", 3), ("job_id", ""), ("job_id", 7), ("timestamp", -1.0), ("timestamp", float("nan")),
    ("init_batch_size", 0), ("init_batch_size", True), ("init_batch_size", 12.5),
    ("max_batch_size", 64),  # below init_batch_size
    ("local_bsz_bounds", [16]), ("local_bsz_bounds", [32, 16]), ("local_bsz_bounds", [0, 16]),
    ("gradient_accumulation", 1), ("max_profiled_replicas", -1), ("max_profiled_nodes", 5),
    ("progress", -0.5), ("progress", "12"),
    ("completed_fraction", -0.1), ("completed_fraction", 1.5), ("completed_fraction", "0.5"),
    ("completed_fraction", float("nan")), ("completed_fraction", True),
])
def test_bad_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        Hints.from_state_dict(dict(_valid(), **{field: value}))


@pytest.mark.parametrize("field,value,message", [
    ("perf_params", dict(PERF, gamma=0.5), "perf_params"),
    ("perf_params", {"alpha_c": 1.0}, "perf_params"),
    ("grad_params", {"sqr": -1.0, "var": 1.0}, "grad_params"),
    ("grad_params", [1.0, 2.0], "grad_params"),
    ("current", {"num_nodes": 2, "num_replicas": 1, "local_bsz": 8, "accum_steps": 1}, "current"),
    ("current", {"num_nodes": 1, "num_replicas": 1, "local_bsz": 8}, "current"),
    ("current", {"num_nodes": 1, "num_replicas": 1, "local_bsz": 0, "accum_steps": 1}, "current.local_bsz"),
])
def test_bad_nested_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        Hints.from_state_dict(dict(_valid(), **{field: value}))


def test_unknown_and_missing_keys():
    with pytest.raises(ValueError, match="unknown fields.*'speed'"):
        Hints.from_state_dict(dict(_valid(), speed=3))
    data = _valid()
    del data["progress"]
    with pytest.raises(ValueError, match="missing fields.*progress"):
        Hints.from_state_dict(data)
    data = _valid()
    del data["completed_fraction"]  # format 2 has it (null when unknown)
    with pytest.raises(ValueError, match="missing fields.*completed_fraction"):
        Hints.from_state_dict(data)
    with pytest.raises(ValueError, match="JSON object"):
        Hints.from_state_dict([1, 2])
    with pytest.raises(ValueError, match="not valid JSON"):
        Hints.from_json("{not json")


def test_direct_construction_validates():
    with pytest.raises(TypeError, match="current"):  # a wrong type (adaptive._utils.checks rule)
        Hints(job_id="j", timestamp=0.0, init_batch_size=8, max_batch_size=None, local_bsz_bounds=None,
              gradient_accumulation=False, perf_params=None, grad_params=None, max_profiled_replicas=1,
              max_profiled_nodes=1, progress=0.0, current={"num_nodes": 1})
    with pytest.raises(ValueError, match="num_nodes"):
        CurrentConfig(num_nodes=3, num_replicas=2, local_bsz=8, accum_steps=1)


def test_write_is_atomic_and_readable(tmp_path):
    hints = Hints.from_state_dict(_valid())
    path = write_hints(hints, tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / HINTS_FILENAME
    assert read_hints(path) == hints
    assert read_hints(tmp_path / "ckpt") == hints
    newer = Hints.from_state_dict(dict(_valid(), progress=400.0))
    write_hints(newer, tmp_path / "ckpt")
    assert read_hints(path).progress == 400.0
    assert os.listdir(tmp_path / "ckpt") == [HINTS_FILENAME]  # no temporary files left behind
    with pytest.raises(TypeError, match="Hints"):
        write_hints(_valid(), tmp_path)


def test_hints_file_holds_the_posted_bytes(tmp_path):
    hints = Hints.from_state_dict(_valid())
    path = write_hints(hints, tmp_path)
    assert path.read_text(encoding="utf-8") == hints.to_json()


def test_atomic_json_keeps_the_old_file_when_a_write_fails(tmp_path):
    path = tmp_path / "sub" / "state.json"
    assert write_json_atomic(path, {"b": 1, "a": [1.5]}) == path
    assert read_json(path) == {"a": [1.5], "b": 1}
    with pytest.raises(ValueError):
        write_json_atomic(path, {"x": float("nan")}, allow_nan=False)
    assert read_json(path) == {"a": [1.5], "b": 1}
    assert os.listdir(path.parent) == ["state.json"]
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match="state.json"):
        read_json(path)


def test_post_hints_sends_json():
    received = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server API)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.update(path=self.path, body=json.loads(body), type=self.headers["Content-Type"],
                            auth=self.headers.get("Authorization"))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1/jobs/job-1/hints"
        post_hints(url, Hints.from_state_dict(_valid()), timeout=10.0, token="secret")
    finally:
        thread.join(timeout=10.0)
        server.server_close()
    assert received == {"path": "/v1/jobs/job-1/hints", "body": _valid(), "type": "application/json",
                        "auth": "Bearer secret"}
    with pytest.raises(ValueError, match="url"):
        post_hints("ftp://x", Hints.from_state_dict(_valid()))


def test_document_format_versions():
    """The document keeps its keys and nested layouts (no version inside perf_params,
    grad_params, current: the document's version covers them); a later format version
    is refused; a wrong type in a document is a ValueError, in direct use a TypeError."""
    hints = Hints.from_state_dict(_valid())
    assert hints.perf_params.state_dict() == {"version": 1, **PERF}
    assert hints.current.state_dict() == {"version": 1, **_valid()["current"]}
    assert hints.state_dict()["perf_params"] == PERF and hints.state_dict()["current"] == _valid()["current"]
    with pytest.raises(StateFormatError, match="version 3"):
        Hints.from_state_dict(dict(_valid(), version=3))
    with pytest.raises(StateFormatError, match="version"):
        Hints.from_state_dict(dict(_valid(), version="1"))
    with pytest.raises(ValueError, match="init_batch_size"):
        Hints.from_state_dict(dict(_valid(), init_batch_size="128"))
    with pytest.raises(TypeError, match="init_batch_size"):
        Hints(**dict(Hints.from_state_dict(_valid()).__dict__, init_batch_size="128"))
    assert CurrentConfig.from_state_dict(CurrentConfig(1, 2, 8, 1).state_dict()) == CurrentConfig(1, 2, 8, 1)


def test_completed_fraction_round_trips_with_and_without_a_value(tmp_path):
    for value in (0.0, 0.25, 1.0, None):
        hints = Hints.from_state_dict(dict(_valid(), completed_fraction=value))
        assert hints.completed_fraction == value
        assert hints.state_dict()["completed_fraction"] == value
        assert Hints.from_json(hints.to_json()) == hints
        assert read_hints(write_hints(hints, tmp_path)) == hints
    assert json.loads(Hints.from_state_dict(dict(_valid(), completed_fraction=None)).to_json())[
        "completed_fraction"] is None  # written as null, not left out
    assert isinstance(Hints.from_state_dict(dict(_valid(), completed_fraction=1)).completed_fraction, float)


def test_a_version_1_document_still_loads_without_completed_fraction(tmp_path):
    """Hints written by the previous release (format 1) are migrated explicitly: completed_fraction is None."""
    hints = Hints.from_state_dict(_valid_v1())
    assert hints.completed_fraction is None and hints.version == HINTS_VERSION
    assert hints.state_dict() == dict(_valid(), completed_fraction=None)  # rewritten as format 2
    assert hints == Hints.from_state_dict(dict(_valid(), completed_fraction=None))
    path = tmp_path / HINTS_FILENAME
    path.write_text(json.dumps(_valid_v1()), encoding="utf-8")  # a hints.json of the previous release
    assert read_hints(tmp_path).completed_fraction is None
    with pytest.raises(StateFormatError, match="completed_fraction.*not part of hints format version 1"):
        Hints.from_state_dict(dict(_valid_v1(), completed_fraction=0.5))
    with pytest.raises(ValueError, match="missing fields.*progress"):  # the v1 layout is still checked
        Hints.from_state_dict({k: v for k, v in _valid_v1().items() if k != "progress"})


def test_completed_fraction_is_validated_in_direct_construction():
    fields = dict(Hints.from_state_dict(_valid()).__dict__)
    del fields["completed_fraction"]
    assert Hints(**fields).completed_fraction is None  # the default: constructors without it keep working
    for bad in (-0.1, 1.5, float("inf")):
        with pytest.raises(ValueError, match="completed_fraction"):
            Hints(**fields, completed_fraction=bad)
    with pytest.raises(TypeError, match="completed_fraction"):
        Hints(**fields, completed_fraction="0.5")
