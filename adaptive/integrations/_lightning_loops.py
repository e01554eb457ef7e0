"""The one place where :mod:`adaptive.integrations.lightning` touches Lightning's private parts.

Checked on the Lightning releases in :data:`CHECKED_LIGHTNING_VERSIONS`
(a warning is logged on others, and :func:`check_lightning_internals`
raises when an attribute used here is gone):

* :func:`train_without_distributed_sampler`: the Trainer's
  ``use_distributed_sampler`` flag (``trainer._accelerator_connector``),
  replaced by a value that is false while the *training* dataloaders are
  set up, so that Lightning adds no ``DistributedSampler`` to them (the
  elastic loader shards them) and keeps adding it to the validation, test
  and prediction loaders as it would.
* :func:`loop_counters` / :func:`restore_loop_counters`: the fit loop's
  progress records (``epoch_progress``, ``batch_progress``,
  ``scheduler_progress``, the optimizer progress) through their public
  ``state_dict`` / ``load_state_dict``, and the epoch loop's private
  ``_batches_that_stepped`` (the step loggers see), and the loops'
  ``restarting`` flag.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning
import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage

__all__ = ["CHECKED_LIGHTNING_VERSIONS", "check_lightning_version", "check_lightning_internals",
           "train_without_distributed_sampler", "loop_counters", "restore_loop_counters"]

logger = logging.getLogger(__name__)

#: The Lightning releases (major.minor) whose private attributes this module was checked on.
CHECKED_LIGHTNING_VERSIONS = ("2.6",)


def check_lightning_version() -> None:
    """Log, as a warning, when the installed Lightning is not one this module was checked on."""
    found = ".".join(lightning.__version__.split(".")[:2])
    if found not in CHECKED_LIGHTNING_VERSIONS:
        logger.warning("AdaptiveStrategy was checked on lightning %s, found %s",
                       ", ".join(CHECKED_LIGHTNING_VERSIONS), lightning.__version__)


def check_lightning_internals(trainer: pl.Trainer) -> None:
    """The private attributes used here exist on ``trainer`` (else a RuntimeError naming the release)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    missing = [name for obj, name in ((trainer, "_accelerator_connector"), (epoch_loop, "_batches_that_stepped"),
                                      (epoch_loop, "automatic_optimization"))
               if not hasattr(obj, name)]
    if not hasattr(getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler"):
        missing.append("_accelerator_connector.use_distributed_sampler")
    if missing:
        raise RuntimeError(f"lightning {lightning.__version__} lacks {', '.join(missing)}; AdaptiveStrategy was "
                           f"checked on lightning {', '.join(CHECKED_LIGHTNING_VERSIONS)}")


class _NotWhileTraining:
    """Truthy as the user's ``use_distributed_sampler``, except while the training dataloaders are set up."""

    def __init__(self, trainer: pl.Trainer, value: bool) -> None:
        self.trainer = trainer
        self.value = bool(value)

    def __bool__(self) -> bool:
        return self.value and self.trainer.state.stage != RunningStage.TRAINING

    def __repr__(self) -> str:
        return f"{self.value} (not for the training dataloaders: AdaptiveStrategy shards them)"


def train_without_distributed_sampler(trainer: pl.Trainer) -> None:
    """No Lightning ``DistributedSampler`` on the training dataloaders; the other stages keep the user's choice."""
    connector = trainer._accelerator_connector
    current = connector.use_distributed_sampler
    if not isinstance(current, _NotWhileTraining):
        connector.use_distributed_sampler = _NotWhileTraining(trainer, current)  # type: ignore[assignment]


def loop_counters(trainer: pl.Trainer) -> dict[str, Any]:
    """The fit loop's counters (``current_epoch``, ``global_step``, the batches of the epoch, the logger step)."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    return {"epoch_progress": fit_loop.epoch_progress.state_dict(),
            "batch_progress": epoch_loop.batch_progress.state_dict(),
            "scheduler_progress": epoch_loop.scheduler_progress.state_dict(),
            "optim_progress": epoch_loop.automatic_optimization.optim_progress.state_dict(),
            "batches_that_stepped": int(epoch_loop._batches_that_stepped)}


def restore_loop_counters(trainer: pl.Trainer, counters: dict[str, Any]) -> None:
    """Put counters saved by :func:`loop_counters` back, as they stood at a step boundary of the elastic loader.

    The library saves at a step boundary (the batch before it completed, the
    next one not fetched yet) or at the start of an epoch; any epoch or
    batch started but not completed is rolled back to its last completed
    count (``reset_on_restart``), and the epoch loop is marked as restarting,
    so that it keeps the batches of the epoch already trained (Lightning
    then counts the rest of the epoch, its accumulation and its last batch
    from there) instead of starting the epoch's counts at 0.
    """
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    fit_loop.epoch_progress.load_state_dict(counters["epoch_progress"])
    fit_loop.epoch_progress.reset_on_restart()
    epoch_loop.batch_progress.load_state_dict(counters["batch_progress"])
    epoch_loop.batch_progress.reset_on_restart()
    epoch_loop.scheduler_progress.load_state_dict(counters["scheduler_progress"])
    epoch_loop.scheduler_progress.reset_on_restart()
    optim_progress = epoch_loop.automatic_optimization.optim_progress
    optim_progress.load_state_dict(counters["optim_progress"])
    optim_progress.reset_on_restart()
    epoch_loop._batches_that_stepped = int(counters["batches_that_stepped"])
    epoch_loop.restarting = True  # keep the epoch's batch counts (reset_on_restart rather than reset_on_run)
