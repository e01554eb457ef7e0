"""Tests for the ramp-up schedules (adaptive.batchsize.rampup*): parsing, Megatron parity, boundaries,
resume, autoscale bounds, LR, specs."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive.batchsize.rampup import ConstantSchedule, LinearRampup, StagedSchedule
from adaptive.batchsize.rampup_specs import describe, make_schedule
from adaptive.batchsize.rampup_stages import parse_count, parse_stages

PROPERTY = settings(max_examples=40, deadline=None)


# --------------------------------------------------------------------------- parsing


def test_parse_stages_with_suffixes_and_separators():
    assert parse_stages("0:64 200K:128 1M:256") == [(0, 64), (200_000, 128), (1_000_000, 256)]
    assert parse_stages(" 0:32,1.5k:64 ,\n2G:1M ") == [(0, 32), (1500, 64), (2 * 10**9, 10**6)]
    assert parse_count("4096") == 4096 and parse_count("0.5M") == 500_000


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "is empty"),
        ("64", "token '64': not of the form THRESHOLD:SIZE"),
        ("0:64 :128", "token ':128': not of the form"),
        ("10:64 20:128", "token '10:64': the first threshold must be 0, got 10"),
        ("0:64 1M:128 1M:256", "token '1M:256': threshold 1000000 must exceed the previous"),
        ("0:64 2M:128 1M:256", "token '1M:256': threshold 1000000 must exceed"),
        ("0:0", "token '0:0': size must be >= 1, got 0"),
        ("0:-5", "token '0:-5': '-5' is not a count"),
        ("0:64 1X:128", "token '1X:128': '1X' is not a count"),
        ("0:64 100:12.5", "token '100:12.5': '12.5' is not a whole number"),
        ("0:64 100:128:3", "token '100:128:3'"),
    ],
)
def test_parse_stages_errors_name_the_token_and_the_rules(text, fragment):
    with pytest.raises(ValueError) as caught:
        parse_stages(text)
    message = str(caught.value)
    assert fragment in message
    assert "THRESHOLD:SIZE" in message and "K (10^3)" in message


def test_sequence_stages_are_validated_too():
    with pytest.raises(ValueError, match="first stage must start at 0"):
        StagedSchedule([(5, 64)])
    with pytest.raises(ValueError, match="strictly increasing: 10 follows 10"):
        StagedSchedule([(0, 64), (10, 128), (10, 256)])
    with pytest.raises(ValueError, match=r"size of stage 1 \(at 10\) must be an integer >= 1"):
        StagedSchedule([(0, 64), (10, 0)])
    with pytest.raises(ValueError, match="at least one"):
        StagedSchedule([])


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"start": 0}, ValueError, "start must be an integer >= 1"),
        ({"increment": 0}, ValueError, "increment must be an integer >= 1"),
        ({"rampup": 0}, ValueError, "rampup must be an integer >= 1"),
        ({"target": 16}, ValueError, "target must be an integer >= 32"),
        ({"target": 100}, ValueError, "target - start = 68 must be a multiple of increment = 32"),
        ({"start": 32.0}, TypeError, "start must be an integer"),
        ({"unit": "bytes"}, ValueError, "unit must be one of 'samples', 'tokens'"),
    ],
)
def test_linear_rampup_validation(kwargs, error, fragment):
    arguments = {"start": 32, "increment": 32, "rampup": 1000, "target": 256, **kwargs}
    with pytest.raises(error, match=fragment):
        LinearRampup(**arguments)


# --------------------------------------------------------------------------- sizes


def test_staged_sizes_switch_exactly_at_thresholds():
    schedule = StagedSchedule("0:64 200K:128 1M:256")
    assert [
        schedule.batch_size_at(c) for c in (0, 199_999, 200_000, 999_999, 10**6, 10**9)
    ] == [64, 64, 128, 128, 256, 256]
    assert schedule.next_change(0) == 200_000 and schedule.next_change(200_000) == 10**6
    assert schedule.next_change(10**6) is None and schedule.rampup_end == 10**6
    assert schedule.initial_batch_size == 64 and schedule.final_batch_size == 256


def megatron_reference(consumed: int, start: int, increment: int, rampup: int, target: int) -> int:
    """Megatron's formula (float arithmetic), written independently as an oracle."""
    per_increment = rampup / ((target - start) / increment)
    return min(target, start + int(consumed / per_increment) * increment)


