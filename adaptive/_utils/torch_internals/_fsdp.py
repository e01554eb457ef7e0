"""FSDP2 and DTensor: what ``fully_shard`` holds for a module, a DTensor's shard and spec, DTensor's caches.

The gradient noise scale of an FSDP2 model reads the gradients where FSDP
holds them; checkpoint staging rebuilds DTensors around CPU copies; a live
regroup clears DTensor's sharding caches.  Part of the adapter
:mod:`adaptive._utils.torch_internals` (import the names from there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor import DTensor

__all__ = [
    "fsdp_module_class", "fsdp_state", "fsdp_param_groups", "fsdp_is_root", "fsdp_param_orig_size",
    "fsdp_unsharded_param", "dtensor_class", "dtensor_local_tensor", "dtensor_like",
    "clear_dtensor_python_sharding_cache", "clear_dtensor_native_sharding_cache",
]


def fsdp_module_class() -> type[FSDPModule]:
    """``FSDPModule``: public ``torch.distributed.fsdp.FSDPModule`` (torch >= 2.6), else the private module's.

    Why: the noise scale of an FSDP2 model works on torch 2.4-2.5 too, where
    only ``torch.distributed._composable.fsdp`` has it.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return FSDPModule


def fsdp_state(module: FSDPModule) -> FSDPState:
    """``module._get_fsdp_state()``: the state ``fully_shard`` keeps for one module.

    Why: the noise scale reads the gradients where FSDP holds them (its
    parameter groups, below); FSDP2 exposes none of it publicly.  Since
    torch 2.4 (FSDP2); checked on 2.13.
    """
    return module._get_fsdp_state()


def fsdp_param_groups(state: FSDPState) -> list[FSDPParamGroup]:
    """The parameter groups of one FSDP state: ``_fsdp_param_groups`` (torch >= 2.9), else ``_fsdp_param_group``.

    Why: the groups and their ``FSDPParam`` objects (``fsdp_params``,
    ``sharded_param``, ``mesh_info``, ``reduce_grads``, ...) are where the
    noise scale finds each parameter's shards and whether the coming
    backward reduces; they are FSDP internals too, read as torch 2.13 has
    them (tests/test_gns_sharded.py).  Since torch 2.4 (one group until 2.9); checked on 2.13.
    """
    groups: list[FSDPParamGroup] | None = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.9: at most one group per state
        group: FSDPParamGroup | None = getattr(state, "_fsdp_param_group")
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_is_root(state: FSDPState) -> bool | None:
    """Whether FSDP took this state for the root (``_is_root``); None before the first forward decides it.

    Why: the noise scale must be attached to the root module.  Since torch 2.4; checked on 2.13.
    """
    return getattr(state, "_is_root", None)


def fsdp_param_orig_size(fsdp_param: FSDPParam) -> torch.Size:
    """The unsharded shape of an FSDP parameter (``FSDPParam._orig_size``).

    Why: which rows of it this rank's shard holds.  Since torch 2.4; checked on 2.13.
    """
    return fsdp_param._orig_size


def fsdp_unsharded_param(fsdp_param: FSDPParam) -> torch.nn.Parameter | None:
    """FSDP's persistent unsharded parameter (``FSDPParam._unsharded_param``), None before the first all-gather.

    Why: a hook on it sees each backward's local gradient before the
    reduce-scatter.  Since torch 2.4; checked on 2.13.
    """
    return getattr(fsdp_param, "_unsharded_param", None)


def dtensor_class() -> type[DTensor]:
    """``DTensor``: public ``torch.distributed.tensor.DTensor`` (torch >= 2.5), else ``torch.distributed._tensor``'s.

    Why: as :func:`fsdp_module_class`, for torch 2.4.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return DTensor


def dtensor_local_tensor(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local shard itself (``_local_tensor``).

    Why: the public ``to_local()`` returns the same tensor only while grad
    mode is off; with it on, a view through an autograd function (a cost per
    parameter per step).  In torch 2.x; checked on 2.13.
    """
    return tensor._local_tensor


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor around ``local`` with ``like``'s spec (mesh, placements, global shape), built by the constructor.

    Why: ``DTensor.from_local`` would move a CPU shard back to a GPU mesh's
    device and runs an autograd function per tensor (~0.2 ms); DCP's own
    staging uses the constructor and ``_spec`` too.  The ``spec``
    argument since torch 2.4; checked on 2.13.
    """
    return dtensor_class()(local, like._spec, requires_grad=False)


def clear_dtensor_python_sharding_cache() -> None:
    """Empty DTensor's Python cache of output shardings (``DTensor._op_dispatcher.sharding_propagator``).

    Why: the cache keys by mesh equality, which ignores the process groups,
    so a live job's new mesh laid out as an old one would find the old one's
    groups (see adaptive.parallel._sharding); no public way to clear it.
    Since torch 2.4; checked on 2.13.
    """
    dtensor_class()._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def clear_dtensor_native_sharding_cache() -> bool:
    """Empty DTensor's C++ sharding cache (``torch._C._clear_DTensor_sharding_propagator_cache``) where torch has one.

    Why: as :func:`clear_dtensor_python_sharding_cache`, for newer torch's
    C++ fast path.  Absent in older torch (nothing to clear); present on
    2.13.  Whether there was one.
    """
    clear: Callable[[], None] | None = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is None:
        return False
    clear()
    return True
