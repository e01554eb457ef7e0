"""AdaptiveAccelerator: an Accelerate script becomes elastic by changing one line.

::

    from adaptive.integrations.accelerate import AdaptiveAccelerator

    accelerator = AdaptiveAccelerator(gradient_accumulation_steps=2)      # was: Accelerator(...)
    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler)
    for epoch in adaptive.remaining_epochs_until(num_epochs):             # was: range(num_epochs)
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()

What the accelerator takes over, and why:

* **The process group.**  ``adaptive.init_process_group()`` runs before
  Accelerate builds its state.  Accelerate treats a job as distributed on
  the CPU only through its ``cpu=True`` path (``PartialState`` picks the
  backend from the device, and a CPU without ``cpu=True`` is "no
  distributed" even when a gloo group exists), so on a machine without
  CUDA the accelerator is built with ``cpu=True``: it then adopts the gloo
  group the library created (``torch.distributed.is_initialized()``) and
  reports the job's world size.
* **Data loaders.**  Each ``torch.utils.data.DataLoader`` given to
  :meth:`AdaptiveAccelerator.prepare` becomes an
  :class:`~adaptive.AdaptiveDataLoader` over the same dataset, collate
  function, workers, order (``RandomSampler``: shuffled) and ``drop_last``;
  Accelerate never wraps it, so the data is sharded once, by the library.
  The DataLoader's ``batch_size`` is per process, as Accelerate users write
  it; the *global* batch of the first launch (``batch_size`` x processes x
  ``gradient_accumulation_steps``; without the processes factor with
  ``split_batches=True``) is recorded in the checkpoint and kept at every
  later world size.  An ``AdaptiveDataLoader`` passes through as it is.
* **Model, optimizer, LR scheduler.**  A model given with its optimizer
  (and that optimizer's scheduler) becomes one
  :class:`~adaptive.AdaptiveDataParallel`, which checkpoints them together
  with the loaders.  The optimizer and scheduler come back wrapped as
  Accelerate wraps them, but stepping by the loader's plan of micro-steps.
* **Accumulation.**  With ``gradient_accumulation_steps=k`` each step is
  ``k`` micro-batches of the DataLoader's ``batch_size`` per process of the
  first launch (the loader's ``accumulation_steps``); ``sync_gradients`` is
  true exactly on the micro-batch that ends an optimizer step of the
  running loader;
  ``gradient_accumulation_steps`` reports the loader's plan; ``backward``
  does not divide the loss, because the model wrapper already averages the
  gradient over replicas and micro-steps (as in a plain script).
  ``autoscale_batch_size(...)`` on a prepared loader works as in a plain
  script: the loader's plan of micro-steps changes as the goodput model
  decides, and ``accumulate``, ``sync_gradients`` and
  ``gradient_accumulation_steps`` follow each step's plan.
* **Metrics.**  :meth:`AdaptiveAccelerator.gather_for_metrics` inside the
  loop of an ``AdaptiveDataLoader`` returns every sample of the step once,
  in the loader's global order, dropping the micro-batches that only
  repeat samples to keep replicas in lock-step.
* **Counters.**  :attr:`AdaptiveAccelerator.completed_steps` and
  :attr:`AdaptiveAccelerator.samples_seen` are the optimizer steps and
  samples of the whole job, restored on a relaunch: the training loaders'
  own checkpointed counters (see :mod:`._accelerate_state`).
* **save_state / load_state.**  Accelerate's ``save_state(dir)`` also
  writes the library's checkpoint (loader positions, epoch, random
  generators, accumulators) under ``dir/adaptive``, and ``load_state(dir)``
  restores it, through Accelerate's public save and load pre-hooks.

Accelerate's public API is used throughout; the only private attributes
are the lists a prepared optimizer and scheduler are registered in, read
and written in :func:`adaptive.integrations._accelerate_wrappers.register_prepared`.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Iterator, Sequence

try:
    # accelerate ships no type information (no py.typed): its names are Any to the type checker.
    from accelerate import Accelerator  # type: ignore[import-untyped]
    from accelerate.utils import DistributedType, gather_object, recursively_apply  # type: ignore[import-untyped]
except ImportError as error:  # the optional extra is missing
    raise ImportError("adaptive.integrations.accelerate needs Hugging Face Accelerate, which is not installed: "
                      "pip install adaptive-elastic[huggingface]") from error

import torch
import torch.utils.data

from adaptive.data._loader_options import options_of
from adaptive.data.dataloader import AdaptiveDataLoader, current_dataloader
from adaptive.integrations._accelerate_state import (LAUNCH_STATE_NAME, LIBRARY_STATE_DIR, LaunchRecord,
                                                     completed_steps, load_library_state, samples_seen,
                                                     save_library_state)
from adaptive.integrations._accelerate_wrappers import (CHECKED_ACCELERATE_VERSIONS, AdaptiveOptimizer,
                                                        AdaptiveScheduler, check_accelerate_version, env_flag,
                                                        follow_job_membership,
                                                        gradients_complete, is_plain, is_scheduler, optimizers_of,
                                                        register_prepared, scheduler_of)
from adaptive.parallel.data_parallel import AdaptiveDataParallel
from adaptive.runtime import env
from adaptive.runtime.collectives import init_process_group

__all__ = ["AdaptiveAccelerator", "CHECKED_ACCELERATE_VERSIONS", "LAUNCH_STATE_NAME", "LIBRARY_STATE_DIR"]

logger = logging.getLogger(__name__)

#: Accelerate's distributed types that are data parallelism, which AdaptiveDataParallel replaces.
_SUPPORTED_TYPES = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)

check_accelerate_version()


class AdaptiveAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose loaders, model and optimizer are elastic (see the module docstring).

    Takes Accelerate's arguments.  Supports data parallelism (DDP) on the
    CPU (gloo) and on CUDA; DeepSpeed, FSDP, Megatron-LM, TPUs and
    ``parallelism_config`` are refused with a ``ValueError``.  One
    ``AdaptiveAccelerator`` per process (its first-launch record is a
    checkpointed state of fixed name).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(Accelerator.__init__).bind(self, *args, **kwargs)
        arguments = bound.arguments
        cpu = bool(arguments.get("cpu", False)) or env_flag("ACCELERATE_USE_CPU")
        gloo = cpu or not torch.cuda.is_available()
        init_process_group("gloo" if gloo else None)
        if gloo:
            # Accelerate adopts an existing gloo group only on its CPU path (PartialState: MULTI_CPU, which
            # skips init_process_group when torch.distributed.is_initialized()); elsewhere a CPU run is
            # "not distributed" and every process would train alone on all the data.
            arguments["cpu"] = True
        # Set before Accelerator.__init__, which may read the properties overridden below.
        self._adaptive_loaders: list[AdaptiveDataLoader] = []
        self._adaptive_models = 0
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._refuse_unsupported()
        world = torch.distributed.get_world_size()
        if self.num_processes != world:
            raise RuntimeError(f"Accelerate sees {self.num_processes} processes but the job's process group has "
                               f"{world}; launch with adaptive-run or torchrun")
        self._first_launch = LaunchRecord(self.num_processes, self.gradient_state.num_steps)
        follow_job_membership(self)
        self._adaptive_schedulers: list[AdaptiveScheduler] = []
        self.register_save_state_pre_hook(self._save_library_state)
        self.register_load_state_pre_hook(self._load_library_state)

    def _refuse_unsupported(self) -> None:
        """What AdaptiveDataParallel cannot replace: say which argument asked for it."""
        if self.distributed_type not in _SUPPORTED_TYPES:
            raise ValueError(f"AdaptiveAccelerator supports data parallelism on CPU (gloo) or CUDA only; this "
                             f"Accelerator is configured for {self.distributed_type} (deepspeed_plugin, "
                             "fsdp_plugin, megatron_lm_plugin or a TPU are not supported)")
        if self.is_fsdp2 or self.parallelism_config is not None:
            raise ValueError("AdaptiveAccelerator does not support FSDP2 or parallelism_config yet; drop them (data "
                             "parallelism is used)")

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any:
        """Make each object elastic and return them in the order given (one object: itself, as Accelerate).

        * ``torch.utils.data.DataLoader``: an ``AdaptiveDataLoader`` (see
          :meth:`prepare_data_loader`); an ``AdaptiveDataLoader``: as it is.
        * ``torch.nn.Module`` with its optimizer among ``args`` (and that
          optimizer's LR scheduler, if any): one ``AdaptiveDataParallel``;
          the optimizer and scheduler are returned wrapped as Accelerate
          wraps them.  A model given without an optimizer is prepared for
          evaluation only (device placement, mixed precision).
        * Anything else is returned unchanged, as Accelerate does.

        Raises:
            ValueError: an optimizer or scheduler given without its model
                (or optimizer), a model with several optimizers, or a
                ``device_placement`` list of the wrong length.
        """
        placement: list[bool | None] = [None] * len(args) if device_placement is None else list(device_placement)
        if len(placement) != len(args):
            raise ValueError(f"device_placement must have one entry per object ({len(args)}), got "
                             f"{len(placement)}")
        result = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, AdaptiveDataLoader):
                self._adaptive_loaders.append(obj)
            elif isinstance(obj, torch.utils.data.DataLoader):
                result[i] = self.prepare_data_loader(obj)
        optimizers = {i: obj for i, obj in enumerate(args) if is_plain(obj, torch.optim.Optimizer)}
        schedulers = {i: obj for i, obj in enumerate(args) if is_scheduler(obj)}
        used: set[int] = set()
        for i, obj in enumerate(args):
            if isinstance(obj, AdaptiveDataParallel) or not is_plain(obj, torch.nn.Module):
                continue
            owned = optimizers_of(obj, optimizers)
            if not owned:
                result[i] = super().prepare_model(obj, device_placement=placement[i], evaluation_mode=True)
                continue
            if len(owned) > 1:
                raise ValueError(f"the model at position {i} of prepare() has {len(owned)} optimizers; "
                                 "AdaptiveDataParallel takes one optimizer per model")
            (j,) = owned
            k = scheduler_of(optimizers[j], schedulers, j)
            self._prepare_training(result, placement, i, j, k)
            used.update({j} if k is None else {j, k})
        for what, found in (("optimizer", optimizers), ("LR scheduler", schedulers)):
            stray = sorted(set(found) - used)
            if stray:
                raise ValueError(f"the {what} at position {stray[0]} of prepare() has no model among the objects "
                                 f"given; pass the model, its optimizer and its LR scheduler to the same prepare() "
                                 f"call (AdaptiveDataParallel checkpoints them together)")
        return tuple(result) if len(result) > 1 else result[0]

    def _prepare_training(self, result: list[Any], device_placement: list[bool | None], i: int, j: int,
                          k: int | None) -> None:
        """Model ``result[i]``, optimizer ``result[j]`` and scheduler ``result[k]`` become the elastic trio."""
        model, optimizer = result[i], result[j]
        scheduler = None if k is None else result[k]
        # Device placement and mixed precision as Accelerate applies them, without its DDP wrapper.
        model = super().prepare_model(model, device_placement=device_placement[i], evaluation_mode=True)
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        if self.distributed_type == DistributedType.MULTI_GPU:
            kwargs.update(device_ids=[self.local_process_index], output_device=self.local_process_index)
        name = "model" if self._adaptive_models == 0 else f"model{self._adaptive_models}"
        self._adaptive_models += 1
        wrapped = AdaptiveDataParallel(model, optimizer, scheduler, self.scaler, name=name, **kwargs)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapped)
        placement = self.device_placement if device_placement[j] is None else device_placement[j]
        prepared_optimizer = AdaptiveOptimizer(optimizer, device_placement=placement, scaler=self.scaler)
        prepared_optimizer.on_step = self._first_launch.step_taken
        register_prepared(self, "optimizer", prepared_optimizer)
        result[i], result[j] = wrapped, prepared_optimizer
        if k is not None:
            prepared_scheduler = AdaptiveScheduler(scheduler, prepared_optimizer,
                                                   steps_per_update=self.scheduler_steps_per_update,
                                                    step_with_optimizer=self.step_scheduler_with_optimizer,
                                                    split_batches=self.split_batches)
            register_prepared(self, "scheduler", prepared_scheduler)
            self._adaptive_schedulers.append(prepared_scheduler)
            result[k] = prepared_scheduler

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> AdaptiveDataLoader:
        """An ``AdaptiveDataLoader`` over ``data_loader``'s dataset, with the first launch's global batch.

        Keeps the dataset, collate function, workers (and their settings),
        order (``RandomSampler``: shuffled; ``SequentialSampler``: in order)
        and ``drop_last``.  A ``generator`` given to the DataLoader seeds the
        order (its ``initial_seed()``); otherwise the seed is 0: the order
        must be the same on every process and every launch.  Batches are not
        moved to a device (``device_placement`` and
        ``slice_fn_for_dispatch`` are accepted for Accelerate's signature).

        Raises:
            ValueError: a custom sampler or batch sampler (the order must be
                the elastic one).
        """
        if isinstance(data_loader, AdaptiveDataLoader):
            self._adaptive_loaders.append(data_loader)
            return data_loader
        if not isinstance(data_loader, torch.utils.data.DataLoader):
            raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
        shuffle, kwargs = options_of(data_loader, None)
        per_process = data_loader.batch_size
        assert per_process is not None  # options_of refused a batch_sampler
        first = self._first_launch
        processes = 1 if self.split_batches else first.num_processes
        global_batch = per_process * processes * first.gradient_accumulation_steps
        seed = data_loader.generator.initial_seed() if data_loader.generator is not None else 0
        # Accelerate's accumulation: each optimizer step is gradient_accumulation_steps micro-batches of the
        # DataLoader's batch_size per process of the first launch (split over the processes there are now)
        loader = AdaptiveDataLoader(data_loader.dataset, batch_size=global_batch, shuffle=shuffle, seed=seed,
                                    drop_last=data_loader.drop_last,
                                    accumulation_steps=first.gradient_accumulation_steps, **kwargs)
        if env.rank() == 0:
            logger.info("DataLoader (batch_size=%d per process) -> AdaptiveDataLoader %s: global batch %d "
                        "(%d per process x %d processes x %d accumulation steps of the first launch%s)",
                        per_process, loader.name, global_batch, per_process, processes,
                        first.gradient_accumulation_steps, ", split_batches" if self.split_batches else "")
        self._adaptive_loaders.append(loader)
        return loader

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """For evaluation only (``evaluation_mode=True``): a model to train must go through :meth:`prepare`.

        Raises:
            ValueError: ``evaluation_mode=False``: the model needs its optimizer
                to become an ``AdaptiveDataParallel``.
        """
        if not evaluation_mode:
            raise ValueError("AdaptiveAccelerator.prepare_model(model) cannot make a model elastic without its "
                             "optimizer: call prepare(model, optimizer[, lr_scheduler]) (or pass "
                             "evaluation_mode=True for a model that is not trained)")
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Refused: the optimizer is prepared with its model by :meth:`prepare`."""
        raise ValueError("AdaptiveAccelerator prepares an optimizer together with its model: call "
                         "prepare(model, optimizer[, lr_scheduler])")

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Refused: the LR scheduler is prepared with its model and optimizer by :meth:`prepare`."""
        raise ValueError("AdaptiveAccelerator prepares an LR scheduler together with its model and optimizer: "
                         "call prepare(model, optimizer, lr_scheduler)")

    # ------------------------------------------------------------------ counters, save_state, load_state

    @property
    def completed_steps(self) -> int:
        """Optimizer steps taken over the whole job, restarts and rescales included.

        The steps of the loaders the optimizer stepped in (their
        checkpointed ``loader.step``), counting the step just taken inside
        the loop body: a script that counts steps starts from it
        (``completed_steps = accelerator.completed_steps``) and stops where an
        uninterrupted run stops.  0 before the first optimizer step.
        """
        return completed_steps(self._first_launch, self._adaptive_loaders)

    @property
    def scheduler_steps_per_update(self) -> int:
        """How many times a prepared LR scheduler steps at each optimizer step, at every world size.

        The first launch's process count (1 with ``split_batches=True``):
        size a schedule in optimizer steps times this, where transformers'
        scripts multiply by ``accelerator.num_processes`` (which changes when
        the job is relaunched on another number of processes).
        """
        return 1 if self.split_batches else self._first_launch.num_processes

    @property
    def samples_seen(self) -> int:
        """Training samples of the whole job (tokens, for a token-budget loader): the loaders' ``consumed``."""
        return samples_seen(self._first_launch, self._adaptive_loaders)

    def _save_library_state(self, models: list[torch.nn.Module], weights: list[Any], output_dir: str) -> None:
        """Accelerate's save_state pre-hook: the library's checkpoint in ``output_dir/adaptive``."""
        save_library_state(output_dir, self._first_launch)

    def _load_library_state(self, models: list[torch.nn.Module], input_dir: str) -> None:
        """Accelerate's load_state pre-hook: the library's state from ``input_dir/adaptive``."""
        before = (self._first_launch.num_processes, self._first_launch.gradient_accumulation_steps)
        if not load_library_state(input_dir):
            return
        record = self._first_launch
        if (record.num_processes, record.gradient_accumulation_steps) != before:
            record.log_first_launch(self.num_processes, self.gradient_state.num_steps)
        for scheduler in self._adaptive_schedulers:  # the saved job's first launch sets the scheduler's steps
            scheduler.steps_per_update = self.scheduler_steps_per_update

    # ------------------------------------------------------------------ accumulation

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch that ends an optimizer step of the running loader (and outside loops)."""
        return gradients_complete()

    @sync_gradients.setter
    def sync_gradients(self, sync_gradients: bool) -> None:
        self.gradient_state.sync_gradients = sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches of the current optimizer step (inside a loop), else of the next step of the
        first loader prepared; Accelerate's setting when no loader was prepared."""
        loader = current_dataloader()
        if loader is not None and loader.micro_step is not None:
            return loader.micro_step[1]
        if self._adaptive_loaders:
            return self._adaptive_loaders[0].accumulation_steps
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, gradient_accumulation_steps: int) -> None:
        raise AttributeError("AdaptiveAccelerator.gradient_accumulation_steps follows the loader's plan and cannot "
                             "be set; pass gradient_accumulation_steps= to the constructor (it sizes the global "
                             "batch), or let loader.autoscale_batch_size(..., gradient_accumulation=True) choose")

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """Accelerate's accumulation context, following the running loader's plan of micro-steps.

        The model wrapper already skips the gradient all-reduce on every
        micro-batch but the last of a step, so nothing else is needed here.
        """
        self.gradient_state.sync_gradients = gradients_complete()
        yield

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` (through the AMP scaler with fp16), *not* divided by the accumulation steps.

        The model wrapper averages the gradient over replicas and micro-steps
        itself, so a mean loss per micro-batch gives the step's mean gradient.
        """
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    # ------------------------------------------------------------------ metrics

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every process's ``input_data``, each sample of the loader's step once.

        Inside the loop of an ``AdaptiveDataLoader``: the processes' rows are
        concatenated in rank order (the loader's global order within the
        step), processes hold different numbers of rows at the end of an
        epoch, and a micro-batch that only repeats samples (``is_padding``)
        contributes none.  Tensors (nested in lists, tuples, dicts) are
        gathered along dimension 0; other data, or ``use_gather_object=True``,
        must be a list (``gather_object``).  Outside such a loop:
        Accelerate's own ``gather_for_metrics``.
        """
        loader = current_dataloader()
        if loader is None:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        drop = loader.is_padding
        if not use_gather_object:
            try:
                recursively_apply(lambda tensor: tensor, input_data, error_on_other_type=True)
            except TypeError:
                use_gather_object = True
        if use_gather_object:
            if not isinstance(input_data, list):
                raise TypeError(f"gather_for_metrics: input_data must be tensors or a list, got "
                                f"{type(input_data).__name__}")
            local = [] if drop else input_data
            return local if self.num_processes == 1 else gather_object(local)
        return recursively_apply(lambda tensor: self._gather_rows(tensor, drop), input_data)

    def _gather_rows(self, tensor: torch.Tensor, drop: bool) -> torch.Tensor:
        """Every process's rows of ``tensor`` (dimension 0, none when ``drop``), concatenated in rank order."""
        rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if drop:
            rows = rows[:0]
        if self.num_processes == 1:
            return rows
        counts = self.gather(torch.tensor([rows.shape[0]], device=rows.device)).tolist()
        gathered = self.gather(self.pad_across_processes(rows, dim=0))
        width = max(counts)
        return torch.cat([gathered[rank * width:rank * width + count] for rank, count in enumerate(counts)])

