"""AdaptiveStrategy: a Lightning script becomes elastic by changing one argument.

::

    import lightning as L
    from adaptive.integrations.lightning import AdaptiveStrategy

    trainer = L.Trainer(max_epochs=10, strategy=AdaptiveStrategy())      # was: strategy="ddp"
    trainer.fit(model, datamodule=data)                                  # resumes by itself

Launched with ``adaptive-run`` (or torchrun), or as ``python train.py``
for one process, a relaunch on any number of processes resumes at the
exact sample where the last checkpoint left it, with the global batch of
the first launch.  What the strategy takes over, and why:

* **Processes.**  :class:`AdaptiveEnvironment`, the strategy's cluster
  environment, reads ranks and the world size from torchrun's variables
  (one process when none is set); ``devices`` and ``num_nodes`` may stay
  at their defaults: the same Trainer line works at every world size.
  The process group is the library's (``adaptive.init_process_group``,
  gloo on the CPU, NCCL on CUDA), which Lightning adopts.
* **Training data.**  Each training DataLoader the LightningModule or
  LightningDataModule returns becomes an :class:`~adaptive.AdaptiveDataLoader`
  over the same dataset, collate function, workers and order
  (``RandomSampler``: shuffled, seeded by ``generator`` or
  ``seed_everything``; ``SequentialSampler``: in order).  Lightning adds no
  ``DistributedSampler`` to it (it still does to the validation loaders).
  The global batch of the first launch, ``batch_size`` x processes x
  ``accumulate_grad_batches``, is recorded in the checkpoint and kept at
  every later world size; each optimizer step is
  ``accumulate_grad_batches`` micro-batches, split over the processes there
  are now.  Lightning sees one epoch of the loader per epoch of
  :func:`adaptive.remaining_epochs_until`.
* **Model, optimizer, LR scheduler.**  The LightningModule is wrapped in an
  :class:`~adaptive.AdaptiveDataParallel` (instead of DDP) with the
  optimizer and LR scheduler that ``configure_optimizers`` returned, so the
  library's checkpoint holds them with the loader's position.  Lightning
  still steps the scheduler (per step or per epoch, as configured).
* **Accumulation.**  Lightning divides each micro-batch's loss by
  ``accumulate_grad_batches``; the wrapper already averages the gradient
  over processes and micro-batches, so the strategy's ``backward`` undoes
  the division, and weights each process's mean loss by its share of the
  step's samples (exactly 1 for even shares), so that a step's gradient is
  the mean over its samples at any world size.
* **Counters.**  ``global_step``, ``current_epoch``, the batches of the
  epoch and the loggers' step are checkpointed with the library's state and
  restored before training resumes.
* **Stops.**  SIGTERM (or :func:`adaptive.request_stop`) stops every
  process after the same step; the library checkpoints and they exit 143.
  Lightning's own SIGTERM handling is replaced while training.
* **Autoscale** (``autoscale_batch_size=``, with the other arguments of
  :meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`): the loader
  chooses the micro-batch size and accumulation steps from the goodput
  model; Lightning's accumulation (``accumulate_grad_batches``, whether a
  micro-batch steps the optimizer) and its count of the epoch's batches
  follow the loader's plan at every micro-batch, ``global_step`` counts
  optimizer steps, per-step LR schedulers count steps of the reference
  batch (so that they follow the samples), and the model wrapper's scaling
  rule scales the LR on top (:mod:`adaptive.integrations._lightning_autoscale`).
* **Lightning's checkpoints.**  Every checkpoint Lightning writes during
  ``fit`` (``ModelCheckpoint``, ``Trainer.save_checkpoint``) carries the
  library's state (``checkpoint["adaptive"]``: loader position, epoch,
  random generators, model wrapper, counters at the step boundary), and
  ``fit(ckpt_path=...)`` resumes from it exactly, at any world size, unless
  the library's own newest checkpoint continues the same run beyond it
  (:mod:`adaptive.integrations._lightning_checkpoint`).
* **Live membership.**  Under ``adaptive-run --live`` a joiner is admitted
  when Lightning sets up the training data, takes the members' state and
  Lightning's counters, and runs its strategy collectives alone until its
  first batch (Lightning's data set-up runs some the members do not);
  rank-zero logging and the validation dataloaders follow every change.

Lightning's private parts are kept in one module,
:mod:`adaptive.integrations._lightning_loops`, checked against
:data:`CHECKED_LIGHTNING_VERSIONS`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import uuid
from typing import Any, Callable, Iterator

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
except ImportError as error:  # the optional extra is missing
    raise ImportError("adaptive.integrations.lightning needs Lightning, which is not installed: "
                      "pip install adaptive-elastic[lightning]") from error

import torch
import torch.utils.data

from adaptive.checkpoint import admission
from adaptive.checkpoint.states import State, load_state
from adaptive.data._loader_options import options_of
from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.elastic import epoch as epochs
from adaptive.integrations import _lightning_checkpoint as embedded_state
from adaptive.integrations._autoscale_settings import AutoscaleSettings, reference_steps, settings_from
from adaptive.integrations._lightning_autoscale import PlannedPasses, epoch_micro_batches
from adaptive.integrations._lightning_loops import (CHECKED_LIGHTNING_VERSIONS, accumulate_as_planned,
                                                    batches_that_stepped, check_lightning_internals,
                                                    check_lightning_version, counters_at_boundary, fetched_batches,
                                                    follow_epoch_length, global_step_of, loop_counters,
                                                    rebuild_evaluation_data, restore_loop_counters,
                                                    skip_sigterm_broadcast, train_without_distributed_sampler)
from adaptive.integrations._epoch_passes import EpochPasses
from adaptive.parallel.data_parallel import AdaptiveDataParallel
from adaptive.runtime import env, membership
from adaptive.runtime.collectives import init_process_group
from adaptive.runtime.step import current_step

__all__ = ["AdaptiveEnvironment", "AdaptiveStrategy", "CHECKED_LIGHTNING_VERSIONS", "RECORD_STATE_NAME"]

logger = logging.getLogger(__name__)

#: The checkpointed record of the first launch and of Lightning's counters.
RECORD_STATE_NAME = "adaptive.integrations.lightning"

#: The training loader's checkpoint name.
LOADER_NAME = "lightning.train"

#: Epochs for ``remaining_epochs_until`` when the Trainer has no epoch limit (``max_epochs=-1``).
_UNLIMITED_EPOCHS = 2**31 - 1

check_lightning_version()


class AdaptiveEnvironment(ClusterEnvironment):
    """Ranks and world size from torchrun's variables (``adaptive-run``), one process when none is set.

    The processes are started outside Lightning (by the launcher), so
    Lightning launches none; ``devices`` and ``num_nodes`` given to the
    Trainer are not checked against the job: the job's size wins.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return env.master_addr()

    @property
    def main_port(self) -> int:
        return env.master_port() or 0

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return env.num_replicas()

    def set_world_size(self, size: int) -> None:
        pass  # the job's size comes from the launcher

    def global_rank(self) -> int:
        return env.rank()

    def set_global_rank(self, rank: int) -> None:
        pass  # as set_world_size

    def local_rank(self) -> int:
        return env.local_rank()

    def node_rank(self) -> int:
        return env.node_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        pass  # devices and num_nodes may stay at their defaults at every world size


