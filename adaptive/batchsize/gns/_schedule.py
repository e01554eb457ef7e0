"""Which optimizer steps the noise-scale probe measures.

A measured step reads every gradient about twice more (its norms before
and after the reduction, in Adam's geometry one multiply more each), and
now and then refreshes the Adam preconditioner: a few memory-bound passes
over the gradients.  On a GPU that is little next to a step; on CPUs and
for small models it is a sizeable part of one (6 ms of a 22 ms step for the
2.1M-parameter MLP of the benchmarks, on two gloo processes).

* A fixed interval ``n`` measures every ``n``-th optimizer step.
* ``"auto"`` measures as often as a budget allows: the host time of each
  measured step's extra work is timed, and the next measurement comes
  after enough steps that this work stays within :data:`COST_BUDGET` of
  the training time (between 1 and :data:`LONGEST_INTERVAL` steps).  A
  cheap measurement is taken every step; an expensive one rarely.  The
  work runs on the host on CPUs; on accelerators its kernels run
  asynchronously and the host time (their launches) is what is counted,
  which is small there as the kernels are.

Replicas must measure the same steps (a measured step all-reduces its
sums), so the next interval is agreed, not decided alone: each replica's
proposal travels with the measured step's own all-reduce (summed with the
norms, no extra collective) and every replica adopts the same rounded mean
when it reads the measurement, before the next step begins.  Each
measurement is weighed by the steps it stands for (:attr:`span`), so the
moving averages decay the same whatever the interval.
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import time
from typing import Iterator, Union

from adaptive._utils.checks import check_int

__all__ = ["AUTO", "COST_BUDGET", "LONGEST_INTERVAL", "MeasureInterval", "MeasureSchedule",
           "check_measure_interval"]

#: The interval that follows the measurement's cost.
AUTO = "auto"
#: With ``"auto"``: the share of the training time the measurement may take.
COST_BUDGET = 0.01
#: With ``"auto"``: the most optimizer steps between two measurements (the averages keep
#: about ``1 / (1 - smoothing) / LONGEST_INTERVAL`` measurements at the least, 31 by default).
LONGEST_INTERVAL = 32
#: Recent measured steps' costs and steps' durations the proposal reads (medians: robust to a
#: step that also wrote a checkpoint, and to the first measurement's allocations).
_RECENT_COSTS, _RECENT_PERIODS = 8, 32

#: What a measurement interval may be: optimizer steps, or ``"auto"``.
MeasureInterval = Union[int, str]


def check_measure_interval(name: str, value: object) -> MeasureInterval:
    """``value`` as a measurement interval: an int >= 1 (optimizer steps) or ``"auto"``."""
    if isinstance(value, str) and value == AUTO:
        return AUTO
    try:
        return check_int(name, value, 1)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name} must be an integer >= 1 (optimizer steps) or 'auto', got "
                          f"{type(value).__name__} {value!r}") from None


def _clock() -> float:
    return time.perf_counter()


class MeasureSchedule:
    """The steps to measure, counted in optimizer steps from the probe's start (or last regroup).

    The probe asks :meth:`measures` and :meth:`stores` as each step begins,
    reports the work a measured step did (:meth:`add_cost`) and the
    interval the replicas agreed when the measurement is read
    (:meth:`agree`); :meth:`proposal` is this replica's vote.
    """

    def __init__(self, interval: MeasureInterval) -> None:
        self.auto = interval == AUTO
        self._initial = 1 if self.auto else int(interval)
        self._costs: collections.deque[float] = collections.deque(maxlen=_RECENT_COSTS)
        self._periods: collections.deque[float] = collections.deque(maxlen=_RECENT_PERIODS)
        self.restart()

    def restart(self) -> None:
        """Start afresh at step 0 with the initial interval, as a new member's schedule does.

        After a membership change every member must measure the same steps,
        the joiners too; the step durations are forgotten (the group changed).
        """
        self.interval = self._initial  # the interval in force
        self._next = 0  # the next step to measure
        self._last_measured: int | None = None
        self._periods.clear()
        self._began: float | None = None
        self._step_cost = 0.0  # measurement work within the step in progress
        self._cycle_cost = 0.0  # measurement work since the last measured step

    # ------------------------------------------------------------ decisions, as a step begins
    def step_began(self, step: int) -> None:
        """Optimizer step ``step`` begins (its first backward): the last one's duration is known."""
        now = _clock()
        if self._began is not None:
            self._periods.append(max(0.0, now - self._began - self._step_cost))
        self._began, self._step_cost = now, 0.0

    def measures(self, step: int) -> bool:
        """Whether ``step`` is measured (from the first step at or after the one due)."""
        return step >= self._next

    def stores(self, step: int) -> bool:
        """Whether ``step``'s gradient is kept as the partner of the next (the differenced estimator)."""
        return step + 1 >= self._next

    def measuring(self, step: int) -> int:
        """``step`` is measured: the steps its measurement stands for; the next one is due an interval on."""
        span = self.interval if self._last_measured is None else step - self._last_measured
        self._last_measured = step
        self._next = step + self.interval
        return max(1, span)

    # ------------------------------------------------------------ cost and agreement
    def add_cost(self, seconds: float) -> None:
        """Measurement work done in the step in progress (norms, a stored partner, the preconditioner)."""
        self._step_cost += seconds
        self._cycle_cost += seconds

    def step_measured(self) -> None:
        """A measured step's work is all counted: the cost of its measurement (with the partner stored
        the step before, for the differenced estimator) is one sample of what a measurement costs."""
        if self._cycle_cost > 0:
            self._costs.append(self._cycle_cost)
        self._cycle_cost = 0.0

    def proposal(self) -> int:
        """This replica's vote for the next interval: the fixed one, or what keeps the cost in budget."""
        if not self.auto:
            return self._initial
        if not self._costs or not self._periods:
            return 1  # nothing known yet: measure the next step too, and learn what a step costs
        cost, period = statistics.median(self._costs), statistics.median(self._periods)
        if period <= 0:
            return LONGEST_INTERVAL
        steps = cost / (COST_BUDGET * period)
        return max(1, min(LONGEST_INTERVAL, math.ceil(steps - 1e-9)))  # (6.000000001 is 6 steps)

    def agree(self, step: int, votes: float, voters: int) -> None:
        """The replicas' votes for the interval after measured ``step`` (their sum over ``voters``).

        Every replica reads the same sum (an all-reduce's result), so all adopt the same interval.
        """
        if self.auto:
            self.interval = max(1, min(LONGEST_INTERVAL, round(votes / voters)))
        self._next = step + self.interval

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Count the work done in the ``with`` block as measurement work (:meth:`add_cost`)."""
        started = _clock()
        try:
            yield
        finally:
            self.add_cost(_clock() - started)
