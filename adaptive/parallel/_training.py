"""What every adaptive model wrapper shares: argument checks, LR rules, accumulation.

:class:`~adaptive.AdaptiveDataParallel` (DDP) and
:class:`~adaptive.AdaptiveFSDP` (FSDP2) differ in how gradients are
reduced and how their state is saved; everything else is here, written
once:

* the checks of the optimizer, LR scheduler and grad scaler arguments;
* :class:`TrainedModel`, the face the data loader reads from the model it
  trains (``gns``, ``scaling_rule``, ``step_lr``, :meth:`gradient_divisor`)
  and the TensorBoard export;
* :func:`wire_optimizer`, the one place where an optimizer is wired to
  the steps the loader plans: the LR scaling rule and the step's LR factor
  as optimizer step hooks, and the accumulation rules of the ordinary
  loop: on every micro-step but the last ``optimizer.step()`` does
  nothing, and ``zero_grad()`` acts only on the first micro-step of each
  optimizer step.  (torch has no hook that can skip a step, so these two
  methods are wrapped on the optimizer instance.)
* :class:`TrainedModels`, the job's registry of wrappers, from which the
  loader reads what it needs of the models it trains (the gradient
  divisor of its loss weights, the gradient statistics its batch-size
  decisions use, the figures of its metrics).

What a step is reaches the wrappers one way only: the loader publishes a
:class:`~adaptive.runtime.step.StepContext` per micro-step, and the
optimizer hooks, the DDP synchronisation and the noise-scale measurement
read it (:func:`adaptive.runtime.step.current_step`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import weakref
from typing import Callable, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.lr_scheduler import LRScheduler

from adaptive.batchsize.gns import GradientNoiseScale, MeasureInterval, check_measure_interval
from adaptive.batchsize.scaling_rules import ScalingRule, make_scaling_rule
from adaptive.batchsize.step_lr import StepLRFactor, lr_factor_of
from adaptive.elastic import sync_points
from adaptive.runtime import env, membership, step_commit
from adaptive.runtime.job import current_job
from adaptive.runtime.step import StepContext, current_step, faulted, stream
from adaptive._utils.types import StateDict
from adaptive.observe.metrics import ScalarWriter, tensorboard_prefix

logger = logging.getLogger(__name__)

__all__ = ["TrainedModel", "TrainedModels", "TrainingParts", "check_optimizer", "check_lr_scheduler", "check_scaler",
           "check_name", "check_gns_interval", "is_accumulation_step", "is_continuing_accumulation",
           "trained_models", "wire_optimizer", "follow_regroups"]


def check_optimizer(optimizer: object, params: list[torch.nn.Parameter]) -> None:
    """``optimizer`` is a torch optimizer holding only parameters of the model (``params``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model_params = {id(p) for p in params}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in model_params:
                raise ValueError("optimizer holds parameters that are not in the model; build the optimizer "
                                 "from model.parameters() before wrapping")


def check_lr_scheduler(lr_scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    """``lr_scheduler`` is None or a scheduler stepping ``optimizer``."""
    if lr_scheduler is None:
        return
    methods = ("step", "state_dict", "load_state_dict")
    if not all(callable(getattr(lr_scheduler, method, None)) for method in methods):
        raise TypeError(f"lr_scheduler must be a torch.optim.lr_scheduler scheduler (or an object with step(), "
                        f"state_dict() and load_state_dict()), got {type(lr_scheduler).__name__} {lr_scheduler!r}")
    stepped = getattr(lr_scheduler, "optimizer", optimizer)
    if stepped is not optimizer:
        raise ValueError("lr_scheduler steps another optimizer than the one given; build it from the same optimizer")


def check_scaler(scaler: object) -> None:
    """``scaler`` is None or a ``torch.amp.GradScaler``-like object."""
    if scaler is None:
        return
    methods = ("scale", "step", "update", "state_dict", "load_state_dict")
    if not all(callable(getattr(scaler, method, None)) for method in methods):
        hint = (" (the fourth positional argument is scaler; pass the checkpoint name as name=...)"
                if isinstance(scaler, str) else "")
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__} {scaler!r}{hint}")


def check_name(name: object) -> str:
    """A wrapper's checkpoint name: a non-empty string."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    return name


def check_gns_interval(gns_interval: object) -> MeasureInterval:
    """Optimizer steps between noise measurements: an int >= 1, or ``"auto"``."""
    return check_measure_interval("gns_interval", gns_interval)


# ---------------------------------------------------------------- checkpointed companions of the model
class TrainingParts:
    """The LR scheduler, grad scaler, noise-scale and scaling-rule state both wrappers checkpoint.

    Their state dicts sit at the top level of the wrapper's checkpointed
    state, under ``gns``, ``scaling_rule``, ``lr_scheduler`` and ``scaler``
    (these two when given); a part missing from a checkpoint starts fresh, with a
    warning.  The optimizer's own state is the wrapper's; its parameter
    groups' hyperparameters are in the live copy (see :meth:`live_copy`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lr_scheduler: LRScheduler | None,
                 scaler: torch.amp.GradScaler | None, gns: GradientNoiseScale, scaling_rule: ScalingRule) -> None:
        self._optimizer = optimizer
        self._parts: dict[str, Stateful | None] = {"gns": gns, "scaling_rule": scaling_rule,
                                                   "lr_scheduler": lr_scheduler, "scaler": scaler}

    def state_dict(self) -> StateDict:
        return {key: part.state_dict() for key, part in self._parts.items() if part is not None}

    def load_state_dict(self, state: StateDict) -> None:
        for key, part in self._parts.items():
            if part is None:
                continue
            if key not in state:
                logger.warning("the checkpoint has no %s state; %s starts fresh", key, key)
                continue
            part.load_state_dict(state[key])

    def live_copy(self) -> StateDict:
        """Live mode: the parts copied at each committed step (:meth:`adaptive.checkpoint.states.State.live_copy`):
        all of them are small; the weights and the optimizer state they go with are not copied.

        The optimizer's hyperparameters (each group's ``lr``, ``momentum``...)
        are: the LR scheduler of a step that is trained again (a lost member
        discarded it) set them when the script stepped it, and a scheduler
        that scales the current value (``StepLR``, ``ExponentialLR``) would
        scale it again when the step is trained again.
        """
        hyperparameters = [{key: value for key, value in group.items() if key != "params"}
                           for group in self._optimizer.param_groups]
        return copy.deepcopy({"parts": self.state_dict(), "param_groups": hyperparameters})

    def restore_live_copy(self, saved: object) -> None:
        """Go back to what :meth:`live_copy` returned."""
        assert isinstance(saved, dict)
        saved = copy.deepcopy(saved)
        self.load_state_dict(saved["parts"])
        for group, hyperparameters in zip(self._optimizer.param_groups, saved["param_groups"]):
            group.update(hyperparameters)


