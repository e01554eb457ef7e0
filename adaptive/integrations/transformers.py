"""AdaptiveTrainer: a ``transformers.Trainer`` script becomes elastic by changing one line.

::

    from adaptive.integrations.transformers import AdaptiveTrainer

    trainer = AdaptiveTrainer(model=model, args=training_args,             # was: Trainer(...)
                              train_dataset=train_dataset, eval_dataset=eval_dataset)
    trainer.train()                                                        # resumes by itself

Launched with ``adaptive-run`` (or torchrun), a relaunch on any number of
processes resumes at the exact sample where the last checkpoint left it,
with the global batch of the first launch.  What the trainer takes over,
and why:

* **The process group.**  ``adaptive.init_process_group()`` runs before the
  Trainer builds its accelerator.  On a machine without CUDA the Trainer's
  arguments get ``use_cpu=True``: Accelerate adopts an existing gloo group
  only on its CPU path, and without it every process would train alone.
* **Training data.**  :meth:`AdaptiveTrainer.get_train_dataloader` (the
  Trainer's extension point) returns the epochs of one
  :class:`~adaptive.AdaptiveDataLoader` over the training dataset (with the
  Trainer's collator and unused-column removal), whose global batch is
  ``per_device_train_batch_size`` x processes x
  ``gradient_accumulation_steps`` *of the first launch*, recorded in the
  checkpoint and kept at every later world size.
* **Accumulation.**  The Trainer itself sees ``gradient_accumulation_steps=1``
  (on a copy of its arguments): each batch it takes is one whole optimizer
  step of the loader (one micro-batch per process of the global batch / the
  processes), so ``global_step`` counts the loader's optimizer steps.  The
  number of steps per epoch, ``max_steps`` and with them warm-up and decay
  are counted in global batches, which are the same at every world size:
  the schedule follows the samples.
* **Model, optimizer, LR scheduler.**  The model is wrapped in an
  :class:`~adaptive.AdaptiveDataParallel` (instead of Accelerate's DDP)
  with the Trainer's optimizer and LR scheduler, so the library's
  checkpoint holds them together with the loader's position.
* **Loss weighting.**  :meth:`AdaptiveTrainer.compute_loss` weights a
  per-process mean loss by the process's share of the step's samples, so
  that a step's gradient is the mean over its samples when processes hold
  uneven shares (8 samples on 3 processes), as one process would compute it.
* **Trainer state.**  ``global_step``, ``epoch``, the log history, the FLOs
  and the best metric are checkpointed too and restored before training
  resumes: ``TrainerState`` carries on as if the job had never stopped.
* **Autoscale** (``max_batch_size=``, with the other arguments of
  :meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`): the loader
  chooses the micro-batch size and accumulation steps from the goodput
  model; the Trainer still takes one batch per optimizer step, whose
  micro-batches :meth:`AdaptiveTrainer.training_step` trains in turn, and
  its steps (``global_step``, ``max_steps``, warm-up, decay, intervals)
  count reference batches so that they follow the samples
  (:mod:`adaptive.integrations._trainer_autoscale`); the model wrapper's
  scaling rule scales the LR on top of the schedule.
* **Epochs.**  The Trainer's epochs are the library's
  (:func:`adaptive.remaining_epochs_until`); a callback ends each epoch's
  loader pass and, when training ends, checkpoints the job as finished
  (:func:`adaptive.finish_training`), so that a relaunch trains nothing.

* **The Trainer's checkpoints.**  Each ``output_dir/checkpoint-N`` the
  Trainer writes gets the library's state in ``checkpoint-N/adaptive``, and
  ``train(resume_from_checkpoint=...)`` resumes from it exactly, at any
  world size, unless the library's own newest checkpoint continues the same
  run beyond it (:mod:`adaptive.integrations._trainer_checkpoint`).

* **Live membership.**  Under ``adaptive-run --live`` the import joins the
  job's process group (:func:`_join_live_job`), Accelerate's process count
  and index follow every membership change, and a joiner gets the members'
  ``TrainerState`` when it is admitted.

SIGTERM (and ``adaptive.request_stop()``) stops every process after the
same optimizer step: the library checkpoints and the processes exit 143.

The Trainer's private methods are kept out except one, overridden in one
place and checked against :data:`CHECKED_TRANSFORMERS_VERSIONS`:
``Trainer._wrap_model``, the Trainer's own point for wrapping a model for
distributed training (see :meth:`AdaptiveTrainer._wrap_model`); and the
cached device set-up of ``TrainingArguments`` is reset in
:func:`_reset_device_setup`.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
from typing import Any

try:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as error:  # the optional extra is missing
    raise ImportError("adaptive.integrations.transformers needs Hugging Face Transformers, which is not installed: "
                      "pip install adaptive-elastic[huggingface]") from error

import torch
import torch.utils.data

from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.elastic import epoch as epochs
from adaptive.integrations import _trainer_checkpoint as checkpoints
from adaptive.integrations._autoscale_settings import AutoscaleSettings, reference_steps, settings_from
from adaptive.integrations._trainer_autoscale import OptimizerSteps, StepBatch
from adaptive.integrations._accelerate_wrappers import follow_job_membership
from adaptive.integrations._epoch_passes import EpochPasses
from adaptive.integrations._trainer_data import (ORDERS, RECORD_STATE_NAME, TrainerRecord,
                                                 refuse_unsupported, sampling_strategy)
from adaptive.parallel.data_parallel import AdaptiveDataParallel
from adaptive.runtime import env, membership
from adaptive.runtime.collectives import init_process_group

__all__ = ["AdaptiveTrainer", "CHECKED_TRANSFORMERS_VERSIONS"]

logger = logging.getLogger(__name__)

#: The transformers releases (major.minor) whose Trainer internals this module was checked on.
CHECKED_TRANSFORMERS_VERSIONS = ("5.25",)

#: The loader's checkpoint name.
LOADER_NAME = "trainer.train"

#: The ``TrainerState`` fields that carry on across restarts (the others are set by ``train()`` itself).
CARRIED_FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "log_history", "best_metric",
                  "best_global_step", "best_model_checkpoint")


# ---------------------------------------------------------------- the one place with Trainer internals

def _check_transformers_version() -> None:
    """Log once, as a warning, when the installed transformers is not one this module was checked on."""
    found = ".".join(transformers.__version__.split(".")[:2])
    if found not in CHECKED_TRANSFORMERS_VERSIONS:
        logger.warning("AdaptiveTrainer was checked on transformers %s, found %s",
                       ", ".join(CHECKED_TRANSFORMERS_VERSIONS), transformers.__version__)


def _check_trainer_internals() -> None:
    """The private Trainer method :class:`AdaptiveTrainer` overrides must exist (checked at construction)."""
    if not callable(getattr(Trainer, "_wrap_model", None)):
        raise RuntimeError(f"transformers {transformers.__version__} has no Trainer._wrap_model; AdaptiveTrainer "
                           f"was checked on transformers {', '.join(CHECKED_TRANSFORMERS_VERSIONS)}")


def _reset_device_setup(args: TrainingArguments) -> None:
    """Make ``args`` set up its devices again (the cached property ``_setup_devices``), after ``use_cpu``
    changed; the new set-up adopts the process group the library created."""
    args.__dict__.pop("_setup_devices", None)
    _ = args.device  # runs _setup_devices: Accelerate's PartialState on the job's group


def _join_live_job() -> None:
    """Under ``adaptive-run --live``, join the job's process group now, at import.

    A Trainer script builds its ``TrainingArguments`` before the trainer, and
    their device set-up (Accelerate's ``PartialState``) starts a process group
    of its own from ``RANK`` unless one exists; a live worker has no ``RANK``
    until it is admitted, so the script would fail there.  The library's
    group (a group of one for a joiner until it is admitted) is made first.
    """
    if membership.is_live() and not torch.distributed.is_initialized():
        init_process_group(None if torch.cuda.is_available() else "gloo")


_check_transformers_version()
_join_live_job()


def _flag_crossed_intervals(args: TrainingArguments, state: TrainerState, control: TrainerControl,
                            before: int) -> None:
    """Flag the logging, evaluation and save intervals that ``global_step`` passed since ``before``.

    The Trainer's ``DefaultFlowCallback`` (after this one) flags exact
    multiples only; an autoscaled step may advance the count by several.
    """
    after = state.global_step

    def crossed(every: Any) -> bool:
        every = int(every or 0)
        return every > 0 and after // every > before // every

    if args.logging_first_step and before < 1 <= after:
        control.should_log = True
    if args.logging_strategy == "steps" and crossed(state.logging_steps):
        control.should_log = True
    if args.eval_strategy == "steps" and crossed(state.eval_steps) and args.eval_delay <= after:
        control.should_evaluate = True
    if args.save_strategy == "steps" and crossed(state.save_steps):
        control.should_save = True


class _ElasticProgress(TrainerCallback):
    """Keeps ``TrainerState.epoch`` on the library's epochs and ends the loader's passes with the Trainer's."""

    def __init__(self, trainer: AdaptiveTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        data = self.trainer._adaptive_epochs
        current = epochs.current_epoch()
        if data is None or current is None:
            return
        step = data.loader.current_step
        samples = data.loader.sampler.num_samples
        if step is not None and samples > 0:
            # the epoch and the share of its samples taken, at any world size (the Trainer's own count
            # restarts at every relaunch)
            state.epoch = current + min(1.0, step.position / samples)
        if step is not None and self.trainer._adaptive_autoscale is not None:
            self.trainer._follow_reference_steps(step, current, state, control)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        data = self.trainer._adaptive_epochs
        if data is not None and not control.should_training_stop:
            data.end_epoch()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        data = self.trainer._adaptive_epochs
        if data is not None:
            data.finish()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """The Trainer wrote ``checkpoint-N``: the library's state goes in with it (``checkpoint-N/adaptive``),
        so that ``resume_from_checkpoint`` resumes it exactly."""
        data = self.trainer._adaptive_epochs
        folder = checkpoints.trainer_checkpoint_dir(args.output_dir, PREFIX_CHECKPOINT_DIR, state.global_step)
        checkpoints.save_to_trainer_checkpoint(folder, None if data is None else data.loader)


# ---------------------------------------------------------------- the trainer

class AdaptiveTrainer(Trainer):
    """``transformers.Trainer`` whose training data, model and state are elastic (see the module docstring).

    Takes the Trainer's arguments.  Data parallelism on the CPU (gloo) or
    CUDA; DeepSpeed, FSDP, ``parallelism_config``, ``auto_find_batch_size``,
    several GPUs per process (``nn.DataParallel``) and the
    ``group_by_length`` / ``batch_rebalance`` sampling strategies are refused
    with a ``ValueError``.  One ``AdaptiveTrainer`` per process, and one
    ``train()`` call (its record, loader and model wrapper are checkpointed
    states of fixed names).

    ``args`` is copied: the copy the Trainer reads has
    ``gradient_accumulation_steps=1`` (the loader plans whole optimizer
    steps) and, without CUDA, ``use_cpu=True``; the argument given is left
    as it is, and ``gradient_accumulation_steps`` given there sizes the
    global batch.

    Keyword-only arguments (besides the Trainer's):

    * ``max_batch_size``: turns autoscale on: the largest global batch
      (samples over all processes and micro-batches), at least the
      reference global batch (the first launch's
      ``per_device_train_batch_size`` x processes x
      ``gradient_accumulation_steps``).  The loader then chooses the
      micro-batch size and accumulation steps that maximise goodput
      (:meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`), the model
      wrapper's scaling rule scales the LR on top of the Trainer's schedule,
      and the Trainer's steps (``global_step``, ``max_steps``, warm-up,
      decay, logging, evaluation and save intervals) count reference
      batches, so that they follow the samples.
    * ``local_bsz_bounds``, ``gradient_accumulation``, ``adapt_every``,
      ``hysteresis``: as in ``autoscale_batch_size`` (only with
      ``max_batch_size``).
    * ``scaling_rule``: the model wrapper's LR scaling rule
      (:class:`~adaptive.AdaptiveDataParallel`; default: AdaScale for SGD,
      its square root for Adam-like optimizers).

    Raises:
        ValueError: an autoscale setting out of range, or given without
            ``max_batch_size`` (naming the argument).
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *more: Any,
                 max_batch_size: int | None = None, local_bsz_bounds: tuple[int, int] | None = None,
                 gradient_accumulation: bool = False, adapt_every: int = 20, hysteresis: float = 0.05,
                 scaling_rule: Any = None, **kwargs: Any) -> None:
        _check_trainer_internals()
        self._adaptive_autoscale: AutoscaleSettings | None = settings_from(
            "AdaptiveTrainer", "max_batch_size",
            "the first launch's per_device_train_batch_size x processes x gradient_accumulation_steps",
            max_batch_size, local_bsz_bounds, gradient_accumulation, adapt_every, hysteresis)
        self._adaptive_scaling_rule = scaling_rule
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be a transformers.TrainingArguments, got {type(args).__name__}")
        refuse_unsupported(args)
        gloo = args.use_cpu or not torch.cuda.is_available()
        init_process_group("gloo" if gloo else None)
        args = copy.copy(args)
        self._adaptive_accumulation = int(args.gradient_accumulation_steps)
        args.gradient_accumulation_steps = 1
        if gloo and not args.use_cpu:
            args.use_cpu = True
            args.dataloader_pin_memory = False
        _reset_device_setup(args)
        self._adaptive_record: TrainerRecord | None = None
        self._adaptive_epochs: EpochPasses | None = None
        self._adaptive_steps: OptimizerSteps | None = None  # what the Trainer iterates under autoscale
        self._adaptive_trained = False
        super().__init__(model, args, *more, **kwargs)
        if args.n_gpu > 1:
            raise ValueError(f"AdaptiveTrainer runs one device per process; this process sees {args.n_gpu} GPUs "
                             "(nn.DataParallel): launch one process per GPU with adaptive-run")
        world = torch.distributed.get_world_size()
        if self.args.world_size != world:
            raise RuntimeError(f"the Trainer sees {self.args.world_size} processes but the job's process group "
                               f"has {world}; launch with adaptive-run or torchrun")
        follow_job_membership(self.accelerator)  # live: args.world_size, process_index and evaluation follow joins
        # First in line, so that every other callback sees the epoch it sets and the passes it ends.
        self.callback_handler.callbacks.insert(0, _ElasticProgress(self))

    # ------------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """Train, resuming by itself from the library's newest checkpoint when there is one.

        ``resume_from_checkpoint``: a Trainer checkpoint (``output_dir/checkpoint-N``,
        or ``True`` for the newest in ``output_dir``) written by an
        ``AdaptiveTrainer``, resumed exactly (its ``adaptive/`` folder holds
        the loader's position, the epoch, the random generators, the model,
        optimizer, LR scheduler and ``TrainerState``), at any world size;
        unless the library's own newest checkpoint continues the same run
        beyond it (a relaunch of the same command), which then wins.

        Raises:
            ValueError: ``resume_from_checkpoint`` names no folder or one not
                written by AdaptiveTrainer; ``trial`` given (hyperparameter
                search is not supported).
            RuntimeError: a second call in the same process.
        """
        if trial is not None:
            raise ValueError("AdaptiveTrainer does not support hyperparameter search (trial=)")
        if self._adaptive_trained:
            raise RuntimeError("AdaptiveTrainer.train() runs once per process: its loader, model wrapper and "
                               "record are checkpointed states of fixed names")
        output_dir = self.args.output_dir or "."
        last = get_last_checkpoint(output_dir) if resume_from_checkpoint is True and os.path.isdir(output_dir) else None
        chosen = checkpoints.choose_trainer_checkpoint(resume_from_checkpoint, last, RECORD_STATE_NAME)
        self._adaptive_trained = True
        if chosen is not None:
            checkpoints.resume_from_trainer_checkpoint(chosen)
        # The Trainer gets no checkpoint to load: the library restores everything as its states are made.
        return super().train(ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def get_train_dataloader(self) -> Any:
        """The epochs of an ``AdaptiveDataLoader`` with the first launch's global batch.

        Over the dataset and collator the Trainer would use (unused columns
        removed as it removes them), shuffled with ``data_seed`` (else
        ``seed``) for ``train_sampling_strategy="random"``, in order for
        ``"sequential"``; ``dataloader_drop_last``, workers and pinning as
        the arguments say.  Under autoscale (``max_batch_size=``) the loader
        autoscales, and the Trainer iterates its optimizer steps
        (:class:`~adaptive.integrations._trainer_autoscale.OptimizerSteps`,
        whose ``loader`` is the ``AdaptiveDataLoader``).

        Raises:
            ValueError: no ``train_dataset``, or an ``IterableDataset``;
                ``max_batch_size`` below the reference global batch.
        """
        if self._adaptive_steps is not None:
            return self._adaptive_steps
        if self._adaptive_epochs is not None:
            return self._adaptive_epochs
        if self.train_dataset is None:
            raise ValueError("AdaptiveTrainer: training requires a train_dataset")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("AdaptiveTrainer needs a map-style train_dataset (__len__ and __getitem__): the elastic "
                             "loader walks a seeded permutation of it; an IterableDataset has no such order")
        plain = super().get_train_dataloader()  # the Trainer's dataset and collator (columns removed)
        args = self.args
        record = TrainerRecord(torch.distributed.get_world_size(), args.per_device_train_batch_size,
                                self._adaptive_accumulation)
        self._adaptive_record = record
        if record.accumulation > 1 and self._adaptive_autoscale is None and env.rank() == 0:
            logger.warning("gradient_accumulation_steps=%d: each optimizer step is one micro-batch of the global "
                           "batch %d per process (%d samples per process on %d processes), not %d micro-batches "
                           "of %d", record.accumulation, record.global_batch,
                           -(-record.global_batch // args.world_size), args.world_size, record.accumulation,
                           record.per_device)
        workers = int(args.dataloader_num_workers)
        options: dict[str, Any] = {"collate_fn": plain.collate_fn, "num_workers": workers,
                                   "pin_memory": bool(args.dataloader_pin_memory)}
        if workers > 0:
            options["persistent_workers"] = bool(args.dataloader_persistent_workers)
            if args.dataloader_prefetch_factor is not None:
                options["prefetch_factor"] = args.dataloader_prefetch_factor
        seed = args.data_seed if args.data_seed is not None else args.seed
        loader = AdaptiveDataLoader(plain.dataset, batch_size=record.global_batch,
                                    shuffle=ORDERS[sampling_strategy(args)], seed=seed,
                                    drop_last=bool(args.dataloader_drop_last), name=LOADER_NAME, **options)
        if self._adaptive_autoscale is not None:
            self._adaptive_autoscale.apply(loader)  # (checks max_batch_size against the reference batch)
            if env.rank() == 0:
                logger.info("autoscale on: global batch up to %d, local batch bounds %s, gradient accumulation %s; "
                            "the Trainer's steps count reference batches of %d samples",
                            self._adaptive_autoscale.max_batch_size, self._adaptive_autoscale.local_bsz_bounds,
                            self._adaptive_autoscale.gradient_accumulation, record.global_batch)
        if env.rank() == 0:
            logger.info("training data -> AdaptiveDataLoader %s: global batch %d (%d per device x %d processes x "
                        "%d accumulation steps of the first launch), %d steps per epoch", loader.name,
                        record.global_batch, record.per_device, record.processes, record.accumulation, len(loader))
        self._adaptive_epochs = EpochPasses(
            loader, lambda: self.state.num_train_epochs, front_end="AdaptiveTrainer", skip_finished_epochs=True,
            # (the Trainer stops training at an epoch without a batch)
            early_end="the Trainer ended an epoch before the elastic loader did (should_epoch_stop); stop training "
                      "instead (should_training_stop)")
        if self._adaptive_autoscale is None:
            return self._adaptive_epochs
        self._adaptive_steps = OptimizerSteps(self._adaptive_epochs, lambda: record.global_batch)
        return self._adaptive_steps

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """The global batch of an optimizer step: the first launch's, at any world size."""
        if self._adaptive_record is not None:
            return self._adaptive_record.global_batch
        return int(super().get_total_train_batch_size(args))

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        """For training: an ``AdaptiveDataParallel`` holding the model, its optimizer and LR scheduler.

        The one private Trainer method overridden here (checked on
        :data:`CHECKED_TRANSFORMERS_VERSIONS`): ``Trainer._prepare_for_training``
        calls it with the optimizer built and, when it returns a wrapper,
        leaves the model to it and prepares only the optimizer with
        Accelerate (no DDP of Accelerate's).  The LR scheduler is created
        here, earlier than the Trainer would, so that the wrapper checkpoints
        it; the wrapper restores the three from the library's checkpoint,
        and the Trainer's state is restored with them.  Evaluation
        (``training=False``) is the Trainer's own.
        """
        if not training:
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        if isinstance(model, AdaptiveDataParallel):
            return model
        if self.optimizer is None:
            raise RuntimeError("AdaptiveTrainer: the Trainer did not build its optimizer before wrapping the model "
                               f"(transformers {transformers.__version__}; checked on "
                               f"{', '.join(CHECKED_TRANSFORMERS_VERSIONS)})")
        self.create_scheduler(num_training_steps=self.state.max_steps, optimizer=self.optimizer)
        kwargs = self.accelerator.ddp_handler.to_kwargs() if self.accelerator.ddp_handler is not None else {}
        if torch.cuda.is_available() and not self.args.use_cpu:
            device = self.args.device
            kwargs.update(device_ids=[device.index], output_device=device.index)
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"AdaptiveTrainer trains a torch.nn.Module, got {type(self.model).__name__}")
        if self._adaptive_scaling_rule is not None:
            kwargs["scaling_rule"] = self._adaptive_scaling_rule
        wrapped = AdaptiveDataParallel(self.model, self.optimizer, self.lr_scheduler, self.accelerator.scaler,
                                       **kwargs)
        self._restore_trainer_state()
        return wrapped

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss, weighted so that a step's gradient is the mean over all its samples.

        The model wrapper averages the gradient over processes; when the
        processes hold different numbers of samples (8 samples on 3
        processes: 3, 3, 2), the mean of their mean losses is not the mean
        over the step's samples.  A per-process *mean* loss is multiplied by
        ``local samples x processes / step samples`` (exactly 1 for even
        shares, 0 on a micro-batch that only repeats samples at an epoch's
        end), so the gradient is the one a single process would compute on
        the whole global batch, at any world size.  A loss the Trainer
        already normalised over the items of the whole batch
        (``num_items_in_batch``, a ``compute_loss_func``, or
        ``loss_is_scaled_for_ga=True``) and evaluation losses are left as
        they are.
        """
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        factor = self._sample_share(num_items_in_batch)
        if factor == 1.0:
            return result
        if isinstance(result, tuple):  # return_outputs=True
            loss, outputs = result
            return loss * factor, outputs
        return result * factor

    def _sample_share(self, num_items_in_batch: Any) -> float:
        """The factor of :meth:`compute_loss` for the micro-batch being trained (1 when none applies)."""
        data = self._adaptive_epochs
        if data is None or not torch.is_grad_enabled() or current_dataloader() is not data.loader:
            return 1.0
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # the Trainer's own rule (Trainer.training_step)
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or getattr(self, "compute_loss_func", None) is not None
        step, micro = data.loader.current_step, data.loader.micro_step
        if scaled or step is None or micro is None:
            return 1.0
        if data.loader.is_padding or step.num_samples == 0:
            return 0.0
        # the processes now (under adaptive-run --live the Trainer's world_size is the one it was built with); the
        # model wrapper averages the gradient over the processes and the step's micro-batches
        return len(step.indices[micro[0]]) * torch.distributed.get_world_size() * micro[1] / step.num_samples

    # ------------------------------------------------------------------ autoscale

    def set_initial_training_values(self, args: TrainingArguments, dataloader: Any) -> tuple[Any, ...]:
        """The Trainer's epoch and step arithmetic; under autoscale an epoch's optimizer steps are unknown ahead.

        ``max_steps`` and the epochs follow from the reference steps of an
        epoch (``len(dataloader)``); the Trainer's loop over an epoch's
        steps is given the epoch's sample count as its bound (a step takes
        at least one sample), and :meth:`get_batch_samples` ends the epoch
        when the loader's pass is over.
        """
        values = list(super().set_initial_training_values(args, dataloader))
        if isinstance(dataloader, OptimizerSteps):
            values[1] = max(int(values[1] or 0), dataloader.loader.sampler.num_samples)  # num_update_steps_per_epoch
        return tuple(values)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        """The next optimizer step's batch; under autoscale one :class:`StepBatch`, and the epoch's end.

        Under autoscale the items of a step's loss (``num_items_in_batch``)
        are counted per micro-batch in :meth:`training_step`, since the
        micro-batches are drawn one at a time; when the loader's pass is
        over the Trainer's epoch ends (``should_epoch_stop``), as no step
        count is known ahead.
        """
        if self._adaptive_steps is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = [batch for batch in itertools.islice(epoch_iterator, num_batches)]
        if not batches:
            self.control.should_epoch_stop = True
        return batches, None

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's training step; under autoscale on every micro-batch of the optimizer step in turn.

        Each micro-batch is drawn from the loader when the previous one was
        trained (the model wrapper synchronises gradients on the last one
        only), its loss items counted by the Trainer's own
        :meth:`get_batch_samples`.  Gradients are zeroed before the first
        (the Trainer's ``zero_grad`` after the previous step ran while that
        step's last micro-batch was published, when the wrapper keeps
        accumulated gradients).  Returns the step's mean loss times the
        reference steps it advances the Trainer by, so that the loss the
        Trainer logs (summed, over the steps counted) is a mean over samples.
        """
        if not isinstance(inputs, StepBatch):
            return super().training_step(model, inputs, num_items_in_batch)
        model.zero_grad()
        total: torch.Tensor | None = None
        counted = self._counted_inputs()
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in counted}
        for micro in inputs.micro_batches():
            _, items = super().get_batch_samples(iter([micro]), 1, self.args.device)
            inputs.flos += float(super().floating_point_ops(micro))
            for key in counted:
                if isinstance(micro, dict) and isinstance(micro.get(key), torch.Tensor):
                    parts[key].append(micro[key].detach())
            loss = super().training_step(model, micro, items)
            total = loss if total is None else total + loss
        inputs.keep_counts(parts)
        assert total is not None
        return total / inputs.count * self._reference_steps_taken()

    def floating_point_ops(self, inputs: Any) -> Any:
        """The Trainer's FLO estimate; for a :class:`StepBatch` the sum over its micro-batches."""
        if isinstance(inputs, StepBatch):
            return inputs.flos
        return super().floating_point_ops(inputs)

    def _counted_inputs(self) -> tuple[str, ...]:
        """The inputs the Trainer counts tokens with (``include_num_input_tokens_seen``), if it counts them."""
        if str(getattr(self.args, "include_num_input_tokens_seen", "no")) in ("no", "False", "false"):
            return ()
        return (getattr(self.model, "main_input_name", "input_ids"), "attention_mask")

    def _reference_after(self, step: Any, epoch: int | None, before: int) -> int:
        """The Trainer's step count once ``step`` is taken, ``before`` it: at least one more (see
        :mod:`adaptive.integrations._trainer_autoscale`)."""
        record, data = self._adaptive_record, self._adaptive_epochs
        assert record is not None and data is not None
        return max(before + 1, reference_steps(data.loader, record.global_batch, epoch or 0, step.position))

    def _reference_steps_taken(self) -> int:
        """How many reference steps the optimizer step being trained advances the Trainer by."""
        data = self._adaptive_epochs
        step = None if data is None else data.loader.current_step
        if step is None:
            return 1
        before = self.state.global_step
        return self._reference_after(step, epochs.current_epoch(), before) - before

    def _follow_reference_steps(self, step: Any, epoch: int | None, state: TrainerState,
                                control: TrainerControl) -> None:
        """After an optimizer step (the Trainer counted one): count the reference steps it took instead.

        The LR scheduler, which the Trainer stepped once, is stepped for the
        others, and the logging, evaluation and save intervals crossed are
        flagged (the Trainer's own checks look for exact multiples).
        """
        before = state.global_step - 1
        state.global_step = self._reference_after(step, epoch, before)
        extra = state.global_step - before - 1
        scheduler = self.lr_scheduler
        per_step = not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and \
            type(scheduler).__name__ != "GreedyLR"
        if extra > 0 and scheduler is not None and per_step and not self.accelerator.optimizer_step_was_skipped:
            for _ in range(extra):
                scheduler.step()
        _flag_crossed_intervals(self.args, state, control, before)

    # ------------------------------------------------------------------ TrainerState

    def _carried_state(self) -> dict[str, Any]:
        """The ``TrainerState`` fields that carry on across restarts, as plain JSON values."""
        fields = {name: getattr(self.state, name) for name in CARRIED_FIELDS}
        fields["log_history"] = list(fields["log_history"] or [])
        fields["stateful_callbacks"] = checkpoints.callback_states(self.callback_handler.callbacks, ExportableState)
        return fields

    def _restore_trainer_state(self) -> None:
        """Put the checkpointed ``TrainerState`` fields back (before the Trainer reads its starting step)."""
        record = self._adaptive_record
        if record is None:
            return
        record.trainer_state = self._carried_state  # saved live from now on
        record.on_admission = self._apply_saved_trainer_state  # a live joiner gets them when it is admitted
        self._apply_saved_trainer_state()

    def _apply_saved_trainer_state(self) -> None:
        """The restored record's ``TrainerState`` fields and callback states, applied to the Trainer's."""
        record = self._adaptive_record
        saved = None if record is None else record.saved_trainer_state
        if saved is None:
            return
        for name in CARRIED_FIELDS:
            if name in saved:
                setattr(self.state, name, saved[name])
        checkpoints.restore_callback_states(self.callback_handler.callbacks, ExportableState,
                                            saved.get("stateful_callbacks") or {})
        if env.rank() == 0:
            logger.info("AdaptiveTrainer resumes at global step %d, epoch %.3f (of %d steps)",
                        self.state.global_step, self.state.epoch, self.state.max_steps)
