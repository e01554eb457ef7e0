"""The learning rate of each optimizer step follows that step's actual size.

A step's *shape* (micro-batch size x micro-steps x replicas) is what the
gradient-noise statistics and the model's LR scaling rule see
(:mod:`adaptive.batchsize.scaling_rules`): they scale the LR by the shape's size
relative to the reference size.  The actual step can be smaller than its
shape: a token-budget micro-batch holds fewer real tokens than its budget,
and the last step of an epoch holds what is left.  The loader therefore
gives every step a second factor, ``lr_scaling(actual / planned)``
(:func:`adaptive.batchsize.step_lr_rules.step_lr_factor`: ``"linear"``,
``"sqrt"`` or ``"none"``), and the two compose::

    lr = scheduler_lr x rule(planned / reference) x lr_scaling(actual / planned)

so with a linear rule and linear ``lr_scaling`` the LR is exactly
proportional to ``actual / reference``.  ``"auto"`` picks the family of the
model's rule (linear for AdaScale and linear scaling, square-root for
AdamScale, square-root scaling and LEGW, none for no scaling).

How it is applied: :class:`StepLRFactor` registers an optimizer step
pre-hook *before* the scaling rule's hooks and a post-hook *after* them.
Torch runs pre- and post-hooks in registration order, so the two pairs
nest: this factor multiplies the scheduler's LR first, the rule multiplies
on top, the rule restores the value it saw and this post-hook restores the
scheduler's value exactly (no division, so no rounding drift), ready for
the LR scheduler's next ``step()``.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from adaptive.batchsize.scaling_rules import ScalingRule
from adaptive.batchsize.step_lr_rules import LR_RULES, step_lr_factor
from adaptive.runtime.step import StepContext

__all__ = ["LR_SCALING", "StepLRFactor", "lr_factor_of", "resolve_lr_scaling"]

logger = logging.getLogger(__name__)

#: Accepted values of ``AdaptiveDataLoader(lr_scaling=...)``.
LR_SCALING = ("auto", *LR_RULES)

_FAMILY = {"adascale": "linear", "linear": "linear", "adamscale": "sqrt", "sqrt": "sqrt", "legw": "sqrt",
           "none": "none"}


def resolve_lr_scaling(spec: str, scaling_rule: ScalingRule | None) -> str:
    """``spec`` itself, or for ``"auto"`` the family of ``scaling_rule`` (``"none"`` without a model)."""
    if spec != "auto":
        return spec
    if scaling_rule is None:
        return "none"
    return _FAMILY.get(getattr(scaling_rule, "name", ""), "linear")


def lr_factor_of(step: StepContext | None, scaling_rule: ScalingRule | None) -> float:
    """The LR factor of ``step`` for its actual size, with ``"auto"`` following ``scaling_rule``; 1 without a step."""
    if step is None:
        return 1.0
    return step_lr_factor(max(step.size, 1), step.planned_size, resolve_lr_scaling(step.lr_scaling, scaling_rule))


class StepLRFactor:
    """Multiplies every parameter group's LR by ``factor()`` for one ``optimizer.step()``.

    Args:
        factor: returns the current step's factor (1.0 outside a loader loop).
    """

    def __init__(self, factor: Callable[[], float]) -> None:
        self._factor = factor
        self._optimizer: torch.optim.Optimizer | None = None
        self._saved: list[float | torch.Tensor] | None = None
        self._handles: list[RemovableHandle] = []
        self.last_factor = 1.0

    def attach_around(self, optimizer: torch.optim.Optimizer, attach_inner: Callable[[], None]) -> None:
        """Register the pre-hook, run ``attach_inner`` (which registers other hooks), then the post-hook."""
        if self._optimizer is not None:
            raise RuntimeError("this StepLRFactor is already attached to an optimizer")
        self._optimizer = optimizer
        self._handles.append(optimizer.register_step_pre_hook(self._pre_step))
        attach_inner()
        self._handles.append(optimizer.register_step_post_hook(self._post_step))

    def detach(self) -> None:
        """Remove the hooks (restoring the LR if a step was interrupted)."""
        self._restore()
        for handle in self._handles:
            handle.remove()
        self._handles, self._optimizer = [], None

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._restore()  # a previous step raised between the hooks
        factor = float(self._factor())
        if not (math.isfinite(factor) and factor >= 0):
            logger.warning("step LR factor %r is not a finite non-negative number; using 1", factor)
            factor = 1.0
        self.last_factor = factor
        if factor == 1.0:
            return
        self._saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._saved is None or self._optimizer is None:
            return
        for group, lr in zip(self._optimizer.param_groups, self._saved):
            group["lr"] = lr
        self._saved = None
