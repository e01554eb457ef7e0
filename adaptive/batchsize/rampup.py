"""Batch-size ramp-up schedules: the global batch as a function of consumed samples (or tokens).

Large-model runs start with small global batches, when the critical batch
size is small, and grow them as training proceeds (Megatron, MaxText,
OLMo). A schedule here is a pure function ``consumed -> global batch size``
where ``consumed`` counts samples (or tokens) trained since the start of the
run:

* :class:`ConstantSchedule`: one size throughout.
* :class:`LinearRampup`: Megatron style: start at ``start``, add
  ``increment`` every ``rampup / ((target - start) / increment)`` consumed,
  reach ``target`` after ``rampup`` consumed.
* :class:`StagedSchedule`: explicit stages, parsed from strings such as
  ``"0:64 200K:128 1M:256"`` (from 0 consumed use 64, from 200 000 use 128,
  from 1 000 000 use 256).

Exactness
---------
The size follows the schedule exactly whatever the replica count: the
loader splits any global batch across replicas (uneven shares are fine), so
nothing is rounded to a multiple of the replica count (Megatron rounds to a
multiple of micro-batch x data-parallel size, which makes the sequence
depend on the replica count).

The step size is the schedule's size at the *start* of the step
(Megatron's choice): a step that starts just before a threshold uses the old
size and may end past it. :meth:`BatchSizeSchedule.step_size` with
``exact_boundaries=True`` instead shortens such a step so that it ends on
the threshold, and the next step starts there with the new size.

Exact resume
------------
The only state is ``consumed``, an int the loader checkpoints together with
its position in the epoch's global sample stream. Step ``k`` reads exactly
the stream positions ``[position, position + size)`` with ``size`` computed
from ``consumed``, so a resume at any step, mid-ramp, recomputes the same
size and reads the next unread sample. Implementations that load a
full-size global batch and slice the ramp-sized part off keep the rest in an
in-memory buffer (MaxText does this); unless that buffer is checkpointed,
its samples are silently lost on resume. Here there is no buffer to lose:
no sample is dropped or repeated at a stage boundary or on resume.

Autoscale
---------
With adaptive batch sizes the goodput model chooses the batch. The schedule
then *bounds it from above*: :meth:`BatchSizeSchedule.bounds_at` returns
``(min(lo, cap), cap)`` with ``cap = min(hi, batch_size_at(consumed))`` for
the autoscaler's own bounds ``(lo, hi)``. Autoscale may choose any size up
to the schedule's size but never more; the schedule never forces a size the
autoscaler does not want, except that early in the ramp the schedule's size
wins over a larger lower bound ``lo``. Once the ramp is over the cap is the
final size, so set the final size to the largest batch autoscale may use.

Where things are
----------------
This module is the schedules. Their textual stages (``"0:64 200K:128"``)
are parsed in :mod:`adaptive.batchsize.rampup_stages`; building a schedule
from what a user passes as ``batch_size_schedule=`` (an int, a string, a
:meth:`BatchSizeSchedule.spec` mapping) is
:func:`adaptive.batchsize.rampup_specs.make_schedule`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence

from adaptive._utils.checks import check_choice, check_int
from adaptive._utils.types import JSON
from adaptive.batchsize.rampup_stages import check_stages, parse_stages
from adaptive.batchsize.step_lr_rules import LR_RULES, step_lr_factor

__all__ = [
    "BatchSizeSchedule",
    "ConstantSchedule",
    "LR_REFERENCES",
    "LinearRampup",
    "StagedSchedule",
    "UNITS",
]

#: What ``consumed`` and the sizes of a schedule count.
UNITS = ("samples", "tokens")
#: Which size :meth:`BatchSizeSchedule.lr_factor` is relative to.
LR_REFERENCES = ("final", "initial")


class BatchSizeSchedule(abc.ABC):
    """A global batch size as a pure function of ``consumed`` samples (or tokens).

    Subclasses define :meth:`batch_size_at`, :meth:`next_change` and the
    ``initial``/``final`` sizes; everything else is derived. ``unit`` says
    whether ``consumed`` and the sizes count samples or tokens.
    """

    def __init__(self, unit: str = "samples") -> None:
        self._unit = check_choice("unit", unit, UNITS)

    @property
    def unit(self) -> str:
        return self._unit

    @abc.abstractmethod
    def batch_size_at(self, consumed: int) -> int:
        """The global batch size for a step that starts after ``consumed`` samples (tokens)."""

    @abc.abstractmethod
    def next_change(self, consumed: int) -> int | None:
        """The smallest ``c > consumed`` where the size differs from the size at ``consumed``,
        or None if it never changes again."""

    @property
    @abc.abstractmethod
    def initial_batch_size(self) -> int:
        """Size at 0 consumed."""

    @property
    @abc.abstractmethod
    def final_batch_size(self) -> int:
        """Size once the schedule stops changing."""

    @property
    def rampup_end(self) -> int:
        """Consumed count from which the final size applies (0 for a constant schedule)."""
        consumed = 0
        while (change := self.next_change(consumed)) is not None:
            consumed = change
        return consumed

    @abc.abstractmethod
    def spec(self) -> JSON:
        """The schedule as a plain-Python spec (``{"type": "linear", ...}``).

        What a user may pass as ``batch_size_schedule=`` (in a config file,
        say): :func:`adaptive.batchsize.rampup_specs.make_schedule` rebuilds
        an equal schedule from it.  Not checkpointed state: a schedule has
        none (the loader checkpoints ``consumed``).
        """

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSizeSchedule) and self.spec() == other.spec()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.spec().items())))

    def step_size(
        self, consumed: int, proposed: int | None = None, *, exact_boundaries: bool = False
    ) -> int:
        """Size of the step that starts after ``consumed``.

        The schedule's size at the step's start (Megatron's rule), or
        ``proposed`` if that is smaller (an autoscaler's choice never exceeds
        the schedule). With ``exact_boundaries=True`` the step is shortened so
        that it ends exactly on the next threshold, where the next step starts
        with the new size.
        """
        consumed = check_int("consumed", consumed, 0)
        size = self.batch_size_at(consumed)
        if proposed is not None:
            size = min(size, check_int("proposed", proposed, 1))
        if exact_boundaries:
            change = self.next_change(consumed)
            if change is not None:
                size = min(size, change - consumed)
        return size

    def steps(
        self, consumed: int, until: int, *, exact_boundaries: bool = False
    ) -> Iterator[tuple[int, int]]:
        """Yield ``(consumed_at_step_start, step_size)`` for steps until ``until`` is reached."""
        consumed = check_int("consumed", consumed, 0)
        until = check_int("until", until, consumed)
        while consumed < until:
            size = self.step_size(consumed, exact_boundaries=exact_boundaries)
            yield consumed, size
            consumed += size

    def bounds_at(
        self, consumed: int, autoscale_bounds: tuple[int, int] | None = None
    ) -> tuple[int, int]:
        """``(min, max)`` global batch size allowed for a step starting after ``consumed``.

        Without autoscale both are the schedule's size. With the autoscaler's
        bounds ``(lo, hi)``, the schedule caps the maximum:
        ``cap = min(hi, batch_size_at(consumed))`` and the result is
        ``(min(lo, cap), cap)`` (see the module docstring).
        """
        scheduled = self.batch_size_at(check_int("consumed", consumed, 0))
        if autoscale_bounds is None:
            return scheduled, scheduled
        if not isinstance(autoscale_bounds, (tuple, list)) or len(autoscale_bounds) != 2:
            raise ValueError(
                f"autoscale_bounds must be a (min, max) pair, got {autoscale_bounds!r}"
            )
        low = check_int("autoscale_bounds[0]", autoscale_bounds[0], 1)
        high = check_int("autoscale_bounds[1]", autoscale_bounds[1], low)
        cap = min(high, scheduled)
        return min(low, cap), cap

    def lr_factor(self, consumed: int, rule: str = "sqrt", reference: str = "final") -> float:
        """LR factor coupling the learning rate to the scheduled size.

        ``rule`` is ``"linear"``, ``"sqrt"`` or ``"none"``; the factor is
        relative to the ``"final"`` (default: the LR is tuned for the final
        batch and is scaled down early in the ramp) or the ``"initial"`` size.
        If autoscale picks a smaller batch than scheduled, scale by the actual
        size instead (:func:`adaptive.batchsize.step_lr_rules.step_lr_factor`).
        """
        check_choice("rule", rule, LR_RULES)
        check_choice("reference", reference, LR_REFERENCES)
        base = self.final_batch_size if reference == "final" else self.initial_batch_size
        return step_lr_factor(self.batch_size_at(check_int("consumed", consumed, 0)), base, rule)


class ConstantSchedule(BatchSizeSchedule):
    """The same global batch size throughout (no ramp)."""

    def __init__(self, batch_size: int, unit: str = "samples") -> None:
        super().__init__(unit)
        self._size = check_int("batch_size", batch_size, 1)

    def batch_size_at(self, consumed: int) -> int:
        check_int("consumed", consumed, 0)
        return self._size

    def next_change(self, consumed: int) -> int | None:
        check_int("consumed", consumed, 0)
        return None

    @property
    def initial_batch_size(self) -> int:
        return self._size

    @property
    def final_batch_size(self) -> int:
        return self._size

    def spec(self) -> JSON:
        return {"type": "constant", "batch_size": self._size, "unit": self.unit}

    def __repr__(self) -> str:
        return f"ConstantSchedule({self._size}, unit={self.unit!r})"


class LinearRampup(BatchSizeSchedule):
    """Megatron-style ramp: ``start``, plus ``increment`` at regular intervals, up to ``target``.

    With ``n = (target - start) / increment`` increments spread over
    ``rampup`` consumed, the size after ``c`` consumed is
    ``start + increment * min(n, floor(c * n / rampup))`` (exact integer
    arithmetic, so thresholds never drift by rounding): increment ``k`` takes
    effect at ``ceil(k * rampup / n)`` consumed and ``target`` from
    ``rampup`` on. ``target - start`` must be a multiple of ``increment``,
    as in Megatron.
    """

    def __init__(
        self, start: int, increment: int, rampup: int, target: int, unit: str = "samples"
    ) -> None:
        super().__init__(unit)
        self._start = check_int("start", start, 1)
        self._increment = check_int("increment", increment, 1)
        self._rampup = check_int("rampup", rampup, 1)
        self._target = check_int("target", target, self._start)
        span = self._target - self._start
        if span % self._increment:
            raise ValueError(
                f"target - start = {span} must be a multiple of increment = {self._increment} "
                f"(got start={self._start}, target={self._target})"
            )
        self._num_increments = span // self._increment

    def _stage(self, consumed: int) -> int:
        return min(self._num_increments, consumed * self._num_increments // self._rampup)

    def batch_size_at(self, consumed: int) -> int:
        return self._start + self._increment * self._stage(check_int("consumed", consumed, 0))

    def next_change(self, consumed: int) -> int | None:
        stage = self._stage(check_int("consumed", consumed, 0))
        if stage >= self._num_increments:
            return None
        return -(-(stage + 1) * self._rampup // self._num_increments)  # ceil division

    @property
    def initial_batch_size(self) -> int:
        return self._start

    @property
    def final_batch_size(self) -> int:
        return self._target

    @property
    def rampup_end(self) -> int:
        return self._rampup if self._num_increments else 0

    def spec(self) -> JSON:
        return {
            "type": "linear",
            "start": self._start,
            "increment": self._increment,
            "rampup": self._rampup,
            "target": self._target,
            "unit": self.unit,
        }

    def __repr__(self) -> str:
        return (
            f"LinearRampup(start={self._start}, increment={self._increment}, "
            f"rampup={self._rampup}, target={self._target}, unit={self.unit!r})"
        )


class StagedSchedule(BatchSizeSchedule):
    """Explicit stages: ``[(0, 64), (200_000, 128), ...]`` or a string ``"0:64 200K:128"``.

    The size at ``consumed`` is the size of the last stage whose threshold
    is ``<= consumed``. Sizes need not increase (a later stage may use a
    smaller batch), but they must be positive.
    """

    def __init__(self, stages: str | Sequence[Sequence[int]], unit: str = "samples") -> None:
        super().__init__(unit)
        self._stages = parse_stages(stages) if isinstance(stages, str) else check_stages(stages)
        self._thresholds = [t for t, _ in self._stages]

    @property
    def stages(self) -> list[tuple[int, int]]:
        """The ``(threshold, size)`` pairs, thresholds increasing from 0."""
        return list(self._stages)

    def _index(self, consumed: int) -> int:
        low, high = 0, len(self._thresholds)
        while high - low > 1:  # last stage with threshold <= consumed
            middle = (low + high) // 2
            if self._thresholds[middle] <= consumed:
                low = middle
            else:
                high = middle
        return low

    def batch_size_at(self, consumed: int) -> int:
        return self._stages[self._index(check_int("consumed", consumed, 0))][1]

    def next_change(self, consumed: int) -> int | None:
        index = self._index(check_int("consumed", consumed, 0))
        size = self._stages[index][1]
        for threshold, later in self._stages[index + 1 :]:
            if later != size:
                return threshold
        return None

    @property
    def initial_batch_size(self) -> int:
        return self._stages[0][1]

    @property
    def final_batch_size(self) -> int:
        return self._stages[-1][1]

    def spec(self) -> JSON:
        return {"type": "staged", "stages": [list(s) for s in self._stages], "unit": self.unit}

    def __repr__(self) -> str:
        text = " ".join(f"{t}:{s}" for t, s in self._stages)
        return f"StagedSchedule({text!r}, unit={self.unit!r})"

