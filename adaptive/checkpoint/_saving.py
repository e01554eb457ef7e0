"""The one collective order of a save, blocking or in the background, with or without sharded states.

Used by :func:`adaptive.checkpoint.states.save_all_states` for every save.
Without a :class:`~adaptive.checkpoint.states.ShardedState` the steps below
still run in the same order, with nothing to write on the ranks other than
0 (a few small collectives, next to nothing beside the files rank 0 writes).

1. **Reservation** (blocking, control group): rank 0 picks the sequence
   number and creates the temporary directory; it broadcasts both.
2. **Preparation** (blocking): every rank takes ``sharded_state_dict()``
   of each sharded state, rank 0 ``state_dict()`` of every state; an
   asynchronous save copies them to the CPU here (:mod:`._staging`). The
   ranks then agree that every rank got this far, so that no rank enters
   the collective write alone.
3. **Writing** (blocking, or in a background thread on a gloo group of its
   own, created collectively by the first asynchronous save): every rank
   writes its shards through DCP and hashes its files; rank 0 gathers the
   records, writes the small states and the manifest, fsyncs and renames
   (:meth:`~adaptive.checkpoint.store.CheckpointStore.publish`), and
   broadcasts how it went.

Whatever fails, a rank killed or a disk full, nothing is published: rank 0
removes the temporary directory (or a later save prunes it) and every rank
raises :class:`~adaptive.checkpoint.store.CheckpointError` (a background
save logs it as an error instead, records a ``checkpoint_failed`` metrics
event, and the previous checkpoint stays the latest). At most one save is
in flight: the next save, a graceful stop, the end of training and the end
of the process wait for it (:func:`wait_for_pending_save`).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn, Protocol, Sequence, TypeVar

import torch.distributed as dist

from adaptive._utils.types import JSON, StateDict
from adaptive.checkpoint import _format, _safe_load
from adaptive.checkpoint.generation import StaleGenerationError
from adaptive.checkpoint.store import CheckpointError, CheckpointStore, Reservation
from adaptive.runtime import broken_groups, collectives, env, membership
from adaptive.runtime.job import Job, current_job, on_reset
from adaptive.observe import metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SavedState(Protocol):
    """A registered state as a save reads it (a :class:`~adaptive.checkpoint.states.State`)."""

    @property
    def name(self) -> str:
        """Its name in the checkpoint."""

    def state_dict(self) -> object:
        """Its content (rank 0 writes it)."""


class SavedShardedState(SavedState, Protocol):
    """A state with a sharded part (a :class:`~adaptive.checkpoint.states.ShardedState`)."""

    def sharded_state_dict(self) -> StateDict:
        """This rank's shards (every rank writes its own)."""


@dataclasses.dataclass
class BackgroundSaves:
    """This job's asynchronous saves (its record on the job context, :mod:`adaptive.runtime.job`)."""

    pending_save: _Pending | None = None  # the asynchronous save in flight
    save_group: dist.ProcessGroup | None = None  # the gloo group of asynchronous saves, created by the first one
    exit_wait_registered: bool = False  # the end of the process waits for the save in flight
    regroup_listener: bool = False  # a live regroup drops save_group (its group is destroyed)


def _session() -> BackgroundSaves:
    return current_job().part(BackgroundSaves)


@dataclasses.dataclass
class _Save:
    """One save after its reservation and preparation: what is left to write, on this rank."""

    seq: int
    temp: Path
    reservation: Reservation | None  # rank 0 only
    store: CheckpointStore
    flat: StateDict | None  # this rank's flattened sharded states, None without any
    sharded: tuple[str, ...]
    small: dict[str, object] | None  # rank 0: every state's state_dict()
    info: JSON | None  # rank 0: the manifest metadata
    started: float  # monotonic, when save_all_states was called
    blocked: float = 0.0  # seconds the caller was blocked (asynchronous saves)


class _Pending:
    """The save running in the background thread."""

    def __init__(self, save: _Save, group: dist.ProcessGroup | None) -> None:
        self.seq = save.seq
        self.result: int | None = None
        self.error: str | None = None
        # A daemon: the exit waits for a save in flight through _wait_at_exit, but not for one abandoned after a
        # lost member (abandon_pending_save), whose collectives may wait for a peer until the timeout.
        self.thread = threading.Thread(target=self._run, args=(save, group), name=f"adaptive-save-{save.seq}",
                                       daemon=True)

    def _run(self, save: _Save, group: dist.ProcessGroup | None) -> None:
        try:
            self.result = _write(save, group)
        except BaseException as error:  # reported, never raised: the training goes on
            self.error = f"{type(error).__name__}: {error}"
            if env.rank() == 0:
                logger.error("asynchronous checkpoint %d was not saved (%s); the previous checkpoint stays the "
                             "latest", save.seq, self.error)
                info = save.info or {}
                metrics.MetricsWriter().event("checkpoint_failed", seq=save.seq, error=self.error,
                                              reason=info.get("reason"), step=info.get("step"),
                                              epoch=info.get("epoch"))
            else:
                logger.debug("asynchronous checkpoint %d failed: %s", save.seq, self.error)


