"""Process-group set-up and collectives on Python objects, all on torch.distributed.

``init_process_group`` reads torchrun's environment (guarantee G1).  Besides the
training group it creates two small gloo groups on the CPU:

* the *control* group carries object collectives and the per-step agreement
  on stopping and checkpointing, also when training uses NCCL;
* the *async* group carries :func:`allreduce_async`, whose operations run in
  one background thread, in order, so they never interleave with the control
  group's operations of the main thread.

A peer that dies makes a pending collective fail (gloo notices the closed
connection at once; a hung peer is caught by ``ADAPTIVE_COLLECTIVE_TIMEOUT``),
and the failure surfaces as :class:`CollectiveError` rather than a hang.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime
import functools
import logging
import operator
import os
import pickle
from typing import Any, Callable, Protocol, TypeVar, cast

import torch
import torch.distributed as dist

from adaptive.runtime import broken_groups, env, launch_status, membership, peer_failure, reforming
from adaptive.runtime.errors import CollectiveError
from adaptive.runtime.live_protocol import Generation
from adaptive.runtime.watched_store import LossWatchedStore
from adaptive.runtime.job import ProcessGroups, current_job

__all__ = [
    "CollectiveError",
    "init_process_group",
    "is_initialized",
    "control_group",
    "broadcast_object",
    "allreduce_object",
    "allreduce_async",
    "allgather_object",
    "allreduce_max_async",
    "barrier",
    "wait",
    "regroup",
    "complete_admission",
    "Waitable",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

def _groups() -> ProcessGroups:
    """This job's process groups (see :mod:`adaptive.runtime.job`)."""
    return current_job().groups



def is_initialized() -> bool:
    """Whether :func:`init_process_group` (or torch's own) has set up a group."""
    return dist.is_available() and dist.is_initialized()


