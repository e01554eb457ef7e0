"""DistributedDataParallel's private calls: rebuild its reducer on a new process group, sync its buffers.

A live membership change rebuilds DDP's reducer on the new group (with its
communication hooks and static graph) and broadcasts DDP's buffers itself,
without bumping their autograd versions.  Part of the adapter
:mod:`adaptive._utils.torch_internals` (import the names from there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Reducer
    from torch.distributed import GradBucket
    from torch.futures import Future
    from torch.nn.parallel import DistributedDataParallel

    #: A DDP communication hook: ``hook(state, bucket) -> future of the reduced bucket``.
    CommHook = Callable[[object, GradBucket], Future[torch.Tensor]]

__all__ = [
    "ddp_params_for_reducer", "ddp_param_names", "ddp_init_reducer", "ddp_comm_hooks", "ddp_assign_modules_buffers",
    "ddp_sync_buffers", "DDP_OVERRIDDEN_METHODS", "reducer_set_static_graph", "register_reducer_comm_hook",
    "preserve_version_counter",
]


def ddp_params_for_reducer(ddp: DistributedDataParallel) -> tuple[list[torch.nn.Parameter], list[bool]]:
    """DDP's ``_build_params_for_reducer()``: the parameters its reducer reduces and which expect sparse grads.

    Why: a live membership change rebuilds the reducer on the new process
    group, as DDP builds it when unpickled; torch has no public "rebind DDP
    to another group".  In torch since 1.x (2.4 has it); checked on 2.13.
    """
    built: tuple[list[torch.nn.Parameter], list[bool]] = ddp._build_params_for_reducer()
    return built


def ddp_param_names(ddp: DistributedDataParallel, parameters: list[torch.nn.Parameter]) -> dict[int, str]:
    """DDP's ``_build_debug_param_to_name_mapping(parameters)``: parameter index -> name, for the reducer's errors.

    Why: an argument of :func:`ddp_init_reducer` (the rebuild above).  In torch since 1.x; checked on 2.13.
    """
    names: dict[int, str] = ddp._build_debug_param_to_name_mapping(parameters)
    return names


def ddp_init_reducer(ddp: DistributedDataParallel, parameters: list[torch.nn.Parameter],
                     expect_sparse_gradient: list[bool], param_names: dict[int, str]) -> None:
    """DDP's ``_ddp_init_helper``: build a new reducer over ``ddp.process_group`` (keeping ``static_graph``).

    Why: the core of rebuilding DDP on a new group; DDP's constructor and
    ``__setstate__`` call it, nothing public does.  The four-argument
    form is in torch 2.x; checked on 2.13.
    """
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, param_names, ddp.static_graph)


def ddp_comm_hooks(ddp: DistributedDataParallel) -> list[tuple[CommHook, object]]:
    """The ``(hook, state)`` pairs registered by ``ddp.register_comm_hook`` (DDP's ``_comm_hooks``).

    Why: a rebuilt reducer has no hooks; they are registered again on it
    (:func:`register_reducer_comm_hook`), and DDP lists them nowhere public.
    Checked on 2.13.
    """
    return ddp._comm_hooks


def ddp_assign_modules_buffers(ddp: DistributedDataParallel) -> None:
    """DDP's ``_assign_modules_buffers()``: refresh ``ddp.modules_buffers``, the buffers it broadcasts.

    Why: the library's own buffer broadcast (live mode, one that a lost peer
    cannot hang) broadcasts exactly DDP's buffers.  In torch since 1.x; checked on 2.13.
    """
    ddp._assign_modules_buffers()


def ddp_sync_buffers(ddp: DistributedDataParallel) -> None:
    """DDP's own ``_sync_buffers()`` (the broadcast of the buffers before a forward), as the subclass overrides it.

    Why: the subclass overrides ``_sync_buffers`` (:data:`DDP_OVERRIDDEN_METHODS`)
    to catch a lost peer, and calls DDP's for the ordinary case.  In torch since 1.x; checked on 2.13.
    """
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._sync_buffers(ddp)


#: DDP methods with private names that ``AdaptiveDataParallel`` overrides; DDP calls them itself
#: (``_sync_buffers`` before each forward that syncs buffers), so a rename in torch would silently skip the
#: override: the tests check that DDP still has them.
DDP_OVERRIDDEN_METHODS: tuple[str, ...] = ("_sync_buffers",)


def reducer_set_static_graph(reducer: Reducer) -> None:
    """``reducer._set_static_graph()``: tell a rebuilt reducer that the graph is static, as DDP's constructor does.

    Why: DDP sets it only in its constructor (``static_graph=True``).  In torch since 1.x; checked on 2.13.
    """
    reducer._set_static_graph()


def register_reducer_comm_hook(reducer: Reducer, state: object, hook: CommHook) -> None:
    """``torch.distributed._register_comm_hook``: register a communication hook on a (rebuilt) reducer.

    Why: the public ``DistributedDataParallel.register_comm_hook`` would also
    append the hook to DDP's list (:func:`ddp_comm_hooks`) a second time;
    this is the call it makes on the reducer.  In torch since 1.x; checked on 2.13.
    """
    torch.distributed._register_comm_hook(reducer, state, hook)


def preserve_version_counter(tensors: Sequence[torch.Tensor]) -> AbstractContextManager[None]:
    """``torch.autograd._unsafe_preserve_version_counter``: in-place writes inside leave ``tensors``' versions as
    they were.

    Why: broadcasting into buffers that the forward saved for backward
    (BatchNorm's running stats) must not fail autograd's version check, as
    DDP's own buffer broadcast does it; there is no public way.  In torch 2.4 (FSDP2 uses it);
    checked on 2.13.
    """
    return torch.autograd._unsafe_preserve_version_counter(tuple(tensors))
