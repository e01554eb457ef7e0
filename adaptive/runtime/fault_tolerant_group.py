"""A gloo process group whose collectives record a lost peer on the step instead of raising (live mode).

In live mode a sharded model's collectives (FSDP2's all-gather and
reduce-scatter, HSDP's all-reduce over replicas, DTensor's own) run inside
the user's forward and backward, where an error cannot be caught and the
step discarded.  So the device mesh of a live job on gloo is built on
:data:`BACKEND`, a backend registered with
``torch.distributed.Backend.register_backend`` whose process groups are
:class:`FaultTolerantGroup`: a ``torch.distributed.ProcessGroup`` that runs
each collective on an ordinary gloo backend and, when it fails because a
peer died, records the failure on the step in flight
(:func:`adaptive.runtime.peer_failure.absorb_in_live_mode`) and completes
it without data.  From then on until the members re-form, its collectives
are not sent at all: the step runs to its end locally, its optimizer step is
skipped, and the loader discards it (as for ``AdaptiveDataParallel``,
whose gradient all-reduce does the same through a DDP communication hook).

A survivor can also be waiting in a collective with a member that recorded
the failure and stopped sending.  Collectives are therefore waited for in
slices, and between them the wait ends as a recorded loss once a member
said on the store that it is re-forming
(:func:`adaptive.runtime.reforming.report_loss`), so the whole group
reaches the re-formation.  :func:`close_all`, which every member that is
left calls then, makes sure nothing more is sent on the old groups; their
gloo backends are kept, not destroyed, until their collectives time out
(:mod:`adaptive.runtime.broken_groups`).

DTensor's functional collectives (``full_tensor``, the norm in
``clip_grad_norm_``, full state dicts) reach the same methods from C++
(through the ``*_coalesced`` ones), so they too record a loss.  Errors that
are not a lost peer, and a lost peer outside the loader's loops (no step to
discard), are raised as gloo raises them.  Only gloo
(CPU) is wrapped; an NCCL mesh is left as it is, and a lost peer there
restarts the members from the checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from torch.distributed.distributed_c10d import GroupName

from adaptive._utils import torch_internals
from adaptive.runtime import broken_groups, collectives, membership, peer_failure, step
from adaptive.runtime.errors import CollectiveError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

__all__ = ["BACKEND", "FaultTolerantGroup", "register", "applies", "close_all"]

logger = logging.getLogger(__name__)

#: The backend name a live job's gloo device mesh is built with (``init_device_mesh(backend_override=...)``).
BACKEND = "adaptive_gloo"

#: ProcessGroup methods whose gloo-backend method has another name.
_BACKEND_NAMES = torch_internals.GLOO_NAMES_OF_PUBLIC_COLLECTIVES
#: The collectives and point-to-point operations a FaultTolerantGroup forwards to gloo.
_OPERATIONS = (*torch_internals.GLOO_PRIVATE_COLLECTIVES, "all_gather_single", "reduce_scatter_single",
               "all_to_all_single", "allgather", "allgather_coalesced", "allreduce", "allreduce_coalesced",
               "alltoall", "alltoall_base", "barrier", "broadcast", "gather", "reduce", "reduce_scatter", "scatter",
               "send", "recv", "recv_anysource")

_open_groups: weakref.WeakSet[FaultTolerantGroup] = weakref.WeakSet()
_registered = threading.Lock()


class FaultTolerantGroup(dist.ProcessGroup):
    """A process group over a gloo backend that turns a lost peer into a recorded fault (module docstring)."""

    def __init__(self, backend: dist.ProcessGroupGloo, rank: int, size: int, timeout: float) -> None:
        # torch's Python subclass constructor is (rank, size); its type stubs list only (store, rank, size)
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._backend: dist.ProcessGroupGloo | None = backend
        self._timeout = timeout  # seconds a collective of the backend waits for its peers
        self._name = ""
        self._description = ""
        _open_groups.add(self)

    # ProcessGroup's naming: set by torch.distributed.new_group, read by DeviceMesh.
    def _set_group_name(self, name: GroupName) -> None:
        self._name = name

    @property
    def group_name(self) -> GroupName:
        return GroupName(self._name)

    def _set_group_desc(self, description: str) -> None:
        self._description = description

    @property
    def group_desc(self) -> str:
        return self._description

    def getBackendName(self) -> str:  # noqa: N802 (ProcessGroup's name)
        return BACKEND

    @property
    def closed(self) -> bool:
        return self._backend is None

    def close(self) -> None:
        """Send nothing more on this group (it belongs to a generation that lost a member).

        Its gloo backend is kept rather than destroyed (:mod:`adaptive.runtime.broken_groups`): a collective
        of it may still wait for a member that gave up, until the timeout.
        """
        if self._backend is not None:
            broken_groups.keep(self._backend, timeout=self._timeout)
        self._backend = None

    def shutdown(self) -> None:
        """torch's ``destroy_process_group`` at an agreed change: every collective completed; drop the backend."""
        self._backend = None

    def abort(self) -> None:
        self.close()

    def all_gather_single_coalesced(self, output_lists: list[torch.Tensor], input_list: list[torch.Tensor],
                                    opts: AllgatherOptions | None = None) -> dist.Work:
        """What DTensor's functional all-gather calls: one all-gather per pair, each as :meth:`_run` runs it."""
        return self._each(torch_internals.GLOO_ALLGATHER_BASE, output_lists, input_list, opts)

    def reduce_scatter_single_coalesced(self, outputTensors: list[torch.Tensor],  # noqa: N803 (torch's names)
                                        inputTensors: list[torch.Tensor],  # noqa: N803
                                        opts: ReduceScatterOptions | None = None) -> dist.Work:
        """What DTensor's functional reduce-scatter calls: one per pair."""
        return self._each(torch_internals.GLOO_REDUCE_SCATTER_BASE, outputTensors, inputTensors, opts)

    def _each(self, operation: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
              options: AllgatherOptions | ReduceScatterOptions | None) -> dist.Work:
        work = _completed()
        for output, tensor in zip(outputs, inputs):
            work = self._run(operation, output, tensor, options)
        return work

    def _run(self, operation: str, *args: object) -> dist.Work:
        """``operation`` on gloo; a lost peer (now, or when it completes) is recorded and it completes empty."""
        if self._backend is None or step.faulted():
            return _completed()
        try:
            work = getattr(self._backend, _BACKEND_NAMES.get(operation, operation))(*args)
        except Exception as error:
            return _absorb(operation, error)
        return self._wait(operation, work)

    def _wait(self, operation: str, work: dist.Work) -> dist.Work:
        """Wait for ``work`` here, as :func:`adaptive.runtime.collectives.wait` does (a callback on gloo's
        thread would need the GIL, which a functional collective waiting on the main thread may hold)."""
        try:
            collectives.wait(work, operation)
        except CollectiveError as error:
            return _absorb(operation, error.__cause__ or error)  # gloo's own error, or the loss reported
        return work


