"""AdaptiveDataLoader: a DataLoader whose position survives restarts and rescales.

It walks one seeded global permutation per epoch (guarantee G2, see
:mod:`adaptive.sampler`), takes the next global batch at each step and gives
each replica its share.  Its position is checkpointed with everything else,
so after any restart or change of replica count the stream continues at the
same sample.

Loops of a loader are numbered within each epoch (the training loop is
loop 1, a second pass over the same loader would be loop 2).  After a
restart, loops that already finished in the current epoch are skipped (they
yield nothing) and the interrupted loop resumes mid-way (guarantee G5).
Leaving a loop with ``break`` counts as finishing it; every replica must
break at the same step.

With :meth:`AdaptiveDataLoader.autoscale_batch_size` the loader chooses the
local batch size and the number of gradient-accumulation steps that
maximise goodput (see :mod:`adaptive.autoscale`), and may change them every
few steps, also in the middle of an epoch.  An optimizer step is then made
of ``accumulation_steps`` micro-batches; the loop stays the ordinary
``zero_grad(); backward(); step()`` loop (see :mod:`adaptive.parallel`).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Iterator

import torch.utils.data

from adaptive import checkpoint, dataloader_context, env, epoch, metrics, parallel, sync_points
from adaptive.autoscale import AutoscaleConfig, BatchSizeController, Decision
from adaptive.sampler import ElasticSampler

__all__ = ["AdaptiveDataLoader"]

logger = logging.getLogger(__name__)

_instances = 0

#: DataLoader arguments passed through unchanged to the loader that fetches local batches.
_PASSTHROUGH = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class _AdaptiveDataLoaderState(checkpoint.State):
    """Where a loader is: the loop in progress, samples consumed, finished loops."""

    def __init__(self, name: str, batch_size: int) -> None:
        super().__init__(name)
        self.epoch: int | None = None  # epoch of the loop in progress (None: outside epochs)
        self.loop = 0  # which loop of this loader in that epoch (1-based; 0: none yet)
        self.index = 0  # global samples consumed by that loop
        self.finished: dict[int | None, int] = {}  # epoch -> last finished loop
        self.step = 0  # steps taken over the whole job
        self.batch_size = batch_size  # global batch size of the next step

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "loop": self.loop,
            "index": self.index,
            "finished": [[key, value] for key, value in self.finished.items()],
            "step": self.step,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.loop = int(state["loop"])
        self.index = int(state["index"])
        self.finished = {key: int(value) for key, value in state["finished"]}
        self.step = int(state["step"])
        self.batch_size = int(state["batch_size"])


class _LocalBatches(torch.utils.data.Sampler):
    """This replica's index lists, from a start position at a fixed batch size.

    Serves as the ``batch_sampler`` of the inner DataLoader; the outer loader
    re-points it (and restarts the inner iterator) whenever the position
    jumps or the batch size changes.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.start = 0
        self.batch_size = 1
        self.num_replicas = 1
        self.rank = 0

    def __iter__(self) -> Iterator[list[int]]:
        start = self.start
        while True:
            size = self.sampler.step_size(start, self.batch_size)
            if size == 0:
                return
            yield self.sampler.local_indices(start, self.batch_size, self.num_replicas, self.rank).tolist()
            start += size

    def __len__(self) -> int:
        return self.sampler.num_steps(self.start, self.batch_size)


