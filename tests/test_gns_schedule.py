"""Which optimizer steps the noise-scale probe measures (adaptive.batchsize.gns._schedule).

The schedule is driven here with a clock the test sets, so every decision
is known exactly; tests/test_gns.py checks with two real replicas that they
agree on the interval their different costs vote for.
"""

from __future__ import annotations

import math

import pytest

from adaptive.batchsize.gns import _schedule
from adaptive.batchsize.gns._schedule import (COST_BUDGET, LONGEST_INTERVAL, MeasureSchedule,
                                              check_measure_interval)


class Clock:
    """A clock that only moves when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(_schedule, "_clock", clock)
    return clock


def run_step(schedule: MeasureSchedule, clock: Clock, step: int, *, period: float, cost: float,
             votes: list[int] | None = None) -> bool:
    """One optimizer step as the probe drives it; returns whether it was measured.

    ``votes``: the other replicas' votes, summed with this one's when the measurement is read
    (at the next step's start, before its decisions).
    """
    schedule.step_began(step)
    measured = schedule.measures(step)
    if measured:
        schedule.measuring(step)
        schedule.add_cost(cost)
        vote = schedule.proposal()
        schedule.step_measured()
        others = votes or []
        schedule.agree(step, vote + sum(others), 1 + len(others))
    clock.now += period + (cost if measured else 0.0)
    return measured


def test_fixed_interval_measures_every_nth_step_and_stores_the_step_before(clock):
    schedule = MeasureSchedule(3)
    measured, stored = [], []
    for step in range(12):
        schedule.step_began(step)
        if schedule.measures(step):
            assert schedule.measuring(step) == 3  # the steps it stands for (the first: one interval)
            measured.append(step)
        if schedule.stores(step):
            stored.append(step)
        if step in measured:
            schedule.agree(step, votes=2 * schedule.proposal(), voters=2)
    assert measured == [0, 3, 6, 9]
    assert stored == [2, 5, 8, 11]
    assert schedule.interval == 3 and schedule.proposal() == 3


def test_auto_measures_every_step_while_cheap(clock):
    schedule = MeasureSchedule("auto")
    measured = [run_step(schedule, clock, step, period=0.100, cost=0.0005) for step in range(20)]
    assert all(measured) and schedule.interval == 1  # 0.5 ms of a 100 ms step is within the 1% budget


def test_auto_spaces_measurements_to_keep_their_cost_in_budget(clock):
    schedule = MeasureSchedule("auto")
    period, cost = 0.020, 0.0012  # a measurement costs 6% of a step: every 6th step keeps it at 1%
    measured = [step for step in range(200) if run_step(schedule, clock, step, period=period, cost=cost)]
    expected = math.ceil(cost / (COST_BUDGET * period))
    assert schedule.interval == expected == 6
    steady = measured[3:]
    assert all(b - a == expected for a, b in zip(steady, steady[1:]))
    # the first measurement knows no step duration yet: the next step is measured too
    assert measured[:2] == [0, 1]


def test_auto_interval_is_capped(clock):
    schedule = MeasureSchedule("auto")
    for step in range(300):
        run_step(schedule, clock, step, period=0.010, cost=0.010)  # as long as a step: 100 steps for 1%
    assert schedule.interval == LONGEST_INTERVAL


def test_replicas_adopt_the_rounded_mean_of_their_votes(clock):
    schedule = MeasureSchedule("auto")
    schedule.step_began(0)
    schedule.measuring(0)
    schedule.agree(0, votes=4 + 9, voters=2)  # 6.5: round half to even, the same on every replica
    assert schedule.interval == 6
    assert not schedule.measures(5) and schedule.measures(6)
    schedule.agree(6, votes=3 * LONGEST_INTERVAL + 100, voters=3)
    assert schedule.interval == LONGEST_INTERVAL


def test_a_skipped_due_step_is_measured_at_the_next_one(clock):
    schedule = MeasureSchedule(4)
    schedule.measuring(0)
    assert schedule.measures(4) and schedule.measures(5)  # due from step 4 until a step is measured
    schedule.measuring(5)
    assert schedule.measuring(9) == 4  # each measurement stands for the steps since the previous one


def test_restart_starts_every_member_alike(clock):
    schedule = MeasureSchedule("auto")
    for step in range(50):
        run_step(schedule, clock, step, period=0.010, cost=0.002)
    assert schedule.interval > 1
    schedule.restart()  # a membership change: a joiner's schedule starts here too
    assert schedule.interval == 1 and schedule.measures(0)
    fixed = MeasureSchedule(5)
    fixed.measuring(0)
    fixed.restart()
    assert fixed.interval == 5 and fixed.measures(0)


def test_the_step_durations_leave_the_measurement_out(clock):
    schedule = MeasureSchedule("auto")
    for step in range(100):
        run_step(schedule, clock, step, period=0.010, cost=0.002)
    # 2 ms against a 10 ms step: 20 steps for 1%; counting the measurement in its step would give 17
    assert schedule.interval == schedule.proposal() == 20


@pytest.mark.parametrize("value", [0, -1, 1.5, "sometimes", None, True])
def test_bad_intervals_are_refused_by_name(value):
    with pytest.raises((TypeError, ValueError), match=r"gns_interval must be an integer >= 1 \(optimizer "
                                                      r"steps\) or 'auto'"):
        check_measure_interval("gns_interval", value)


def test_good_intervals():
    assert check_measure_interval("gns_interval", "auto") == "auto"
    assert check_measure_interval("gns_interval", 7) == 7
