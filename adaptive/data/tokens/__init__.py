"""Token-budget batches: steps that hold a number of tokens, not of samples.

:mod:`.planner` packs samples of known lengths into micro-batches under a
token budget (torch-free); :mod:`.batching` plugs that plan into the loader.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "TokenBudgetPlanner": "adaptive.data.tokens.planner",
    "SampleLengths": "adaptive.data.tokens.planner",
    "OversizeSampleError": "adaptive.data.tokens.planner",
    "TokenBatching": "adaptive.data.tokens.batching",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
