"""Model wrappers: data-parallel training that checkpoints itself and measures gradient noise.

:mod:`.data_parallel` is :class:`AdaptiveDataParallel` (DDP: every replica
holds the whole model); :mod:`.fully_sharded` is :class:`AdaptiveFSDP`
(FSDP2 ``fully_shard``: parameters, gradients and optimizer state sharded
over the replicas, checkpointed through ``torch.distributed.checkpoint``),
with :func:`sharding_mesh` for its 1-D or 2-D (HSDP) device mesh.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "AdaptiveDataParallel": "adaptive.parallel.data_parallel",
    "AdaptiveFSDP": "adaptive.parallel.fully_sharded",
    "sharding_mesh": "adaptive.parallel._sharding",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
