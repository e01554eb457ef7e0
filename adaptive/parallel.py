"""AdaptiveDataParallel: DistributedDataParallel whose training state survives restarts.

The model, optimizer, LR scheduler and AMP grad scaler are checkpointed
together with the loaders, epochs and accumulators, and restored when the
wrapper is created after a restart (guarantee G3).  It accepts every
argument ``DistributedDataParallel`` does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from adaptive import checkpoint, collectives, env

__all__ = ["AdaptiveDataParallel"]

logger = logging.getLogger(__name__)


class _AdaptiveDataParallelState(checkpoint.State):
    """Model, optimizer, LR scheduler and grad scaler, saved as one unit."""

    def __init__(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, scaler: Any) -> None:
        super().__init__(name)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for key, target in (("lr_scheduler", self.lr_scheduler), ("scaler", self.scaler)):
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


class AdaptiveDataParallel(DistributedDataParallel):
    """``DistributedDataParallel`` plus checkpointing of the whole training state.

    Args:
        module: the model, as for DDP.
        optimizer: its optimizer.
        lr_scheduler: an LR scheduler stepping that optimizer, if any.
        scaler: a ``torch.amp.GradScaler``, if AMP is used.
        name: checkpoint name; give distinct names when a job trains
            several models.
        **kwargs: passed to ``DistributedDataParallel`` (``device_ids``,
            ``find_unused_parameters``, ``bucket_cap_mb``, ...).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any = None, scaler: Any = None, *, name: str = "model", **kwargs: Any) -> None:
        _check_optimizer(optimizer, module)
        if not collectives.is_initialized():
            if env.num_replicas() > 1:
                raise RuntimeError("call adaptive.init_process_group(backend) before AdaptiveDataParallel")
            collectives.init_process_group("nccl" if next(module.parameters()).is_cuda else "gloo")
        super().__init__(module, **kwargs)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self._state = _AdaptiveDataParallelState(f"adaptive.parallel.{name}", self.module, optimizer,
                                                 lr_scheduler, scaler)
        if checkpoint.load_state(self._state) and env.rank() == 0:
            logger.info("restored model, optimizer%s%s from the checkpoint",
                        ", LR scheduler" if lr_scheduler is not None else "",
                        ", grad scaler" if scaler is not None else "")