def save(states: Sequence[SavedState], sharded: Sequence[SavedShardedState], store: CheckpointStore,
         info: Callable[[], JSON], *, blocking: bool) -> int:
    """Steps 1-3 above; returns the sequence number (reserved, not yet published, if not ``blocking``)."""
    started = time.monotonic()
    rank0 = env.rank() == 0
    reservation: Reservation | None = None
    # Rank 0's (seq, temporary directory, None), or (None, None, the failure); broadcast to every rank.
    outcome: tuple[int | None, str | None, str | JSON | None] = (None, None, None)
    if rank0:
        try:
            reservation = store.reserve(sharded=bool(sharded))
            outcome = (reservation.seq, str(reservation.temp), None)
        except Exception as error:
            outcome = (None, None, failure(error))
    seq, temp, failed = collectives.broadcast_object(outcome)
    if failed is not None:
        raise_failure(failed)
    assert seq is not None and temp is not None, "no failure: rank 0 reserved"
    job = _Save(seq=seq, temp=Path(temp), reservation=reservation, store=store, flat=None,
                sharded=tuple(state.name for state in sharded), small=None, info=None, started=started)
    problem = None
    try:
        _prepare(job, states, sharded, info, staged=not blocking)
    except Exception as error:
        problem = f"rank {env.rank()}: {type(error).__name__}: {error}"
    try:
        problems = [p for p in collectives.allgather_object(problem) if p is not None]
    except collectives.CollectiveError:  # a peer died: nothing will be published
        if reservation is not None:
            store.abandon(reservation)
        raise
    if problems:
        if reservation is not None:
            store.abandon(reservation)
        if rank0:
            logger.error("checkpoint not saved: %s", "; ".join(problems))
        raise CheckpointError("; ".join(problems))
    if blocking:
        return _write(job, collectives.control_group())
    job.blocked = time.monotonic() - started
    pending = _Pending(job, _background_group())
    session = _session()
    session.pending_save = pending
    if not session.exit_wait_registered:
        atexit.register(_wait_at_exit, current_job())
        session.exit_wait_registered = True
    pending.thread.start()
    return seq


def _prepare(job: _Save, states: Sequence[SavedState], sharded: Sequence[SavedShardedState],
             info: Callable[[], JSON], staged: bool) -> None:
    """Step 2 on this rank: collect (and for the background, copy) what will be written."""
    from adaptive.checkpoint import _dcp_io, _staging  # DCP and DTensor: imported by the first such save

    if sharded:
        job.flat = _dcp_io.flatten({state.name: state.sharded_state_dict() for state in sharded})
        if staged:
            job.flat = _staging.stage_flat(job.flat)
    if env.rank() == 0:
        small = {state.name: state.state_dict() for state in states}
        _safe_load.validate_states(small)  # refused before any shard is written
        job.small = _staging.stage_states(small) if staged else small
        job.info = info()


def _write(job: _Save, group: dist.ProcessGroup | None) -> int:
    """Step 3 on this rank (collective over ``group``); returns the sequence number or raises CheckpointError."""
    from adaptive.checkpoint import _dcp_io

    records: list[_format.FileEntry] = []
    problem = None
    try:
        if job.flat is not None:
            records = _dcp_io.write_shards(job.temp / _format.SHARDED_DIR, job.flat, group,
                                           coordinator=env.rank() == 0)
    except _dcp_io.DCP_ERRORS as error:  # DCP reports every rank's failure on every rank
        inner = _dcp_io.underlying(error)
        problem = f"rank {env.rank()}: {type(inner).__name__}: {inner}"
    job.flat = None  # the staged copy is not needed any more
    outcome: tuple[int | None, str | JSON | None] = (None, None)
    try:
        gathered = _allgather(group, (records, problem))
        if job.reservation is not None:
            outcome = _publish(job, gathered)
        seq, failed = _broadcast(group, outcome)
    except collectives.CollectiveError as error:
        if job.reservation is not None and outcome == (None, None):
            job.store.abandon(job.reservation)
        raise CheckpointError(f"checkpoint {job.seq} not saved: {error}") from error
    if failed is not None:
        raise_failure(failed)
    assert seq is not None, "no failure: rank 0 published"
    return seq


def _publish(job: _Save, gathered: list[tuple[list[_format.FileEntry], str | None]]
             ) -> tuple[int | None, str | JSON | None]:
    """Rank 0: publish the checkpoint if every rank wrote its shards; (seq, None) or (None, the failure)."""
    assert job.reservation is not None, "called on rank 0, which holds the reservation"
    assert job.small is not None and job.info is not None, "rank 0 prepared them"
    problems = [problem for _, problem in gathered if problem is not None]
    if problems:
        job.store.abandon(job.reservation)
        logger.error("checkpoint %d not saved: %s", job.seq, "; ".join(problems))
        return None, "; ".join(problems)
    files = tuple(sorted((entry for records, _ in gathered for entry in records), key=lambda e: e.file))
    sharded = _format.ShardedPart(states=job.sharded, files=files) if job.sharded else None
    try:
        saved = job.store.publish(job.reservation, job.small, job.info, sharded)
    except Exception as error:
        return None, failure(error, f"checkpoint {job.seq} not saved")
    report_saved(saved.seq, saved.size, time.monotonic() - job.started, job.info,
                 blocked=job.blocked if job.blocked else None)
    return saved.seq, None


