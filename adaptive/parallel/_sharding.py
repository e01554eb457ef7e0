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
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from adaptive._utils.checks import check_int
from adaptive.runtime import env

__all__ = ["sharding_mesh", "apply_fully_shard", "check_rebindable", "rebind_optimizer", "parameter_names",
           "is_fully_sharded", "module_mesh", "ShardPolicy", "FSDP_OPTIONS"]

logger = logging.getLogger(__name__)

#: The ``fully_shard`` keyword arguments :class:`~adaptive.AdaptiveFSDP` passes on.
FSDP_OPTIONS = ("reshard_after_forward", "mp_policy")

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
            replicas (HSDP); it must divide the number of replicas.
            ``"node"``: the replicas of one node (``LOCAL_WORLD_SIZE``).
        device_type: ``"cuda"`` or ``"cpu"``; default from the process
            group's backend.

    Call after ``adaptive.init_process_group``; collective (every replica).
    """
    replicas = env.num_replicas()
    kind = _device_type(device_type)
    if shard_size is None:
        return init_device_mesh(kind, (replicas,), mesh_dim_names=("shard",))
    if shard_size == "node":
        shard_size = env.num_local_replicas()
    shard_size = check_int("shard_size", shard_size, 1, hint=" (replicas per shard group, or 'node', or None)")
    if replicas % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide the number of replicas ({replicas}); "
                         "use shard_size=None for one shard group over all replicas")
    return init_device_mesh(kind, (replicas // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


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


def apply_fully_shard(module: torch.nn.Module, mesh: DeviceMesh, shard: ShardPolicy,
                      options: dict[str, Any]) -> list[str]:
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
