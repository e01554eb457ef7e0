"""The gradient noise scale: one concept, its public face and its internals.

:class:`GradientNoiseScale` (:mod:`.estimator`) is what users and the model
wrappers hold.  The internals each have a contract of their own, as
``torch.utils.data._utils`` holds the internals of the DataLoader: the
autograd hooks that measure a DDP model's gradients (:mod:`._probe`), their
FSDP2 variant for sharded models (:mod:`._sharded`), the norms of a
gradient (:mod:`._norms`), Adam's preconditioner (:mod:`._precondition`),
which steps are measured (:mod:`._schedule`) and the record of one measured
step (:mod:`._record`).  The arithmetic that
turns the measured norms into the noise estimate is torch-free and shared
with the scheduler: :mod:`adaptive.goodput.noise_estimate`.
"""

from adaptive.batchsize.gns._schedule import MeasureInterval, check_measure_interval
from adaptive.batchsize.gns.estimator import GradientNoiseScale

__all__ = ["GradientNoiseScale", "MeasureInterval", "check_measure_interval"]