class LightningRecord(State):
    """The first launch's processes and accumulation, and Lightning's loop counters; checkpointed.

    The counters are read live at every save (``counters`` is a callable)
    and kept, as restored, until the strategy applies them (``on_admission``
    applies them on a live joiner once it is admitted).  ``run`` names the
    training run (made at the first launch, kept by every resume), so that
    ``fit(ckpt_path=...)`` can tell a later checkpoint of the same run from
    another run's.
    """

    version = 2  # 2 adds "run"
    migrations = {1: lambda state: dict(state, run="")}

    def __init__(self, processes: int, accumulation: int) -> None:
        super().__init__(RECORD_STATE_NAME)
        self.processes = processes
        self.accumulation = accumulation
        self.run = uuid.uuid4().hex  # only rank 0's is saved, and every rank reads that one back
        self.counters: Callable[[], dict[str, Any]] | None = None
        self.saved_counters: dict[str, Any] | None = None
        self.on_admission: Callable[[], None] | None = None
        self.restored = load_state(self)
        if self.restored and (self.processes, self.accumulation) != (processes, accumulation) and env.rank() == 0:
            logger.info("first launch: %d processes x %d accumulated batches; now %d x %d: the first launch's "
                        "global batch is kept", self.processes, self.accumulation, processes, accumulation)

    def state_dict(self) -> dict[str, Any]:
        counters = self.counters() if self.counters is not None else self.saved_counters
        return {"processes": self.processes, "accumulation": self.accumulation, "counters": json.dumps(counters),
                "run": self.run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.processes = int(state["processes"])
        self.accumulation = int(state["accumulation"])
        self.saved_counters = json.loads(state["counters"])
        if state["run"]:  # (a version-1 record has none: keep the new one)
            self.run = str(state["run"])

    def restore_on_admission(self) -> None:
        super().restore_on_admission()
        if self.on_admission is not None:
            self.on_admission()


class AdaptiveStrategy(DDPStrategy):
    """Lightning's DDP strategy with elastic data, model and state (see the module docstring).

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; default gloo on the
            CPU, NCCL on CUDA.
        autoscale_batch_size: turns autoscale on: the largest global batch
            (samples over all processes and micro-batches), at least the
            reference global batch (the first launch's ``batch_size`` x
            processes x ``accumulate_grad_batches``); the ``max_batch_size``
            of :meth:`adaptive.AdaptiveDataLoader.autoscale_batch_size`.
        local_bsz_bounds, gradient_accumulation, adapt_every, hysteresis: as
            in ``autoscale_batch_size`` (only with ``autoscale_batch_size``).
        scaling_rule: the model wrapper's LR scaling rule
            (:class:`~adaptive.AdaptiveDataParallel`; default AdaScale for
            SGD, its square root for Adam-like optimizers).
        **kwargs: passed to ``DistributedDataParallel`` through
            :class:`~adaptive.AdaptiveDataParallel` (``find_unused_parameters``,
            ``bucket_cap_mb``, ...), as ``DDPStrategy`` passes them.

    One ``trainer.fit()`` per process: the loader, model wrapper and record
    are checkpointed states of fixed names.  One optimizer (automatic
    optimization), at most one LR scheduler, one training dataloader.

    Raises:
        ValueError, TypeError: an autoscale setting out of range, or given
            without ``autoscale_batch_size`` (naming the argument).
    """

    strategy_name = "adaptive"

    def __init__(self, process_group_backend: str | None = None, *, autoscale_batch_size: int | None = None,
                 local_bsz_bounds: tuple[int, int] | None = None, gradient_accumulation: bool = False,
                 adapt_every: int = 20, hysteresis: float = 0.05, scaling_rule: Any = None, **kwargs: Any) -> None:
        self._autoscale: AutoscaleSettings | None = settings_from(
            "AdaptiveStrategy", "autoscale_batch_size",
            "the first launch's batch_size x processes x accumulate_grad_batches", autoscale_batch_size,
            local_bsz_bounds, gradient_accumulation, adapt_every, hysteresis)
        self._scaling_rule = scaling_rule
        for refused in ("cluster_environment", "parallel_devices", "ddp_comm_hook", "ddp_comm_state",
                        "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(refused) is not None:
                raise ValueError(f"AdaptiveStrategy does not take {refused}= (the job's environment and the "
                                 "library's gradient reduction are used)")
        super().__init__(cluster_environment=AdaptiveEnvironment(), process_group_backend=process_group_backend,
                         **kwargs)
        self._record: LightningRecord | None = None
        self._epochs: EpochPasses | None = None
        self._library_handlers: dict[int, Any] = {}
        self._fitted = False
        self._joining = False  # a live joiner, until its first training batch (see _local_while_joining)
        self._stepped_before_batch = 0  # Lightning's _batches_that_stepped when the batch in progress started
        self._reference_batch = 0  # the first launch's global batch (what the LR schedule counts steps of)

    # ------------------------------------------------------------------ processes

    @property
    def is_distributed(self) -> bool:
        return True  # (sync_dist logging, the validation loaders' DistributedSampler), also with one process

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": env.num_replicas(), "rank": env.rank()}

    def setup_environment(self) -> None:
        """One device per process, from the job's local size; the library's process group, adopted."""
        local = env.num_local_replicas()
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            self.parallel_devices = [torch.device("cuda", i) for i in range(local)]
        else:
            self.parallel_devices = [torch.device("cpu")] * local
        self.num_nodes = env.num_nodes()
        super().setup_environment()

    def setup_distributed(self) -> None:
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        init_process_group(backend)  # Lightning's own set-up adopts the initialised group
        super().setup_distributed()

    def set_world_ranks(self) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ model, optimizer, record

    def setup(self, trainer: pl.Trainer) -> None:
        """Build the optimizer, then wrap the LightningModule with it in an ``AdaptiveDataParallel``.

        Raises:
            ValueError: several optimizers or LR schedulers, manual
                optimization, or a second ``fit`` in the same process.
        """
        if trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        if self._fitted:
            raise RuntimeError("AdaptiveStrategy runs one trainer.fit() per process: its loader, model wrapper and "
                               "record are checkpointed states of fixed names")
        self._fitted = True
        check_lightning_internals(trainer)
        module = self.lightning_module
        assert module is not None and self.accelerator is not None and self.model is not None
        if not module.automatic_optimization:
            raise ValueError("AdaptiveStrategy supports automatic optimization only (automatic_optimization=True)")
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._joining = membership.is_live() and membership.is_awaiting_admission()
        # before configure_optimizers, which may set up the training data (trainer.estimated_stepping_batches)
        self._record = LightningRecord(env.num_replicas(), int(trainer.accumulate_grad_batches))
        train_without_distributed_sampler(trainer)
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers; AdaptiveStrategy "
                             "trains with one (AdaptiveDataParallel checkpoints one optimizer)")
        if len(self.lr_scheduler_configs) > 1:
            raise ValueError(f"configure_optimizers returned {len(self.lr_scheduler_configs)} LR schedulers; "
                             "AdaptiveStrategy checkpoints one")
        scheduler = self.lr_scheduler_configs[0].scheduler if self.lr_scheduler_configs else None
        kwargs = dict(self._ddp_kwargs)
        if self._scaling_rule is not None:
            kwargs["scaling_rule"] = self._scaling_rule
        if self.root_device.type == "cuda":
            kwargs.update(device_ids=[self.root_device.index], output_device=self.root_device.index)
        self.model = AdaptiveDataParallel(module, self.optimizers[0], scheduler, name="lightning", **kwargs)
        self._library_handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        self.setup_precision_plugin()  # (optimizer state restored from a checkpoint is on its parameters' device)
        record = self._record
        self._apply_saved_counters(trainer, "resumes")
        record.counters = lambda: loop_counters(trainer)
        record.on_admission = lambda: self._apply_saved_counters(trainer, "joins the job")
        skip_sigterm_broadcast(trainer)  # (the library's SIGTERM handling replaces Lightning's flag)
        if self._autoscale is not None:
            accumulate_as_planned(trainer, self._accumulating)
        if membership.is_live():
            membership.on_regroup(lambda: self._follow_regroup(trainer))

    def _apply_saved_counters(self, trainer: pl.Trainer, what: str) -> None:
        """Lightning's counters as the record restored them (from a checkpoint, or from the members of a live
        job when this process was admitted)."""
        record = self._record
        if record is None or record.saved_counters is None:
            return
        restore_loop_counters(trainer, record.saved_counters)
        self._stepped_before_batch = batches_that_stepped(trainer)
        if env.rank() == 0 or what != "resumes":
            logger.info("Lightning %s at epoch %d, global step %d", what, trainer.current_epoch, trainer.global_step)

    def _follow_regroup(self, trainer: pl.Trainer) -> None:
        """Live: after a membership change, Lightning's rank-zero logging follows the new rank, and the next
        validation builds its dataloaders (their ``DistributedSampler``) for the processes there are now."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = env.rank()  # type: ignore[attr-defined]
        rebuild_evaluation_data(trainer)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._take_signals_back()  # the sanity check runs before on_train_start

    def on_train_start(self) -> None:
        super().on_train_start()
        self._take_signals_back()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Note Lightning's ``_batches_that_stepped`` as the batch starts (for a checkpoint written in its hooks);
        a live joiner's first batch ends its set-up (see :meth:`_local_while_joining`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            self._stepped_before_batch = batches_that_stepped(trainer)
            if self._joining:
                self._joining = False
                rebuild_evaluation_data(trainer)  # built alone; built again with every member at the next validation
        super().on_train_batch_start(batch, batch_idx)

    # ------------------------------------------------------------------ live joiners

    def _local_while_joining(self) -> bool:
        """Whether this process is a live joiner that has not trained its first batch yet.

        Lightning's data set-up runs a barrier and all-reduces the loaders'
        lengths, before and after the training loader's first ``iter()``,
        where the joiner is admitted; the members, then between two batches,
        run none of them.  Until its first batch the joiner's collectives of
        the strategy are its own: the elastic loader has the same length on
        every process.
        """
        return self._joining

    def barrier(self, name: str | None = None) -> None:
        if not self._local_while_joining():
            super().barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._local_while_joining() else super().broadcast(obj, src)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return tensor if self._local_while_joining() else super().reduce(tensor, group=group, reduce_op=reduce_op)

    # ------------------------------------------------------------------ Lightning's checkpoints

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's checkpoint, with the library's state in it (``checkpoint["adaptive"]``), so that
        ``fit(ckpt_path=...)`` resumes it exactly; collective, as ``Trainer.save_checkpoint`` is.

        A weights-only checkpoint, or one written in the middle of a batch or of an accumulated step, holds
        none (a warning says so for the latter).
        """
        contents = self._library_contents(checkpoint)
        if contents is not None:
            checkpoint[embedded_state.EMBEDDED_KEY] = contents
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _library_contents(self, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """The library's state for Lightning's ``checkpoint`` (on rank 0; collective), or None when it gets none."""
        record, module = self._record, self.lightning_module
        trainer = module.trainer if module is not None else None
        if record is None or record.counters is None or trainer is None or "optimizer_states" not in checkpoint:
            return None  # not fitting, or a weights-only checkpoint
        found = self._counters_at_save(trainer)
        if found is None:
            return None
        counters, stepped = found

        def replace(contents: dict[str, Any]) -> None:
            contents[record.name] = dict(contents[record.name], counters=json.dumps(counters))

        return embedded_state.library_contents(self.train_loader, stepped, replace)

    def _counters_at_save(self, trainer: pl.Trainer) -> tuple[dict[str, Any], bool] | None:
        """Lightning's counters at the step boundary the loader's saved position stands for, and whether the
        loader's step in progress had its optimizer step taken; None inside a batch (no exact boundary)."""
        loader = self.train_loader
        step = None if loader is None else loader.current_step
        if loader is None or step is None:  # before the first batch, between epochs' passes, or after training
            return loop_counters(trainer), False
        micro = loader.micro_step
        progress = loop_counters(trainer)["batch_progress"]["total"]
        if progress["processed"] != progress["ready"] or micro is None:
            if env.rank() == 0:
                logger.warning("a Lightning checkpoint written in the middle of a training batch holds no library "
                               "state: fit(ckpt_path=...) cannot resume it exactly")
            return None
        stepped = not loader.is_accumulation_step()
        if not stepped and env.rank() == 0:
            logger.warning("a Lightning checkpoint written in the middle of an accumulated step: it resumes at the "
                           "step's start (the step's first %d micro-batches are trained again)", micro[0] + 1)
        back = 0 if stepped else micro[0] + 1
        return counters_at_boundary(trainer, back, self._stepped_before_batch, stepped), stepped

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint for ``fit(ckpt_path=...)``; the library resumes from the state in it.

        Every library state (model, optimizer, LR scheduler, loader position,
        epoch, random generators, accumulators, Lightning's counters) then
        restores from the checkpoint's library state, at any world size,
        unless the library's own newest checkpoint continues the same run
        beyond it (then that one wins, and the file's training state is
        ignored).  Lightning still restores the file's callbacks, datamodule
        and precision states; its loop counters are the library's (they
        stand at the step boundary the loader's position was saved at).

        Raises:
            ValueError: the file holds no library state (see :meth:`save_checkpoint`).
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        embedded = checkpoint.pop(embedded_state.EMBEDDED_KEY, None)
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return checkpoint
        chosen = embedded_state.choose_embedded(checkpoint_path, embedded, RECORD_STATE_NAME, global_step_of)
        checkpoint.pop("loops", None)  # Lightning's counters come with the library's state
        if chosen is None:  # the library's own newest checkpoint, or a live job's members: not this file's
            checkpoint["optimizer_states"], checkpoint["lr_schedulers"] = [], []
        else:
            embedded_state.resume_from_embedded(chosen)
        return checkpoint

    def _take_signals_back(self) -> None:
        """The library's SIGTERM and SIGINT handlers again: Lightning installs its own once the strategy is set up
        (its SIGTERM handler broadcasts from inside the handler and ends ``fit`` with exit 1); the library's
        makes every process agree on a stop at a step boundary, checkpoint, and exit 143."""
        for signum, handler in self._library_handlers.items():
            if callable(handler) and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)

    def on_train_end(self) -> None:
        """Training ended (``max_epochs`` or ``max_steps`` reached, or ``trainer.should_stop``): the loader commits
        the last step and the job is checkpointed as finished, so that a relaunch trains nothing."""
        super().on_train_end()
        if self._epochs is not None:
            self._epochs.finish()

    def on_exception(self, exception: BaseException) -> None:
        """``fit`` is interrupted (the agreed stop's exit 143, an error): end the elastic epochs here."""
        super().on_exception(exception)
        if self._epochs is not None:
            self._epochs.close()

    def teardown(self) -> None:
        if isinstance(self.model, AdaptiveDataParallel):
            self.model = self.lightning_module
        super().teardown()

    # ------------------------------------------------------------------ data

    @property
    def train_loader(self) -> AdaptiveDataLoader | None:
        """The elastic training loader (its ``step``, ``current_step``, ``is_accumulation_step()``, ...), once
        ``fit`` has set up the training data; None before."""
        return None if self._epochs is None else self._epochs.loader

    def process_dataloader(self, dataloader: object) -> object:
        """The training DataLoader becomes the epochs of an ``AdaptiveDataLoader``; other stages' are kept.

        Raises:
            ValueError: a custom sampler or batch sampler, an
                ``IterableDataset``, or several training dataloaders.
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self._epochs is not None:
            if self._epochs.loader.dataset is getattr(dataloader, "dataset", None):
                return self._epochs  # reloaded (reload_dataloaders_every_n_epochs): the same elastic loader
            raise ValueError("AdaptiveStrategy trains with one training dataloader (a CombinedLoader of several, or "
                             "a reloaded one over another dataset, is not supported)")
        if self._joining:
            # A live joiner is admitted here, before Lightning counts the training batches: the loader is built
            # with the job's record (the first launch's global batch) and restores the members' position.
            admission.admit()
        loader = self._make_loader(dataloader)
        early_end = ("Lightning ended an epoch before the elastic loader did (limit_train_batches, or "
                     "on_train_batch_start returned -1); stop training instead (trainer.should_stop = True)")
        if self._autoscale is None:
            self._epochs = EpochPasses(loader, lambda: _epoch_limit(trainer), front_end="AdaptiveStrategy",
                                       early_end=early_end)
            return self._epochs
        self._epochs = PlannedPasses(loader, lambda: _epoch_limit(trainer), front_end="AdaptiveStrategy",
                                     early_end=early_end, on_micro_batch=lambda: self._follow_plan(trainer),
                                     reference_batch=self._reference_batch)
        trainer.accumulate_grad_batches = 1  # len() counts reference steps until the first batch (see PlannedPasses)
        return self._epochs

    def _make_loader(self, dataloader: object) -> AdaptiveDataLoader:
        if isinstance(dataloader, AdaptiveDataLoader):
            return dataloader
        if not isinstance(dataloader, torch.utils.data.DataLoader):
            raise ValueError(f"AdaptiveStrategy needs a torch.utils.data.DataLoader as training dataloader, got "
                             f"{type(dataloader).__name__}")
        if isinstance(dataloader.dataset, torch.utils.data.IterableDataset):
            raise ValueError("AdaptiveStrategy needs a map-style training dataset (__len__ and __getitem__): the "
                             "elastic loader walks a seeded permutation of it")
        shuffle, kwargs = options_of(dataloader, None)
        record = self._record
        assert record is not None and dataloader.batch_size is not None  # options_of refused a batch_sampler
        global_batch = dataloader.batch_size * record.processes * record.accumulation
        if dataloader.generator is not None:
            seed = dataloader.generator.initial_seed()
        else:
            seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        self._reference_batch = global_batch
        accumulation = record.accumulation if self._autoscale is None else 1  # (autoscale plans the micro-steps)
        loader = AdaptiveDataLoader(dataloader.dataset, batch_size=global_batch, shuffle=shuffle, seed=seed,
                                    drop_last=dataloader.drop_last, accumulation_steps=accumulation,
                                    name=LOADER_NAME, **kwargs)
        if self._autoscale is not None:
            self._autoscale.apply(loader)
            if env.rank() == 0:
                logger.info("autoscale on: global batch up to %d, local batch bounds %s, gradient accumulation %s; "
                            "LR schedules count steps of the reference batch %d", self._autoscale.max_batch_size,
                            self._autoscale.local_bsz_bounds, self._autoscale.gradient_accumulation, global_batch)
        if env.rank() == 0:
            logger.info("training DataLoader (batch_size=%d per process) -> AdaptiveDataLoader %s: global batch %d "
                        "(%d per process x %d processes x %d accumulated batches of the first launch), %d "
                        "micro-batches per epoch", dataloader.batch_size, loader.name, global_batch,
                        dataloader.batch_size, record.processes, record.accumulation, len(loader))
        return loader

    # ------------------------------------------------------------------ autoscale

    def _accumulating(self) -> bool:
        """Under autoscale, whether Lightning accumulates on the batch in progress: the loader's plan says so
        (False between steps)."""
        loader = self.train_loader
        if loader is None or current_dataloader() is not loader:
            return False
        return loader.is_accumulation_step()

    def _follow_plan(self, trainer: pl.Trainer) -> None:
        """The loader yields a micro-batch: Lightning's ``accumulate_grad_batches`` becomes its step's
        micro-batches, and Lightning's count of the epoch's batches follows the plan (before its fetcher counts
        the batch).

        The first micro-batch of a step zeroes the gradients (the LightningModule's ``optimizer_zero_grad``):
        Lightning zeroes them when ``batch_idx`` is a multiple of ``accumulate_grad_batches``, which need not
        fall on a step's first micro-batch once the plan changed inside the epoch (the model wrapper ignores a
        call inside a step, but a step that got none would add the previous step's gradients).
        """
        loader, module = self.train_loader, self.lightning_module
        micro = None if loader is None else loader.micro_step
        if loader is None or micro is None:
            return
        trainer.accumulate_grad_batches = micro[1]
        context = current_step()
        if context is not None and context.init_batch_size != self._reference_batch:
            # the checkpointed reference batch wins over the one computed from this launch's DataLoader
            self._reference_batch = context.init_batch_size
            if isinstance(self._epochs, PlannedPasses):
                self._epochs.reference_batch = context.init_batch_size
        fetched = fetched_batches(trainer)
        follow_epoch_length(trainer, epoch_micro_batches(loader, fetched))
        if micro[0] == 0 and module is not None and self.optimizers:
            module.optimizer_zero_grad(trainer.current_epoch, fetched, self.optimizers[0])

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step; under autoscale, per-step LR schedulers then follow the samples: a step of ``k``
        reference batches advances them by ``k`` (Lightning steps them once more after the batch).

        The model wrapper takes the step's batch configuration first: Lightning runs the last micro-batch's
        forward inside ``optimizer.step`` (its closure), after the scaling rule's pre-step hook has read the
        configuration, which would otherwise still be the previous step's (a step of one micro-batch after a
        batch-size change would get the previous step's LR factor).
        """
        if isinstance(self.model, AdaptiveDataParallel):
            self.model._follow_step()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._autoscale is not None:
            self._advance_schedulers()
        return output

    def _advance_schedulers(self) -> None:
        """Step each per-step LR scheduler up to the reference steps the samples trained so far stand for, less
        the one step Lightning takes after the batch: its count is then ``max(count + 1, reference steps)``
        (a step smaller than the reference batch still counts one)."""
        loader, module = self.train_loader, self.lightning_module
        step = None if loader is None else loader.current_step
        if loader is None or step is None or module is None or self._reference_batch <= 0:
            return
        target = reference_steps(loader, self._reference_batch, epochs.current_epoch() or 0, step.position)
        for config in self.lr_scheduler_configs:
            counted = getattr(config.scheduler, "last_epoch", None)
            if config.interval != "step" or config.frequency != 1 or config.reduce_on_plateau or counted is None:
                continue
            for _ in range(target - int(counted) - 1):
                module.lr_scheduler_step(config.scheduler, None)

    # ------------------------------------------------------------------ training step

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to do: the wrapper skips the all-reduce on every micro-batch but the last of a step."""
        yield None

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Backward of the loss Lightning divided by ``accumulate_grad_batches``, scaled back and weighted by this
        process's share of the step's samples (see the module docstring)."""
        factor = self._loss_factor()
        scaled = closure_loss * factor if factor != 1.0 else closure_loss
        super().backward(scaled, optimizer, *args, **kwargs)
        return closure_loss

    def _loss_factor(self) -> float:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        undo = float(trainer.accumulate_grad_batches) if trainer is not None else 1.0
        loader = self._epochs.loader if self._epochs is not None else None
        if loader is None or current_dataloader() is not loader:
            return undo
        step, micro = loader.current_step, loader.micro_step
        if step is None or micro is None:
            return undo
        if loader.is_padding or step.num_samples == 0:
            return 0.0
        local = len(step.indices[micro[0]])
        share_numerator = local * env.num_replicas() * micro[1]
        share = 1.0 if share_numerator == step.num_samples else share_numerator / step.num_samples
        return undo * share


def _epoch_limit(trainer: pl.Trainer) -> int:
    """The epochs ``remaining_epochs_until`` runs: the Trainer's ``max_epochs`` (unlimited when -1)."""
    limit = trainer.max_epochs
    return _UNLIMITED_EPOCHS if limit is None or limit < 0 else int(limit)
