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
  ``_batches_that_stepped`` (the step loggers see; saved as the epoch
  loop's restart "on last" will count it, with its ``_should_check_val_fx``
  and ``_should_accumulate``), and the loops'
  ``restarting`` flag; :func:`counters_at_boundary` writes them as they
  will stand once the batch in progress has ended (for the library's state
  in a Lightning checkpoint written from a batch-end hook).
* :func:`skip_sigterm_broadcast`: the training epoch loop's per-batch
  broadcast of Lightning's own SIGTERM flag
  (``_broadcast_sigterm_tensor``), which the strategy's SIGTERM handling
  replaces (the flag stays false), and which a live joiner, admitted
  between two batches of the members, would answer out of turn.
* :func:`rebuild_evaluation_data`: the validation loop's
  ``_combined_loader``, dropped after a live membership change so that
  Lightning builds the validation dataloaders (and their
  ``DistributedSampler``) again for the members there are now.
* Under autoscale: :func:`accumulate_as_planned`, the epoch loop's
  ``_should_accumulate`` replaced by the loader's plan (Lightning's own
  counts a step's micro-batches from the epoch's start, which a plan that
  changes inside the epoch contradicts); :func:`follow_epoch_length`, the
  fit loop's ``max_batches`` (``trainer.num_training_batches``) and its
  data fetcher's ``length`` (whether a batch is the epoch's last), counted
  again at every micro-batch; :func:`fetched_batches`, the epoch's batches
  fetched so far (``batch_progress``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import lightning
import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage

__all__ = ["CHECKED_LIGHTNING_VERSIONS", "check_lightning_version", "check_lightning_internals",
           "train_without_distributed_sampler", "loop_counters", "restore_loop_counters", "counters_at_boundary",
           "global_step_of", "batches_that_stepped", "skip_sigterm_broadcast", "rebuild_evaluation_data",
           "accumulate_as_planned", "follow_epoch_length", "fetched_batches"]

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
                                      (epoch_loop, "automatic_optimization"), (epoch_loop, "_broadcast_sigterm_tensor"),
                                      (epoch_loop, "_should_check_val_fx"), (epoch_loop, "_should_accumulate"),
                                      (trainer.fit_loop, "_data_fetcher"), (epoch_loop.val_loop, "_combined_loader"))
               if not hasattr(obj, name)]
    if not hasattr(trainer.fit_loop, "max_batches"):
        missing.append("fit_loop.max_batches")
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
            "batches_that_stepped": int(epoch_loop._batches_that_stepped) - _replayed_batch_end(trainer)}


def _replayed_batch_end(trainer: pl.Trainer) -> int:
    """1 when a resume from the counters saved now will replay the end of the last completed batch, else 0.

    Restored at a step boundary, the epoch loop restarts "on last": when a
    validation is due after that batch, its first ``advance`` returns at
    once (the validation ran before the save) and its ``on_advance_end``
    counts the batch in ``_batches_that_stepped`` once more.  The counters
    are saved one lower, so that the loggers' step comes back as it was.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or epoch_loop._should_accumulate():
        return 0
    return int(bool(epoch_loop._should_check_val_fx(fetcher)))


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


def counters_at_boundary(trainer: pl.Trainer, batches_back: int, stepped_before_batch: int,
                         stepped: bool) -> dict[str, Any]:
    """The counters of :func:`loop_counters` at the step boundary a checkpoint written now stands for.

    Lightning writes its checkpoints from hooks inside a batch's processing
    (``on_train_batch_end``, ``on_validation_end``, ``on_train_epoch_end``),
    where the batch is not yet counted as completed and
    ``_batches_that_stepped`` may not count it yet.  The library saves the
    loader's position at a step boundary: after the batch in progress when
    its optimizer step was taken (``stepped``), else before the
    ``batches_back`` micro-batches of the step in progress.  The batch
    counts are set to that boundary (every batch there is completed), and
    ``_batches_that_stepped`` to its value before the batch in progress
    (``stepped_before_batch``), plus one when that batch stepped.
    """
    counters = loop_counters(trainer)
    for part in ("total", "current"):
        counts = counters["batch_progress"][part]
        boundary = max(int(counts["processed"]) - batches_back, 0)
        counts.update(ready=boundary, started=boundary, processed=boundary, completed=boundary)
    replayed = _replayed_batch_end(trainer) if stepped else 0
    counters["batches_that_stepped"] = int(stepped_before_batch) + (1 if stepped else 0) - replayed
    return counters


def global_step_of(counters: dict[str, Any]) -> int:
    """Lightning's ``global_step`` in counters saved by :func:`loop_counters` (its optimizer steps taken)."""
    return int(counters["optim_progress"]["optimizer"]["step"]["total"]["completed"])


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The epoch loop's ``_batches_that_stepped`` now."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def skip_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """No per-batch broadcast of Lightning's SIGTERM flag in the training epoch loop (see the module docstring)."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]


def rebuild_evaluation_data(trainer: pl.Trainer) -> None:
    """Make the next validation build its dataloaders again (for the processes of a new live generation)."""
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def accumulate_as_planned(trainer: pl.Trainer, accumulating: Callable[[], bool]) -> None:
    """Lightning accumulates (no optimizer step, no step-interval scheduler, no logger step) when
    ``accumulating()`` says so, instead of counting ``accumulate_grad_batches`` batches from the epoch's start.

    Under autoscale the loader's plan decides: a step's micro-batches change
    with the batch size, also inside an epoch, where Lightning's count
    (``batch_idx + 1`` a multiple of ``accumulate_grad_batches``, or the
    epoch's last batch) would not fall on the loader's step boundaries.
    """
    trainer.fit_loop.epoch_loop._should_accumulate = accumulating  # type: ignore[method-assign]


def fetched_batches(trainer: pl.Trainer) -> int:
    """The training batches of the epoch in progress Lightning has fetched (restored ones included)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def follow_epoch_length(trainer: pl.Trainer, micro_batches: int) -> None:
    """Lightning counts ``micro_batches`` training batches in the epoch in progress.

    Its number of training batches (its epoch's last batch, epoch-interval
    schedulers, the progress bar), its data fetcher's length (whether the
    batch just fetched is the last) and the batch of the epoch's
    validation (``val_check_interval`` as a fraction of the epoch) follow.
    """
    fit_loop = trainer.fit_loop
    fit_loop.max_batches = micro_batches
    fetcher = fit_loop._data_fetcher
    if fetcher is not None:
        fetcher.length = micro_batches
    interval = trainer.val_check_interval
    if getattr(trainer, "_val_check_time_interval", None) is None and isinstance(interval, float):
        trainer.val_check_batch = max(1, int(micro_batches * interval))
