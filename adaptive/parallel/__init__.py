"""Model wrappers: data-parallel training that checkpoints itself and measures gradient noise.

:mod:`.data_parallel` is :class:`AdaptiveDataParallel` (DDP).
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "AdaptiveDataParallel": "adaptive.parallel.data_parallel",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
