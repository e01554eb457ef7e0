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

from adaptive.checkpoint.states import State, load_state
from adaptive.data._loader_options import options_of
from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.integrations._lightning_loops import (CHECKED_LIGHTNING_VERSIONS, check_lightning_internals,
                                                    check_lightning_version, loop_counters, restore_loop_counters,
                                                    train_without_distributed_sampler)
from adaptive.integrations._epoch_passes import EpochPasses
from adaptive.parallel.data_parallel import AdaptiveDataParallel
from adaptive.runtime import env
from adaptive.runtime.collectives import init_process_group

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
    and kept, as restored, until the strategy applies them.
    """

    def __init__(self, processes: int, accumulation: int) -> None:
        super().__init__(RECORD_STATE_NAME)
        self.processes = processes
        self.accumulation = accumulation
        self.counters: Callable[[], dict[str, Any]] | None = None
        self.saved_counters: dict[str, Any] | None = None
        self.restored = load_state(self)
        if self.restored and (self.processes, self.accumulation) != (processes, accumulation) and env.rank() == 0:
            logger.info("first launch: %d processes x %d accumulated batches; now %d x %d: the first launch's "
                        "global batch is kept", self.processes, self.accumulation, processes, accumulation)

    def state_dict(self) -> dict[str, Any]:
        counters = self.counters() if self.counters is not None else self.saved_counters
        return {"processes": self.processes, "accumulation": self.accumulation, "counters": json.dumps(counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.processes = int(state["processes"])
        self.accumulation = int(state["accumulation"])
        self.saved_counters = json.loads(state["counters"])


class AdaptiveStrategy(DDPStrategy):
    """Lightning's DDP strategy with elastic data, model and state (see the module docstring).

    Args:
        process_group_backend: ``"gloo"`` or ``"nccl"``; default gloo on the
            CPU, NCCL on CUDA.
        **kwargs: passed to ``DistributedDataParallel`` through
            :class:`~adaptive.AdaptiveDataParallel` (``find_unused_parameters``,
            ``bucket_cap_mb``, ...), as ``DDPStrategy`` passes them.

    One ``trainer.fit()`` per process: the loader, model wrapper and record
    are checkpointed states of fixed names.  One optimizer (automatic
    optimization), at most one LR scheduler, one training dataloader.
    """

    strategy_name = "adaptive"

    def __init__(self, process_group_backend: str | None = None, **kwargs: Any) -> None:
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
        if self.root_device.type == "cuda":
            kwargs.update(device_ids=[self.root_device.index], output_device=self.root_device.index)
        self.model = AdaptiveDataParallel(module, self.optimizers[0], scheduler, name="lightning", **kwargs)
        self._library_handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        self.setup_precision_plugin()  # (optimizer state restored from a checkpoint is on its parameters' device)
        record = self._record
        if record.saved_counters is not None:
            restore_loop_counters(trainer, record.saved_counters)
            if env.rank() == 0:
                logger.info("Lightning resumes at epoch %d, global step %d", trainer.current_epoch,
                            trainer.global_step)
        record.counters = lambda: loop_counters(trainer)
        if trainer.ckpt_path is not None and env.rank() == 0:
            logger.warning("trainer.fit(ckpt_path=%r): Lightning restores its checkpoint's optimizer, LR scheduler and "
                           "loop counters over the library's, and a Lightning checkpoint holds no loader position: "
                           "the resume is not exact. AdaptiveStrategy resumes by itself from the library's newest "
                           "checkpoint; leave ckpt_path out", str(trainer.ckpt_path))

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._take_signals_back()  # the sanity check runs before on_train_start

    def on_train_start(self) -> None:
        super().on_train_start()
        self._take_signals_back()

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
        self._epochs = EpochPasses(
            self._make_loader(dataloader), lambda: _epoch_limit(trainer), front_end="AdaptiveStrategy",
            early_end="Lightning ended an epoch before the elastic loader did (limit_train_batches, or "
                      "on_train_batch_start returned -1); stop training instead (trainer.should_stop = True)")
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
        loader = AdaptiveDataLoader(dataloader.dataset, batch_size=global_batch, shuffle=shuffle, seed=seed,
                                    drop_last=dataloader.drop_last, accumulation_steps=record.accumulation,
                                    name=LOADER_NAME, **kwargs)
        if env.rank() == 0:
            logger.info("training DataLoader (batch_size=%d per process) -> AdaptiveDataLoader %s: global batch %d "
                        "(%d per process x %d processes x %d accumulated batches of the first launch), %d "
                        "micro-batches per epoch", dataloader.batch_size, loader.name, global_batch,
                        dataloader.batch_size, record.processes, record.accumulation, len(loader))
        return loader

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
