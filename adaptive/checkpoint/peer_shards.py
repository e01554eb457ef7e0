"""Sharded training state moved between live generations in memory, from one full copy on the new rank 0.

A sharded model (FSDP2: parameters and optimizer state are DTensors) cannot
hand its state to joiners the way :mod:`adaptive.checkpoint.peer_state`
does for the small states: every rank holds only its shards, and the
sharding itself depends on the number of replicas.  A live membership
change therefore moves it in two collectives, on either side of the regroup:

1. :func:`gather_full`, on the old group (leavers included, they hold
   shards too): every DTensor of the state dict is gathered, one at a time,
   and kept in host memory on one rank only, the member that becomes rank 0
   of the new generation;
2. :func:`fill_from_rank0`, on the new group: every member (survivors and
   joiners) builds the targets of its new sharding (a state dict shaped like
   the one that was gathered, with DTensors on the new mesh), and rank 0
   scatters each full tensor into them (``distribute_tensor`` with
   ``src_data_rank=0``).  Plain tensors and values travel with the layout,
   which rank 0 broadcasts first.

This is the in-memory counterpart of a restart that reshards from the DCP
checkpoint (:class:`~adaptive.checkpoint.states.ShardedState`); it costs one
full copy of the sharded state in rank 0's host memory during the change.

When a member is *lost* the old group is broken and nothing is gathered:
the job restarts every member from the checkpoint, resharded for the
replicas there are (:func:`adaptive.elastic.live.recover`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, cast

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from adaptive._utils.types import StateDict
from adaptive.runtime import collectives, env

__all__ = ["gather_full", "fill_from_rank0"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Sharded:
    """In the layout rank 0 broadcasts: a DTensor leaf, sent by scatter afterwards."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def gather_full(state_dict: StateDict, dst: int) -> StateDict | None:
    """``state_dict`` with every tensor whole and on the CPU, on rank ``dst`` of the current group; None elsewhere.

    Collective on the current (old) group: each DTensor is all-gathered in
    the state dict's order, so peak device memory grows by one full tensor.
    """
    keep = env.rank() == dst

    def leaf(value: object) -> object:
        if isinstance(value, DTensor):
            whole = value.full_tensor()
            return whole.cpu() if keep else None
        if isinstance(value, torch.Tensor):
            return value.detach().cpu() if keep else None
        return value

    gathered = _map_leaves(state_dict, leaf)
    return gathered if keep else None


def _layout(full: StateDict) -> StateDict:
    """``full`` with each tensor that is sharded in ``target`` replaced by its shape and dtype."""
    def leaf(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return _Sharded(tuple(value.shape), value.dtype)
        return value  # scalars (an optimizer's step) and plain values travel with the layout

    return _map_leaves(full, leaf)


def fill_from_rank0(target: StateDict, full: StateDict | None) -> StateDict:
    """``target`` (this rank's new sharding) filled from rank 0's ``full`` copy; collective on the new group.

    Args:
        target: a state dict shaped as the gathered one, whose sharded
            leaves are DTensors on the current mesh (from
            ``get_state_dict`` on the resharded model); its other values
            are replaced by rank 0's.
        full: what :func:`gather_full` returned, on rank 0; ignored elsewhere.

    Returns:
        ``target``'s structure with rank 0's values: DTensors in this
        rank's sharding, plain tensors on their target's device.
    """
    layout = collectives.broadcast_object(_layout(full) if env.rank() == 0 and full is not None else None)
    sent = [0]

    def visit(spec: object, aim: object, source: object) -> object:
        # ``source`` (rank 0's full copy; None elsewhere) has the structure of ``spec``, built from it.
        if isinstance(spec, dict):
            by_key = aim if isinstance(aim, dict) else {}
            return {key: visit(item, by_key.get(key), source[key] if isinstance(source, dict) else None)
                    for key, item in spec.items()}
        if isinstance(spec, (list, tuple)):
            by_index = aim if isinstance(aim, (list, tuple)) and len(aim) == len(spec) else [None] * len(spec)
            return type(spec)(visit(item, by_index[i], source[i] if isinstance(source, (list, tuple)) else None)
                              for i, item in enumerate(spec))
        if isinstance(spec, _Sharded):
            sent[0] += 1
            return _scatter(spec, aim, source if isinstance(source, torch.Tensor) else None)
        if isinstance(spec, torch.Tensor) and isinstance(aim, torch.Tensor) and not isinstance(aim, DTensor):
            return spec.to(aim.device)
        return spec

    filled = cast(StateDict, visit(layout, target, full))  # a dict: ``layout`` is one
    logger.debug("filled %d sharded tensors from rank 0", sent[0])
    return filled


def _scatter(spec: _Sharded, aim: object, source: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's whole tensor, in ``aim``'s sharding (a DTensor) or whole (a plain tensor target)."""
    if isinstance(aim, DTensor):
        device = aim.to_local().device
        whole = source.to(device) if source is not None else torch.empty(spec.shape, dtype=spec.dtype, device=device)
        if tuple(aim.shape) != spec.shape:
            raise ValueError(f"the resharded model has a tensor of shape {tuple(aim.shape)} where rank 0 has "
                             f"{spec.shape}: the members run different models")
        return distribute_tensor(whole, aim.device_mesh, aim.placements, src_data_rank=0)
    device = aim.device if isinstance(aim, torch.Tensor) else torch.device("cpu")
    whole = source.to(device) if source is not None else torch.empty(spec.shape, dtype=spec.dtype, device=device)
    try:
        torch.distributed.broadcast(whole, src=0)
    except (RuntimeError, torch.distributed.DistError) as error:
        raise collectives.CollectiveError(f"resharding the model state from rank 0 failed: {error}") from error
    return whole


def _map_leaves(state: StateDict, leaf: Callable[[object], object]) -> StateDict:
    """``state`` with ``leaf`` applied to every value below it that is not a dict, list or tuple, in walk order."""
    return {key: _map_value(item, leaf) for key, item in state.items()}


def _map_value(value: object, leaf: Callable[[object], object]) -> object:
    """``value`` (nested dicts, lists and tuples) with ``leaf`` applied to everything else, in walk order."""
    if isinstance(value, dict):
        return {key: _map_value(item, leaf) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_value(item, leaf) for item in value)
    return leaf(value)