# ---------------------------------------------------------------- the step, as the loader published it
def is_accumulation_step() -> bool:
    """A micro-step that is not the last of its optimizer step (False outside loader loops)."""
    step = current_step()
    return step is not None and step.is_accumulation_step


def is_continuing_accumulation() -> bool:
    """A micro-step that is not the first of its optimizer step (False outside loader loops)."""
    step = current_step()
    return step is not None and step.continues_accumulation


def _skip_during_accumulation(optimizer: torch.optim.Optimizer, method: str, skip: Callable[[], bool],
                              ran: Callable[[], None] | None = None) -> None:
    """Make ``optimizer.<method>()`` a no-op while ``skip()`` holds; call ``ran()`` after each real call."""
    original = getattr(optimizer, method)

    @functools.wraps(original)
    def wrapper(*args: object, **kwargs: object) -> object:
        if skip():
            return None
        result = original(*args, **kwargs)
        if ran is not None:
            ran()
        return result

    setattr(optimizer, method, wrapper)


def _skips_update() -> bool:
    """Whether ``optimizer.step()`` does nothing now: a micro-step inside an accumulation, a step that lost a
    peer, or, in a live job, a step not every member completed (the members agree on it first,
    :mod:`adaptive.runtime.step_commit`)."""
    if is_accumulation_step():
        return True
    if step_commit.is_voting():
        return not step_commit.agree()
    return faulted()


def _count_optimizer_step() -> None:
    """An optimizer step ran (the loader tells a peek at a batch from a trained step by it)."""
    stream().optimizer_steps += 1


def wire_optimizer(optimizer: torch.optim.Optimizer, scaling_rule: ScalingRule, gns: GradientNoiseScale) -> StepLRFactor:
    """Attach the scaling rule and the step's LR factor to ``optimizer``, and the accumulation rules.

    The step's LR factor (its actual over its planned size, by the loader's
    ``lr_scaling``; ``"auto"`` follows ``scaling_rule``) nests around the
    rule's hooks.  Returns the attached :class:`StepLRFactor`.
    """
    step_lr = StepLRFactor(lambda: lr_factor_of(current_step(), scaling_rule))
    step_lr.attach_around(optimizer, lambda: scaling_rule.attach(optimizer, gns))
    _skip_during_accumulation(optimizer, "step", _skips_update, ran=_count_optimizer_step)
    _skip_during_accumulation(optimizer, "zero_grad", is_continuing_accumulation)
    return step_lr


