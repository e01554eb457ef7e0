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

When a member is *lost* the old group is broken, so the full copy is built
from local copies instead: after the members that are left re-formed, each
copies its own shards to host memory (:func:`copy_local`; every member holds
them as the last committed step left them), :func:`gather_from_copies` finds, for every shard, a member
that holds a copy of it (with HSDP, every replica group holds all of them)
and sends those copies to the new rank 0, which joins them into the full
copy that :func:`fill_from_rank0` scatters.  When the lost members held
every copy of some shard (1-D FSDP), :class:`ShardsLost` is raised on every
member alike and the job restarts from the checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Callable, Iterator, cast

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from adaptive._utils.types import StateDict
from adaptive.runtime import collectives, env

__all__ = ["gather_full", "fill_from_rank0", "copy_local", "gather_from_copies", "ShardsLost"]

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


# ---------------------------------------------------------------- after a lost member: from local copies
class ShardsLost(RuntimeError):
    """Some shard of the sharded state has no copy among the members that are left (raised on every member)."""


@dataclasses.dataclass(frozen=True)
class _LocalShard:
    """In a local copy: this rank's part of a DTensor, on the host, and which part it is."""

    tensor: torch.Tensor  # the local shard, on the CPU
    shape: tuple[int, ...]  # the whole tensor's
    index: int | None  # which of ``count`` dim-0 shards; None: a layout other than FSDP's (not recoverable)
    count: int


def copy_local(state_dict: StateDict) -> StateDict:
    """``state_dict`` with each DTensor replaced by a host copy of this rank's shard (no communication).

    Plain tensors are copied too, other values deep-copied, so the copy
    does not change when training goes on.
    """
    def leaf(value: object) -> object:
        if isinstance(value, DTensor):
            index, count = _shard_position(value)
            return _LocalShard(value.to_local().detach().to("cpu", copy=True), tuple(value.shape), index, count)
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        return copy.deepcopy(value)

    return _map_leaves(state_dict, leaf)


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


def _shard_position(value: DTensor) -> tuple[int | None, int]:
    """Which dim-0 shard of ``value`` this rank holds and of how many (FSDP2's placements: Shard(0), the
    rest Replicate); ``(None, 0)`` for any other layout."""
    sharded = [dim for dim, placement in enumerate(value.placements) if isinstance(placement, Shard)]
    if len(sharded) != 1 or value.placements[sharded[0]] != Shard(0) or not all(
            isinstance(placement, (Shard, Replicate)) for placement in value.placements):
        return None, 0
    mesh = value.device_mesh
    return mesh.get_local_rank(sharded[0]), mesh.size(sharded[0])


def _local_shards(copied: StateDict) -> list[_LocalShard]:
    """The :class:`_LocalShard` leaves of ``copied``, in the order of :func:`_map_leaves`'s walk."""
    found: list[_LocalShard] = []
    _map_leaves(copied, lambda value: found.append(value) if isinstance(value, _LocalShard) else None)
    return found


def gather_from_copies(copied: StateDict, dst: int = 0) -> StateDict | None:
    """The whole state on rank ``dst`` of the current group from every member's :func:`copy_local` copy.

    Collective on the group the members that are left formed.  Every member
    says which shard it holds; for each shard the first member holding it
    sends its copies to ``dst`` (one message per dtype), which joins them
    along dim 0.  Returns what :func:`gather_full` would have (None on the
    other ranks).

    Raises:
        ShardsLost: on every member, before anything is sent, when some
            shard has no copy left or a tensor is not sharded as FSDP2 shards.
    """
    leaves = _local_shards(copied)
    positions = {(leaf.index, leaf.count) for leaf in leaves}
    mine = positions.pop() if len(positions) == 1 else (None, 0)
    shapes = [(tuple(leaf.tensor.shape), leaf.tensor.dtype) for leaf in leaves]
    said = collectives.allgather_object((mine, shapes))
    holders = _holders([position for position, _ in said])
    rank = env.rank()
    group = collectives.control_group()
    sends = sorted({holder for holder in holders if holder != dst})
    if rank in holders and rank != dst:
        for dtype in _in_order({leaf.tensor.dtype for leaf in leaves}):
            flat = torch.cat([leaf.tensor.reshape(-1) for leaf in leaves if leaf.tensor.dtype == dtype])
            torch.distributed.send(flat, group_dst=dst, group=group)
    if rank != dst:
        return None
    received = {dst: [leaf.tensor for leaf in leaves]}
    for holder in sends:
        received[holder] = _receive(said[holder][1], holder, group)
    return _join(copied, [received[holder] for holder in holders], iter(range(len(leaves))))


def _holders(positions: list[tuple[int | None, int]]) -> list[int]:
    """For each shard index, the first rank that holds it; :class:`ShardsLost` when one has none."""
    counts = {count for _, count in positions}
    if any(index is None for index, _ in positions) or len(counts) != 1:
        raise ShardsLost("the sharded state is not sharded as FSDP2 shards it (Shard(0) over one mesh dimension) "
                         "on every member")
    count = counts.pop()
    holders: dict[int, int] = {}
    for rank, (index, _) in enumerate(positions):
        holders.setdefault(int(index), rank)  # type: ignore[arg-type]
    missing = [index for index in range(count) if index not in holders]
    if missing:
        raise ShardsLost(f"shard(s) {missing} of {count} were held only by the members that were lost")
    return [holders[index] for index in range(count)]


def _in_order(dtypes: set[torch.dtype]) -> list[torch.dtype]:
    """``dtypes`` in the one order every member sends and receives them in (a message per dtype)."""
    return sorted(dtypes, key=str)


def _receive(shapes: list[tuple[tuple[int, ...], torch.dtype]], holder: int,
             group: torch.distributed.ProcessGroup | None) -> list[torch.Tensor]:
    """``holder``'s local shards, one message per dtype, split back into tensors of ``shapes``."""
    tensors: list[torch.Tensor | None] = [None] * len(shapes)
    for dtype in _in_order({dtype for _, dtype in shapes}):
        which = [i for i, (_, kind) in enumerate(shapes) if kind == dtype]
        sizes = [int(torch.Size(shapes[i][0]).numel()) for i in which]
        flat = torch.empty(sum(sizes), dtype=dtype)
        torch.distributed.recv(flat, group_src=holder, group=group)
        for i, part in zip(which, flat.split(sizes)):
            tensors[i] = part.view(shapes[i][0])
    return [tensor for tensor in tensors if tensor is not None]


def _join(copied: StateDict, by_shard: list[list[torch.Tensor]], order: Iterator[int]) -> StateDict:
    """``copied`` with each local shard replaced by the whole tensor joined from every shard's copy."""
    def leaf(value: object) -> object:
        if not isinstance(value, _LocalShard):
            return value
        i = next(order)
        whole = torch.cat([parts[i] for parts in by_shard], dim=0)
        if tuple(whole.shape) != value.shape:
            raise RuntimeError(f"the shards of a tensor of shape {value.shape} join into {tuple(whole.shape)}: "
                               "the members run different models")
        return whole

    return _map_leaves(copied, leaf)
