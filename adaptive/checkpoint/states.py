"""Named pieces of job state that are saved together and restored on restart.

A :class:`State` is anything with ``state_dict()`` / ``load_state_dict()`` and a
unique name: the model and optimizer (:class:`~adaptive.AdaptiveDataParallel`),
each data loader's position, the epoch counter, accumulators.  A state
restores itself from the job's newest complete checkpoint when it is created
(:func:`load_state`), and :func:`save_all_states` writes all of them at a step
boundary that every replica agreed on (guarantee G3).

Rules that keep restarts exact:

* every replica creates the same states in the same order;
* creating and restoring a state is local (guarantee G1b): each replica
  picks the newest checkpoint that verifies by itself, so objects may be
  built before ``init_process_group`` and on each rank at different moments.
  The replicas check that they resumed the same checkpoint at their first
  agreement (:mod:`adaptive.elastic.sync_points`), where they are in lock-step anyway;
* ``sync()`` is collective: each replica's state is made whole there (for
  example, accumulators add up their replicas' pending updates), and only
  then does rank 0 write;
* the write is atomic (see :mod:`adaptive.checkpoint.store`), so a crash
  during a save leaves the previous checkpoint as the newest complete one.

States of objects created inside an epoch of ``remaining_epochs_until``
belong to that epoch and leave the checkpoint when it ends; see
:mod:`adaptive.checkpoint.naming`.

A job is *resuming* exactly when a complete checkpoint exists; see
:func:`resumed_checkpoint`. The store it resumes from and saves to is held
under this incarnation's generation of the checkpoint folder (guarantee G6,
see :mod:`adaptive.checkpoint.fencing`).  In live mode the states move
between members in memory instead (:mod:`adaptive.checkpoint.handover`).

A :class:`ShardedState` (a model and optimizer sharded with FSDP2) adds a
sharded part that every rank writes its own shards of, through
``torch.distributed.checkpoint``, and that is resharded on load for the
current world size or mesh. Saves can run in the background
(``save_all_states(blocking=False)``, and periodic saves under
``ADAPTIVE_ASYNC_CHECKPOINT``): only the agreement and a CPU copy of the
states block the training loop; see :mod:`adaptive.checkpoint._saving`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Any, Callable

from adaptive._utils.checks import check_bool
from adaptive.checkpoint import _saving, fencing, peer_shards
from adaptive.runtime import collectives, membership
from adaptive.runtime import env
from adaptive.observe import metrics
from adaptive.checkpoint.store import Checkpoint, CheckpointError
from adaptive.checkpoint._safe_load import validate_metadata as _validate_metadata
from adaptive.runtime.job import current_job
from adaptive.runtime.step import stream
from adaptive.checkpoint.versions import UNVERSIONED, Format, Migrations, StateFormatError

__all__ = [
    "State",
    "ShardedState",
    "save_all_states",
    "wait_for_pending_save",
    "load_state",
    "resumed_checkpoint",
    "resume_from",
    "registered_states",
    "CheckpointError",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointSession:
    """The checkpoint side of the job: its record on the job context (:mod:`adaptive.runtime.job`)."""

    registry: dict[str, State] = dataclasses.field(default_factory=dict)  # name -> State, in creation order
    resumed: Checkpoint | None = None  # the checkpoint this process resumed from
    resumed_looked_up: bool = False
    last_save_time: float | None = None  # monotonic
    save_count: int = 0
    steps_at_save: int = 0  # committed loader steps when this process last took part in a save


def _session() -> CheckpointSession:
    """This job's checkpoint record."""
    return current_job().part(CheckpointSession)


