"""Learning-rate scaling rules for batch sizes that change during training.

When the global batch is ``scale`` times the reference batch (the user's
``batch_size``), a rule multiplies every parameter group's learning rate by
a factor for that optimizer step:

==============  ==============================================================
rule            factor
==============  ==============================================================
``AdaScale``    ``gain(scale)`` (AdaScale; for SGD-like optimizers)
``AdamScale``   ``sqrt(gain(scale))`` (square-root AdaScale; Adam-like)
``LinearScale`` ``scale``
``SqrtScale``   ``sqrt(scale)``
``LEGW``        ``sqrt(scale)`` times a linear warm-up whose length in
                samples grows linearly with ``scale``
``NoScaling``   ``1``
==============  ==============================================================

``gain(scale) = (var + sqr) / (var / scale + sqr)`` comes from the
gradient noise scale (:class:`adaptive.batchsize.gns.GradientNoiseScale`).
:meth:`ScalingRule.attach` registers the optimizer's step pre- and
post-hooks: the pre-hook multiplies each group's ``lr`` just before the
update and the post-hook restores it, so the user's
``optimizer.step()`` calls stay unchanged and an LR scheduler keeps
setting the *base* learning rate.  Every step adds ``gain(scale)`` to the
scale-invariant *progress* (the number of reference-batch steps the
training is worth), which is checkpointed with :meth:`~ScalingRule.state_dict`.

Only optimizer steps that actually run count: a step skipped by an AMP
``GradScaler`` (overflow) neither scales nor adds progress, and under
gradient accumulation the real ``step`` must run once per accumulated
batch, not per micro-batch.  Reading the gain costs one small host copy of
the gradient statistics per step.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from typing import Mapping, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from adaptive._utils.checks import check_float
from adaptive._utils.types import StateDict
from adaptive.checkpoint.versions import UNVERSIONED, check_fields, read_state
from adaptive.goodput.noise_estimate import BatchConfig

__all__ = [
    "GainSource",
    "ScalingRule",
    "AdaScale",
    "AdamScale",
    "LinearScale",
    "SqrtScale",
    "LEGW",
    "NoScaling",
    "RULES",
    "default_scaling_rule",
    "make_scaling_rule",
]

logger = logging.getLogger(__name__)

_STATE_FIELDS = ("name", "progress", "steps", "samples", "last_factor", "last_gain")

#: Optimizers with per-coordinate adaptive step sizes get square-root rules.
_ADAPTIVE_OPTIMIZERS = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "Adafactor")
    if hasattr(torch.optim, name))


class GainSource(Protocol):
    """What a rule needs from the gradient statistics (a GradientNoiseScale)."""

    @property
    def scale(self) -> float:
        """Current global batch over the reference batch."""

    @property
    def config(self) -> BatchConfig | None:
        """Batch configuration with ``global_batch_size`` and ``init_batch_size`` (or None)."""

    def gain(self, scale: float | None = None) -> float:
        """Gain ratio at ``scale``."""


class ScalingRule(ABC):
    """Base class: multiplies learning rates by :meth:`factor` at every step."""

    #: Short name accepted by :func:`make_scaling_rule`.
    name = "base"
    #: Format of :meth:`state_dict` (1: the progress counters; release 0.1 wrote them without a version).
    version = 1

    def __init__(self) -> None:
        self._optimizer: torch.optim.Optimizer | None = None
        self._gns: GainSource | None = None
        self._handles: list[RemovableHandle] = []
        self._saved_lrs: list[float | torch.Tensor] | None = None
        self._step_gain = 1.0
        self._step_factor = 1.0
        self._step_samples = 0
        self.progress = 0.0
        self.steps = 0
        self.samples = 0
        self.last_factor = 1.0
        self.last_gain = 1.0

    @abstractmethod
    def factor(self, scale: float, gain: float) -> float:
        """LR multiplier for a step at ``scale`` whose gain ratio is ``gain``."""

    # ------------------------------------------------------------ wiring
    def attach(self, optimizer: torch.optim.Optimizer, gns: GainSource) -> None:
        """Scale ``optimizer``'s learning rates from now on, using ``gns``."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self._optimizer is not None:
            raise RuntimeError(f"{type(self).__name__} is already attached to an optimizer")
        self._optimizer, self._gns = optimizer, gns
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    def detach(self) -> None:
        """Remove the hooks (restoring learning rates if a step was interrupted)."""
        self._restore()
        for handle in self._handles:
            handle.remove()
        self._handles, self._optimizer, self._gns = [], None, None

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._restore()  # a previous step raised before its post-hook
        gns = self._gns
        scale = gns.scale if gns is not None else 1.0
        gain = gns.gain(scale) if gns is not None else 1.0
        factor = float(self.factor(scale, gain))
        if not (math.isfinite(factor) and factor >= 0):
            logger.warning("%s gave LR factor %r at scale %.3g; using 1", type(self).__name__, factor, scale)
            factor = 1.0
        self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        config = getattr(gns, "config", None) if gns is not None else None
        self._step_samples = config.global_batch_size if config is not None else 0
        self._step_gain, self._step_factor = gain, factor

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        self._restore()
        self.progress += self._step_gain
        self.steps += 1
        self.samples += self._step_samples
        self.last_factor, self.last_gain = self._step_factor, self._step_gain

    def _restore(self) -> None:
        if self._saved_lrs is None or self._optimizer is None:
            return
        for group, lr in zip(self._optimizer.param_groups, self._saved_lrs):
            group["lr"] = lr
        self._saved_lrs = None

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> StateDict:
        """Progress counters as plain numbers, format :attr:`version`."""
        return {"version": self.version, "name": self.name, "progress": self.progress, "steps": self.steps,
                "samples": self.samples, "last_factor": self.last_factor, "last_gain": self.last_gain}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict` (also one of another rule: its progress carries over)."""
        fields = read_state("scaling rule", state, self, unversioned=UNVERSIONED)
        check_fields("scaling rule state", fields, _STATE_FIELDS, optional=("base_warmup_steps",))
        if fields["name"] != self.name:
            logger.warning("restoring %s progress into a %s rule", fields["name"], self.name)
        self.progress = float(fields["progress"])
        self.steps = int(fields["steps"])
        self.samples = int(fields["samples"])
        self.last_factor = float(fields["last_factor"])
        self.last_gain = float(fields["last_gain"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AdaScale(ScalingRule):
    """AdaScale: LR times the gain ratio (SGD and SGD with momentum)."""

    name = "adascale"

    def factor(self, scale: float, gain: float) -> float:
        return gain


class AdamScale(ScalingRule):
    """Square-root AdaScale for Adam-type optimizers: LR times ``sqrt(gain)``.

    Adam normalises the update by the gradient's second moment, so a
    gradient whose noise shrinks by ``gain`` behaves like a square-root
    rather than linear change of the step size.  The betas are unchanged.
    """

    name = "adamscale"

    def factor(self, scale: float, gain: float) -> float:
        return math.sqrt(gain)


class LinearScale(ScalingRule):
    """Linear scaling: LR times the batch scale."""

    name = "linear"

    def factor(self, scale: float, gain: float) -> float:
        return scale


class SqrtScale(ScalingRule):
    """Square-root scaling: LR times ``sqrt(scale)``."""

    name = "sqrt"

    def factor(self, scale: float, gain: float) -> float:
        return math.sqrt(scale)


class NoScaling(ScalingRule):
    """Leave the learning rate alone (progress is still counted)."""

    name = "none"

    def factor(self, scale: float, gain: float) -> float:
        return 1.0


class LEGW(ScalingRule):
    """Linear-epoch gradual warm-up: ``sqrt(scale)`` after a warm-up that lasts
    ``base_warmup_steps * init_batch_size * scale`` samples.

    During warm-up the factor rises linearly with the samples trained
    (counting the current step) towards ``sqrt(scale)``; at the reference
    batch the warm-up lasts ``base_warmup_steps`` steps.

    Args:
        base_warmup_steps: warm-up length in optimizer steps at the
            reference batch size (>= 0).
    """

    name = "legw"

    def __init__(self, base_warmup_steps: float) -> None:
        super().__init__()
        self.base_warmup_steps = check_float("base_warmup_steps", base_warmup_steps, 0.0)

    def factor(self, scale: float, gain: float) -> float:
        config = getattr(self._gns, "config", None)
        init = config.init_batch_size if config is not None else 1
        warmup = self.base_warmup_steps * init * scale
        if warmup <= 0:
            return math.sqrt(scale)
        done = self.samples + scale * init
        return math.sqrt(scale) * min(1.0, done / warmup)

    def state_dict(self) -> StateDict:
        return dict(super().state_dict(), base_warmup_steps=self.base_warmup_steps)

    def __repr__(self) -> str:
        return f"LEGW(base_warmup_steps={self.base_warmup_steps:g})"


#: Rules constructible by name without arguments.
RULES = {cls.name: cls for cls in (AdaScale, AdamScale, LinearScale, SqrtScale, NoScaling)}


def default_scaling_rule(optimizer: torch.optim.Optimizer) -> ScalingRule:
    """AdamScale for adaptive optimizers (Adam, AdamW, RMSprop, ... or any
    with ``betas`` in its groups), AdaScale otherwise (SGD, ...)."""
    adaptive = isinstance(optimizer, _ADAPTIVE_OPTIMIZERS) or any(
        "betas" in group for group in optimizer.param_groups)
    return AdamScale() if adaptive else AdaScale()


def make_scaling_rule(spec: None | str | ScalingRule, optimizer: torch.optim.Optimizer) -> ScalingRule:
    """A rule from ``None`` (the default for ``optimizer``), a name in
    :data:`RULES` or an instance (returned as is)."""
    if spec is None:
        return default_scaling_rule(optimizer)
    if isinstance(spec, ScalingRule):
        return spec
    if isinstance(spec, str):
        key = spec.strip().lower()
        if key in RULES:
            return RULES[key]()
        if key == LEGW.name:
            raise ValueError("the 'legw' rule needs its warm-up length: pass LEGW(base_warmup_steps=...)")
        raise ValueError(f"unknown scaling rule {spec!r}; choose one of {sorted(RULES) + ['legw']} "
                         "or pass a ScalingRule instance")
    raise TypeError(f"scaling rule must be None, a name or a ScalingRule, got {type(spec).__name__}")
