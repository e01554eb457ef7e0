"""Live mode: the job's states handed over between members in memory, instead of through a checkpoint.

When a live job (``adaptive-run --live``, :mod:`adaptive.elastic.live`)
changes its members at an agreed step boundary, nobody restarts, so the
states cannot come back from the checkpoint folder; they move over the
process groups instead:

* joiners receive every registered state from the new rank 0, as a
  checkpoint would hold it (:func:`share_with_joiners`, over
  :mod:`adaptive.checkpoint.peer_state`), and restore it as if they resumed
  from it (:mod:`adaptive.checkpoint.admission`);
* the sharded part of a :class:`~adaptive.checkpoint.states.ShardedState`
  (FSDP2, HSDP) is gathered whole on the next rank 0 while the old group,
  leavers included, still holds it (:func:`gather_sharded_states`), and
  sharded anew for the new members from that copy
  (:func:`reshard_sharded_states`; see :mod:`adaptive.checkpoint.peer_shards`);
* after a lost member there is no old group to gather from: each member
  that is left copies its own shards, which every member left as the last
  committed step made them (:func:`copy_local_shards`), and they join their
  copies into a whole one on the new rank 0 and shard it anew
  (:func:`recover_sharded_states`).

Each function walks the registered states in registration order, the same
on every member, which is the order of their collectives.  The states
themselves (:mod:`adaptive.checkpoint.states`) know nothing of live mode
beyond the hooks a :class:`~adaptive.checkpoint.states.ShardedState`
implements.
"""

from __future__ import annotations

import logging
from typing import Any

from adaptive.checkpoint import peer_shards, peer_state, states
from adaptive.runtime import env
from adaptive.runtime.step import stream

__all__ = ["share_with_joiners", "sharded_states", "gather_sharded_states", "reshard_sharded_states",
           "copy_local_shards", "recover_sharded_states"]

logger = logging.getLogger(__name__)


def share_with_joiners(metadata: dict[str, Any]) -> None:
    """After a live regroup that admitted joiners: rank 0 sends every state, as a checkpoint would hold it.

    Collective on the new generation; the joiners receive in
    :func:`adaptive.checkpoint.states.resumed_checkpoint`.  Every state's
    ``sync()`` ran on the old generation, before the regroup.  ``metadata``
    describes the position (as a checkpoint's manifest does).
    """
    if env.rank() != 0:
        peer_state.pass_states()
        return
    registered = states.registered_states()
    steps_since_save = stream().steps_committed - states.steps_at_last_save()
    info = states.manifest_info(registered, dict(metadata, steps_since_save=steps_since_save))
    sent = peer_state.send_states({state.name: state.state_dict() for state in registered}, states.resumed_seq(),
                                  info, [state.name for state in sharded_states()])
    logger.debug("sent %d states (%.1f MB) to the joiners", len(registered), sent / 1e6)


def sharded_states() -> list[states.ShardedState]:
    """The registered states with a sharded part, in registration order (the order of their collectives)."""
    return [state for state in states.registered_states() if isinstance(state, states.ShardedState)]


def gather_sharded_states(dst: int) -> dict[str, Any]:
    """At a live change, on the old group: every sharded state whole on rank ``dst`` (the next rank 0).

    Returns ``{name: gathered}`` (the values are None except on ``dst``).
    """
    return {state.name: state.gather_for_peers(dst) for state in sharded_states()}


def reshard_sharded_states(gathered: dict[str, Any]) -> None:
    """At a live change, on the new group: every sharded state resharded for the new members from rank 0's copy."""
    for state in sharded_states():
        state.reshard_for_peers(gathered.get(state.name))


def copy_local_shards() -> dict[str, Any]:
    """Live mode, after a lost member: every sharded state's local shards, copied (no communication)."""
    return {state.name: state.copy_local_shards() for state in sharded_states()}


def recover_sharded_states(copies: dict[str, Any]) -> None:
    """After a lost member, on the group of the members that are left: every sharded state resharded for
    them from their ``copies`` (:func:`copy_local_shards`: each member's shards at the same committed step).

    Raises:
        peer_shards.ShardsLost: on every member, before any state changed,
            when the lost members held every copy of some shard.
    """
    sharded = sharded_states()
    missing = [state.name for state in sharded if state.name not in copies]
    if missing:  # the same on every member: the same states are registered on each
        raise peer_shards.ShardsLost(f"no copy holds the shards of {missing}")
    gathered = {state.name: peer_shards.gather_from_copies(copies[state.name]) for state in sharded}
    for state in sharded:
        state.reshard_for_peers(gathered[state.name])
