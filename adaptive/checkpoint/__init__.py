"""Checkpoints: the state protocol and the verified on-disk store.

:mod:`.states` holds the protocol every checkpointed object follows
(:class:`State`: ``state_dict``/``load_state_dict`` with a format version;
:class:`ShardedState` adds a part every rank writes its shards of) and
saves all of a job's states together, blocking or in the background; :mod:`.store` writes and verifies
checkpoint directories (atomic publication, checksums, keep-K); :mod:`.generation` lets only the newest
incarnation of a job publish (guarantee G6), and :mod:`.fencing` holds the job's store under the generation
it took; :mod:`.naming` names the states and ties them to an epoch; :mod:`.handover` moves them between the
members of a live job in memory.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "State": "adaptive.checkpoint.states",
    "ShardedState": "adaptive.checkpoint.states",
    "wait_for_pending_save": "adaptive.checkpoint.states",
    "save_all_states": "adaptive.checkpoint.states",
    "load_state": "adaptive.checkpoint.states",
    "resumed_checkpoint": "adaptive.checkpoint.states",
    "CheckpointError": "adaptive.checkpoint.store",
    "CheckpointStore": "adaptive.checkpoint.store",
    "Checkpoint": "adaptive.checkpoint.store",
    "CheckpointInfo": "adaptive.checkpoint.store",
    "Generation": "adaptive.checkpoint.generation",
    "StaleGenerationError": "adaptive.checkpoint.generation",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