class FollowsRegroups(Protocol):
    """A wrapper that rebuilds its reduction when a live membership change rebuilt the process group."""

    def _follow_regroup(self) -> None:
        """Move onto the new process group."""


def follow_regroups(model: FollowsRegroups) -> None:
    """Call ``model._follow_regroup()`` whenever a live membership change rebuilt the process group.

    Held weakly: a wrapper the script dropped is not kept alive for it.
    """
    ref = weakref.WeakMethod(model._follow_regroup)

    def listener() -> None:
        method = ref()
        if method is not None:
            method()

    membership.on_regroup(listener)


# ---------------------------------------------------------------- the wrappers' shared face
@dataclasses.dataclass
class TrainedModels:
    """The wrappers of this job: their record on the job context (:mod:`adaptive.runtime.job`)."""

    latest: TrainedModel | None = None  # the most recently created wrapper
    every: weakref.WeakSet[TrainedModel] = dataclasses.field(default_factory=weakref.WeakSet)  # every live one


def trained_models() -> TrainedModels:
    """This job's wrappers."""
    return current_job().part(TrainedModels)


class TrainedModel:
    """Mixin of the adaptive model wrappers: what the loader and the tools read from them.

    A wrapper sets ``optimizer``, ``lr_scheduler``, ``scaler``, ``gns``,
    ``scaling_rule`` and ``step_lr`` and then calls :meth:`_register_with_job`.
    """

    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler | None
    scaler: torch.amp.GradScaler | None
    gns: GradientNoiseScale
    scaling_rule: ScalingRule
    step_lr: StepLRFactor

    def _make_gns_and_rule(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                           scaling_rule: str | ScalingRule | None,
                           gns_interval: MeasureInterval) -> None:
        self.gns = GradientNoiseScale(optimizer, grad_scaler=scaler, measure_interval=gns_interval)
        self.scaling_rule = make_scaling_rule(scaling_rule, optimizer)

    def _register_with_job(self) -> None:
        """The loader reads the models it trains from the job's registry; stops are caught from now on."""
        self._configured_for: tuple[str, int] | None = None  # the loader step whose configuration the noise scale has
        models = trained_models()
        models.latest = self
        models.every.add(self)
        sync_points.install_signal_handlers()

    def _follow_step(self) -> StepContext | None:
        """The step being trained; its batch configuration goes to the noise-scale measurement.

        Called at each forward: the measurement follows the step the loader
        published (a no-op while the configuration is unchanged; not under
        ``no_grad``, where nothing is measured).
        """
        step = current_step()
        if step is not None and (step.loader, step.index) != self._configured_for and torch.is_grad_enabled():
            self._configured_for = (step.loader, step.index)  # once per step: its micro-steps share the configuration
            self.gns.set_batch_config(init_batch_size=step.init_batch_size, local_bsz=step.local_batch_size,
                                      accum_steps=step.num_micro_steps, num_replicas=step.num_replicas,
                                      batch_size=step.planned_size)  # 128 on 3 replicas, not 3 x 42
        return step

    def gradient_divisor(self, micro_steps: int) -> int:
        """What the reduction divides the gradient summed over replicas and micro-steps by.

        The gradient reduction averages over replicas and the noise-scale
        measurement (:meth:`adaptive.batchsize.gns.GradientNoiseScale.attach`)
        over the step's ``micro_steps``; the loader uses this to weight
        losses so a step's gradient is a mean over its samples or tokens.
        """
        return env.num_replicas() * micro_steps

    def to_tensorboard(self, writer: ScalarWriter, step: int, *, tag_prefix: str = "") -> None:
        """Write the gradient statistics and LR scaling as TensorBoard scalars.

        Tags are ``<tag_prefix>noise_scale``, ``grad_sqr``, ``grad_var`` (once
        the noise is measured), ``gain``, ``lr_factor`` and ``progress``; the
        default prefix is ``adaptive/`` and a ``/`` is appended to a prefix
        that lacks one (see :func:`adaptive.observe.metrics.tensorboard_prefix`).
        """
        prefix = tensorboard_prefix(tag_prefix)
        values = {"gain": self.scaling_rule.last_gain, "lr_factor": self.scaling_rule.last_factor,
                  "progress": self.scaling_rule.progress}
        if self.gns.to_grad_params() is not None:
            values = {"noise_scale": self.gns.noise_scale(), "grad_sqr": self.gns.sqr_avg(),
                      "grad_var": self.gns.var_avg(), **values}
        for key, value in values.items():
            if math.isfinite(value):
                writer.add_scalar(f"{prefix}{key}", value, step)
