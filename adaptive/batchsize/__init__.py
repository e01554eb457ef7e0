"""Batch-size control: what batch size, learning rate and replica count to use.

The gradient noise scale (:mod:`.gns`, its arithmetic in :mod:`.noise_estimate`),
the goodput model (:mod:`.goodput`), its fit to measured step times
(:mod:`.throughput_fit`) and the record of those times
(:mod:`.throughput_profile`), the controller that picks batch sizes
(:mod:`.autoscale`), learning-rate scaling rules (:mod:`.scaling_rules`,
:mod:`.step_lr`), ramp-up schedules (:mod:`.rampup`) and the hints a job
gives the cluster scheduler (:mod:`.hints`).
"""

from adaptive._utils.lazy import lazy_exports

_EXPORTS = {
    "GradientNoiseScale": "adaptive.batchsize.gns",
    "GoodputFunction": "adaptive.batchsize.goodput",
    "GradParams": "adaptive.batchsize.goodput",
    "PerfParams": "adaptive.batchsize.goodput",
    "ThroughputProfile": "adaptive.batchsize.throughput_profile",
    "fit_perf_params": "adaptive.batchsize.throughput_fit",
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
    "Hints": "adaptive.batchsize.hints",
    "read_hints": "adaptive.batchsize.hints",
    "write_hints": "adaptive.batchsize.hints",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
