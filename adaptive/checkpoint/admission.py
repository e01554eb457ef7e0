"""Admission of a process into a running live job: one explicit point, whatever order the script builds in.

A worker that starts while a live job is running (a joining node, or a
worker its launcher started again after a loss) does not become a member
as it builds its objects.  Until it is admitted everything it builds is
local, on a process group of its own (one member), as guarantee G1b
promises outside live mode: its loaders, model wrappers, optimizers, LR
schedulers, accumulators and states restore nothing yet, and reading the
checkpoint has no membership side effect.  The running members do not wait
for its imports, its model or its data.

It is admitted by :func:`admit`, called where the job's collectives start:
the first ``remaining_epochs_until`` iteration, the first loader iteration,
the first ``Accumulator.synchronized()`` (whichever the script reaches
first).  There it

1. asks the running generation to admit it and rebuilds its process groups
   on the generation it joins (:func:`adaptive.runtime.collectives.complete_admission`;
   the model wrappers rebind to the new group);
2. receives the training state the new rank 0 sends
   (:func:`adaptive.checkpoint.peer_state.receive_states`); when the
   generation it asked ended meanwhile (every member was lost) it forms the
   next one with the other candidates instead, and restores from the
   checkpoint on disk, as they do;
3. restores every state it built so far from it, in the order it built them
   (:meth:`adaptive.checkpoint.states.State.restore_on_admission`; a sharded
   model shards itself anew for the generation and takes its shards from
   rank 0 while the members reshard theirs, in the same order).

States created after that restore from the same received state as they
are created, as after a restart.  The rest of the script then replays to
the boundary where the members admitted it (the replay rule of a restart).
"""

from __future__ import annotations

import logging
import time

from adaptive.checkpoint import peer_state, states
from adaptive.runtime import collectives, membership
from adaptive.runtime.step import stream

__all__ = ["admit"]

logger = logging.getLogger(__name__)


def admit() -> None:
    """Live mode: join the running job now, if this process is waiting to, and restore what it built.

    Collective with the running members' change (they admit it at their
    next agreement boundary); does nothing for a member, and outside live
    mode.  Blocks until admitted, at most the collective timeout.

    Raises:
        TimeoutError: no generation of the live job took this process in time.
        adaptive.runtime.errors.CollectiveError: the hand-over of the state
            failed (a member was lost meanwhile); the process ends and its
            launcher starts it again.
    """
    if not membership.is_live():
        return
    collectives.init_process_group()  # a no-op once the script did; finds the job running, or forms it
    if not membership.is_awaiting_admission():
        return
    started = time.perf_counter()
    collectives.complete_admission()
    if membership.membership().took_state_from_peers:
        received = peer_state.receive_states()
        # As many steps since the last save as the members count, so that all decide alike whether a save
        # agreed at the boundary repeats the last one (sync_points._act).
        since = int((received.info.metadata or {}).get("steps_since_save", 0))
        states.resume_from(received, steps_at_save=stream().steps_committed - since)
        source = "the running members' state"
    else:  # the generation it asked ended meanwhile (every member lost): it formed the next one from disk
        source = "the checkpoint on disk (the generation it asked to join ended; it formed the next one)"
    built = states.registered_states()
    for state in built:
        state.restore_on_admission()
    logger.info("admitted into generation %s of the live job; restored %d states built before admission from "
                "%s in %.3f s", membership.generation_number(), len(built), source, time.perf_counter() - started)
