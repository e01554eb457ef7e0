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
"""

from __future__ import annotations

import abc
import inspect
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from adaptive.data.tokens.planner import LR_RULES, _check_choice, _check_int, step_lr_factor

logger = logging.getLogger(__name__)

__all__ = [
    "BatchSizeSchedule",
    "ConstantSchedule",
    "LinearRampup",
    "StagedSchedule",
    "UNITS",
    "describe",
    "make_schedule",
    "parse_count",
    "parse_stages",
]

UNITS = ("samples", "tokens")
LR_REFERENCES = ("final", "initial")
_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)$", re.IGNORECASE)
_STAGES_HELP = (
    "expected space- or comma-separated 'THRESHOLD:SIZE' pairs, thresholds strictly "
    "increasing from 0, sizes >= 1, numbers as integers with an optional K (10^3), "
    "M (10^6) or G (10^9) suffix, e.g. '0:64 200K:128 1M:256'"
)


def parse_count(text: str) -> int:
    """Parse ``"200K"``, ``"1.5M"``, ``"3G"`` or ``"4096"`` into an int (decimal suffixes).

    Raises ``ValueError`` for anything that is not a non-negative whole
    number once the suffix is applied.
    """
    match = _COUNT.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a count: use digits with an optional K, M or G suffix")
    try:
        value = Decimal(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f"{text!r} is not a count") from None
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def parse_stages(text: str) -> list[tuple[int, int]]:
    """Parse ``"0:64 200K:128 1M:256"`` into ``[(0, 64), (200000, 128), (1000000, 256)]``.

    Errors name the bad token and say what is allowed.
    """
    if not isinstance(text, str):
        raise TypeError(f"stages must be a string, got {type(text).__name__}")
    tokens = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if not tokens:
        raise ValueError(f"batch-size schedule {text!r} is empty; {_STAGES_HELP}")
    stages: list[tuple[int, int]] = []
    for token in tokens:
        stages.append(_parse_stage(token, stages[-1][0] if stages else None))
    return stages


def _parse_stage(token: str, previous: int | None) -> tuple[int, int]:
    """Parse one ``THRESHOLD:SIZE`` token, checking it against the previous threshold."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"batch-size schedule token {token!r}: {problem}; {_STAGES_HELP}")

    threshold_text, sep, size_text = token.partition(":")
    if not sep or not threshold_text or not size_text:
        raise bad("not of the form THRESHOLD:SIZE")
    try:
        threshold, size = parse_count(threshold_text), parse_count(size_text)
    except ValueError as error:
        raise bad(str(error)) from None
    if size < 1:
        raise bad(f"size must be >= 1, got {size}")
    if previous is None and threshold != 0:
        raise bad(f"the first threshold must be 0, got {threshold}")
    if previous is not None and threshold <= previous:
        raise bad(f"threshold {threshold} must exceed the previous threshold {previous}")
    return threshold, size