@PROPERTY
@given(
    start=st.integers(1, 64),
    increment=st.integers(1, 64),
    increments=st.integers(1, 40),
    per_increment=st.integers(1, 5000),
    consumed=st.integers(0, 300_000),
)
def test_linear_rampup_matches_megatron(start, increment, increments, per_increment, consumed):
    target, rampup = start + increment * increments, per_increment * increments
    schedule = LinearRampup(start, increment, rampup, target)
    assert schedule.batch_size_at(consumed) == megatron_reference(
        consumed, start, increment, rampup, target
    )
    change = schedule.next_change(consumed)
    if change is None:
        assert consumed >= rampup and schedule.batch_size_at(consumed) == target
    else:
        assert schedule.batch_size_at(change) == schedule.batch_size_at(consumed) + increment
        assert schedule.batch_size_at(change - 1) == schedule.batch_size_at(consumed)


def test_linear_rampup_with_uneven_intervals_uses_exact_integer_thresholds():
    schedule = LinearRampup(start=10, increment=10, rampup=10, target=40)  # 3 increments over 10
    assert [schedule.batch_size_at(c) for c in range(12)] == [
        10,
        10,
        10,
        10,
        20,
        20,
        20,
        30,
        30,
        30,
        40,
        40,
    ]
    assert [schedule.next_change(c) for c in (0, 4, 7, 10)] == [4, 7, 10, None]
    assert schedule.rampup_end == 10


# --------------------------------------------------------------------------- steps and boundaries


def test_megatron_rule_uses_the_size_at_step_start():
    schedule = StagedSchedule("0:64 100:128")
    assert list(schedule.steps(0, 300)) == [(0, 64), (64, 64), (128, 128), (256, 128)]


def test_exact_boundaries_end_steps_on_thresholds():
    schedule = StagedSchedule("0:64 100:128 300:256")
    steps = list(schedule.steps(0, 800, exact_boundaries=True))
    assert steps == [(0, 64), (64, 36), (100, 128), (228, 72), (300, 256), (556, 256)]
    starts = {start for start, _ in steps}
    assert {100, 300} <= starts
    for start, size in steps:
        assert size <= schedule.batch_size_at(start)


def test_step_size_caps_a_proposal_at_the_schedule():
    schedule = StagedSchedule("0:64 100:128")
    assert schedule.step_size(0, proposed=32) == 32
    assert schedule.step_size(0, proposed=500) == 64
    assert schedule.step_size(90, proposed=500, exact_boundaries=True) == 10
    with pytest.raises(ValueError, match="proposed must be an integer >= 1"):
        schedule.step_size(0, proposed=0)
    with pytest.raises(ValueError, match="consumed must be an integer >= 0"):
        schedule.batch_size_at(-1)


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


@PROPERTY
@given(
    kills=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)), min_size=1, max_size=6),
    exact=st.booleans(),
)
def test_resume_mid_ramp_continues_the_schedule_and_reads_each_sample_once(kills, exact):
    """Simulated kills at random steps with changing replica counts; state is only `consumed`."""
    spec = "0:7 50:16 170:33 400:64"
    total = 1500  # one epoch of a stream of 1500 samples
    uninterrupted = list(StagedSchedule(spec).steps(0, total, exact_boundaries=exact))

    consumed, seen, sizes = 0, [], []
    for steps_before_kill, replicas in kills + [(10**6, 3)]:
        schedule = make_schedule(json.loads(json.dumps(StagedSchedule(spec).spec())))
        for _ in range(steps_before_kill):
            if consumed >= total:
                break
            size = min(schedule.step_size(consumed, exact_boundaries=exact), total - consumed)
            shares = split_evenly(size, replicas)
            assert sum(shares) == size  # the global batch does not depend on the replica count
            seen.extend(range(consumed, consumed + size))  # stream positions this step reads
            sizes.append(size)
            consumed += size  # the checkpoint: just this int
    assert seen == list(range(total))
    expected = [min(size, total - start) for start, size in uninterrupted]
    assert sizes == expected