def init_process_group(backend: str | None = None, timeout: float | None = None) -> None:
    """Initialise torch.distributed from torchrun's environment.

    With no torchrun variables (``python train.py``) this creates a one-process
    group, so code that expects a group (DDP) works unchanged.  Calling it
    again is harmless.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or any backend torch knows; default
            ``"nccl"`` when CUDA is available, else ``"gloo"``.
        timeout: seconds a collective waits for its peers before failing;
            default ``ADAPTIVE_COLLECTIVE_TIMEOUT`` (300 s).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name such as 'gloo' or 'nccl', got {backend!r}")
    seconds = env.collective_timeout() if timeout is None else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    delta = datetime.timedelta(seconds=seconds)
    groups = _groups()
    peer_failure.install()  # a peer's death (or the live store's, while joining) ends the script with one line
    if not dist.is_initialized():
        groups.timeout = seconds
        if backend == "nccl" and torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank())
        # adaptive-run --live: the members are whoever the live job admits; a process that finds the job
        # running builds on a group of one until it is admitted (complete_admission).
        generation = membership.join(seconds, admit_now=False) if membership.is_live() else None
        if generation is not None:
            _init_generation(backend, generation, delta)
        elif membership.is_live() or (env.num_replicas() == 1 and env.master_port() is None):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=delta)
        else:
            dist.init_process_group(backend, init_method="env://", rank=env.rank(), world_size=env.num_replicas(),
                                    timeout=delta)
        logger.debug("process group ready: backend=%s rank=%d world=%d", backend, env.rank(), env.num_replicas())
        groups.owns_default_group = True
    launch_status.clear_earlier_reports()
    if groups.control is None:
        _make_side_groups(delta)
        _register_teardown()


def _init_generation(backend: str, generation: Generation, delta: datetime.timedelta) -> None:
    """The default group of a live generation, on its own prefix of the launchers' store, and its side groups.

    The members meet on the store first (:func:`adaptive.runtime.reforming.meet`), and the group's rendezvous
    gives up once a member is reported lost (:mod:`adaptive.runtime.watched_store`): a member lost since the
    generation was agreed fails this with :class:`CollectiveError` within seconds, not at the timeout.
    """
    wid = membership.membership().wid
    assert wid is not None
    os.environ.update(membership.members_env(generation, wid))  # env.rank() & co. follow the membership
    _groups().backend = backend
    missing = reforming.meet(generation) if len(generation.members) > 1 else []
    if missing:
        raise CollectiveError(f"generation {generation.number}'s group cannot form: worker(s) "
                              f"{', '.join(map(str, missing))} did not come")
    store = LossWatchedStore(membership.generation_store(generation.number), reforming.loss_reported,
                             f"generation {generation.number} lost a member while its group was being built")
    _groups().rendezvous_stores.append(store)
    try:
        dist.init_process_group(backend, store=store, rank=env.rank(), world_size=env.num_replicas(), timeout=delta)
        membership.group_formed(delta.total_seconds())
        _make_side_groups(delta)
    except (RuntimeError, dist.DistError) as error:  # a member lost after it met the others
        raise _wrap_failure(f"the rendezvous of generation {generation.number}'s groups", error) from error


def _make_side_groups(delta: datetime.timedelta) -> None:
    """The control group (the default one with gloo) and the asynchronous group."""
    groups = _groups()
    if dist.get_backend() == "gloo":
        groups.control = dist.group.WORLD
    else:
        groups.control = dist.new_group(backend="gloo", timeout=delta)
    groups.asynchronous = dist.new_group(backend="gloo", timeout=delta)


def complete_admission() -> None:
    """Live mode: a process that found the job running joins it now, in place of its group of one.

    Called at its admission point (:func:`adaptive.checkpoint.admission.admit`:
    its first epoch, loader or ``synchronized()`` iteration): its model,
    optimizer and loaders were built by then, on its group of one, so the
    running members wait only for the state to arrive.  Does nothing for a
    member.
    """
    if not membership.is_awaiting_admission():
        return
    following = membership.join(_groups().timeout or env.collective_timeout())
    assert following is not None
    regroup(following)


def regroup(following: Generation, *, broken: bool = False) -> None:
    """Leave this generation's groups and build ``following``'s, in place (live mode, on every member that stays).

    Every member of the old generation must have finished its collectives on
    the old groups (the caller agreed on the change at a step boundary),
    unless the old group is ``broken`` (a peer was lost): then nothing more
    is waited for on it, and its groups are kept rather than destroyed
    (:mod:`adaptive.runtime.broken_groups`: destroying one would wait for
    collectives that only end at the timeout).  The listeners of
    :func:`adaptive.runtime.membership.on_regroup` are told once the new
    groups exist.
    """
    groups = _groups()
    if groups.executor is not None:  # operations of the old asynchronous group: all issued, let them finish
        groups.executor.shutdown(wait=not broken)
        groups.executor = None
    delta = datetime.timedelta(seconds=groups.timeout or env.collective_timeout())
    if dist.is_initialized():  # not after a new generation's group failed to form (a member lost meanwhile)
        groups.backend = dist.get_backend()
        if broken:
            broken_groups.keep(dist.group.WORLD, groups.control, groups.asynchronous, timeout=delta.total_seconds())
        dist.destroy_process_group()
    backend = groups.backend
    assert backend is not None, "a live member's first group was built by init_process_group"
    groups.control = groups.asynchronous = None
    groups.retained.clear()
    membership.enter(following)
    _init_generation(backend, following, delta)
    membership.notify_regroup()


def _register_teardown() -> None:
    groups = _groups()
    if not groups.teardown_registered:
        atexit.register(_destroy_at_exit)
        groups.teardown_registered = True


def _destroy_at_exit() -> None:
    """Destroy the groups this module created while the interpreter is intact.

    Left to interpreter teardown, a gloo group whose last asynchronous
    operations (the final step agreement, the noise-scale all-reduce) are
    still in its worker threads can be destroyed in an order that aborts
    the process ("terminate called without an active exception", SIGABRT),
    turning a finished or gracefully stopped worker into a failed one.
    Destroying it here first lets those operations finish. A default group
    the user created is left to them; only the module's own groups go.
    """
    if not is_initialized():
        return
    if env.rank() == 0:
        membership.mark_ended()  # live mode: the generation is over; a late joiner forms the next one
    groups = _groups()
    own = [g for g in (groups.asynchronous, groups.control) if g is not None and g is not dist.group.WORLD]
    try:
        for group in [None] if groups.owns_default_group else own:
            dist.destroy_process_group(group)
    except Exception:  # best effort: the process is exiting anyway
        logger.debug("destroying the process groups at exit failed", exc_info=True)
    groups.control = groups.asynchronous = None


def _require_group() -> dist.ProcessGroup | None:
    if _groups().control is None:
        if env.num_replicas() > 1:
            raise RuntimeError(
                "this job has several replicas (WORLD_SIZE="
                f"{env.num_replicas()}): call adaptive.init_process_group(backend) before training "
                "(the first loader step, epoch end or synchronized() block agrees with the other replicas; "
                "loaders and accumulators may be built before it)"
            )
        return None
    return _groups().control


def control_group() -> dist.ProcessGroup | None:
    """The gloo group for object collectives, or None with one replica and no group."""
    return _require_group()


def _world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _wrap_failure(what: str, error: BaseException) -> CollectiveError:
    return CollectiveError(
        f"{what} failed: a peer replica died, hung for longer than the collective "
        f"timeout, or the process group broke ({type(error).__name__}: {error})"
    )


#: How long a live job's collective is waited for between looks at whether a member reported a lost peer.
_WAIT_SLICE = datetime.timedelta(seconds=0.1)


def wait(work: dist.Work, what: str) -> None:
    """Wait for the collective ``work``; :class:`CollectiveError` when it fails.

    In live mode it is waited for in slices, and between them a lost peer
    that another member reported (:func:`adaptive.runtime.reforming.report_loss`)
    ends the wait with the error too: in a group of three or more, a member
    can wait for data that a member which already saw the loss will never
    send, and would otherwise only learn of it at the collective timeout.
    """
    if not membership.is_live():
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as error:
            raise _wrap_failure(what, error) from error
        return
    generation = membership.generation_number()  # the members may re-form meanwhile (a background wait)
    while True:
        try:
            work.wait(timeout=_WAIT_SLICE)
            return
        except (RuntimeError, dist.DistError):
            if work.is_completed():  # it failed, or it finished as the slice ran out: waiting again tells which
                try:
                    work.wait(timeout=_WAIT_SLICE)
                except (RuntimeError, dist.DistError) as error:
                    raise _wrap_failure(what, error) from error
                return
        if reforming.loss_reported(generation):
            raise _wrap_failure(what, CollectiveError("another member reported a lost peer"))


def allgather_object(obj: T) -> list[T]:
    """Every replica's ``obj``, in rank order."""
    group = _require_group()
    if _world_size(group) == 1:
        return [obj]
    return _gather_objects(obj, group, "allgather_object")


