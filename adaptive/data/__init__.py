"""The data side: the elastic loader and what plans its steps.

:mod:`.dataloader` is :class:`AdaptiveDataLoader`; :mod:`.sampler` the
seeded, replica-independent permutation of each epoch; :mod:`.steps` the
plan of steps and micro-steps; :mod:`.sample_batches` batches of a number of
samples and :mod:`.tokens` batches of a token budget; :mod:`.weighting` the
loss weight of each micro-batch, for both.
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "AdaptiveDataLoader": "adaptive.data.dataloader",
    "current_dataloader": "adaptive.data.dataloader",
    "ElasticSampler": "adaptive.data.sampler",
    "GlobalPermutation": "adaptive.data.sampler",
    "OversizeSampleError": "adaptive.data.tokens.lengths",
    "SampleLengths": "adaptive.data.tokens.lengths",
    "TokenBudgetPlanner": "adaptive.data.tokens.planner",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
