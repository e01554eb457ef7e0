"""Checks of :class:`~adaptive.AdaptiveDataLoader`'s arguments that need more than one value.

Which DataLoader keyword arguments pass through, which are refused and
why, which token-budget options need ``max_tokens``, and that a ramp-up
schedule counts the loader's unit.  Single values are checked with
:mod:`adaptive._utils.checks`.
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from adaptive._utils.checks import check_int
from adaptive.batchsize.rampup import BatchSizeSchedule
from adaptive.batchsize.rampup_specs import make_schedule
from adaptive.data.tokens.plan_state import DEFAULT_WINDOW_SIZE

__all__ = ["PASSTHROUGH", "dataset_length", "unit_schedule", "refuse_token_options", "check_token_options",
           "check_sample_accumulation", "refuse_unsupported"]


#: DataLoader arguments passed through unchanged to the loader that fetches local batches.
PASSTHROUGH = (
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


def dataset_length(dataset: Any) -> int:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise TypeError("AdaptiveDataLoader needs a map-style dataset (with __len__ and __getitem__), "
                        "not an IterableDataset")
    try:
        length = len(dataset)
    except TypeError:
        raise TypeError(f"dataset must define __len__; got {type(dataset).__name__}") from None
    if length == 0:
        raise ValueError("dataset is empty: AdaptiveDataLoader needs at least one sample")
    return length


def unit_schedule(spec: Any, unit: str) -> BatchSizeSchedule:
    """The ramp-up schedule from ``batch_size_schedule=``, checked to count ``unit``."""
    schedule = make_schedule(spec, unit)
    if schedule.unit != unit:
        raise ValueError(f"batch_size_schedule counts {schedule.unit} but this loader batches by {unit} "
                         f"({'with' if unit == 'tokens' else 'without'} max_tokens); build the schedule "
                         f"with unit={unit!r}")
    return schedule


def refuse_token_options(lengths: Any, window_size: Any, on_oversize: Any, average_by: Any) -> None:
    """Token-budget options given without ``max_tokens`` are mistakes: say so."""
    given = {"lengths": lengths is not None,
             "window_size": window_size != DEFAULT_WINDOW_SIZE, "on_oversize": on_oversize != "error",
             "average_by": average_by not in (None, "samples")}
    wrong = [key for key, value in given.items() if value]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} only apply to token-budget batches; pass max_tokens= as well "
                         "(for sample batches use autoscale_batch_size(gradient_accumulation=True) "
                         "for accumulation)")


def check_sample_accumulation(accumulation_steps: Any, batch_size: int | None, scheduled: bool) -> None:
    """``accumulation_steps`` with sample batches: a fixed ``batch_size`` that it divides."""
    check_int("accumulation_steps", accumulation_steps, minimum=1)
    if accumulation_steps == 1:
        return
    if batch_size is None:
        raise ValueError("accumulation_steps only apply to token-budget batches (max_tokens=), or to sample batches "
                         "with a batch_size= that they divide; pass one of them (or use "
                         "autoscale_batch_size(gradient_accumulation=True) for accumulation)")
    if scheduled:
        raise ValueError("accumulation_steps= cannot be combined with batch_size_schedule= for sample batches: "
                         "a scheduled step is one micro-batch")
    if batch_size % accumulation_steps:
        raise ValueError(f"batch_size={batch_size} must be a multiple of accumulation_steps={accumulation_steps}: "
                         f"each optimizer step is {accumulation_steps} micro-batches of batch_size / "
                         "accumulation_steps samples")


def check_token_options(drop_last: bool, accumulation_steps: Any, global_batch: bool) -> None:
    """Options that cannot go with ``max_tokens``, or only in some combinations."""
    if drop_last:
        raise ValueError("drop_last=True is not supported with max_tokens: the last step of an epoch is kept "
                         "(it may be smaller)")
    check_int("accumulation_steps", accumulation_steps, minimum=1)
    if accumulation_steps != 1 and global_batch:
        raise ValueError("accumulation_steps= cannot be combined with a global batch_size= or "
                         "batch_size_schedule= in tokens: the micro-steps follow from the global batch and "
                         "max_tokens")


def refuse_unsupported(kwargs: dict[str, Any]) -> None:
    refused = {
        "sampler": "the order must be the elastic, replica-independent one; use shuffle= and seed=",
        "batch_sampler": "batches are cut from the elastic global stream; use batch_size= or max_tokens=",
        "generator": "the order is seeded by seed=, independently of torch's RNG",
    }
    for key, why in refused.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"AdaptiveDataLoader cannot honour {key}=: {why}")
        kwargs.pop(key, None)
    unknown = set(kwargs) - set(PASSTHROUGH)
    if unknown:
        raise TypeError(f"AdaptiveDataLoader got unexpected keyword arguments {sorted(unknown)}; "
                        f"allowed DataLoader arguments are {list(PASSTHROUGH)}")


def options_of(loader: torch.utils.data.DataLoader[Any], shuffle: bool | None) -> tuple[bool, dict[str, Any]]:
    """An existing DataLoader's order and worker settings, for ``AdaptiveDataLoader.from_dataloader``.

    The order is taken from its sampler (``RandomSampler`` means shuffle)
    unless ``shuffle`` says it; other samplers cannot be honoured and are
    refused, as is a custom ``batch_sampler``.
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
    return shuffle, kwargs
