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
(accumulators and loaders built in a ``train()`` called every epoch) belong
to that epoch: their default names count creations within the epoch, their
checkpoint names carry the epoch, and they leave the checkpoint when the
epoch ends.  A replay of the epoch creates them in the same order and finds
them again; another epoch's objects never pick them up.

A job is *resuming* exactly when a complete checkpoint exists; see
:func:`resumed_checkpoint`. Before rank 0 looks for that checkpoint it takes
the job's next generation in the checkpoint folder (guarantee G6, see
:mod:`adaptive.checkpoint.generation`); its store publishes only while that
generation is the newest.

A :class:`ShardedState` (a model and optimizer sharded with FSDP2) adds a
sharded part that every rank writes its own shards of, through
``torch.distributed.checkpoint``, and that is resharded on load for the
current world size or mesh. Saves can run in the background
(``save_all_states(blocking=False)``, and periodic saves under
``ADAPTIVE_ASYNC_CHECKPOINT``): only the agreement and a CPU copy of the
states block the training loop; see :mod:`adaptive.checkpoint._saving`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Callable

from adaptive._utils.checks import check_bool
from adaptive.checkpoint import _saving, peer_shards, peer_state
from adaptive.runtime import collectives, membership
from adaptive.runtime import env
from adaptive.observe import metrics
from adaptive.checkpoint.generation import Generation, StaleGenerationError, newest_generation
from adaptive.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore
from adaptive.runtime import launch_status
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
    "share_with_joiners",
    "sharded_states",
    "snapshot_sharded_states",
    "recover_sharded_states",
    "renew_generation",
    "CheckpointError",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointSession:
    """The checkpoint side of the job: its record on the job context (:mod:`adaptive.runtime.job`)."""

    registry: dict[str, State] = dataclasses.field(default_factory=dict)  # name -> State, in creation order
    store: CheckpointStore | None = None
    store_root: str | None = None
    generation: Generation | None = None  # rank 0: the Generation this incarnation took in store_root
    generation_checked_at: float | None = None  # monotonic, when rank 0 last read the newest generation
    stale: StaleGenerationError | None = None  # rank 0: the error once a newer generation was seen
    resumed: Checkpoint | None = None  # the checkpoint this process resumed from
    resumed_looked_up: bool = False
    last_save_time: float | None = None  # monotonic
    save_count: int = 0
    steps_at_save: int = 0  # committed loader steps when this process last took part in a save
    epoch_scope: int | None = None  # the epoch in progress, owner of the states created now
    # (kind, epoch scope) -> objects of that kind created so far in that scope
    name_counts: collections.Counter[tuple[str, int | None]] = dataclasses.field(default_factory=collections.Counter)


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

    def snapshot_shards(self) -> Any:
        """Live mode: this rank's shards copied to host memory, to go back to after a lost member.

        See :func:`adaptive.checkpoint.peer_shards.copy_local`; after the loss
        :func:`recover_sharded_states` joins the members' copies.
        """
        return peer_shards.copy_local(self.sharded_state_dict())


def epoch_scope() -> int | None:
    """The epoch whose objects are being created now (None outside ``remaining_epochs_until``)."""
    return _session().epoch_scope


def default_name(kind: str) -> str:
    """The default name of the next ``kind`` object (an accumulator, a loader).

    Its creation order among the ``kind`` objects created in the same epoch
    (``"e3.0"``, ``"e3.1"``, ...), or outside epochs (``"0"``, ``"1"``, ...):
    the same object gets the same name when a restart replays its code.
    """
    session = _session()
    key = (kind, session.epoch_scope)
    count = session.name_counts[key]
    session.name_counts[key] += 1
    return str(count) if session.epoch_scope is None else f"e{session.epoch_scope}.{count}"


def begin_epoch(epoch: int) -> None:
    """Objects created from now on belong to ``epoch`` (called by ``remaining_epochs_until``)."""
    session = _session()
    session.epoch_scope = epoch
    for key in [key for key in session.name_counts if key[1] == epoch]:
        del session.name_counts[key]


def end_epoch() -> None:
    """The epoch is over: its objects leave the checkpoint, and objects are global again."""
    session = _session()
    if session.epoch_scope is not None:
        for name in [name for name, state in session.registry.items() if state.scope == session.epoch_scope]:
            del session.registry[name]
    session.epoch_scope = None


def registered_states() -> list[State]:
    """The states that the next checkpoint will contain, in creation order."""
    return list(_session().registry.values())


#: Seconds between rank 0's reads of the newest generation (:func:`stale_generation`).
GENERATION_CHECK_INTERVAL = 1.0


def _checkpoint_store() -> CheckpointStore:
    """The job's store; on rank 0 it holds this incarnation's generation, taken on first use."""
    root = env.checkpoint_path()
    session = _session()
    if session.store is None or session.store_root != root:
        session.generation = _take_generation(root) if env.rank() == 0 else None
        session.generation_checked_at, session.stale = time.monotonic(), None
        session.store = CheckpointStore(root, keep=env.checkpoint_keep(), generation=session.generation)
        session.store_root = root
    return session.store


def _take_generation(root: str) -> Generation:
    """Rank 0 takes this incarnation's generation, unless its launcher's incarnation was already fenced.

    A torchrun restart round of a fenced incarnation must not take over from
    the incarnation that fenced it: adaptive-run ends such an incarnation, and
    a round that starts before it does refuses here.
    """
    fenced = launch_status.stale_report()
    if fenced is not None:
        raise StaleGenerationError(root, int(fenced.get("generation") or 0), newest_generation(root))
    taken = Generation.take(root)
    logger.debug("this incarnation is generation %d of the job's checkpoint folder %s", taken.number, root)
    return taken