class State:
    """Base class of every piece of checkpointed job state.

    Subclasses implement :meth:`state_dict` and :meth:`load_state_dict` with
    the usual PyTorch meaning: plain containers of tensors, numbers and
    strings (what ``torch.load(weights_only=True)`` accepts), and may override
    :meth:`sync` to gather what replicas hold privately before a save.

    The format is versioned the way every saved format of the library is
    (see :mod:`adaptive.checkpoint.versions`): :attr:`version` is the format
    ``state_dict()`` writes (raise it when its keys change) and
    :attr:`migrations` brings an older saved format one version forward.
    Each checkpoint records the version of every state it holds, and
    :func:`load_state` migrates an older one before ``load_state_dict``.
    """

    #: The format version of what :meth:`state_dict` returns.
    version: int = 1
    #: ``{v: f}``: ``f`` turns a saved version-``v`` state into version ``v + 1``.
    migrations: Migrations = {}

    def __init__(self, name: str, *, scope: int | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"State name must be a non-empty string, got {name!r}")
        if scope is not None:  # owned by an epoch: only that epoch's replay may restore it
            name = f"{name}@epoch{scope}"
        registry = _session().registry
        if name in registry:
            raise ValueError(
                f"a State named {name!r} already exists; give each checkpointed object a unique name "
                "(for example name= on AdaptiveDataLoader)"
            )
        self.name = name
        self.scope = scope
        registry[name] = self

    def state_dict(self) -> Any:
        """This state's content as plain, safely loadable data."""
        raise NotImplementedError(f"{type(self).__name__} must implement state_dict()")

    def load_state_dict(self, state: Any) -> None:
        """Restore from what :meth:`state_dict` returned."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_state_dict()")

    def sync(self) -> None:
        """Collective hook called on every replica just before a save."""

    def live_copy(self) -> object:
        """Live mode: this process's part of the state, copied in memory at each step that every member applied.

        After a lost member, the members that are left go back to their copy
        (:meth:`restore_live_copy`), which undoes what the step in flight
        changed besides the update itself (the LR scheduler stepped, metrics
        counted, random numbers drawn; :mod:`adaptive.elastic.live`).  It is
        taken after every step, without communication, so keep it small: the
        default copies :meth:`state_dict`; the model wrappers leave out the
        weights and the optimizer state, which the step commit keeps equal on
        every member (:mod:`adaptive.runtime.step_commit`).
        """
        return copy.deepcopy(self.state_dict())

    def restore_live_copy(self, saved: object) -> None:
        """Go back to what :meth:`live_copy` returned (it may be restored again after another loss)."""
        self.load_state_dict(copy.deepcopy(saved))

    def private_part(self) -> object | None:
        """Live mode: what this replica alone holds of the state and would take with it if it were lost.

        An :class:`~adaptive.Accumulator`'s increments that were not
        synchronized yet are the example: no other member has them, and the
        steps they count are not trained again after a loss.  Each member
        publishes its private parts on the job's store at every committed step
        (when they changed), and after a loss the new rank 0 folds the lost
        members' parts in (:meth:`adopt_private_part`).  Plain containers of
        numbers, strings and CPU tensors.  None (the default): nothing private.
        """
        return None

    def adopt_private_part(self, part: object, worker: int) -> None:
        """Live mode, on the new rank 0 after a loss: fold in ``part``, what lost ``worker`` last published as
        its :meth:`private_part` (this state went back to its last commit point just before)."""
        raise NotImplementedError(f"{type(self).__name__} publishes a private part but cannot adopt one")

    def restore_on_admission(self) -> None:
        """Live mode: restore from the running members' state, received when this process was admitted.

        Called on a joiner for every state it built before admission (see
        :mod:`adaptive.checkpoint.admission`), in creation order.  The default
        restores as at creation (:func:`load_state`); a state whose object
        holds more than its content (a sharded model's mesh) overrides it.
        """
        load_state(self)

    def manifest_step(self) -> tuple[str, int] | None:
        """``(label, step)`` that the checkpoint's manifest lists under ``loader_steps``; None (the default): none.

        A state that counts the job's steps (a data loader's) lists its count
        there, so that a checkpoint can be described (the resume log line,
        ``adaptive report``) without loading any state.
        """
        return None

    def is_registered(self) -> bool:
        """Whether the next checkpoint holds this state (False after a job reset or the end of its epoch)."""
        return _session().registry.get(self.name) is self

    def unregister(self) -> None:
        """Remove this state from the checkpoint (the object will no longer be saved)."""
        if self.is_registered():
            del _session().registry[self.name]


class ShardedState(State):
    """A state whose bulk is sharded across ranks (FSDP2 parameters and optimizer state).

    It has two parts:

    * the small part, :meth:`state_dict` / :meth:`load_state_dict` as for
      every :class:`State` (counters, the LR scheduler, ...). At a save it
      is called on rank 0 only, and rank 0 writes it as for any state;
    * the sharded part, :meth:`sharded_state_dict`, called on **every**
      rank at a save: a nested dict (str or int keys) whose leaves are
      DTensors or tensors (and plain values such as the optimizer's
      ``param_groups``). It is written through
      ``torch.distributed.checkpoint``: each rank writes only its own
      shards (a replicated plain tensor is written once).

    At restore, on each rank, :meth:`load_state_dict` runs first and then
    :meth:`load_sharded_state_dict` with a ``read`` function: ``read(target)``
    fills ``target``, a dict shaped like what :meth:`sharded_state_dict`
    returned with freshly allocated tensors/DTensors in the *current*
    sharding (possibly another world size or mesh), from the saved shards,
    and returns it (for example build targets with
    ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)``
    and apply the result with ``set_state_dict``). ``read`` is local to the
    calling process: it reads the files it needs, verified, weights-only, and
    communicates with no other rank, so restoring stays local (G1b).
    """

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards: a nested dict of DTensors, tensors and plain values (called on every rank)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sharded_state_dict()")

    def load_sharded_state_dict(self, read: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Restore the sharded part: ``read(target)`` fills ``target`` from the checkpoint and returns it."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_sharded_state_dict()")

    def gather_for_peers(self, dst: int) -> Any:
        """Live membership change, on the old group: the sharded part whole, on rank ``dst`` only.

        Every member calls it (leavers too: they hold shards); see
        :func:`adaptive.checkpoint.peer_shards.gather_full`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot move between live generations in memory")

    def reshard_for_peers(self, gathered: Any) -> None:
        """Live membership change, on the new group: shard anew for the new members, from rank 0's ``gathered``.

        Called on the members that stay, after the joiners received the
        small states; each joiner restores the same state through
        :meth:`load_sharded_state_dict`, whose ``read`` then fills from rank 0.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot move between live generations in memory")

    def copy_local_shards(self) -> Any:
        """Live mode, after a lost member: this rank's shards copied to host memory.

        See :func:`adaptive.checkpoint.peer_shards.copy_local`;
        :func:`adaptive.checkpoint.handover.recover_sharded_states` joins the members' copies.
        """
        return peer_shards.copy_local(self.sharded_state_dict())


def registered_states() -> list[State]:
    """The states that the next checkpoint will contain, in creation order."""
    return list(_session().registry.values())


def resumed_checkpoint() -> Checkpoint | None:
    """The checkpoint this process resumed from, or None for a fresh start.

    Each replica chooses the newest checkpoint that verifies by itself, with
    no communication (so states can be restored before ``init_process_group``
    and while other ranks wait in a barrier); the replicas compare their
    choices at their first agreement.
    """
    session = _session()
    if session.resumed_looked_up:
        return session.resumed
    if membership.is_live():
        collectives.init_process_group()  # forms the live job, or finds it running (a no-op once the script did)
        if membership.is_awaiting_admission():
            return None  # restored when admitted (adaptive.checkpoint.admission), not from disk
    store = fencing.checkpoint_store()
    generation = fencing.generation()
    resumed = session.resumed = store.latest()
    session.resumed_looked_up = True
    meta = {} if resumed is None else dict(resumed.info.metadata or {})
    metrics.MetricsWriter().event("start", replicas=env.num_replicas(), nodes=env.num_nodes(),
                                  generation=None if generation is None else generation.number,
                                  resumed=None if resumed is None else resumed.info.seq,
                                  epoch=meta.get("epoch"), step=meta.get("step"), loader=meta.get("loader"),
                                  loader_steps=meta.get("loader_steps"), replicas_before=meta.get("replicas"))
    if resumed is not None:
        logger.log(
            logging.INFO if env.rank() == 0 else logging.DEBUG,
            "resuming from checkpoint %d in %s as folder generation %s (saved at epoch %s, step %s, with %s replicas; "
            "now %d replicas)",
            resumed.info.seq,
            store.root,
            "?" if generation is None else generation.number,
            meta.get("epoch"),
            meta.get("step"),
            meta.get("replicas"),
            env.num_replicas(),
        )
    return resumed


def resume_from(checkpoint: Checkpoint, *, steps_at_save: int) -> None:
    """This process resumes from ``checkpoint`` (a live joiner: the state its peers sent, at admission).

    ``steps_at_save``: the committed loader steps at the members' last save,
    counted as this process counts them.
    """
    session = _session()
    session.resumed, session.resumed_looked_up = checkpoint, True
    session.steps_at_save = steps_at_save


def resumed_seq() -> int:
    """The sequence number of the resumed checkpoint, -1 for a fresh start (replicas compare it)."""
    checkpoint = resumed_checkpoint()
    return -1 if checkpoint is None else checkpoint.info.seq


def load_state(state: State) -> bool:
    """Restore ``state`` from the resumed checkpoint; True if it was there.

    A state saved in an older format is migrated first (``state.migrations``).

    Raises:
        CheckpointError: the saved format is newer than this release reads,
            or cannot be migrated.
    """
    checkpoint = resumed_checkpoint()
    if checkpoint is None or state.name not in checkpoint.names():
        return False
    versions = (checkpoint.info.metadata or {}).get("state_versions")
    saved = UNVERSIONED if versions is None else versions[state.name]  # 0.1 checkpoints record no versions
    try:
        content = Format.of(state, state.name).upgrade(checkpoint.load(state.name), saved)
    except StateFormatError as error:
        raise CheckpointError(f"checkpoint {checkpoint.info.seq}: {error}") from None
    state.load_state_dict(content)
    if isinstance(state, ShardedState):
        if state.name not in checkpoint.sharded_names():
            raise CheckpointError(
                f"checkpoint {checkpoint.info.seq} holds state {state.name!r} without a sharded part (it was "
                "saved by an unsharded object of that name); resume it with the same kind of wrapper"
            )
        state.load_sharded_state_dict(lambda target: checkpoint.read_sharded(state.name, target))
    return True


def save_all_states(metadata: dict[str, Any] | None = None, *, blocking: bool = True) -> int:
    """Checkpoint every registered state; collective, call on every replica.

    All replicas run each state's ``sync()``, agree that they hold the same
    set of states, and then save in the one collective order of
    :mod:`adaptive.checkpoint._saving`: rank 0 reserves the checkpoint,
    every rank writes its own shards (with a :class:`ShardedState`), rank 0
    writes the other states and publishes, and tells the others how it went.  If a peer
    died, a collective fails here and nothing is written, so the last
    complete checkpoint stays the newest.  A save still in flight
    (``blocking=False`` earlier) is waited for first.

    Args:
        metadata: JSON-serialisable mapping stored in the manifest.
        blocking: False returns once the replicas agreed and the states are
            copied to the CPU; writing and publishing continue in a
            background thread on a process group of their own.  A failure
            there is logged as an error and the previous checkpoint stays
            the latest; :func:`wait_for_pending_save` waits for it (a
            graceful stop, the end of training and the end of the process
            do).

    Returns:
        The new checkpoint's sequence number, on every replica (not yet
        published when ``blocking`` is False).

    Raises:
        TypeError: ``metadata`` is not a JSON-serialisable mapping with str keys.
        CheckpointError: on every replica when the checkpoint could not be
            written (with ``blocking=False``: could not be started).
    """
    _validate_metadata(metadata)  # a bad argument fails on every replica alike, before any collective
    check_bool("blocking", blocking)
    if membership.is_awaiting_admission():
        raise RuntimeError("save_all_states() was called by a process that joins a running live job before it "
                           "was admitted (admission comes at its first remaining_epochs_until, loader or "
                           "Accumulator.synchronized() iteration): it has no state of the job to save yet; "
                           "save inside or after the training loop")
    _saving.wait_for_pending_save()
    states = registered_states()
    for state in states:
        state.sync()
    sharded = [state for state in states if isinstance(state, ShardedState)]
    kinds = (sorted((state.name, isinstance(state, ShardedState)) for state in states), blocking)
    all_kinds = collectives.allgather_object(kinds)
    if any(other != kinds for other in all_kinds):
        raise RuntimeError(
            "replicas hold different checkpointed objects (or disagree on blocking); every replica must create "
            "the same AdaptiveDataLoader/Accumulator/AdaptiveDataParallel objects in the same order: "
            f"{all_kinds}"
        )
    session = _session()
    try:
        return _saving.save(states, sharded, fencing.checkpoint_store(), lambda: manifest_info(states, metadata),
                            blocking=blocking)
    finally:
        session.save_count += 1
        session.last_save_time = time.monotonic()
        session.steps_at_save = stream().steps_committed


def wait_for_pending_save() -> int | None:
    """Wait for the asynchronous save in flight, if any (local: each replica waits for its own part).

    Returns:
        Its sequence number once it is published; None when no save was in
        flight or it failed (the failure was logged as an error, and the
        previous checkpoint stays the latest).
    """
    return _saving.wait_for_pending_save()


def abandon_pending_save() -> int | None:
    """Live mode, after a lost member: do not wait for the asynchronous save in flight (its group broke);
    its sequence number, or None (see :func:`adaptive.checkpoint._saving.abandon_pending_save`)."""
    return _saving.abandon_pending_save()


def periodic_saves_asynchronous() -> bool:
    """Whether periodic checkpoints are saved in the background (``ADAPTIVE_ASYNC_CHECKPOINT``).

    ``auto`` (the default) means: when a :class:`ShardedState` is registered.
    """
    setting = env.async_checkpoint()
    if setting is None:
        return any(isinstance(state, ShardedState) for state in registered_states())
    return setting


def manifest_info(states: list[State], metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest metadata: the caller's, the job's shape, the loaders' steps, the state versions and the
    writer's generation (also what :mod:`adaptive.checkpoint.handover` sends the joiners)."""
    info = dict(metadata or {})
    info.setdefault("replicas", env.num_replicas())
    info.setdefault("nodes", env.num_nodes())
    info.setdefault("loader_steps", dict(entry for entry in (state.manifest_step() for state in states)
                                         if entry is not None))
    info["state_versions"] = {state.name: state.version for state in states}
    generation = fencing.generation()
    if generation is not None:  # which incarnation wrote it (rank 0 builds the manifest)
        info["generation"] = generation.number
    return info


def save_count() -> int:
    """Checkpoints this process has taken part in (equal on every replica at every agreement)."""
    return _session().save_count


def steps_at_last_save() -> int:
    """The loader steps this process had committed at its last save (0 before any: a resume is not a step)."""
    return _session().steps_at_save


def seconds_since_last_save(now: float | None = None) -> float | None:
    """Seconds since this process last took part in a save, None if never."""
    last = _session().last_save_time
    if last is None:
        return None
    return (time.monotonic() if now is None else now) - last
