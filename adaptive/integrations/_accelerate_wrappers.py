"""Accelerate's optimizer and scheduler wrappers, stepping by the loader's plan (for :mod:`.accelerate`).

Also the one place where the integration touches a private attribute of
accelerate (:func:`register_prepared`) and the version it was checked on,
what keeps Accelerate's process count and index true in live mode
(:func:`follow_job_membership`), and the small helpers :meth:`AdaptiveAccelerator.prepare` sorts its
arguments with.  Import :mod:`adaptive.integrations.accelerate`, which says
which extra to install when accelerate is missing.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

# accelerate ships no type information (no py.typed): its names are Any to the type checker.
import accelerate  # type: ignore[import-untyped]
from accelerate import Accelerator, PartialState
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from accelerate.scheduler import AcceleratedScheduler  # type: ignore[import-untyped]

import torch

from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.runtime import env, membership

__all__ = ["CHECKED_ACCELERATE_VERSIONS", "register_prepared", "check_accelerate_version", "follow_job_membership",
           "gradients_complete",
           "AdaptiveOptimizer", "AdaptiveScheduler", "env_flag", "is_plain", "is_scheduler", "optimizers_of",
           "scheduler_of"]

logger = logging.getLogger(__name__)

#: The accelerate releases (major.minor) whose private attributes :func:`register_prepared` was checked on.
CHECKED_ACCELERATE_VERSIONS = ("1.16",)


def register_prepared(accelerator: Accelerator, kind: str, obj: Any) -> None:
    """Register a prepared optimizer or scheduler where Accelerate keeps its own.

    ``Accelerator.prepare_optimizer`` and ``prepare_scheduler`` build
    Accelerate's own wrapper classes and append them to the private lists
    ``_optimizers`` and ``_schedulers``, which ``save_state``, ``load_state``,
    ``unscale_gradients``, ``clip_grad_norm_`` and ``free_memory`` walk;
    no public method registers an instance of a subclass.  Checked on
    accelerate 1.16.0 (:data:`CHECKED_ACCELERATE_VERSIONS`); this is the
    only place the integration touches a private attribute of accelerate.
    """
    attribute = {"optimizer": "_optimizers", "scheduler": "_schedulers"}[kind]
    registry = getattr(accelerator, attribute, None)
    if not isinstance(registry, list):
        raise RuntimeError(f"accelerate {accelerate.__version__} has no list Accelerator.{attribute}; "
                           f"AdaptiveAccelerator was checked on accelerate {', '.join(CHECKED_ACCELERATE_VERSIONS)}")
    registry.append(obj)


def follow_job_membership(accelerator: Accelerator) -> None:
    """Live mode: after every membership change, Accelerate's process count and index are the new generation's.

    Accelerate reads them once, when its state is built
    (``PartialState.num_processes`` / ``process_index``, copied into the
    ``AcceleratorState``); a script reads them through
    ``accelerator.num_processes``, ``process_index`` and
    ``is_main_process``, which a live job's joins and leaves change.  The
    new values are set on both states, as public attributes, whenever the
    library rebuilt the job's process group.
    """
    if not membership.is_live():
        return
    state = accelerator.state

    def follow() -> None:
        replicas, rank = env.num_replicas(), env.rank()
        for shared in (PartialState(), state):
            shared.num_processes, shared.process_index = replicas, rank

    membership.on_regroup(follow)


def check_accelerate_version() -> None:
    """Log, as a warning, when the installed accelerate is not one this integration was checked on."""
    found = ".".join(accelerate.__version__.split(".")[:2])
    if found not in CHECKED_ACCELERATE_VERSIONS:
        logger.warning("AdaptiveAccelerator was checked on accelerate %s, found %s",
                       ", ".join(CHECKED_ACCELERATE_VERSIONS), accelerate.__version__)


def gradients_complete() -> bool:
    """Whether the micro-batch being trained ends its optimizer step (True outside loader loops).

    The one rule of the integration for Accelerate's ``sync_gradients``: the
    running loader's plan, as the library's optimizer hooks follow it.
    """
    loader = current_dataloader()
    return loader is None or not loader.is_accumulation_step()


class AdaptiveOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, stepping and zeroing by the loader's plan of micro-steps.

    ``step`` and ``zero_grad`` act only on the micro-batch that ends an
    optimizer step, as Accelerate's do under ``accumulate()``.  The
    library's own hook on ``zero_grad`` lets it act only on the *first*
    micro-step (a plain loop zeroes before ``backward``); Accelerate's loop
    zeroes after ``optimizer.step()`` on the last one, so the optimizer
    class's ``zero_grad`` is called directly.  ``on_step`` is told the
    running loader after each optimizer step taken inside a loader loop (the
    accelerator's step and sample counters).
    """

    on_step: Callable[[AdaptiveDataLoader], None] | None = None

    def step(self, closure: Any = None) -> None:
        complete = gradients_complete()
        self.gradient_state.sync_gradients = complete
        super().step(closure)
        loader = current_dataloader()
        if complete and loader is not None and self.on_step is not None:
            self.on_step(loader)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if not gradients_complete():
            return
        self.gradient_state.sync_gradients = True
        type(self.optimizer).zero_grad(self.optimizer, set_to_none=True if set_to_none is None else set_to_none)


class AdaptiveScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper, stepping by the loader's plan and the first launch's process count.

    Accelerate steps the scheduler once per process at each optimizer step
    (``split_batches=False``), because its scripts size schedules in
    per-process batches.  The global batch here is the first launch's at any
    world size, so the scheduler steps as many times as the first launch had
    processes: the schedule follows samples across rescales.
    """

    def __init__(self, scheduler: Any, optimizer: AcceleratedOptimizer, *, step_with_optimizer: bool,
                 split_batches: bool, steps_per_update: int) -> None:
        super().__init__(scheduler, optimizer, step_with_optimizer=step_with_optimizer, split_batches=split_batches)
        self.steps_per_update = steps_per_update  # replaces Accelerate's count (the current processes) in step()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not gradients_complete() or any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.steps_per_update):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR refuses to step past its end
            if total is not None and self.scheduler.last_epoch >= total:
                return
            self.scheduler.step(*args, **kwargs)


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value, as Accelerate reads its flags."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def is_plain(obj: Any, kind: type) -> bool:
    """``obj`` is a ``kind`` and not one of Accelerate's wrappers (those are returned unchanged)."""
    return isinstance(obj, kind) and not isinstance(obj, AcceleratedOptimizer)


def is_scheduler(obj: Any) -> bool:
    """A torch LR scheduler (``LRScheduler``, or ``ReduceLROnPlateau`` on torch releases where it is not one)."""
    return isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau))


def optimizers_of(model: torch.nn.Module, optimizers: dict[int, torch.optim.Optimizer]) -> list[int]:
    """Positions of the optimizers whose parameters all belong to ``model``."""
    params = {id(param) for param in model.parameters()}
    return [i for i, optimizer in optimizers.items()
            if all(id(param) in params for group in optimizer.param_groups for param in group["params"])]


def scheduler_of(optimizer: torch.optim.Optimizer, schedulers: dict[int, Any], position: int) -> int | None:
    """The position of the scheduler stepping ``optimizer`` (None if none was given)."""
    owned = [k for k, scheduler in schedulers.items() if getattr(scheduler, "optimizer", None) is optimizer]
    if len(owned) > 1:
        raise ValueError(f"the optimizer at position {position} of prepare() has {len(owned)} LR schedulers; "
                         "AdaptiveDataParallel checkpoints one")
    return owned[0] if owned else None
