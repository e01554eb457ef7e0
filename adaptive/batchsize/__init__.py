"""Batch-size control: what batch size, learning rate and replica count to use.

The gradient noise scale (:mod:`.gns`, torch hooks feeding the arithmetic
of :mod:`adaptive.goodput.noise_estimate`), the record of measured step
times (:mod:`.throughput_profile`), the controller that picks batch sizes
(:mod:`.autoscale`), learning-rate scaling rules (:mod:`.scaling_rules`,
:mod:`.step_lr`), ramp-up schedules (:mod:`.rampup`) and the posting of the
job's hints to the cluster scheduler (:mod:`.hint_posting`).

The goodput model, its fit and the hints format are shared with the
scheduler and live in the torch-free :mod:`adaptive.goodput`; this face
still exports their names (``GoodputFunction``, ``Hints``, ...).
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "GradientNoiseScale": "adaptive.batchsize.gns",
    "GoodputFunction": "adaptive.goodput.model",
    "GradParams": "adaptive.goodput.model",
    "PerfParams": "adaptive.goodput.model",
    "ThroughputProfile": "adaptive.batchsize.throughput_profile",
    "fit_perf_params": "adaptive.goodput.fit",
    "AutoscaleConfig": "adaptive.batchsize.autoscale",
    "BatchSizeController": "adaptive.batchsize.autoscale",
    "ScalingRule": "adaptive.batchsize.scaling_rules",
    "AdaScale": "adaptive.batchsize.scaling_rules",
    "AdamScale": "adaptive.batchsize.scaling_rules",
    "LinearScale": "adaptive.batchsize.scaling_rules",
    "SqrtScale": "adaptive.batchsize.scaling_rules",
    "LEGW": "adaptive.batchsize.scaling_rules",
    "NoScaling": "adaptive.batchsize.scaling_rules",
    "ConstantSchedule": "adaptive.batchsize.rampup",
    "LinearRampup": "adaptive.batchsize.rampup",
    "StagedSchedule": "adaptive.batchsize.rampup",
    "Hints": "adaptive.goodput.hints",
    "read_hints": "adaptive.goodput.hints",
    "write_hints": "adaptive.goodput.hints",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
