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
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Iterator

import torch.utils.data

from adaptive import checkpoint, dataloader_context, env, epoch, sync_points
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

    # ------------------------------------------------------------------ properties

    @property
    def batch_size(self) -> int:
        """The global batch size of the next step (summed over replicas)."""
        return self._state.batch_size

    @property
    def current_local_bsz(self) -> int:
        """This replica's share of the next full step."""
        total, replicas = self._state.batch_size, env.num_replicas()
        return total // replicas + (env.rank() < total % replicas)

    @property
    def step(self) -> int:
        """Steps this loader has taken over the whole job, restarts included."""
        return self._state.step

    def __len__(self) -> int:
        """Steps in a whole epoch at the current global batch size."""
        return self.sampler.num_steps(0, self._state.batch_size)

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

    def _steps(self, key: int | None) -> Iterator[Any]:
        state = self._state
        iterator: Iterator[Any] | None = None
        planned: tuple[int, int] | None = None
        try:
            while True:
                sync_points.step_boundary(self._checkpoint_metadata)
                size = self.sampler.step_size(state.index, state.batch_size)
                if size == 0:
                    break
                config = (state.batch_size, env.num_replicas())
                if iterator is None or planned != config:
                    iterator = self._restart_inner(state.index, *config)
                    planned = config
                batch = next(iterator)
                state.index += size
                state.step += 1
                yield batch
        except GeneratorExit:
            # ``break`` (or the loop abandoned): the loop counts as done.  No
            # collective here: the pending agreement settles at the next boundary.
            self._mark_finished(key)
            raise
        self._mark_finished(key)
        sync_points.final_boundary(self._checkpoint_metadata)

    def _restart_inner(self, start: int, batch_size: int, replicas: int) -> Iterator[Any]:
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
                "index": self._state.index, "batch_size": self._state.batch_size}


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