def generation() -> Generation | None:
    """The generation this incarnation took (rank 0, once the store was used; None elsewhere)."""
    return _session().generation


def stale_generation(now: float | None = None) -> StaleGenerationError | None:
    """On rank 0: the error to stop with once a newer generation took over (None while this one is newest).

    Reads the newest generation at most every :data:`GENERATION_CHECK_INTERVAL`
    seconds; other ranks, and a job that has not used its store yet, get None.
    """
    session = _session()
    if session.generation is None:
        return None
    if session.stale is None:
        now = time.monotonic() if now is None else now
        if session.generation_checked_at is None or now - session.generation_checked_at >= GENERATION_CHECK_INTERVAL:
            session.generation_checked_at = now
            try:
                session.generation.check()
            except StaleGenerationError as error:
                session.stale = error
            except CheckpointError as error:  # unreadable record: the next publication decides
                logger.warning("could not check this incarnation's generation: %s", error)
    return session.stale


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
    store = _checkpoint_store()
    resumed = session.resumed = store.latest()
    session.resumed_looked_up = True
    meta = {} if resumed is None else dict(resumed.info.metadata or {})
    metrics.MetricsWriter().event("start", replicas=env.num_replicas(), nodes=env.num_nodes(),
                                  generation=None if session.generation is None else session.generation.number,
                                  resumed=None if resumed is None else resumed.info.seq,
                                  epoch=meta.get("epoch"), step=meta.get("step"), loader=meta.get("loader"),
                                  loader_steps=meta.get("loader_steps"), replicas_before=meta.get("replicas"))
    if resumed is not None:
        logger.log(
            logging.INFO if env.rank() == 0 else logging.DEBUG,
            "resuming from checkpoint %d in %s as generation %s (saved at epoch %s, step %s, with %s replicas; "
            "now %d replicas)",
            resumed.info.seq,
            store.root,
            "?" if session.generation is None else session.generation.number,
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
        return _saving.save(states, sharded, _checkpoint_store(), lambda: _manifest_info(states, metadata),
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


def _manifest_info(states: list[State], metadata: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest metadata: the caller's, the job's shape, the loaders' steps, the state versions and the
    writer's generation."""
    info = dict(metadata or {})
    info.setdefault("replicas", env.num_replicas())
    info.setdefault("nodes", env.num_nodes())
    info.setdefault("loader_steps", dict(entry for entry in (state.manifest_step() for state in states)
                                         if entry is not None))
    info["state_versions"] = {state.name: state.version for state in states}
    generation = _session().generation
    if generation is not None:  # which incarnation wrote it (rank 0 builds the manifest)
        info["generation"] = generation.number
    return info


def share_with_joiners(metadata: dict[str, Any]) -> None:
    """After a live regroup that admitted joiners: rank 0 sends every state, as a checkpoint would hold it.

    Collective on the new generation; the joiners receive in
    :func:`resumed_checkpoint`.  Every state's ``sync()`` ran on the old
    generation, before the regroup.  ``metadata`` describes the position
    (as a checkpoint's manifest does).
    """
    if env.rank() != 0:
        peer_state.pass_states()
        return
    states = registered_states()
    info = _manifest_info(states, dict(metadata, steps_since_save=stream().steps_committed - _session().steps_at_save))
    sent = peer_state.send_states({state.name: state.state_dict() for state in states}, resumed_seq(), info,
                                  [state.name for state in sharded_states()])
    logger.debug("sent %d states (%.1f MB) to the joiners", len(states), sent / 1e6)


def sharded_states() -> list[ShardedState]:
    """The registered states with a sharded part, in registration order (the order of their collectives)."""
    return [state for state in registered_states() if isinstance(state, ShardedState)]


def gather_sharded_states(dst: int) -> dict[str, Any]:
    """At a live change, on the old group: every sharded state whole on rank ``dst`` (the next rank 0).

    Returns ``{name: gathered}`` (the values are None except on ``dst``).
    """
    return {state.name: state.gather_for_peers(dst) for state in sharded_states()}


def reshard_sharded_states(gathered: dict[str, Any]) -> None:
    """At a live change, on the new group: every sharded state resharded for the new members from rank 0's copy."""
    for state in sharded_states():
        state.reshard_for_peers(gathered.get(state.name))


def snapshot_sharded_states() -> dict[str, Any]:
    """Live mode, at an agreed boundary: every sharded state's local shards, copied (no communication)."""
    return {state.name: state.snapshot_shards() for state in sharded_states()}


def recover_sharded_states(snapshots: dict[str, Any]) -> None:
    """After a lost member, on the group of the members that are left: every sharded state resharded for
    them from their ``snapshots`` (:func:`snapshot_sharded_states`, taken at the same boundary on each).

    Raises:
        peer_shards.ShardsLost: on every member, before any state changed,
            when the lost members held every copy of some shard.
    """
    sharded = sharded_states()
    missing = [state.name for state in sharded if state.name not in snapshots]
    if missing:  # the same on every member: the snapshots were taken at the same agreed boundary
        raise peer_shards.ShardsLost(f"no snapshot holds the shards of {missing}")
    gathered = {state.name: peer_shards.gather_from_snapshots(snapshots[state.name]) for state in sharded}
    for state in sharded:
        state.reshard_for_peers(gathered[state.name])


def renew_generation() -> None:
    """The membership changed: the new rank 0 takes a new generation of the checkpoint folder (G6).

    Checkpoints of the old generation's rank 0 are fenced from then on.
    """
    session = _session()
    session.store = session.store_root = None
    session.generation = session.stale = None
    if env.rank() == 0:
        _checkpoint_store()


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
