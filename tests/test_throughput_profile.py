"""The throughput profile: running means, window, cap, checkpoint format, fit."""

from __future__ import annotations

import math

import pytest
from goodput_cases import TRUE, synthetic

from adaptive.batchsize.throughput_profile import ThroughputProfile
from adaptive.checkpoint.versions import StateFormatError


def test_profile_running_means_window_and_cap():
    profile = ThroughputProfile(max_entries=3, window=4)
    for value in (1.0, 2.0, 3.0):
        profile.record(1, 1, 32, 1, step_time=value, compute_time=value / 2)
    entry = profile.get(1, 1, 32, 1)
    assert entry["step_time"] == pytest.approx(2.0)
    assert entry["compute_time"] == pytest.approx(1.0)
    assert math.isnan(entry["sync_time"])
    for _ in range(100):  # past the window the mean follows the new level
        profile.record(1, 1, 32, 1, step_time=10.0)
    assert profile.get(1, 1, 32, 1)["step_time"] == pytest.approx(10.0, rel=1e-6)
    profile.record(1, 2, 32, 1, step_time=1.0, sync_time=0.2)
    profile.record(2, 4, 32, 1, step_time=1.0)
    profile.record(1, 1, 32, 1, step_time=10.0)  # touch: now the most recent
    profile.record(1, 1, 64, 1, step_time=1.0)  # full: evicts (1, 2, 32, 1), the least recent
    assert len(profile) == 3
    assert profile.get(1, 2, 32, 1) is None and profile.get(1, 1, 32, 1) is not None
    assert profile.max_replicas == 4 and profile.max_nodes == 2


def test_profile_state_dict_round_trip_and_fit():
    profile = ThroughputProfile()
    nodes, replicas, local_bsz, accum, step, compute, sync = synthetic(TRUE)
    for row in zip(nodes, replicas, local_bsz, accum, step, compute, sync):
        n, r, m, a = (int(v) for v in row[:4])
        s, c, y = (float(v) for v in row[4:])
        profile.record(n, r, m, a, step_time=s, compute_time=c, sync_time=None if math.isnan(y) else y)
    copy = ThroughputProfile()
    copy.load_state_dict(profile.state_dict())
    assert list(copy) == list(profile)
    for key in profile:
        assert copy.get(*key) == pytest.approx(profile.get(*key), nan_ok=True)
    fitted = copy.fit()
    assert fitted.alpha_r == pytest.approx(TRUE.alpha_r, rel=0.01)
    assert ThroughputProfile().fit() is None


def test_profile_validation():
    profile = ThroughputProfile()
    with pytest.raises(ValueError, match="step_time"):
        profile.record(1, 1, 8, 1, step_time=0.0)
    with pytest.raises(ValueError, match="sync_time"):
        profile.record(1, 2, 8, 1, step_time=1.0, sync_time=-1.0)
    with pytest.raises(ValueError, match="num_nodes"):
        profile.record(2, 1, 8, 1, step_time=1.0)
    with pytest.raises(ValueError, match="max_entries"):
        ThroughputProfile(max_entries=0)
    with pytest.raises(TypeError, match="local_bsz"):
        profile.record(1, 1, 8.0, 1, step_time=1.0)
    with pytest.raises(ValueError, match="version"):
        profile.load_state_dict({"entries": []})


def test_profile_state_format_version():
    """Version 1 (what this release and the previous one write) loads; a later one is refused."""
    profile = ThroughputProfile()
    profile.record(1, 2, 32, 1, step_time=0.5, compute_time=0.2, sync_time=0.1)
    state = profile.state_dict()
    assert state["version"] == 1 and set(state) == {"version", "max_entries", "window", "clock", "entries"}
    saved = {"version": 1, "max_entries": 256, "window": 64, "clock": 3,  # a state as written before
             "entries": [[1, 2, 32, 1, 3.0, 0.5, 0.2, 0.1, math.nan, 3.0, 3.0, 3.0, 0.0]]}
    copy = ThroughputProfile()
    copy.load_state_dict(saved)
    assert copy.get(1, 2, 32, 1)["step_time"] == 0.5 and math.isnan(copy.get(1, 2, 32, 1)["data_time"])
    copy.record(1, 2, 32, 1, step_time=0.9)
    assert copy.state_dict()["clock"] == 4
    with pytest.raises(StateFormatError, match="version 2"):
        copy.load_state_dict(dict(saved, version=2))
    with pytest.raises(StateFormatError, match="clock"):
        copy.load_state_dict({key: value for key, value in saved.items() if key != "clock"})
