"""The one validator of arguments: integers, numbers, choices and flags.

Every public constructor checks its arguments here, so that bad input
always reads the same way: a ``TypeError`` when the type is wrong, a
``ValueError`` when the value is out of range, and a message that names
the argument and what is allowed.  Pure Python and numpy (no torch).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Sequence

import numpy as np

__all__ = ["check_int", "check_float", "check_choice", "check_bool"]


def _is_bool(value: object) -> bool:
    return isinstance(value, (bool, np.bool_))  # np.bool_'s type name is "bool" in numpy 2, "bool_" before


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None,
              hint: str = "") -> int:
    """``value`` as a Python int (numpy integers accepted; bools refused).

    Args:
        name: the argument's name, as the caller's user wrote it.
        value: what was given.
        minimum, maximum: the allowed range, inclusive; None for no bound.
        hint: appended to the ValueError's message (what to do instead).
    """
    allowed = _range_text(minimum, maximum)
    if _is_bool(value):
        raise TypeError(f"{name} must be an integer{allowed}, got bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # any object: TypeError below
    except TypeError:
        raise TypeError(f"{name} must be an integer{allowed}, got {type(value).__name__} {value!r}") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be an integer{allowed}, got {number}{hint}")
    return number


def check_float(name: str, value: object, minimum: float | None = None, maximum: float | None = None, *,
                strict_minimum: bool = False) -> float:
    """``value`` as a finite Python float (ints accepted; bools refused).

    ``strict_minimum``: the value must be greater than ``minimum``, not equal.
    """
    low = "" if minimum is None else (f" > {minimum}" if strict_minimum else f" >= {minimum}")
    high = "" if maximum is None else f" <= {maximum}"
    allowed = low + ("," if low and high else "") + high
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number{allowed}, got {type(value).__name__} {value!r}")
    number = float(value)
    too_low = minimum is not None and (number <= minimum if strict_minimum else number < minimum)
    if not math.isfinite(number) or too_low or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be a finite number{allowed}, got {value!r}")
    return number


def check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    """``value`` if it is one of the strings ``allowed``."""
    choices = ", ".join(repr(choice) for choice in allowed)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {type(value).__name__} {value!r}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` as a Python bool (numpy bools accepted); anything else is a TypeError."""
    if _is_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _range_text(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""
