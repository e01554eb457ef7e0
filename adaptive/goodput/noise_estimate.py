"""The gradient noise scale's arithmetic: estimator and moving averages (numpy only).

Let per-sample gradients have mean ``G`` and covariance ``Sigma``.  Given
``n`` independent minibatch gradients of ``b`` samples each ("small") and
their average ("big"), with ``S_small`` the mean of their squared norms and
``S_big`` the squared norm of the average, :func:`estimate_from_norms`
returns the unbiased estimates::

    |G|^2     = (n * S_big - S_small) / (n - 1)
    tr(Sigma) = (S_small - S_big) * b * n / (n - 1)

:class:`NoiseAverages` folds one such measurement per measured optimizer
step (a :class:`Measurement`, read from the device by the hooks of
:class:`adaptive.batchsize.gns.GradientNoiseScale`) into bias-corrected
exponential moving averages of ``sqr = |G|^2`` and ``var = tr(Sigma) /
init_batch_size`` per parameter group.  Each measurement is weighted by the
inverse of the recent squared gradient norm: early in training the gradient
shrinks by orders of magnitude within a few hundred steps, and plain
averages would stay dominated by the first steps long after the ratio of
the two has moved on.  When the estimator changes (one replica's
*differenced* estimator <-> replicas or accumulation, e.g. after a restart)
the earlier averages are discounted so the new measurements take over
quickly while the estimate stays usable.

It sits with the goodput model, torch-free, because what it estimates is
the model's :class:`~adaptive.goodput.model.GradParams`; only the hooks that
read the norms from the device need torch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from adaptive._utils.checks import check_int
from adaptive._utils.types import StateDict

__all__ = ["BatchConfig", "estimate_from_norms", "Measurement", "NoiseAverages", "DIRECT", "DIFFERENCED"]

logger = logging.getLogger(__name__)

#: Small gradients from replicas and/or accumulation micro-steps.
DIRECT = "direct"
#: One replica without accumulation: two consecutive steps' gradients.
DIFFERENCED = "differenced"
#: When the estimator changes (one replica <-> several, e.g. after a restart)
#: the earlier averages keep this fraction of their weight: the estimate stays
#: usable at once, and new measurements take over within about
#: ``_SWITCH_DISCOUNT / (1 - smoothing)`` reference steps.
_SWITCH_DISCOUNT = 0.1


@dataclass(frozen=True)
class BatchConfig:
    """Batch sizes of the current optimizer steps.

    Attributes:
        init_batch_size: reference global batch (the user's batch size).
        local_bsz: samples per replica per micro-batch.
        accum_steps: micro-batches per optimizer step.
        num_replicas: data-parallel replicas.
        batch_size: the actual global batch of the steps, when it is not
            ``local_bsz * accum_steps * num_replicas`` (a batch of 128 over
            3 replicas is 43 + 43 + 42 samples, not 3 x 42); None: it is.
    """

    init_batch_size: int
    local_bsz: int
    accum_steps: int = 1
    num_replicas: int = 1
    batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("init_batch_size", "local_bsz", "accum_steps", "num_replicas"):
            check_int(name, getattr(self, name), 1)
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, 1)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all replicas."""
        if self.batch_size is not None:
            return self.batch_size
        return self.local_bsz * self.accum_steps * self.num_replicas

    @property
    def scale(self) -> float:
        """Global batch relative to the reference batch."""
        return self.global_batch_size / self.init_batch_size


def estimate_from_norms(small_sqr: ArrayLike, big_sqr: ArrayLike, count: int, small_batch: int,
                        init_batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Unbiased ``(|G|^2, tr(Sigma) / init_batch_size)`` from two squared norms.

    Args:
        small_sqr: mean squared norm of ``count`` independent minibatch
            gradients of ``small_batch`` samples each.
        big_sqr: squared norm of their average.
        count: number of small gradients (>= 2).
        small_batch: samples per small gradient.
        init_batch_size: reference batch for the variance.
    """
    check_int("count", count, 2)
    small = np.asarray(small_sqr, dtype=float)
    big = np.asarray(big_sqr, dtype=float)
    sqr = (count * big - small) / (count - 1)
    trace = (small - big) * small_batch * count / (count - 1)
    return sqr, trace / init_batch_size


@dataclass(frozen=True)
class Measurement:
    """Per-group squared norms of one measured optimizer step, on the host.

    Attributes:
        estimator: :data:`DIRECT` or :data:`DIFFERENCED`.
        config: the batch configuration of the step.
        count: number of small gradients (replicas x micro-steps, or 2).
        big: squared norm of the step's gradient (direct) or of the current
            step's gradient (differenced).
        local: direct: the sum over small gradients of their squared norms.
        prev, cross: differenced: the previous step's squared norm and the
            dot product of the two steps' gradients.
        scale, prev_scale: AMP loss scales to divide out (None: none).
    """

    estimator: str
    config: BatchConfig
    count: int
    big: np.ndarray
    local: np.ndarray | None = None
    prev: np.ndarray | None = None
    cross: np.ndarray | None = None
    scale: float | None = None
    prev_scale: float | None = None

    def small_and_big(self) -> tuple[np.ndarray, np.ndarray]:
        """``(S_small, S_big)`` per group, loss scales divided out."""
        scale_sq = self.scale ** 2 if self.scale is not None else 1.0
        if self.estimator == DIRECT:
            assert self.local is not None, "a direct measurement has its local norms"
            return self.local / self.count / scale_sq, self.big / scale_sq
        assert self.prev is not None and self.cross is not None, "a differenced measurement has prev and cross"
        prev_sq = self.prev_scale ** 2 if self.prev_scale is not None else 1.0
        cur, prev = self.big / scale_sq, self.prev / prev_sq
        cross = self.cross / math.sqrt(scale_sq * prev_sq)
        return (cur + prev) / 2.0, (cur + prev + 2.0 * cross) / 4.0

    def samples(self, span: int) -> int:
        """Samples per replica trained in the ``span`` optimizer steps since the previous measurement
        (what the averages decay by)."""
        if self.estimator == DIRECT:
            return self.config.local_bsz * self.count * span
        return max(2, span) * self.config.local_bsz


class _Magnitude:
    """Bias-corrected moving average of the measured squared gradient norm, over
    the last few measurements (it sets the weight of the next one)."""

    def __init__(self, decay: float = 0.9) -> None:
        self._decay = decay
        self._sum = 0.0
        self._weight = 0.0

    def value(self, default: float) -> float:
        return self._sum / self._weight if self._weight > 0 else default

    def update(self, value: float) -> None:
        self._sum = self._decay * self._sum + (1.0 - self._decay) * value
        self._weight = self._decay * self._weight + (1.0 - self._decay)

    def state(self) -> list[float]:
        return [self._sum, self._weight]

    def load(self, state: Sequence[float]) -> None:
        self._sum, self._weight = (float(v) for v in state)


class NoiseAverages:
    """Weighted, bias-corrected moving averages of per-group ``sqr`` and ``var``.

    Each measurement weighs ``importance * (1 - decay)``; the read-out is
    ``sqr / weight`` (``var / weight``), a weighted mean of the measurements.
    """

    def __init__(self, num_groups: int) -> None:
        self.sqr = np.zeros(num_groups)
        self.var = np.zeros(num_groups)
        self.weight = 0.0
        self.estimator: str | None = None  # of the measurements averaged so far
        self.updates = 0  # measurements folded in
        self.skipped = 0  # measurements discarded for non-finite gradients
        self._magnitude = _Magnitude()

    def add(self, measurement: Measurement, smoothing: float, span: int) -> bool:
        """Fold ``measurement``, which stands for the ``span`` optimizer steps since the previous one, in;
        False when it was discarded (non-finite or all-zero gradients)."""
        small, big = measurement.small_and_big()
        config = measurement.config
        with np.errstate(invalid="ignore", over="ignore"):
            sqr, var = estimate_from_norms(small, big, measurement.count, config.local_bsz, config.init_batch_size)
        if not (np.all(np.isfinite(sqr)) and np.all(np.isfinite(var))):
            self.skipped += 1
            logger.debug("skipping a gradient-noise measurement with non-finite gradients")
            return False
        total = float(np.sum(small))
        if not total > 0:  # all gradients exactly zero: nothing to learn from
            return False
        importance = 1.0 / self._magnitude.value(default=total)
        self._magnitude.update(total)
        if self.estimator not in (None, measurement.estimator):
            logger.info("gradient noise estimator changed from %s to %s; discounting earlier estimates",
                        self.estimator, measurement.estimator)
            self._discount(_SWITCH_DISCOUNT)
        self.estimator = measurement.estimator
        # Weighted by 1 / |g_small|^2 (as recent measurements had it: a weight taken from
        # this measurement's own noise would bias the averages): early in training
        # gradients shrink by orders of magnitude, and plain averages of sqr and var would
        # stay dominated by the first steps long after their ratio has moved on.
        decay = smoothing ** (measurement.samples(span) / config.init_batch_size)
        self.sqr = decay * self.sqr + (1.0 - decay) * importance * sqr
        self.var = decay * self.var + (1.0 - decay) * importance * var
        self.weight = decay * self.weight + (1.0 - decay) * importance
        self.updates += 1
        return True

    def totals(self, group: int | None) -> tuple[float, float] | None:
        """``(sqr, var)`` of all groups (summed) or of one; None before any measurement."""
        if self.weight <= 0:
            return None
        sqr = np.maximum(self.sqr / self.weight, 0.0)
        var = np.maximum(self.var / self.weight, 0.0)
        if group is None:
            return float(sqr.sum()), float(var.sum())
        return float(sqr[group]), float(var[group])

    def rescale_var(self, factor: float) -> None:
        """Re-express ``var`` at another reference batch (``old / new``)."""
        self.var *= factor

    def _discount(self, factor: float) -> None:
        """Keep the current estimate but let new data outweigh it sooner."""
        self.sqr *= factor
        self.var *= factor
        self.weight *= factor

    def reset(self) -> None:
        """Forget the estimates (the counters stay)."""
        self.sqr[:] = 0.0
        self.var[:] = 0.0
        self.weight = 0.0
        self.estimator = None
        self._magnitude = _Magnitude()

    def state_fields(self) -> StateDict:
        """The averages as plain floats, lists and strings (part of the estimator's state)."""
        return {"sqr": self.sqr.tolist(), "var": self.var.tolist(), "weight": self.weight,
                "estimator": self.estimator or "", "magnitude": self._magnitude.state(),
                "updates": self.updates, "skipped": self.skipped}

    def load_fields(self, fields: StateDict) -> None:
        """Restore :meth:`state_fields` (same number of groups, checked by the caller)."""
        self.sqr = np.asarray(fields["sqr"], dtype=float).copy()
        self.var = np.asarray(fields["var"], dtype=float).copy()
        self.weight = float(fields["weight"])
        self._magnitude = _Magnitude()
        self._magnitude.load(fields["magnitude"])
        self.estimator = fields["estimator"] or None
        self.updates, self.skipped = int(fields["updates"]), int(fields["skipped"])
