"""Ramp-up schedules from what a user writes: ``batch_size_schedule=`` specs, and log lines.

A spec is an int (a constant size), a string (``"256"``, or stages such as
``"0:64 200K:128"``), a mapping as :meth:`adaptive.batchsize.rampup.BatchSizeSchedule.spec`
returns it (``{"type": "linear", ...}``, e.g. from a config file) or a
schedule itself; :func:`make_schedule` turns any of them into a
:class:`~adaptive.batchsize.rampup.BatchSizeSchedule`, and :func:`describe`
says in one log line what it does.  Pure Python.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping

from adaptive._utils.checks import check_choice
from adaptive.batchsize.rampup import BatchSizeSchedule, ConstantSchedule, LinearRampup, StagedSchedule
from adaptive.batchsize.rampup_stages import STAGES_HELP, parse_count

__all__ = ["describe", "make_schedule"]

logger = logging.getLogger(__name__)

#: Each spec ``type`` and the constructor its other keys are passed to (each checks its arguments).
_KINDS: dict[str, Callable[..., BatchSizeSchedule]] = {
    "constant": ConstantSchedule, "linear": LinearRampup, "staged": StagedSchedule,
}  # fmt: skip


def make_schedule(
    spec: BatchSizeSchedule | int | str | Mapping[str, object], unit: str = "samples"
) -> BatchSizeSchedule:
    """Build a schedule from a user-facing spec.

    ``int`` -> :class:`ConstantSchedule`; ``str`` -> :class:`StagedSchedule`
    (``"0:64 200K:128"``) or a constant (``"256"``); a mapping from
    :meth:`BatchSizeSchedule.spec` (``{"type": "linear", ...}``); a
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
                    f"batch-size schedule {spec!r} is neither a size nor stages; {STAGES_HELP}"
                ) from None
        return StagedSchedule(spec, unit)
    if isinstance(spec, Mapping):
        return _from_spec(spec, unit)
    if isinstance(spec, bool) or not hasattr(spec, "__index__"):
        raise TypeError(
            "batch-size schedule must be an int, a stages string such as '0:64 200K:128', "
            f"a spec mapping or a BatchSizeSchedule, got {type(spec).__name__}"
        )
    return ConstantSchedule(spec, unit)


def _from_spec(spec: Mapping[str, object], unit: str) -> BatchSizeSchedule:
    """Build a schedule from a :meth:`BatchSizeSchedule.spec` mapping, checking the keys."""
    if "type" not in spec:
        raise ValueError(f"schedule spec {dict(spec)!r} has no 'type': one of {', '.join(map(repr, _KINDS))}")
    kind = check_choice("schedule spec 'type'", spec["type"], tuple(_KINDS))
    arguments = {k: v for k, v in spec.items() if k != "type"}
    arguments.setdefault("unit", unit)
    parameters = inspect.signature(_KINDS[kind]).parameters
    required = {name for name, p in parameters.items() if p.default is inspect.Parameter.empty}
    unknown, missing = set(arguments) - set(parameters), required - set(arguments)
    if unknown or missing:
        raise TypeError(
            f"bad keys for a {kind!r} schedule spec {dict(spec)!r}: unknown "
            f"{sorted(unknown)}, missing {sorted(missing)}; expected {sorted(parameters)}"
        )
    schedule = _KINDS[kind](**arguments)
    logger.debug("%s", describe(schedule))
    return schedule


def describe(schedule: BatchSizeSchedule) -> str:
    """One log line: the stages (or the ramp) and the unit."""
    if isinstance(schedule, StagedSchedule):
        body = ", ".join(f"{s} from {t}" for t, s in schedule.stages)
    else:
        body = repr(schedule)
    return f"global batch size schedule in {schedule.unit}: {body}"
