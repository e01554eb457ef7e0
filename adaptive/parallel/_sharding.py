"""How :class:`~adaptive.AdaptiveFSDP` shards a model: the mesh, the policy, the optimizer.

* :func:`sharding_mesh` builds the device mesh for the current world size:
  1-D (every replica holds one shard: FSDP) or 2-D ``(replicate, shard)``
  (HSDP: shard within groups of ``shard_size`` replicas, typically a node,
  replicate across them).  An elastic job builds it anew after every
  restart, so the mesh always matches the replicas it has.
* :func:`apply_fully_shard` calls ``fully_shard`` on the modules a policy
  picks (default: each element of every ``nn.ModuleList``, the usual
  container of transformer blocks), children before parents, then on the
  root, the order FSDP2 requires.
* :func:`rebind_optimizer` points an optimizer built on the unsharded model
  at the sharded parameters that replaced them (matched by name), so the
  ordinary "model, optimizer, wrap" order of DDP scripts works unchanged.
* In live mode (``adaptive-run --live``) the model is sharded again at each
  membership change: :func:`meta_copy` keeps a storage-free copy of the
  unsharded model to shard anew, :func:`sharding_mesh_like` gives the mesh
  for the new replica count and :func:`move_optimizer` carries the
  optimizer over to the new parameters.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
from typing import Callable, Sequence, TypedDict

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from adaptive._utils import torch_internals
from adaptive._utils.checks import check_int
from adaptive._utils.types import StateDict
from adaptive.runtime import env, fault_tolerant_group, membership
from adaptive.runtime.job import current_job

__all__ = ["sharding_mesh", "sharding_mesh_like", "live_shard_size", "apply_fully_shard", "check_rebindable",
           "rebind_optimizer", "parameter_names", "is_fully_sharded", "module_mesh", "meta_copy", "move_optimizer",
           "is_fault_tolerant", "ShardPolicy", "FSDP_OPTIONS", "FSDPOptions"]

logger = logging.getLogger(__name__)

#: The ``fully_shard`` keyword arguments :class:`~adaptive.AdaptiveFSDP` passes on.
FSDP_OPTIONS = ("reshard_after_forward", "mp_policy")


class FSDPOptions(TypedDict, total=False):
    """:data:`FSDP_OPTIONS` with their types (as ``fully_shard`` takes them)."""

    reshard_after_forward: bool | int | None
    mp_policy: MixedPrecisionPolicy

#: What ``shard=`` accepts: ``"blocks"``, ``"root"``, module classes, or ``(name, module) -> bool``.
ShardPolicy = str | type | Sequence[type] | Callable[[str, torch.nn.Module], bool]


def _device_type(device_type: str | None) -> str:
    if device_type is not None:
        return device_type
    return "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"


def sharding_mesh(shard_size: int | str | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """The device mesh for sharding over all current replicas.

    Args:
        shard_size: ``None`` (default): one dimension, every replica holds
            one shard of every parameter (FSDP).  An int: a 2-D mesh
            ``(replicate, shard)`` whose shard groups have that many
            replicas (HSDP); it must divide the number of replicas (in
            live mode, where a generation may have any size, a size that
            does not divide them grows to the smallest one that does).
            ``"node"``: the replicas of one node (``LOCAL_WORLD_SIZE``).
        device_type: ``"cuda"`` or ``"cpu"``; default from the process
            group's backend.

    Call after ``adaptive.init_process_group``; collective (every replica).
    In live mode a process that joins a running job builds it over its group
    of one until it is admitted (:mod:`adaptive.checkpoint.admission`);
    :class:`~adaptive.AdaptiveFSDP` then shards anew for the generation it
    joined.
    """
    replicas = env.num_replicas()
    kind = _device_type(device_type)
    if shard_size is None:
        return _mesh(kind, (replicas,), ("shard",))
    if shard_size == "node":
        shard_size = env.num_local_replicas()
    shard_size = check_int("shard_size", shard_size, 1, hint=" (replicas per shard group, or 'node', or None)")
    if membership.is_live():  # a generation may have any size: shard as its members reshard for it
        current_job().part(_LiveShardSize).wanted = shard_size
        return _hsdp_mesh(kind, shard_size, replicas)
    if replicas % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide the number of replicas ({replicas}); "
                         "use shard_size=None for one shard group over all replicas")
    return _mesh(kind, (replicas // shard_size, shard_size), ("replicate", "shard"))


def sharding_mesh_like(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh of ``mesh``'s kind for the current replicas (after a live membership change).

    1-D: one shard group over all replicas.  2-D (HSDP): shard groups of
    the size asked of :func:`sharding_mesh` (else ``mesh``'s) where that
    divides the replicas; otherwise the smallest size above it that does (at
    most every replica in one group), so that no replica holds more than it
    would.  Collective.
    """
    kind = mesh.device_type
    replicas = env.num_replicas()
    if mesh.ndim == 1:
        return _mesh(kind, (replicas,), ("shard",))
    return _hsdp_mesh(kind, current_job().part(_LiveShardSize).wanted or mesh.shape[1], replicas)


