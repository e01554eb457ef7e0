"""Gradient noise measurement of an FSDP2 model (``fully_shard``), from what FSDP holds.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``, 1-D mesh: FSDP; 2-D mesh
``(replicate, shard)``: HSDP) every data-parallel rank trains on its own
samples, so the ``n = R_dp * k`` small gradients are, as with DDP, each
rank's gradient of each micro-step (``R_dp`` = all ranks of the mesh), and
the big one is their mean, the reduced gradient.  Neither is ever held whole
after the backward: this module reads both where FSDP has them anyway.

Where the small and big gradients come from
-------------------------------------------
* **Small**: FSDP keeps one persistent ``nn.Parameter`` per sharded
  parameter for its unsharded value (``FSDPParam._unsharded_param``,
  created at the first all-gather; its storage is freed and re-filled, the
  object stays).  A tensor hook on it (registered in the root's forward
  hook once it exists, so before the first backward) sees each backward's
  local gradient contribution: the micro-step's gradient on this rank,
  before it is accumulated and before the reduce-scatter (whose input it
  is).  Its squared norm is summed per optimizer group, in float32 (also
  when ``MixedPrecisionPolicy(param_dtype=bfloat16)`` makes it bf16).
* **Big**: after the synchronising backward (after FSDP's root
  post-backward callback, so the reduce-scatter results are in ``.grad``)
  ``param.grad`` is the sharded, rank-averaged gradient (a DTensor).  The
  squared norms of its local shards sum to ``|g_big|^2`` over the shard
  group; under HSDP every shard is held once per replicate group, so each
  rank's sum is divided by ``R`` (the replicate size) before all ranks add.
* Big and small sums travel together in **one asynchronous all-reduce** of
  ``2 * groups`` floats over the mesh's ranks per measured step, read when
  the estimator folds the step in.
* **One rank, no accumulation**: the differenced estimator of
  :mod:`adaptive.batchsize.gns._probe` on the local (here: whole) gradient.

Adam preconditioning
--------------------
The optimizer state is sharded like the parameters: ``exp_avg_sq`` holds
only this rank's rows ``s(r)`` (FSDP2 shards dim 0 in ``torch.chunk``
order).  The big norm is exact (``sum_s |g_big[s] * p[s]|^2`` over the
shards, with ``p = (sqrt(v_hat) + eps) ** -1/2``).  For the small one rank
``r`` sees its whole local gradient ``g_r`` but only its own rows of ``p``,
so it measures ``S * |g_r[s(r)] * p[s(r)]|^2`` (a view of its rows, ``S`` =
shard-group size).  Each rank's samples are independent of which rows it
owns, so ``E[S |g_r[s(r)] p[s(r)]|^2] = S * E|g[s(r)] p[s(r)]|^2``, and
summed over the ``S`` ranks of a shard group (one per shard) this is ``S *
E|g p|^2``: the sum over all ranks is an unbiased estimate of ``sum_r
|g_r p|^2``, which is what the estimator needs.  The price is variance: each
row's small norm is seen by ``R_dp / S`` ranks instead of ``R_dp``, and
the scale factor ``S`` adds the spread of ``|g[s] p[s]|^2`` between shards;
both average out over steps (the moving averages) and vanish for ``S = 1``.
On the 32-parameter test problem of tests/test_gns.py (simulated, 250
steps) the estimate's spread with 2 ranks and no accumulation is 2-3x
DDP's exact one (about 10% instead of 4%), with 2 micro-steps or a 2x2 HSDP
mesh 3-4% (DDP on 4 replicas: 2%); with millions of elements per shard the
row sub-sampling matters less.
The alternative, gathering the preconditioner or the gradient rows, would
cost a full unsharded copy or an all-to-all per step.

Cost
----
Per backward, with several small gradients: one norm per parameter of the
local unsharded gradient (what DDP's hooks read), or, preconditioned, a
multiply of this rank's rows into the reusable workspace (``1 / S`` of the
parameter).  Per measured step: a multi-tensor norm of the local shards, the
division of the shards by the number of micro-steps, one all-reduce of a
few floats.  No unsharded gradient is kept or copied, no host
synchronisation per parameter; with one rank and no accumulation one float32
copy of the (local = whole) gradient, as for DDP.

Requirements: ``attach`` the root ``FSDPModule`` (the outermost one that
``fully_shard`` was called on) after ``fully_shard`` and before its first
forward; the caller marks non-last micro-steps (FSDP reduces only when
``set_requires_gradient_sync(True)``, the default ``is_last_micro_step``
reads that flag).  Not supported (refused with an error): parameters that
already are DTensors (tensor parallelism), CPU offloading, and meshes whose
ranks are not the whole default group unless ``process_group`` spans them.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from adaptive._utils import torch_internals
from adaptive.batchsize.gns._probe import BackwardProbe, ProbeOptions

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only (the library runs on 3.10)

    from torch.distributed.fsdp import FSDPModule

    from adaptive._utils.torch_internals import FSDPParam, FSDPParamGroup

# FSDP2's module class and DTensor: the public ones (torch >= 2.6 and 2.5), the private modules' on older torch.
_FSDP_MODULE = torch_internals.fsdp_module_class()
_DTENSOR = torch_internals.dtensor_class()

__all__ = ["FSDPLayout", "ShardedProbe", "fsdp_layout", "is_fsdp_module"]

logger = logging.getLogger(__name__)


def is_fsdp_module(module: object) -> bool:
    """Whether ``fully_shard`` was called on ``module``."""
    return isinstance(module, _FSDP_MODULE)


def _param_groups(module: FSDPModule) -> list[FSDPParamGroup]:
    return list(torch_internals.fsdp_param_groups(torch_internals.fsdp_state(module)))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (anything else unchanged)."""
    return torch_internals.dtensor_local_tensor(tensor) if isinstance(tensor, _DTENSOR) else tensor


