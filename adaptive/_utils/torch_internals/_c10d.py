"""Process groups (c10d): a ``Work`` from a future, gloo's private collective names, ProcessGroup's overrides.

What a Python ``ProcessGroup`` (``FaultTolerantGroup``) needs to stand in
for gloo.  Part of the adapter :mod:`adaptive._utils.torch_internals`
(import the names from there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import Work
    from torch.futures import Future

__all__ = [
    "work_from_future", "GLOO_ALLGATHER_BASE", "GLOO_REDUCE_SCATTER_BASE", "GLOO_PRIVATE_COLLECTIVES",
    "GLOO_NAMES_OF_PUBLIC_COLLECTIVES", "PROCESS_GROUP_OVERRIDDEN_METHODS",
]


def work_from_future(future: Future[None]) -> Work:
    """``torch._C._distributed_c10d._create_work_from_future``: a ``Work`` that completes with ``future``.

    Why: a Python ``ProcessGroup`` must return a ``Work`` from each
    collective, and a collective that a lost peer ended is completed without
    data; torch can build a ``Work`` from Python only this way.  Not in
    torch's type stubs.  Checked on 2.13.
    """
    create: Callable[[Future[None]], Work] = getattr(torch._C._distributed_c10d, "_create_work_from_future")
    return create(future)


#: The all-gather into one flat tensor and the reduce-scatter from one, under their private names: what
#: torch's device mesh and DTensor call on a ``ProcessGroup`` (so a Python process group such as
#: ``FaultTolerantGroup`` must define them), and what gloo's backend calls them.  In torch 2.x; checked on 2.13.
GLOO_ALLGATHER_BASE = "_allgather_base"
GLOO_REDUCE_SCATTER_BASE = "_reduce_scatter_base"
GLOO_PRIVATE_COLLECTIVES: tuple[str, ...] = (GLOO_ALLGATHER_BASE, GLOO_REDUCE_SCATTER_BASE)

#: gloo backend's (private or older) names for ``ProcessGroup``'s public collectives, where they differ.
GLOO_NAMES_OF_PUBLIC_COLLECTIVES: dict[str, str] = {
    "all_gather_single": GLOO_ALLGATHER_BASE, "reduce_scatter_single": GLOO_REDUCE_SCATTER_BASE,
    "all_to_all_single": "alltoall_base"}

#: ``ProcessGroup`` methods with private names that ``FaultTolerantGroup`` overrides and torch calls
#: (``new_group`` names and describes the group with them); the tests check that ProcessGroup still has them.
PROCESS_GROUP_OVERRIDDEN_METHODS: tuple[str, ...] = ("_set_group_name", "_set_group_desc")