# --------------------------------------------------------------------------- autoscale and LR


def test_bounds_schedule_caps_the_autoscaler():
    schedule = StagedSchedule("0:64 1000:512 5000:2048")
    assert schedule.bounds_at(0) == (64, 64)
    assert schedule.bounds_at(0, (32, 4096)) == (32, 64)
    assert schedule.bounds_at(0, (128, 4096)) == (64, 64)  # early in the ramp the schedule wins
    assert schedule.bounds_at(1000, (128, 4096)) == (128, 512)
    assert schedule.bounds_at(9000, (128, 1024)) == (128, 1024)  # autoscale's own cap is lower
    with pytest.raises(ValueError, match=r"autoscale_bounds\[1\] must be an integer >= 128"):
        schedule.bounds_at(0, (128, 64))
    with pytest.raises(ValueError, match="must be a \\(min, max\\) pair"):
        schedule.bounds_at(0, (1, 2, 3))


def test_lr_coupling_rules():
    schedule = StagedSchedule("0:64 100:256")
    assert schedule.lr_factor(0, "sqrt") == pytest.approx(0.5)
    assert schedule.lr_factor(0, "linear") == pytest.approx(0.25)
    assert schedule.lr_factor(100, "sqrt") == pytest.approx(1.0)
    assert schedule.lr_factor(100, "linear", reference="initial") == pytest.approx(4.0)
    assert schedule.lr_factor(0, "none") == 1.0
    with pytest.raises(ValueError, match="rule must be one of 'linear', 'sqrt', 'none'"):
        schedule.lr_factor(0, "adascale")
    with pytest.raises(ValueError, match="reference must be one of 'final', 'initial'"):
        schedule.lr_factor(0, "sqrt", reference="median")
    ramp = LinearRampup(16, 16, 1000, 64)
    assert ramp.lr_factor(500, "sqrt") == pytest.approx(math.sqrt(32 / 64))


# --------------------------------------------------------------------------- specs


def test_make_schedule_specs_and_spec_round_trip():
    assert make_schedule(256) == ConstantSchedule(256)
    assert make_schedule("2K") == ConstantSchedule(2000)
    assert make_schedule("0:64 1M:128", unit="tokens") == StagedSchedule(
        [(0, 64), (10**6, 128)], "tokens"
    )
    for schedule in (
        ConstantSchedule(8),
        LinearRampup(16, 16, 1000, 64, "tokens"),
        StagedSchedule("0:1 5:2"),
    ):
        spec = json.loads(json.dumps(schedule.spec()))
        assert make_schedule(spec) == schedule
        assert make_schedule(schedule) is schedule
        assert schedule.unit in describe(schedule)
    assert ConstantSchedule(8).rampup_end == 0 and ConstantSchedule(8).next_change(5) is None


@pytest.mark.parametrize(
    "spec, error, fragment",
    [
        ("fast", ValueError, "neither a size nor stages"),
        (2.5, TypeError, "must be an int, a stages string"),
        (True, TypeError, "must be an int, a stages string"),
        ({"type": "cosine"}, ValueError, "'type' must be one of 'constant', 'linear', 'staged'"),
        ({"type": "constant", "size": 3}, TypeError, "bad keys for a 'constant' schedule spec"),
        ({"batch_size": 3}, ValueError, "has no 'type'"),
        ({"type": 3}, TypeError, "'type' must be one of"),
        (0, ValueError, "batch_size must be an integer >= 1"),
    ],
)
def test_make_schedule_rejects_bad_specs(spec, error, fragment):
    with pytest.raises(error, match=fragment):
        make_schedule(spec)
