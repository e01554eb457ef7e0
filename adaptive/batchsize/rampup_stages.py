"""Ramp-up stages as text: counts such as ``"200K"`` and stages such as ``"0:64 200K:128 1M:256"``.

The textual form of a :class:`adaptive.batchsize.rampup.StagedSchedule`
(what ``AdaptiveDataLoader(batch_size_schedule="0:64 200K:128")`` and the
command line accept), and the validation of stages given as
``(threshold, size)`` pairs.  Errors name the bad token and say what is
allowed.  Pure Python.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

from adaptive._utils.checks import check_int

__all__ = ["STAGES_HELP", "check_stages", "parse_count", "parse_stages"]

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([KMG]?)$", re.IGNORECASE)

#: What a stages string looks like (appended to every parse error).
STAGES_HELP = (
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
        raise ValueError(f"batch-size schedule {text!r} is empty; {STAGES_HELP}")
    stages: list[tuple[int, int]] = []
    for token in tokens:
        stages.append(_parse_stage(token, stages[-1][0] if stages else None))
    return stages


def _parse_stage(token: str, previous: int | None) -> tuple[int, int]:
    """Parse one ``THRESHOLD:SIZE`` token, checking it against the previous threshold."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"batch-size schedule token {token!r}: {problem}; {STAGES_HELP}")

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


def check_stages(stages: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Validate ``(threshold, size)`` pairs: first threshold 0, strictly increasing, sizes >= 1."""
    if not stages:
        raise ValueError("a staged schedule needs at least one (threshold, size) stage")
    out: list[tuple[int, int]] = []
    for position, stage in enumerate(stages):
        if len(stage) != 2:
            raise ValueError(f"stage {position} must be a (threshold, size) pair, got {stage!r}")
        threshold = check_int(f"threshold of stage {position}", stage[0], 0)
        size = check_int(f"size of stage {position} (at {threshold})", stage[1], 1)
        if position == 0 and threshold != 0:
            raise ValueError(f"the first stage must start at 0 consumed, got {threshold}")
        if out and threshold <= out[-1][0]:
            raise ValueError(
                f"thresholds must be strictly increasing: {threshold} follows {out[-1][0]}"
            )
        out.append((threshold, size))
    return out