def _gather_objects(obj: T, group: dist.ProcessGroup | None, what: str) -> list[T]:
    """``torch.distributed.all_gather_object``, its two collectives waited for by :func:`wait`."""
    size = _world_size(group)
    data = _to_bytes(obj)
    lengths = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    wait(_issue(what, dist.all_gather, lengths, torch.tensor([data.numel()]), group=group, async_op=True), what)
    longest = max(int(length) for length in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    received = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    wait(_issue(what, dist.all_gather, received, padded, group=group, async_op=True), what)
    return [_from_bytes(tensor[:int(length)]) for tensor, length in zip(received, lengths)]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every replica."""
    group = _require_group()
    if _world_size(group) == 1:
        return obj
    what = "broadcast_object"
    data = _to_bytes(obj) if env.rank() == src else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([data.numel()])
    wait(_issue(what, dist.broadcast, length, group_src=src, group=group, async_op=True), what)
    if env.rank() != src:
        data = torch.empty(int(length), dtype=torch.uint8)
    wait(_issue(what, dist.broadcast, data, group_src=src, group=group, async_op=True), what)
    return obj if env.rank() == src else _from_bytes(data)


def _issue(what: str, operation: Callable[..., dist.Work | None], *args: object, **kwargs: object) -> dist.Work:
    """Start an asynchronous collective (``async_op=True``); :class:`CollectiveError` when it cannot start."""
    try:
        work = operation(*args, **kwargs)
    except (RuntimeError, dist.DistError) as error:
        raise _wrap_failure(what, error) from error
    return cast(dist.Work, work)  # with async_op=True a member of the group always gets its work


def _to_bytes(obj: object) -> torch.Tensor:
    """``obj`` pickled, as a uint8 tensor (as ``all_gather_object`` sends it: between the job's processes)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(tensor: torch.Tensor) -> Any:
    return pickle.loads(tensor.numpy().tobytes())  # noqa: S301 (a peer process of this job sent it)


def allreduce_object(obj: T, reduce_fn: Callable[[T, T], T] = operator.add) -> T:
    """Combine every replica's ``obj`` with ``reduce_fn`` (in rank order) on all replicas."""
    return functools.reduce(reduce_fn, allgather_object(obj))


def _allreduce_on_async_group(obj: T, reduce_fn: Callable[[T, T], T]) -> T:
    return functools.reduce(reduce_fn, _gather_objects(obj, _groups().asynchronous, "allreduce_async"))


def allreduce_async(obj: T, reduce_fn: Callable[[T, T], T] = operator.add) -> concurrent.futures.Future[T]:
    """Like :func:`allreduce_object`, but returns at once with a Future of the result.

    Operations complete in the order they were issued; every replica must issue
    the same sequence.
    """
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    group = _require_group()
    if _world_size(group) == 1:
        future.set_result(obj)
        return future
    groups = _groups()
    if groups.executor is None:
        groups.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="adaptive-async")
    return groups.executor.submit(_allreduce_on_async_group, obj, reduce_fn)


def barrier() -> None:
    """Wait until every replica gets here."""
    group = _require_group()
    if _world_size(group) == 1:
        return
    wait(_issue("barrier", dist.barrier, group=group, async_op=True), "barrier")


class Waitable(Protocol):
    """The result of :func:`allreduce_max_async`: the reduced flags, once ``result()`` returns."""

    def result(self) -> list[float]:
        """Wait for the reduction and return the element-wise maximum."""


def allreduce_max_async(values: list[float]) -> Waitable:
    """Start an element-wise max over replicas of a few flags; returns a waitable.

    The returned object has ``result() -> list[float]``.  Used for the per-step
    agreement on stopping and checkpointing, which must cost next to nothing.
    """
    group = _require_group()
    tensor = torch.tensor(values, dtype=torch.float64)
    if _world_size(group) == 1:
        return _Ready(tensor)
    try:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
    except (RuntimeError, dist.DistError) as error:
        raise _wrap_failure("step agreement", error) from error
    return _Pending(work, tensor)


class _Ready:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def result(self) -> list[float]:
        return self._tensor.tolist()


class _Pending:
    def __init__(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self._work = work
        self._tensor = tensor

    def result(self) -> list[float]:
        wait(self._work, "step agreement")
        # Keep the finished operation referenced for a few more agreements.  Gloo's worker thread can
        # still hold the work for a moment after wait() returns; if Python dropped the tensor first, that
        # thread would destroy the tensor's Python object and so take the interpreter's thread-state lock
        # from a foreign thread.  A DataLoader worker forked at that instant (loaders start their workers
        # right after an agreement) deadlocks in CPython 3.11's after-fork code (python/cpython#112275).
        _groups().retained.append((self._work, self._tensor))
        return self._tensor.tolist()