def _check_stages(stages: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Validate ``(threshold, size)`` pairs: first threshold 0, strictly increasing, sizes >= 1."""
    if not stages:
        raise ValueError("a staged schedule needs at least one (threshold, size) stage")
    out = []
    for position, stage in enumerate(stages):
        if len(stage) != 2:
            raise ValueError(f"stage {position} must be a (threshold, size) pair, got {stage!r}")
        threshold = _check_int(f"threshold of stage {position}", stage[0], 0)
        size = _check_int(f"size of stage {position} (at {threshold})", stage[1], 1)
        if position == 0 and threshold != 0:
            raise ValueError(f"the first stage must start at 0 consumed, got {threshold}")
        if out and threshold <= out[-1][0]:
            raise ValueError(
                f"thresholds must be strictly increasing: {threshold} follows {out[-1][0]}"
            )
        out.append((threshold, size))
    return out


class BatchSizeSchedule(abc.ABC):
    """A global batch size as a pure function of ``consumed`` samples (or tokens).

    Subclasses define :meth:`batch_size_at`, :meth:`next_change` and the
    ``initial``/``final`` sizes; everything else is derived. ``unit`` says
    whether ``consumed`` and the sizes count samples or tokens.
    """

    def __init__(self, unit: str = "samples") -> None:
        self._unit = _check_choice("unit", unit, UNITS)

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
    def to_config(self) -> dict[str, Any]:
        """Plain-Python description; :func:`make_schedule` rebuilds the schedule from it."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSizeSchedule) and self.to_config() == other.to_config()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.to_config().items())))

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
        consumed = _check_int("consumed", consumed, 0)
        size = self.batch_size_at(consumed)
        if proposed is not None:
            size = min(size, _check_int("proposed", proposed, 1))
        if exact_boundaries:
            change = self.next_change(consumed)
            if change is not None:
                size = min(size, change - consumed)
        return size

    def steps(
        self, consumed: int, until: int, *, exact_boundaries: bool = False
    ) -> Iterator[tuple[int, int]]:
        """Yield ``(consumed_at_step_start, step_size)`` for steps until ``until`` is reached."""
        consumed = _check_int("consumed", consumed, 0)
        until = _check_int("until", until, consumed)
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
        scheduled = self.batch_size_at(_check_int("consumed", consumed, 0))
        if autoscale_bounds is None:
            return scheduled, scheduled
        if not isinstance(autoscale_bounds, (tuple, list)) or len(autoscale_bounds) != 2:
            raise ValueError(
                f"autoscale_bounds must be a (min, max) pair, got {autoscale_bounds!r}"
            )
        low = _check_int("autoscale_bounds[0]", autoscale_bounds[0], 1)
        high = _check_int("autoscale_bounds[1]", autoscale_bounds[1], low)
        cap = min(high, scheduled)
        return min(low, cap), cap

    def lr_factor(self, consumed: int, rule: str = "sqrt", reference: str = "final") -> float:
        """LR factor coupling the learning rate to the scheduled size.

        ``rule`` is ``"linear"``, ``"sqrt"`` or ``"none"``; the factor is
        relative to the ``"final"`` (default: the LR is tuned for the final
        batch and is scaled down early in the ramp) or the ``"initial"`` size.
        If autoscale picks a smaller batch than scheduled, scale by the actual
        size instead (:func:`adaptive.data.tokens.planner.step_lr_factor`).
        """
        _check_choice("rule", rule, LR_RULES)
        _check_choice("reference", reference, LR_REFERENCES)
        base = self.final_batch_size if reference == "final" else self.initial_batch_size
        return step_lr_factor(self.batch_size_at(_check_int("consumed", consumed, 0)), base, rule)


class ConstantSchedule(BatchSizeSchedule):
    """The same global batch size throughout (no ramp)."""

    def __init__(self, batch_size: int, unit: str = "samples") -> None:
        super().__init__(unit)
        self._size = _check_int("batch_size", batch_size, 1)

    def batch_size_at(self, consumed: int) -> int:
        _check_int("consumed", consumed, 0)
        return self._size

    def next_change(self, consumed: int) -> int | None:
        _check_int("consumed", consumed, 0)
        return None

    @property
    def initial_batch_size(self) -> int:
        return self._size

    @property
    def final_batch_size(self) -> int:
        return self._size

    def to_config(self) -> dict[str, Any]:
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
        self._start = _check_int("start", start, 1)
        self._increment = _check_int("increment", increment, 1)
        self._rampup = _check_int("rampup", rampup, 1)
        self._target = _check_int("target", target, self._start)
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
        return self._start + self._increment * self._stage(_check_int("consumed", consumed, 0))

    def next_change(self, consumed: int) -> int | None:
        stage = self._stage(_check_int("consumed", consumed, 0))
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

    def to_config(self) -> dict[str, Any]:
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
        self._stages = parse_stages(stages) if isinstance(stages, str) else _check_stages(stages)
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
        return self._stages[self._index(_check_int("consumed", consumed, 0))][1]

    def next_change(self, consumed: int) -> int | None:
        index = self._index(_check_int("consumed", consumed, 0))
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

    def to_config(self) -> dict[str, Any]:
        return {"type": "staged", "stages": [list(s) for s in self._stages], "unit": self.unit}

    def __repr__(self) -> str:
        text = " ".join(f"{t}:{s}" for t, s in self._stages)
        return f"StagedSchedule({text!r}, unit={self.unit!r})"


def make_schedule(
    spec: BatchSizeSchedule | int | str | Mapping[str, Any], unit: str = "samples"
) -> BatchSizeSchedule:
    """Build a schedule from a user-facing spec.

    ``int`` -> :class:`ConstantSchedule`; ``str`` -> :class:`StagedSchedule`
    (``"0:64 200K:128"``) or a constant (``"256"``); a mapping from
    :meth:`BatchSizeSchedule.to_config` (``{"type": "linear", ...}``); a
    schedule is returned as is. ``unit`` applies where the spec has none.
    """
    if isinstance(spec, BatchSizeSchedule):
        return spec
    if isinstance(spec, str):
        if ":" not in spec:
            try:
                return ConstantSchedule(parse_count(spec), unit)
            except ValueError:
                raise ValueError(
                    f"batch-size schedule {spec!r} is neither a size nor stages; {_STAGES_HELP}"
                ) from None
        return StagedSchedule(spec, unit)
    if isinstance(spec, Mapping):
        return _from_config(spec, unit)
    if isinstance(spec, bool) or not hasattr(spec, "__index__"):
        raise TypeError(
            "batch-size schedule must be an int, a stages string such as '0:64 200K:128', "
            f"a config mapping or a BatchSizeSchedule, got {type(spec).__name__}"
        )
    return ConstantSchedule(spec, unit)


def _from_config(config: Mapping[str, Any], unit: str) -> BatchSizeSchedule:
    """Rebuild a schedule from :meth:`BatchSizeSchedule.to_config` output, checking the keys."""
    kinds = {"constant": ConstantSchedule, "linear": LinearRampup, "staged": StagedSchedule}
    kind = _check_choice("schedule config 'type'", config.get("type"), tuple(kinds))
    arguments = {k: v for k, v in config.items() if k != "type"}
    arguments.setdefault("unit", unit)
    parameters = inspect.signature(kinds[kind]).parameters
    required = {name for name, p in parameters.items() if p.default is inspect.Parameter.empty}
    unknown, missing = set(arguments) - set(parameters), required - set(arguments)
    if unknown or missing:
        raise TypeError(
            f"bad keys for a {kind!r} schedule config {dict(config)!r}: unknown "
            f"{sorted(unknown)}, missing {sorted(missing)}; expected {sorted(parameters)}"
        )
    schedule = kinds[kind](**arguments)
    logger.debug("%s", describe(schedule))
    return schedule


def describe(schedule: BatchSizeSchedule) -> str:
    """One log line: the stages (or the ramp) and the unit."""
    if isinstance(schedule, StagedSchedule):
        body = ", ".join(f"{s} from {t}" for t, s in schedule.stages)
    else:
        body = repr(schedule)
    return f"global batch size schedule in {schedule.unit}: {body}"
