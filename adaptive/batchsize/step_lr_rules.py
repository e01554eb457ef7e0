"""The per-step learning-rate factor: how the LR follows a step's actual size.

A step can hold more or fewer samples (or tokens) than the size the base
learning rate was tuned for: a token-budget step holds a varying number of
real tokens, a ramp-up schedule grows the global batch, and the last step
of an epoch holds what is left.  :func:`step_lr_factor` turns the ratio of
the two sizes into an LR multiplier by one of :data:`LR_RULES`:
``"linear"`` (SGD-style), ``"sqrt"`` (Adam-style) or ``"none"``.

The factor multiplies the LR the user's scheduler produces, so the two
compose.  The ramp-up schedules (:meth:`adaptive.batchsize.rampup.
BatchSizeSchedule.lr_factor`) and the loader use it; applying it to an
optimizer is :class:`adaptive.batchsize.step_lr.StepLRFactor`.  Pure
Python (no torch), so the planning side stays importable without torch.
"""

from __future__ import annotations

import math

from adaptive._utils.checks import check_choice, check_float

__all__ = ["LR_RULES", "step_lr_factor"]

#: How the LR follows the ratio of a step's size to the reference size.
LR_RULES = ("linear", "sqrt", "none")


def step_lr_factor(actual_size: float, reference_size: float, rule: str = "linear") -> float:
    """Learning-rate factor for a step of ``actual_size`` relative to ``reference_size``.

    ``"linear"``: ``actual / reference`` (SGD-style); ``"sqrt"``:
    ``sqrt(actual / reference)`` (Adam-style); ``"none"``: 1. Sizes are in
    the same unit (real tokens or samples of the step), both positive and
    finite. Multiply the LR the user's scheduler produces by this factor, so
    both compose.
    """
    check_choice("rule", rule, LR_RULES)
    actual = check_float("actual_size", actual_size, 0, strict_minimum=True)
    reference = check_float("reference_size", reference_size, 0, strict_minimum=True)
    if rule == "none":
        return 1.0
    ratio = actual / reference
    return ratio if rule == "linear" else math.sqrt(ratio)