@dataclass(frozen=True)
class FSDPLayout:
    """How an FSDP2 model is sharded, as the noise scale needs it.

    Attributes:
        params: ``id(sharded parameter) -> FSDPParam`` for every parameter
            FSDP manages under the root.
        shard_size: ranks in a shard group (``S``).
        replicate_size: shard groups holding the same shards (``R``, 1 for FSDP).
        group: process group over all ``S * R`` ranks (None: the default group).
        param_groups: FSDP's parameter groups (their ``reduce_grads`` flag
            says whether the coming backward reduces).
    """

    params: dict[int, FSDPParam]
    shard_size: int
    replicate_size: int
    group: dist.ProcessGroup | None
    param_groups: tuple[FSDPParamGroup, ...]

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: every rank trains on its own samples."""
        return self.shard_size * self.replicate_size

    def syncs(self) -> bool:
        """Whether the coming backward reduces gradients (``set_requires_gradient_sync``)."""
        return all(group.reduce_grads for group in self.param_groups)


def fsdp_layout(root: torch.nn.Module, process_group: dist.ProcessGroup | None = None) -> FSDPLayout:
    """Read the sharding of ``root`` (an ``FSDPModule``); raises for what cannot be measured."""
    if not isinstance(root, _FSDP_MODULE):  # is_fsdp_module, spelled out so that root is typed as one
        raise TypeError(f"expected a module on which fully_shard was called, got {type(root).__name__}")
    if torch_internals.fsdp_is_root(torch_internals.fsdp_state(root)) is False:
        raise ValueError("attach the root FSDP module (the outermost one fully_shard was called on), "
                         "not a submodule")
    params: dict[int, FSDPParam] = {}
    param_groups = []
    for module in root.modules():
        if isinstance(module, _FSDP_MODULE):
            for group in _param_groups(module):
                param_groups.append(group)
                for fsdp_param in group.fsdp_params:
                    params[id(fsdp_param.sharded_param)] = fsdp_param
    if not params:
        raise ValueError("the FSDP model manages no parameters")
    shapes = set()
    for fsdp_param in params.values():
        if getattr(fsdp_param, "is_dtensor", False):
            raise ValueError("parameters that already are DTensors (tensor parallelism under FSDP) are not "
                             "supported by the gradient noise scale")
        if getattr(fsdp_param, "offload_to_cpu", False):
            raise ValueError("FSDP CPU offloading is not supported by the gradient noise scale")
        info = fsdp_param.mesh_info
        shapes.add((info.shard_mesh_size, getattr(info, "replicate_mesh_size", 1), id(info.mesh)))
    if len({shape[:2] for shape in shapes}) != 1:
        raise ValueError(f"FSDP parameters are sharded over meshes of different shapes {sorted(shapes)}; "
                         "the gradient noise scale needs one data-parallel mesh")
    shard_size, replicate_size, _ = next(iter(shapes))
    mesh = next(iter(params.values())).mesh_info.mesh
    world = shard_size * replicate_size
    if process_group is None:
        if mesh.ndim == 1:
            process_group = mesh.get_group()
        elif world != dist.get_world_size():
            raise ValueError(f"the {mesh.ndim}-D mesh has {world} of the default group's "
                             f"{dist.get_world_size()} ranks; pass process_group= spanning the mesh's ranks")
    if dist.get_world_size(process_group) != world:
        raise ValueError(f"process_group has {dist.get_world_size(process_group)} ranks but the mesh has {world}")
    return FSDPLayout(params, shard_size, replicate_size, process_group, tuple(param_groups))


def _own_rows(fsdp_param: FSDPParam) -> tuple[int, int, int]:
    """``(dim, start, length)`` of this rank's shard in the unsharded parameter (``torch.chunk`` order)."""
    dim = fsdp_param.fsdp_placement.dim
    size = torch_internals.fsdp_param_orig_size(fsdp_param)[dim]
    shards = fsdp_param.mesh_info.shard_mesh_size
    chunk = math.ceil(size / shards) if size else 0
    start = min(fsdp_param.mesh_info.shard_mesh_rank * chunk, size)
    length = min(chunk, size - start)
    expected = fsdp_param.sharded_size[dim] if len(fsdp_param.sharded_size) > dim else 0
    if length != expected and math.prod(fsdp_param.sharded_size) != 0:
        raise ValueError(f"unexpected FSDP shard: rows {start}:{start + length} of dim {dim} but the "
                         f"shard has {expected}")
    return dim, start, length