class _StepTiming:
    """Wall time of each optimizer step, split into data waiting and compute."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._boundary: float | None = None
        self._data = 0.0
        self._compute: list[float] = []
        self._yielded: float | None = None
        self._recent: collections.deque = collections.deque(maxlen=20)

    def fetch(self, iterator: Iterator[Any], last: bool) -> Any:
        now = time.perf_counter()
        if self._boundary is None:
            self._boundary = now
        if self._yielded is not None:  # the previous micro-batch (an accumulation step) is done
            self._compute.append(now - self._yielded)
        batch = next(iterator)
        done = time.perf_counter()
        self._data += done - now
        self._yielded = None if last else done
        return batch

    def step_done(self) -> tuple[float | None, float | None, float | None]:
        """(step time, compute time per micro-batch or None, data wait) of the step just finished."""
        now = time.perf_counter()
        start, self._boundary = self._boundary, now
        data, compute = self._data, self._compute
        self._data, self._compute, self._yielded = 0.0, [], None
        if start is None:
            return None, None, None
        self._recent.append(now - start)
        return now - start, (sum(compute) / len(compute) if compute else None), data

    def samples_per_sec(self, batch_size: int) -> float | None:
        if not self._recent:
            return None
        return batch_size / (sum(self._recent) / len(self._recent))


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class AdaptiveDataLoader:
    """An elastic, restartable replacement for ``torch.utils.data.DataLoader``.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        batch_size: the *global* batch size, summed over all replicas; each
            replica gets an even share.
        shuffle: visit the samples in a seeded random order each epoch.
        seed: seed of the shuffling; the order depends only on (seed, epoch).
        drop_last: drop the final step of an epoch if it is smaller than
            ``batch_size`` (otherwise it is kept; if fewer samples remain
            than replicas, fewer than ``replicas`` samples are repeated).
        name: checkpoint name; default the creation order ("0", "1", ...).
        **kwargs: the usual DataLoader arguments (``num_workers``,
            ``collate_fn``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
            ``multiprocessing_context``, ``prefetch_factor``,
            ``persistent_workers``, ``pin_memory_device``, ``in_order``).
            ``sampler``, ``batch_sampler`` and ``generator`` cannot be
            honoured (the order must be the elastic one) and are refused.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        seed: int = 0,
        drop_last: bool = False,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        global _instances
        _refuse_unsupported(kwargs)
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("AdaptiveDataLoader needs a map-style dataset (with __len__ and __getitem__), "
                            "not an IterableDataset")
        try:
            length = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"dataset must define __len__; got {type(dataset).__name__}") from None
        if length == 0:
            raise ValueError("dataset is empty: AdaptiveDataLoader needs at least one sample")
        _check_positive_int("batch_size", batch_size)
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if dataloader_context.current_dataloader() is not None:
            raise RuntimeError("AdaptiveDataLoader created inside another AdaptiveDataLoader loop; "
                               "create loaders before the loops")
        self.dataset = dataset
        self.sampler = ElasticSampler(length, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._batches = _LocalBatches(self.sampler)
        self._inner = torch.utils.data.DataLoader(dataset, batch_sampler=self._batches, **kwargs)
        if name is None:
            name = str(_instances)
        _instances += 1
        self.name = name
        self._loops: collections.Counter = collections.Counter()
        self._init_batch_size = batch_size
        self._controller: BatchSizeController | None = None
        self._micro: tuple[int, int] | None = None
        self._timing = _StepTiming()
        self._metrics = metrics.MetricsWriter()
        self._state = _AdaptiveDataLoaderState(f"adaptive.dataloader.{name}", batch_size)
        if checkpoint.load_state(self._state) and self._state.batch_size != batch_size:
            logger.info("loader %s: continuing with the checkpointed batch size %d (batch_size=%d given)",
                        name, self._state.batch_size, batch_size)
        sync_points.install_signal_handlers()

    @classmethod
    def from_dataloader(cls, loader: torch.utils.data.DataLoader, *, shuffle: bool | None = None,
                        seed: int = 0, name: str | None = None) -> "AdaptiveDataLoader":
        """Build from an existing DataLoader, keeping its dataset, batch size and worker settings.

        ``batch_size`` becomes the global batch size.  The order is taken from
        its sampler (``RandomSampler`` means shuffle); other samplers cannot be
        honoured and are refused.
        """
        if loader.batch_size is None:
            raise ValueError("from_dataloader: the DataLoader uses a custom batch_sampler, which cannot be "
                             "honoured; build AdaptiveDataLoader(dataset, batch_size=...) instead")
        sampler = loader.sampler
        if shuffle is None:
            if isinstance(sampler, torch.utils.data.RandomSampler):
                shuffle = True
            elif isinstance(sampler, torch.utils.data.SequentialSampler):
                shuffle = False
            else:
                raise ValueError(f"from_dataloader: the DataLoader's sampler {type(sampler).__name__} cannot be "
                                 "honoured; only the default sequential or random order is supported")
        kwargs: dict[str, Any] = {
            "num_workers": loader.num_workers,
            "collate_fn": loader.collate_fn,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "persistent_workers": loader.persistent_workers,
        }
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        return cls(loader.dataset, batch_size=loader.batch_size, shuffle=shuffle, seed=seed,
                   drop_last=loader.drop_last, name=name, **kwargs)

    def autoscale_batch_size(self, max_batch_size: int, local_bsz_bounds: tuple[int, int] | None = None,
                             gradient_accumulation: bool = False, *, adapt_every: int = 20,
                             hysteresis: float = 0.05) -> None:
        """Let the loader choose the batch size that trains fastest, while training.

        Args:
            max_batch_size: the largest global batch size allowed (>= batch_size).
            local_bsz_bounds: (lo, hi) per-replica micro-batch sizes that fit
                in memory and keep the device busy; default (1, max_batch_size).
            gradient_accumulation: allow several micro-batches per optimizer
                step, to reach large global batches with few replicas.
            adapt_every: optimizer steps between decisions.
            hysteresis: only switch when goodput rises by more than this fraction.
        """
        if dataloader_context.current_dataloader() is self:
            raise RuntimeError("call autoscale_batch_size before iterating the loader")
        bounds = (1, max_batch_size) if local_bsz_bounds is None else tuple(local_bsz_bounds)
        config = AutoscaleConfig(self._init_batch_size, max_batch_size, bounds, bool(gradient_accumulation),
                                 adapt_every, hysteresis)
        if self._controller is None:
            self._controller = BatchSizeController(self.name, config)
        else:
            self._controller.config = config

    # ------------------------------------------------------------------ properties

    @property
    def batch_size(self) -> int:
        """The global batch size of the next optimizer step (summed over replicas and micro-steps)."""
        if self._controller is None:
            return self._state.batch_size
        local, accum = self._controller.current()
        return local * accum * env.num_replicas()

    @property
    def current_local_bsz(self) -> int:
        """This replica's micro-batch size in the next full step."""
        if self._controller is not None:
            return self._controller.current()[0]
        total, replicas = self._state.batch_size, env.num_replicas()
        return total // replicas + (env.rank() < total % replicas)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return 1 if self._controller is None else self._controller.current()[1]

    @property
    def micro_step(self) -> tuple[int, int] | None:
        """(index, count) of the micro-batch being trained on, or None outside the loop."""
        return self._micro

    def is_accumulation_step(self) -> bool:
        """True on micro-batches that are not the last of their optimizer step.

        On those, clip gradients or step a GradScaler only when this is False.
        """
        return self._micro is not None and self._micro[0] < self._micro[1] - 1

    @property
    def step(self) -> int:
        """Optimizer steps this loader has taken over the whole job, restarts included."""
        return self._state.step

    def to_tensorboard(self, writer: Any, step: int | None = None) -> None:
        """Write the latest metrics (batch sizes, noise scale, gain, LR factor, throughput, goodput)."""
        metrics.to_tensorboard(writer, self._metrics_record(), step if step is not None else self._state.step)

    def __len__(self) -> int:
        """Micro-batches in a whole epoch at the current batch size."""
        return self.sampler.num_steps(0, self._micro_global_size())

    def __repr__(self) -> str:
        return f"AdaptiveDataLoader(name={self.name!r}, batch_size={self.batch_size})"

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        with dataloader_context.active_loop(self):
            key = epoch.current_epoch()
            self._loops[key] += 1
            loop = self._loops[key]
            if self._state.finished.get(key, 0) >= loop:
                logger.log(_rank0_info(), "loader %s: loop %d of epoch %s already finished before the restart; "
                           "skipping it", self.name, loop, key)
                return
            self._enter_loop(key, loop)
            yield from self._steps(key)

    def _enter_loop(self, key: int | None, loop: int) -> None:
        state = self._state
        for old in [k for k in state.finished if k is not None and key is not None and k < key]:
            del state.finished[old]
        if (state.epoch, state.loop) == (key, loop) and state.index > 0:
            logger.log(_rank0_info(), "loader %s: resuming loop %d of epoch %s at sample %d of %d",
                       self.name, loop, key, state.index, self.sampler.num_samples)
        else:
            state.epoch, state.loop, state.index = key, loop, 0
        self.sampler.set_epoch(0 if key is None else key)

    def _micro_global_size(self) -> int:
        """Samples per micro-step, summed over replicas."""
        if self._controller is None:
            return self._state.batch_size
        return self._controller.current()[0] * env.num_replicas()

    def _plan_step(self) -> list[int]:
        """Global sizes of the next optimizer step's micro-steps (empty: the epoch is over)."""
        size, accum = self._micro_global_size(), self.accumulation_steps
        sizes, position = [], self._state.index
        for _ in range(accum):
            taken = self.sampler.step_size(position, size)
            if taken == 0:
                break
            sizes.append(taken)
            position += taken
        return sizes

    def _steps(self, key: int | None) -> Iterator[Any]:
        state = self._state
        iterator: Iterator[Any] | None = None
        planned: tuple[int, int] | None = None
        self._timing.reset()
        try:
            while True:
                sync_points.step_boundary(self._checkpoint_metadata)
                self._after_boundary(first=iterator is None)
                sizes = self._plan_step()
                if not sizes:
                    break
                config = (self._micro_global_size(), env.num_replicas())
                if iterator is None or planned != config:
                    iterator = self._restart_inner(state.index, *config)
                    planned = config
                for micro in range(len(sizes)):
                    self._micro = (micro, len(sizes))
                    batch = self._timing.fetch(iterator, last=micro == len(sizes) - 1)
                    yield batch
                state.index += sum(sizes)
                state.step += 1
                self._micro = None
        except GeneratorExit:
            # ``break`` (or the loop abandoned): the loop counts as done.  No
            # collective here: the pending agreement settles at the next boundary.
            self._micro = None
            self._mark_finished(key)
            raise
        self._mark_finished(key)
        sync_points.final_boundary(self._checkpoint_metadata)

    def _after_boundary(self, first: bool) -> None:
        """Per-step bookkeeping at a boundary: timing, batch-size decisions, metrics."""
        model = parallel.current_model()
        local, accum = self.current_local_bsz, self.accumulation_steps
        step_time, compute_time, data_time = self._timing.step_done()
        if self._controller is not None and step_time is not None:
            self._controller.observe(local, accum, step_time, compute_time, data_time)
        if first:
            self._configure_gns(model)
        if self._controller is not None and model is not None:
            force = first and self._controller.replicas_changed()
            if force or (not first and self._state.step % self._controller.config.adapt_every == 0):
                decision = self._controller.decide(model.gns.to_grad_params(), force=force)
                if decision is not None:
                    self._apply(decision, local, accum, model)
        interval = metrics.metrics_interval()
        if interval and not first and self._state.step % interval == 0:
            self._metrics.write(self._metrics_record())

    def _configure_gns(self, model: Any) -> None:
        if model is not None:
            model.gns.set_batch_config(init_batch_size=self._init_batch_size,
                                       local_bsz=max(1, self._micro_global_size() // env.num_replicas()),
                                       accum_steps=self.accumulation_steps, num_replicas=env.num_replicas())

    def _apply(self, decision: Decision, local: int, accum: int, model: Any) -> None:
        replicas = env.num_replicas()
        if env.rank() == 0:
            logger.info("batch size changed from %d (local %d x %d steps) to %d (local %d x %d steps) on %d "
                        "replicas because %s (goodput %.1f -> %.1f samples/s-equivalent)",
                        local * accum * replicas, local, accum,
                        decision.local_bsz * decision.accum_steps * replicas, decision.local_bsz,
                        decision.accum_steps, replicas, decision.reason, decision.previous_goodput,
                        decision.goodput)
        self._metrics.event("batch_size", step=self._state.step, before=local * accum * replicas,
                            after=decision.local_bsz * decision.accum_steps * replicas,
                            local_bsz=decision.local_bsz, accum_steps=decision.accum_steps,
                            goodput_before=decision.previous_goodput, goodput_after=decision.goodput,
                            reason=decision.reason)
        self._configure_gns(model)

    def _metrics_record(self) -> dict[str, Any]:
        model = parallel.current_model()
        record: dict[str, Any] = {"step": self._state.step, "epoch": epoch.current_epoch(),
                                  "replicas": env.num_replicas(), "nodes": env.num_nodes(),
                                  "batch_size": self.batch_size, "local_bsz": self.current_local_bsz,
                                  "accum_steps": self.accumulation_steps,
                                  "samples_per_sec": self._timing.samples_per_sec(self.batch_size)}
        if model is not None:
            gns, rule = model.gns, model.scaling_rule
            grad = gns.to_grad_params()
            record.update(noise_scale=gns.noise_scale() if grad is not None else None,
                          gain=rule.last_gain, lr_factor=rule.last_factor, progress=rule.progress)
            if grad is not None and record["samples_per_sec"]:
                scale = self.batch_size / self._init_batch_size
                record["goodput"] = record["samples_per_sec"] * gns.gain(scale) / max(scale, 1e-12)
        return record

    def _restart_inner(self, start: int, batch_size: int, replicas: int) -> Iterator[Any]:
        """(Re)start fetching this replica's micro-batches from global position ``start``."""
        if batch_size < replicas:
            raise ValueError(f"loader {self.name}: batch_size={batch_size} is smaller than the number of "
                             f"replicas ({replicas}); every replica needs at least one sample per step")
        plan = self._batches
        plan.start, plan.batch_size, plan.num_replicas, plan.rank = start, batch_size, replicas, env.rank()
        return iter(self._inner)

    def _mark_finished(self, key: int | None) -> None:
        self._state.finished[key] = self._state.loop
        self._state.index = 0

    def _checkpoint_metadata(self) -> dict:
        return {"epoch": epoch.current_epoch(), "step": self._state.step, "loader": self.name,
                "index": self._state.index, "batch_size": self.batch_size}


def _rank0_info() -> int:
    """INFO on rank 0, DEBUG elsewhere: one line per event, not one per replica."""
    return logging.INFO if env.rank() == 0 else logging.DEBUG


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    refused = {
        "sampler": "the order must be the elastic, replica-independent one; use shuffle= and seed=",
        "batch_sampler": "batches are cut from the elastic global stream; use batch_size=",
        "generator": "the order is seeded by seed=, independently of torch's RNG",
    }
    for key, why in refused.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"AdaptiveDataLoader cannot honour {key}=: {why}")
        kwargs.pop(key, None)
    unknown = set(kwargs) - set(_PASSTHROUGH)
    if unknown:
        raise TypeError(f"AdaptiveDataLoader got unexpected keyword arguments {sorted(unknown)}; "
                        f"allowed DataLoader arguments are {list(_PASSTHROUGH)}")


def _reset_for_tests() -> None:
    global _instances
    _instances = 0

