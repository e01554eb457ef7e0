"""AdaptiveDataParallel: DistributedDataParallel whose training state survives restarts.

The model, optimizer, LR scheduler and AMP grad scaler are checkpointed
together with the loaders, epochs and accumulators, and restored when the
wrapper is created after a restart (guarantee G3).  It accepts every
argument ``DistributedDataParallel`` does.

It also measures the gradient noise scale (``model.gns``, see
:mod:`adaptive.batchsize.gns`) and scales the learning rate at every optimizer step by
a scaling rule (``model.scaling_rule``, see :mod:`adaptive.batchsize.scaling_rules`),
so that the loader can change the batch size while training.  When the
loader runs gradient accumulation, the wrapper makes the ordinary loop do
the right thing: on every micro-step but the last, the backward pass skips
the all-reduce and ``optimizer.step()`` does nothing; ``zero_grad()`` acts
only on the first micro-step of each optimizer step.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from adaptive.checkpoint import states
from adaptive.elastic import collectives
from adaptive.elastic.job import current_job
from adaptive.elastic import env
from adaptive.elastic import sync_points
from adaptive.batchsize.gns import GradientNoiseScale
from adaptive.observe.metrics import tensorboard_prefix
from adaptive.batchsize.scaling_rules import ScalingRule, make_scaling_rule
from adaptive.batchsize.step_lr import StepLRFactor

__all__ = ["AdaptiveDataParallel"]

logger = logging.getLogger(__name__)


class _AdaptiveDataParallelState(states.State):
    """Model, optimizer, LR scheduler and grad scaler, saved as one unit."""

    def __init__(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, scaler: Any, gns: GradientNoiseScale, scaling_rule: ScalingRule) -> None:
        super().__init__(name)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.gns = gns
        self.scaling_rule = scaling_rule

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "gns": self.gns.state_dict(), "scaling_rule": self.scaling_rule.state_dict()}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for key, target in (("lr_scheduler", self.lr_scheduler), ("scaler", self.scaler), ("gns", self.gns),
                            ("scaling_rule", self.scaling_rule)):
            if target is None:
                continue
            if key not in state:
                logger.warning("the checkpoint has no %s state; %s starts fresh", key, key)
                continue
            target.load_state_dict(state[key])


def _check_optimizer(optimizer: Any, module: torch.nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model_params = {id(p) for p in module.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in model_params:
                raise ValueError("optimizer holds parameters that are not in the model; build the optimizer "
                                 "from model.parameters() before wrapping")


def _check_lr_scheduler(lr_scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    if lr_scheduler is None:
        return
    methods = ("step", "state_dict", "load_state_dict")
    if not all(callable(getattr(lr_scheduler, method, None)) for method in methods):
        raise TypeError(f"lr_scheduler must be a torch.optim.lr_scheduler scheduler (or an object with step(), "
                        f"state_dict() and load_state_dict()), got {type(lr_scheduler).__name__} {lr_scheduler!r}")
    stepped = getattr(lr_scheduler, "optimizer", optimizer)
    if stepped is not optimizer:
        raise ValueError("lr_scheduler steps another optimizer than the one given; build it from the same optimizer")


def _check_scaler(scaler: Any) -> None:
    if scaler is None:
        return
    methods = ("scale", "step", "update", "state_dict", "load_state_dict")
    if not all(callable(getattr(scaler, method, None)) for method in methods):
        hint = (" (the fourth positional argument is scaler; pass the checkpoint name as name=...)"
                if isinstance(scaler, str) else "")
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__} {scaler!r}{hint}")


class AdaptiveDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` plus checkpointing of the whole training state.

    Args:
        module: the model, as for DDP.
        optimizer: its optimizer.
        lr_scheduler: an LR scheduler stepping that optimizer, if any.
        scaler: a ``torch.amp.GradScaler``, if AMP is used.
        scaling_rule: how the learning rate follows the batch size:
            ``"adascale"``, ``"adamscale"`` (square-root AdaScale for Adam),
            ``"linear"``, ``"sqrt"``, ``"none"``, or a
            :class:`~adaptive.batchsize.scaling_rules.ScalingRule` such as
            ``LEGW(base_warmup_steps=...)``; default chosen from
            the optimizer (AdamScale for Adam-type, AdaScale otherwise).
        name: checkpoint name; give distinct names when a job trains
            several models.
        gns_interval: measure the gradient noise every this many optimizer
            steps (>= 1, default 4).  A measured step reads the gradients
            about twice more (their norms before and after the
            all-reduce), which shows on CPUs and for small models; the
            noise scale changes slowly, so every few steps is enough (the
            moving averages weigh each measurement for the steps since
            the last one).
        **kwargs: passed to ``DistributedDataParallel`` (``device_ids``,
            ``find_unused_parameters``, ``bucket_cap_mb``, ...).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any = None, scaler: Any = None, *, scaling_rule: Any = None,
                 name: str = "model", gns_interval: int = 4, **kwargs: Any) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        _check_optimizer(optimizer, module)
        _check_lr_scheduler(lr_scheduler, optimizer)
        _check_scaler(scaler)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if isinstance(gns_interval, bool) or not isinstance(gns_interval, int) or gns_interval < 1:
            raise ValueError(f"gns_interval must be an int >= 1 (optimizer steps), got {gns_interval!r}")
        if not collectives.is_initialized():
            if env.num_replicas() > 1:
                raise RuntimeError("call adaptive.init_process_group(backend) before AdaptiveDataParallel")
            collectives.init_process_group("nccl" if next(module.parameters()).is_cuda else "gloo")
        super().__init__(module, **kwargs)
        self._replicas = torch.distributed.get_world_size(self.process_group)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.gns = GradientNoiseScale(optimizer, grad_scaler=scaler, measure_interval=gns_interval)
        self.gns.attach(self, is_last_micro_step=lambda: not _is_accumulation_step())
        self.scaling_rule = make_scaling_rule(scaling_rule, optimizer)
        # The loader's per-step LR factor (actual / planned step size) nests around the rule's hooks.
        self.step_lr = StepLRFactor(_loader_lr_factor)
        self.step_lr.attach_around(optimizer, lambda: self.scaling_rule.attach(optimizer, self.gns))
        _skip_during_accumulation(optimizer, "step", _is_accumulation_step)
        _skip_during_accumulation(optimizer, "zero_grad", _is_continuing_accumulation)
        self._state = _AdaptiveDataParallelState(f"adaptive.parallel.{name}", self.module, optimizer,
                                                 lr_scheduler, scaler, self.gns, self.scaling_rule)
        training = current_job().training  # the loader configures and reads every model it trains
        training.model = self
        training.models.add(self)
        sync_points.install_signal_handlers()
        if states.load_state(self._state) and env.rank() == 0:
            logger.info("restored model, optimizer%s%s from the checkpoint",
                        ", LR scheduler" if lr_scheduler is not None else "",
                        ", grad scaler" if scaler is not None else "")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Exactly what ``no_sync()`` does, decided per micro-step by the loader.  With one
        # replica there is nothing to reduce: DDP's bucket copies are skipped altogether.
        self.require_backward_grad_sync = self._replicas > 1 and not _is_accumulation_step()
        return super().forward(*inputs, **kwargs)

    def to_tensorboard(self, writer: Any, step: int, *, tag_prefix: str = "") -> None:
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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, except in the middle of an accumulation."""
        if not _is_continuing_accumulation():
            super().zero_grad(set_to_none=set_to_none)

    def gradient_divisor(self, micro_steps: int) -> int:
        """What the reduction divides the gradient summed over replicas and micro-steps by.

        DDP averages over replicas and the noise-scale measurement
        (:meth:`adaptive.batchsize.gns.GradientNoiseScale.attach`) over the step's
        ``micro_steps``; the loader
        uses this to weight losses so a step's gradient is a mean over its tokens.
        """
        return env.num_replicas() * micro_steps


def _loader_lr_factor() -> float:
    """The running loader's LR factor for the current step (1 outside loader loops)."""
    loader = current_job().training.loop
    return 1.0 if loader is None else loader.lr_factor


def _micro_step() -> tuple[int, int] | None:
    loader = current_job().training.loop
    return None if loader is None else loader.micro_step


def _is_accumulation_step() -> bool:
    """A micro-step that is not the last of its optimizer step."""
    micro = _micro_step()
    return micro is not None and micro[0] < micro[1] - 1


def _is_continuing_accumulation() -> bool:
    """A micro-step that is not the first of its optimizer step."""
    micro = _micro_step()
    return micro is not None and micro[0] > 0


def _skip_during_accumulation(optimizer: torch.optim.Optimizer, method: str, skip: Callable[[], bool]) -> None:
    """Make ``optimizer.<method>()`` a no-op while ``skip()`` holds."""
    original = getattr(optimizer, method)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if skip():
            return None
        return original(*args, **kwargs)

    setattr(optimizer, method, wrapper)