def _operation(name: str) -> Callable[..., dist.Work]:
    def forward(self: FaultTolerantGroup, *args: object) -> dist.Work:
        return self._run(name, *args)

    forward.__name__ = name
    forward.__doc__ = f"ProcessGroup.{name} on gloo; a lost peer is recorded on the step (module docstring)."
    return forward


for _name in _OPERATIONS:
    setattr(FaultTolerantGroup, _name, _operation(_name))


def _completed() -> dist.Work:
    """A finished ``Work`` with no data (what a collective that is not sent returns)."""
    done: Future[None] = Future()
    done.set_result(None)
    return torch_internals.work_from_future(done)


def _recorded(error: BaseException) -> bool:
    """Whether ``error`` is a lost peer during a loader loop, now recorded on the step in flight."""
    return step.loop_running() and peer_failure.absorb_in_live_mode(error)


def _absorb(operation: str, error: BaseException) -> dist.Work:
    """A failed operation: recorded (and completed empty) when a peer was lost in a loop; else it is raised."""
    if not _recorded(error):
        raise error
    logger.warning("a peer was lost during %s of the sharded model's mesh; the step is discarded (%s)", operation,
                   str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
    return _completed()


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> FaultTolerantGroup:
    return FaultTolerantGroup(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size, timeout.total_seconds())


def register() -> None:
    """Register :data:`BACKEND` with torch.distributed (once per process)."""
    with _registered:
        if BACKEND.lower() not in dist.Backend.backend_list:  # register_backend adds it
            dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def applies(device_type: str) -> bool:
    """Whether a device mesh of ``device_type`` is built on :data:`BACKEND` now (live mode, gloo, CPU)."""
    return membership.is_live() and device_type == "cpu" and dist.is_initialized() and dist.get_backend() == "gloo"


def close_all() -> int:
    """Close every fault-tolerant group of this process (before re-forming after a loss); how many were open."""
    groups = [group for group in list(_open_groups) if not group.closed]
    for group in groups:
        group.close()
    return len(groups)