@dataclasses.dataclass
class _LiveShardSize:
    """The HSDP shard-group size asked of :func:`sharding_mesh` in live mode (its record on the job context).

    Meshes after a change are built for it, not for the last mesh's size
    (which grew while it did not divide the replicas), so that the members
    and a joiner, which asks for it anew, build the same mesh.
    """

    wanted: int | None = None


def _hsdp_mesh(kind: str, wanted: int, replicas: int) -> DeviceMesh:
    """A 2-D mesh over ``replicas`` with shard groups of :func:`live_shard_size` ``(wanted, replicas)``."""
    size = live_shard_size(wanted, replicas)
    if size != wanted and not membership.is_awaiting_admission():  # a joiner's group of one: it shards anew once admitted
        logger.warning("HSDP shard groups of %d replicas do not divide the %d replicas now; sharding in groups of "
                       "%d until they do", wanted, replicas, size)
    return _mesh(kind, (replicas // size, size), ("replicate", "shard"))


def _mesh(kind: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh``; in live mode on gloo its groups record a lost peer instead of raising
    (:mod:`adaptive.runtime.fault_tolerant_group`), so the survivors can discard the step and go on."""
    if membership.is_live():
        _forget_earlier_meshes()
    if not fault_tolerant_group.applies(kind):
        return init_device_mesh(kind, shape, mesh_dim_names=names)
    fault_tolerant_group.register()
    return init_device_mesh(kind, shape, mesh_dim_names=names,
                            backend_override={name: fault_tolerant_group.BACKEND for name in names})


def _forget_earlier_meshes() -> None:
    """Empty DTensor's sharding-propagation caches before a live job builds a mesh for a new generation.

    A DeviceMesh compares equal to another of the same layout whatever
    process groups it names, and DTensor caches the output sharding of each
    operation by its inputs' sharding, mesh included.  A mesh of this
    generation laid out as one of an earlier generation would then find that
    mesh in the cache: the outputs of operations (the state-dict copies a
    reshard fills, among others) would name the earlier generation's groups,
    which are gone, or are another group of the same name now.  Seen as
    "Could not resolve the process group registered under the name 3" when
    an HSDP job went back to its first layout (2, 2) -> (1, 3) -> (2, 2).
    The caches fill again within a step.
    """
    torch_internals.clear_dtensor_python_sharding_cache()
    torch_internals.clear_dtensor_native_sharding_cache()  # newer torch only


def is_fault_tolerant(mesh: DeviceMesh) -> bool:
    """Whether every group of ``mesh`` records a lost peer instead of raising."""
    return all(isinstance(mesh.get_group(dim), fault_tolerant_group.FaultTolerantGroup) for dim in range(mesh.ndim))


def _policy(shard: ShardPolicy, module: torch.nn.Module) -> Callable[[str, torch.nn.Module], bool]:
    """``shard=`` as a predicate over ``(qualified name, module)`` of ``module``'s non-root modules."""
    if shard == "blocks":
        lists = {name for name, child in module.named_modules() if isinstance(child, torch.nn.ModuleList)}
        return lambda name, child: name.rpartition(".")[0] in lists
    if shard == "root":
        return lambda name, module: False
    if isinstance(shard, type) or (isinstance(shard, (tuple, list)) and shard
                                   and all(isinstance(kind, type) for kind in shard)):
        kinds = tuple(shard) if isinstance(shard, (tuple, list)) else (shard,)
        return lambda name, module: isinstance(module, kinds)
    if callable(shard):
        return shard
    raise ValueError(f"shard must be 'blocks', 'root', a module class (or a tuple of them) or a callable "
                     f"(name, module) -> bool, got {shard!r}")


def live_shard_size(wanted: int, replicas: int) -> int:
    """The HSDP shard-group size for ``replicas`` after a live change: ``wanted`` if it divides them, else the
    smallest size above it that does (``replicas`` at most); never more replicas' worth of state per rank."""
    return next(size for size in range(min(wanted, replicas), replicas + 1) if replicas % size == 0)


def apply_fully_shard(module: torch.nn.Module, mesh: DeviceMesh, shard: ShardPolicy,
                      options: FSDPOptions) -> list[str]:
    """``fully_shard`` the modules ``shard`` picks (innermost first), then the root; returns their names."""
    wants = _policy(shard, module)
    picked = [(name, child) for name, child in module.named_modules() if name and wants(name, child)]
    for name, child in reversed(picked):  # named_modules is pre-order: reversed puts children first
        fully_shard(child, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    logger.debug("fully_shard applied to %d module(s) and the root: %s", len(picked),
                 ", ".join(name for name, _ in picked))
    return [name for name, _ in picked]


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> qualified name`` of every parameter (taken before sharding replaces them)."""
    return {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}


def check_rebindable(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer built on the unsharded model can move to the sharded one only before its first step."""
    if optimizer.state:
        raise ValueError("the optimizer has already stepped on the unsharded model; build it from the "
                         "model's parameters before its first step, or call fully_shard yourself and build "
                         "the optimizer after it")


def rebind_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: torch.nn.Module) -> None:
    """Point ``optimizer``'s groups at the sharded parameters that replaced the ones it was built from."""
    sharded = dict(module.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(param)]] for param in group["params"]]


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (no storage, nothing copied).

    Shared and tied parameters stay shared in the copy.
    """
    memo: dict[int, torch.Tensor] = {}
    for param in module.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(module, memo)


def move_optimizer(optimizer: torch.optim.Optimizer, old: torch.nn.Module, new: torch.nn.Module) -> None:
    """Point ``optimizer`` at ``new``'s parameters, which replace ``old``'s of the same names.

    Its per-parameter state moves to the new parameters with the new
    sharding and zeros in place of the sharded values (they are filled from
    the full copy right after); plain values (the step count) are kept.
    """
    names = parameter_names(old)
    rebind_optimizer(optimizer, names, new)
    params = dict(new.named_parameters(remove_duplicate=False))
    moved: collections.defaultdict[torch.Tensor, StateDict] = collections.defaultdict(dict)
    for param, entry in optimizer.state.items():
        target = params[names[id(param)]]
        moved[target] = {key: torch.zeros_like(target, dtype=value.dtype) if isinstance(value, DTensor) else value
                         for key, value in entry.items()}
    optimizer.state = moved


def is_fully_sharded(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was already called on ``module`` (the root)."""
    return isinstance(module, FSDPModule)


def module_mesh(module: torch.nn.Module) -> DeviceMesh:
    """The mesh an already sharded module's parameters live on."""
    for param in module.parameters():
        mesh: DeviceMesh | None = getattr(param, "device_mesh", None)  # a sharded parameter is a DTensor
        if mesh is not None:
            return mesh
    raise ValueError("the fully sharded module has no sharded parameters")