def failure(error: BaseException, context: str = "checkpoint not saved") -> str | JSON:
    """How rank 0 tells the other ranks that a save failed: plain text, or the fields of a stale generation.

    Logged here as an error, except a stale generation, whose agreed stop says it once per rank.
    """
    if isinstance(error, StaleGenerationError):
        logger.debug("%s: %s", context, error)
        return {"stale": error.fields()}
    logger.error("%s: %s", context, error)
    return f"{type(error).__name__}: {error}"


def raise_failure(failure: str | JSON) -> NoReturn:
    """Raise on any rank what :func:`failure` described: :class:`StaleGenerationError` or :class:`CheckpointError`."""
    if isinstance(failure, dict):
        raise StaleGenerationError.from_fields(failure["stale"])
    raise CheckpointError(failure)


def report_saved(seq: int, size: int, seconds: float, info: JSON, blocked: float | None = None) -> None:
    """Rank 0's INFO line and metrics event for a saved checkpoint (``blocked``: an asynchronous save)."""
    how = "" if blocked is None else f"; in the background, training blocked {blocked:.2f} s"
    logger.info("checkpoint %d saved (%s, %.1f MB in %.2f s%s)", seq, info.get("reason", "requested"),
                size / 1e6, seconds, how)
    extra = {} if blocked is None else {"blocked_seconds": blocked}
    metrics.MetricsWriter().event("checkpoint", seq=seq, bytes=size, seconds=seconds, reason=info.get("reason"),
                                  step=info.get("step"), epoch=info.get("epoch"), loader=info.get("loader"), **extra)


# ------------------------------------------------------------- background


def wait_for_pending_save(job: Job | None = None) -> int | None:
    """Wait for the asynchronous save in flight; its sequence number, or None if none was in flight or it failed.

    A failure was logged (as an error, on rank 0) by the save itself;
    the previous checkpoint stays the latest.
    """
    session = (job or current_job()).part(BackgroundSaves)
    pending = session.pending_save
    if pending is None:
        return None
    if pending.thread.is_alive():
        logger.debug("waiting for asynchronous checkpoint %d", pending.seq)
    pending.thread.join()
    session.pending_save = None
    return pending.result


def abandon_pending_save() -> int | None:
    """Live mode, after a lost member: stop waiting for the asynchronous save in flight; its sequence number.

    Its collectives ran on the generation that lost the member: it fails, or
    waits for a peer that is gone, and nothing waits for it any more.  If it
    did complete everywhere before the loss, rank 0 may still publish it (a
    complete checkpoint of an earlier step); otherwise the previous
    checkpoint stays the latest.  The next save builds its group anew.
    """
    session = _session()
    broken_groups.keep(session.save_group, timeout=env.collective_timeout())  # not destroyed: see broken_groups
    pending, session.pending_save, session.save_group = session.pending_save, None, None
    if pending is None or not pending.thread.is_alive():
        return None
    logger.warning("asynchronous checkpoint %d was in flight when a member was lost; it is not waited for "
                   "(the previous checkpoint stays the latest unless it completed everywhere)", pending.seq)
    return pending.seq


def forget_save_group() -> None:
    """The process groups were rebuilt (a live change): the next asynchronous save creates its group anew."""
    _session().save_group = None


def _wait_at_exit(job: Job) -> None:
    try:
        wait_for_pending_save(job)
    except Exception:  # the process is ending; the save logged its own failure
        logger.debug("waiting for the asynchronous checkpoint at exit failed", exc_info=True)


def _background_group() -> dist.ProcessGroup | None:
    """The gloo group of background saves (created collectively at the first one); None with one process."""
    session = _session()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if session.save_group is None:
        timeout = datetime.timedelta(seconds=env.collective_timeout())
        session.save_group = dist.new_group(backend="gloo", timeout=timeout)
        if not session.regroup_listener:
            membership.on_regroup(forget_save_group)
            session.regroup_listener = True
    return session.save_group


def _allgather(group: dist.ProcessGroup | None, obj: T) -> list[T]:
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out = [obj] * dist.get_world_size(group)  # every entry is replaced by the rank's object
    try:
        dist.all_gather_object(out, obj, group=group)
    except (RuntimeError, dist.DistError) as error:
        raise collectives.CollectiveError(f"gathering the shard records failed: a peer died or hung "
                                          f"({type(error).__name__}: {error})") from error
    return out


def _broadcast(group: dist.ProcessGroup | None, obj: T) -> T:
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    except (RuntimeError, dist.DistError) as error:
        raise collectives.CollectiveError(f"broadcasting the outcome failed: a peer died or hung "
                                          f"({type(error).__name__}: {error})") from error
    return box[0]


on_reset(lambda old: _wait_at_exit(old))  # a reset job (tests' in-process restarts) finishes its save first
