"""Token-budget batches: steps that hold a number of tokens, not of samples.

:mod:`.planner` packs samples of known lengths (:mod:`.lengths`) from the
epoch's index stream (:mod:`.streams`) into micro-batches under a token
budget and deals them to replicas (:mod:`.micro_batches`), with a saved
position for exact resume (:mod:`.plan_state`); all torch-free.
:mod:`.batching` plugs that plan into the loader.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "TokenBudgetPlanner": "adaptive.data.tokens.planner",
    "SampleLengths": "adaptive.data.tokens.lengths",
    "OversizeSampleError": "adaptive.data.tokens.lengths",
    "TokenBatching": "adaptive.data.tokens.batching",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