class ShardedProbe(BackwardProbe):
    """The hooks on one FSDP2 root module (see the module docstring).

    Args:
        optimizer: the model's optimizer (over the sharded parameters).
        model: the root ``FSDPModule``.
        layout: its :func:`fsdp_layout`.
        **kwargs: as :class:`~adaptive.batchsize.gns._probe.BackwardProbe`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *, layout: FSDPLayout,
                 is_last_micro_step: Callable[[], bool] | None = None, **kwargs: Unpack[ProbeOptions]) -> None:
        self._layout = layout
        if is_last_micro_step is None:
            is_last_micro_step = layout.syncs
        super().__init__(optimizer, model, process_group=layout.group, world_size=layout.world_size,
                         is_last_micro_step=is_last_micro_step, **kwargs)
        self._fsdp = [layout.params[id(p)] for p in self._params]
        self._rows = [_own_rows(f) for f in self._fsdp]
        self._unhooked = list(range(len(self._params)))

    # ------------------------------------------------------------ where gradients are read
    def _model_params(self, model: torch.nn.Module) -> tuple[set[int], list[torch.Tensor]]:
        sharded = {i for i, f in self._layout.params.items() if f.sharded_param.requires_grad}
        return sharded, [p for p in model.parameters() if p.requires_grad]

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return _local(tensor)

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        grad = param.grad
        return None if grad is None else _local(grad)

    def _micro_sq_norm(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Local unsharded gradient: its whole squared norm, or preconditioned, ``S`` times
        that of this rank's rows (the rows its preconditioner shard covers)."""
        norms = self._norms
        root = norms.root(index)
        if root is None:
            return norms.sq_norm(grad, None)
        dim, start, length = self._rows[index]
        return norms.sq_norm(grad.narrow(dim, start, length), root) * self._layout.shard_size

    def _reduce_direct(self, big: torch.Tensor, local: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
        """Big (shard sums, over ``R`` copies of each shard) and small sums in one all-reduce."""
        if self.world_size == 1:
            return big, local, None
        replicas = self._layout.replicate_size
        buffer = torch.cat([big / replicas if replicas > 1 else big, local])
        work = dist.all_reduce(buffer, group=self._process_group, async_op=True)
        return buffer[:big.numel()], buffer[big.numel():], work

    # ------------------------------------------------------------ hooks on the unsharded parameters
    def _register_micro_hooks(self) -> list[RemovableHandle]:
        handles: list[RemovableHandle] = []
        self._hook_unsharded(handles)
        return handles

    def _remove_micro_hooks(self) -> None:
        super()._remove_micro_hooks()
        self._unhooked = list(range(len(self._params)))

    def _hook_unsharded(self, handles: list[RemovableHandle]) -> None:
        """Hook every unsharded parameter FSDP has created by now (they persist once created)."""
        still = []
        for index in self._unhooked:
            unsharded = torch_internals.fsdp_unsharded_param(self._fsdp[index])
            if unsharded is None:
                still.append(index)
                continue
            handles.append(unsharded.register_hook(functools.partial(self._micro_hook, index)))
        self._unhooked = still

    def _micro_hooks_complete(self) -> bool:
        """Every parameter with an unsharded value is hooked (one without had no all-gather,
        hence no local gradient, this step)."""
        return bool(self._micro_handles) and all(
            torch_internals.fsdp_unsharded_param(self._fsdp[i]) is None for i in self._unhooked)

    def _on_forward(self, module: torch.nn.Module, inputs: tuple[object, ...], output: object) -> None:
        """Root forward hook (after FSDP's): hook new unsharded parameters, then as for DDP."""
        if torch.is_grad_enabled() and self._unhooked and self._wants_micro_hooks():
            self._hook_unsharded(self._micro_handles)
        super()._on_forward(module, inputs, output)
