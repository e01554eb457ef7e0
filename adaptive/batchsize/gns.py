"""Gradient noise scale, measured during ordinary data-parallel training.

What is estimated
-----------------
Let per-sample gradients have mean ``G`` and covariance ``Sigma``.  The
gradient of a minibatch of ``b`` samples satisfies
``E|g_b|^2 = |G|^2 + tr(Sigma) / b``.  Given ``n`` independent minibatch
gradients of ``b`` samples each ("small") and their average ("big", ``n*b``
samples), with ``S_small`` the mean of their squared norms and ``S_big`` the
squared norm of the average::

    |G|^2     = (n * S_big - S_small) / (n - 1)          (unbiased)
    tr(Sigma) = (S_small - S_big) * b * n / (n - 1)      (unbiased)

This module keeps bias-corrected exponential moving averages (as Adam does)
of ``sqr = |G|^2`` and ``var = tr(Sigma) / init_batch_size`` per optimizer
parameter group.  Each measurement is weighted by the inverse of its
squared gradient norm: early in training the gradient shrinks by orders of
magnitude within a few hundred steps, and plain averages would stay
dominated by the first steps long after the ratio of the two has moved on
(with steady gradients the weights are equal and nothing changes).  From
them it derives

* ``noise_scale() = tr(Sigma) / |G|^2`` (the simple noise scale, in samples);
* ``gain(scale) = (var + sqr) / (var / scale + sqr)``: how many reference
  steps (batch ``init_batch_size``) one step with ``scale`` times that batch
  is worth (AdaScale's gain ratio).

Where the small and big gradients come from
-------------------------------------------
* **Replicas** (``R > 1``, no accumulation): each replica's gradient before
  the all-reduce is small, the all-reduced one big; ``n = R``.
* **Accumulation micro-steps** (``k > 1``): each micro-step's gradient
  contribution is small (read by a tensor hook as autograd hands it over,
  before it is added to ``.grad``), the accumulated and all-reduced
  gradient big; ``n = R * k``.
* **One replica, no accumulation**: a *differenced* estimator over two
  consecutive steps ``t-1, t``: ``S_small = (|g_{t-1}|^2 + |g_t|^2) / 2``,
  ``S_big = |g_{t-1} + g_t|^2 / 4``, ``n = 2``.  It is unbiased only if the
  weights do not move.  They do: with ``D = G_t - G_{t-1}`` (about
  ``-lr * H g`` for SGD) it over-estimates ``tr(Sigma)`` by ``b |D|^2 / 2``
  and returns ``G_{t-1} . G_t ~ |G|^2 - |D|^2 / 4`` for ``|G|^2``, so the
  noise scale is biased upwards by a term of order ``lr^2``.  When training
  switches between this and the unbiased estimators (a restart with a new
  replica count), the earlier averages are discounted so that the new
  measurements take over quickly while the estimate stays usable.

Each replica's small-gradient sums are averaged over replicas (one
all-reduce of a few floats per measured step, asynchronous), so every
replica holds the same estimates.

Preconditioning
---------------
For Adam-type optimizers (parameter groups with ``betas`` and ``eps`` whose
state holds ``exp_avg_sq``), gradients are measured in the geometry the
optimizer steps in: every squared gradient element is divided by
``sqrt(v_hat) + eps``, with ``v_hat`` Adam's bias-corrected second moment
(``max_exp_avg_sq`` with amsgrad).  The preconditioner is a persistent
float32 copy of the parameters' shape, refreshed every
``precondition_interval`` optimizer steps.  Before the optimizer's first
step there is no ``v_hat``: those steps are not measured (their
statistics would be in different units).  An Adam-like optimizer without
``exp_avg_sq`` (Adamax, ...) is measured without preconditioning.

How it runs, and what it costs
------------------------------
:meth:`GradientNoiseScale.attach` leaves DDP's reduction alone (its fused
C++ all-reduce, or any communication hook the user registers) and watches
the backward passes through autograd hooks:

* a forward hook on the DDP model marks where each backward starts, which
  counts the micro-steps and tells the synchronising one;
* with several replicas or micro-steps, a tensor hook per parameter reads
  the norm of each backward's gradient contribution as autograd hands it
  over (before it is added to ``.grad`` and before DDP reduces it);
* at the end of the synchronising backward (after DDP has written the
  reduced gradient back), ``.grad`` is divided by the number of micro-steps
  (so it is the mean over all micro-batches of all replicas) and its
  per-group norms are read: one multi-tensor norm;
* with preconditioning: additionally one fused multiply per parameter into
  a reusable float32 workspace (the largest parameter);
* the differenced estimator: one persistent float32 copy of the previous
  step's gradient (preconditioned in place when used, so both partners
  share the current preconditioner), and a norm and a dot product per
  parameter;
* results stay on the device; a handful of floats is copied to the host
  once per measured step, at the first read-out (``gain``, ``sqr_avg``...)
  or at the start of the next step.  No per-parameter synchronisation and
  no full-size temporaries beyond the reusable workspace.

A measured step therefore reads the gradient about twice more; steps that
are not measured (``measure_interval``) cost one Python call per backward.

Integration
-----------
::

    gns = GradientNoiseScale(optimizer, grad_scaler=scaler)
    gns.attach(ddp_model)                       # before the first backward
    gns.set_batch_config(init_batch_size=256, local_bsz=64, accum_steps=2)
    ... ordinary training; under accumulation the forward *and* backward of
    every micro-step but the last run in ddp_model.no_sync() ...
    gns.gain(gns.scale), gns.noise_scale(), gns.to_grad_params()

``set_batch_config`` must describe the steps that follow.  Losses must be
means over the micro-batch (the usual reduction).  Extra backward passes
through the model outside training steps (e.g. ``torch.autograd.grad`` for
a gradient penalty) would be counted as micro-steps.  The end-of-backward
work runs from torch's autograd-engine callback queue, after DDP's own
finalisation.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from adaptive.batchsize.goodput import GradParams

__all__ = ["BatchConfig", "GradientNoiseScale", "estimate_from_norms"]

logger = logging.getLogger(__name__)

_DIRECT = "direct"
_DIFFERENCED = "differenced"
#: When the estimator changes (one replica <-> several, e.g. after a restart)
#: the earlier averages keep this fraction of their weight: the estimate stays
#: usable at once, and new measurements take over within about
#: ``_SWITCH_DISCOUNT / (1 - smoothing)`` reference steps.
_SWITCH_DISCOUNT = 0.1


def _check_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class BatchConfig:
    """Batch sizes of the current optimizer steps.

    Attributes:
        init_batch_size: reference global batch (the user's batch size).
        local_bsz: samples per replica per micro-batch.
        accum_steps: micro-batches per optimizer step.
        num_replicas: data-parallel replicas.
    """

    init_batch_size: int
    local_bsz: int
    accum_steps: int = 1
    num_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("init_batch_size", "local_bsz", "accum_steps", "num_replicas"):
            _check_int(getattr(self, name), name)

    @property
    def global_batch_size(self) -> int:
        return self.local_bsz * self.accum_steps * self.num_replicas

    @property
    def scale(self) -> float:
        """Global batch relative to the reference batch."""
        return self.global_batch_size / self.init_batch_size


def estimate_from_norms(small_sqr: Any, big_sqr: Any, count: int, small_batch: int,
                        init_batch_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Unbiased ``(|G|^2, tr(Sigma) / init_batch_size)`` from two squared norms.

    Args:
        small_sqr: mean squared norm of ``count`` independent minibatch
            gradients of ``small_batch`` samples each.
        big_sqr: squared norm of their average.
        count: number of small gradients (>= 2).
        small_batch: samples per small gradient.
        init_batch_size: reference batch for the variance.
    """
    _check_int(count, "count", 2)
    small = np.asarray(small_sqr, dtype=float)
    big = np.asarray(big_sqr, dtype=float)
    sqr = (count * big - small) / (count - 1)
    trace = (small - big) * small_batch * count / (count - 1)
    return sqr, trace / init_batch_size


class _GroupEma:
    """Bias-corrected exponential moving averages of per-group sqr and var.

    Each measurement weighs ``importance * (1 - decay)``; the read-out is
    ``sqr / weight`` (``var / weight``), a weighted mean of the measurements.
    """

    def __init__(self, num_groups: int) -> None:
        self.sqr = np.zeros(num_groups)
        self.var = np.zeros(num_groups)
        self.weight = 0.0

    def update(self, sqr: np.ndarray, var: np.ndarray, decay: float, importance: float = 1.0) -> None:
        self.sqr = decay * self.sqr + (1.0 - decay) * importance * sqr
        self.var = decay * self.var + (1.0 - decay) * importance * var
        self.weight = decay * self.weight + (1.0 - decay) * importance

    def discount(self, factor: float) -> None:
        """Keep the current estimate but let new data outweigh it sooner."""
        self.sqr *= factor
        self.var *= factor
        self.weight *= factor

    def reset(self) -> None:
        self.sqr[:] = 0.0
        self.var[:] = 0.0
        self.weight = 0.0


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

    def state_dict(self) -> List[float]:
        return [self._sum, self._weight]

    def load_state_dict(self, state: Sequence[float]) -> None:
        self._sum, self._weight = (float(v) for v in state)


class _Preconditioner:
    """Adam's ``1 / (sqrt(v_hat) + eps)``, kept as its square root per parameter.

    ``state`` is ``"waiting"`` (no optimizer state yet: do not measure),
    ``"ready"`` or ``"off"`` (the optimizer has no ``exp_avg_sq``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 group_of: Sequence[int], interval: int) -> None:
        self._optimizer = optimizer
        self._params = list(params)
        self._group_of = list(group_of)
        self._interval = interval
        self.roots: List[Optional[torch.Tensor]] = [None] * len(self._params)
        self.state = "waiting"
        self._refreshed_at = -1

    def maybe_refresh(self, step: int) -> None:
        if self.state == "off" or (self.state == "ready" and step - self._refreshed_at < self._interval):
            return
        found = stepped = 0
        with torch.no_grad():
            for i, param in enumerate(self._params):
                state = self._optimizer.state.get(param)
                if not state:
                    continue
                stepped += 1
                group = self._optimizer.param_groups[self._group_of[i]]
                second = state.get("max_exp_avg_sq") if group.get("amsgrad") else None
                second = state.get("exp_avg_sq") if second is None else second
                if second is None or "step" not in state:
                    continue
                root = self.roots[i]
                if root is None:
                    root = self.roots[i] = torch.empty_like(param, dtype=torch.float32)
                correction = 1.0 - group["betas"][1] ** _step_value(state["step"])
                torch.div(second, correction, out=root)
                root.sqrt_().add_(group["eps"]).rsqrt_()
                found += 1
        if found:
            self.state, self._refreshed_at = "ready", step
        elif stepped:
            self.state = "off"
            logger.info("optimizer state has no exp_avg_sq; the gradient noise scale is measured "
                        "without preconditioning")


def _step_value(step: Any) -> Any:
    """Adam's step count as a float, or a device tensor (no host sync)."""
    if isinstance(step, torch.Tensor):
        return float(step) if step.device.type == "cpu" else step.to(torch.float32)
    return float(step)


@dataclass
class _StepRecord:
    """Device-side measurements of one optimizer step, read at flush time."""

    estimator: str
    config: BatchConfig
    count: int
    big: torch.Tensor
    local: Optional[torch.Tensor] = None
    work: Any = None
    scale: Optional[torch.Tensor] = None
    prev: Optional[torch.Tensor] = None
    prev_scale: Optional[torch.Tensor] = None
    cross: Optional[torch.Tensor] = None


def _output_tensors(output: Any) -> List[torch.Tensor]:
    """Tensors in a model's output (nested tuples, lists, dicts, dataclass-like objects)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    elif hasattr(output, "__dataclass_fields__"):
        output = [getattr(output, name) for name in output.__dataclass_fields__]
    if isinstance(output, (list, tuple)):
        return [tensor for item in output for tensor in _output_tensors(item)]
    return []


class GradientNoiseScale:
    """Gradient statistics of a DDP model, measured as it trains.

    Args:
        optimizer: the model's optimizer; statistics are kept per
            parameter group.
        smoothing: per-reference-batch decay of the moving averages; a
            step of ``scale`` times the reference batch decays by
            ``smoothing ** scale``, so the window is about
            ``1 / (1 - smoothing)`` reference steps whatever the batch.
        precondition: measure Adam-preconditioned gradients; default: when
            the optimizer's groups have ``betas`` and ``eps``.
        precondition_interval: optimizer steps between preconditioner
            refreshes.
        measure_interval: measure every this many optimizer steps (1 =
            every step); larger values cut the cost proportionally.
        grad_scaler: the AMP ``GradScaler`` scaling the loss, if any (its
            scale is divided out; overflowing steps are skipped).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, smoothing: float = 0.999,
                 precondition: Optional[bool] = None, precondition_interval: int = 10,
                 measure_interval: int = 1, grad_scaler: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not 0.0 < float(smoothing) < 1.0:
            raise ValueError(f"smoothing must be in (0, 1), got {smoothing!r}")
        self._optimizer = optimizer
        self._smoothing = float(smoothing)
        self._precondition_interval = _check_int(precondition_interval, "precondition_interval")
        self._measure_interval = _check_int(measure_interval, "measure_interval")
        if precondition is None:
            precondition = all("betas" in g and "eps" in g for g in optimizer.param_groups)
        self._wants_precondition = bool(precondition)
        #: The AMP ``GradScaler`` whose loss scale is divided out (or None).
        self.grad_scaler = grad_scaler
        self._enabled = True
        self._num_groups = len(optimizer.param_groups)
        self._ema = _GroupEma(self._num_groups)
        self._magnitude = _Magnitude()
        self._ema_estimator: Optional[str] = None
        self._updates = 0
        self._skipped = 0
        self._config: Optional[BatchConfig] = None
        self._lock = threading.RLock()
        self._ddp: Optional[DistributedDataParallel] = None
        self._world_size = 1
        self._process_group: Any = None
        self._average_micro_steps = True
        self._is_last_micro_step: Callable[[], bool] = lambda: True
        self._params: List[torch.Tensor] = []  # tracked: trainable, in the model and in the optimizer
        self._group_of: List[int] = []
        self._trained: List[torch.Tensor] = []  # every trainable parameter of the model (gradients averaged)
        self._device = torch.device("cpu")
        self._preconditioner: Optional[_Preconditioner] = None
        self._micro_handles: List[Any] = []
        self._micro_sq: Optional[torch.Tensor] = None
        self._group_index: Optional[torch.Tensor] = None
        self._workspaces: Dict[torch.device, torch.Tensor] = {}
        self._prev_grads: Dict[int, torch.Tensor] = {}
        self._prev_meta: Any = None
        self._prev_scale: Optional[torch.Tensor] = None
        self._pending: Optional[_StepRecord] = None
        self._in_backward = False
        self._steps = 0
        self._reset_step()

    # ------------------------------------------------------------ set-up
    @property
    def enabled(self) -> bool:
        """Whether steps are measured; while False the micro-steps of a step
        are still averaged."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        self._update_micro_hooks()

    def attach(self, ddp_model: DistributedDataParallel, *, process_group: Any = None,
               average_micro_steps: bool = True,
               is_last_micro_step: Optional[Callable[[], bool]] = None) -> None:
        """Measure ``ddp_model``'s gradients; call once, before its first backward.

        Only autograd hooks are registered: DDP reduces as it would without
        measurement, with any communication hook the user registers (it
        must average over replicas, as torch's hooks do).

        Args:
            ddp_model: the ``DistributedDataParallel`` model trained with
                this optimizer.
            process_group: the group DDP reduces over (default: the model's).
            average_micro_steps: divide the accumulated gradient by the
                number of micro-steps, so ``.grad`` is the mean over the
                whole global batch (DDP averages over replicas).
            is_last_micro_step: called after each forward; whether its
                backward ends the optimizer step.  Default: whether DDP
                synchronises it (``no_sync()`` marks the other micro-steps).
        """
        if not isinstance(ddp_model, DistributedDataParallel):
            raise ValueError(f"ddp_model must be a DistributedDataParallel, got {type(ddp_model).__name__}")
        if self._ddp is not None:
            raise RuntimeError("this GradientNoiseScale is already attached to a model")
        group = process_group if process_group is not None else getattr(ddp_model, "process_group", None)
        world_size = dist.get_world_size(group)
        if self._config is not None and self._config.num_replicas != world_size:
            raise ValueError(f"batch config has num_replicas={self._config.num_replicas} but the process "
                             f"group has {world_size}")
        self._process_group, self._world_size = group, world_size
        self._average_micro_steps = bool(average_micro_steps)
        if is_last_micro_step is None:
            self._is_last_micro_step = lambda: bool(ddp_model.require_backward_grad_sync)
        else:
            self._is_last_micro_step = is_last_micro_step
        self._track_params(ddp_model)
        ddp_model.register_forward_hook(self._on_forward)
        self._ddp = ddp_model
        self._update_micro_hooks()

    def _track_params(self, ddp_model: DistributedDataParallel) -> None:
        ignored = set(getattr(ddp_model, "parameters_to_ignore", ()) or ())
        in_model = {id(p) for name, p in ddp_model.module.named_parameters()
                    if p.requires_grad and name not in ignored}
        for index, group in enumerate(self._optimizer.param_groups):
            for param in group["params"]:
                if id(param) in in_model:
                    self._params.append(param)
                    self._group_of.append(index)
        if not self._params:
            raise ValueError("the optimizer holds none of the model's trainable parameters")
        self._trained = [p for p in ddp_model.module.parameters() if p.requires_grad]
        self._device = self._params[0].device
        self._group_index = torch.tensor(self._group_of, dtype=torch.long, device=self._device)
        self._micro_sq = torch.zeros(len(self._params), dtype=torch.float32, device=self._device)
        if self._wants_precondition:
            self._preconditioner = _Preconditioner(self._optimizer, self._params, self._group_of,
                                                   self._precondition_interval)

    def detach(self) -> None:
        """Stop measuring for good; micro-steps are still averaged."""
        self.enabled = False

    def set_batch_config(self, *, init_batch_size: int, local_bsz: int, accum_steps: int = 1,
                         num_replicas: Optional[int] = None) -> None:
        """Tell the estimator the batch sizes of the coming steps.

        Call before the first step and whenever the loader changes the
        batch size, the number of accumulation steps or (after a restart)
        the replicas, between optimizer steps.  ``num_replicas`` defaults
        to the attached process group's size.
        """
        replicas = self._world_size if num_replicas is None else num_replicas
        config = BatchConfig(init_batch_size, local_bsz, accum_steps, replicas)
        if self._ddp is not None and replicas != self._world_size:
            raise ValueError(f"num_replicas={replicas} but the process group has {self._world_size} replicas")
        with self._lock:
            if config == self._config:
                return
            self._flush()
            old = self._config
            if old is not None and old.init_batch_size != config.init_batch_size:
                self._ema.var *= old.init_batch_size / config.init_batch_size
            self._config = config
            self._prev_meta = None
            if self._step_open:
                logger.debug("batch configuration changed within a step; that step is not measured")
                self._measuring = self._storing = False
        self._update_micro_hooks()

    @property
    def config(self) -> Optional[BatchConfig]:
        """The configuration last given to :meth:`set_batch_config`."""
        return self._config

    @property
    def scale(self) -> float:
        """Current global batch relative to the reference (1 until configured)."""
        return 1.0 if self._config is None else self._config.scale

    # ------------------------------------------------------------ read-out
    def flush(self) -> None:
        """Fold the last measured step into the averages (read-outs do this)."""
        with self._lock:
            self._flush()

    def _totals(self, group: Optional[int]) -> Optional[Tuple[float, float]]:
        if group is not None and not (isinstance(group, int) and 0 <= group < self._num_groups):
            raise ValueError(f"group must be None or an int in [0, {self._num_groups - 1}], got {group!r}")
        self.flush()
        if self._ema.weight <= 0:
            return None
        sqr = np.maximum(self._ema.sqr / self._ema.weight, 0.0)
        var = np.maximum(self._ema.var / self._ema.weight, 0.0)
        if group is None:
            return float(sqr.sum()), float(var.sum())
        return float(sqr[group]), float(var[group])

    def sqr_avg(self, group: Optional[int] = None) -> float:
        """Estimated ``|G|^2`` (all groups, or one), 0.0 before any estimate."""
        totals = self._totals(group)
        return 0.0 if totals is None else totals[0]

    def var_avg(self, group: Optional[int] = None) -> float:
        """Estimated ``tr(Sigma) / init_batch_size``, 0.0 before any estimate."""
        totals = self._totals(group)
        return 0.0 if totals is None else totals[1]

    def noise_scale(self) -> float:
        """Simple noise scale ``tr(Sigma) / |G|^2`` in samples.

        NaN before any estimate; ``inf`` while the true gradient is
        indistinguishable from zero.
        """
        totals = self._totals(None)
        if totals is None or self._config is None:
            return math.nan
        sqr, var = totals
        if sqr <= 0:
            return math.inf if var > 0 else math.nan
        return var * self._config.init_batch_size / sqr

    def gain(self, scale: Optional[float] = None, group: Optional[int] = None) -> float:
        """Gain ratio ``(var + sqr) / (var / scale + sqr)`` at ``scale``
        (default: the current one); 1.0 before any estimate."""
        scale = self.scale if scale is None else float(scale)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        totals = self._totals(group)
        if totals is None or totals[0] + totals[1] <= 0:
            return 1.0
        sqr, var = totals
        return (var + sqr) / (var / scale + sqr)

    def to_grad_params(self) -> Optional[GradParams]:
        """The estimates as :class:`~adaptive.batchsize.goodput.GradParams`, or None before any."""
        totals = self._totals(None)
        if totals is None or totals[0] + totals[1] <= 0:
            return None
        return GradParams(sqr=totals[0], var=totals[1])

    @property
    def num_updates(self) -> int:
        """Measured steps folded into the averages."""
        self.flush()
        return self._updates

    @property
    def num_skipped(self) -> int:
        """Measured steps discarded for non-finite gradients (AMP overflow)."""
        self.flush()
        return self._skipped

    def reset(self) -> None:
        """Forget all estimates."""
        with self._lock:
            self._pending = None
            self._ema.reset()
            self._magnitude = _Magnitude()
            self._ema_estimator = None
            self._prev_meta = None

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """The estimates as plain floats, ints, lists and strings."""
        with self._lock:
            self._flush()
            return {"version": 2, "sqr": self._ema.sqr.tolist(), "var": self._ema.var.tolist(),
                    "weight": self._ema.weight, "estimator": self._ema_estimator or "",
                    "magnitude": self._magnitude.state_dict(),
                    "updates": self._updates, "skipped": self._skipped,
                    "init_batch_size": self._config.init_batch_size if self._config else 0}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (same number of parameter groups)."""
        if not isinstance(state, Mapping) or state.get("version") not in (1, 2):
            raise ValueError("GradientNoiseScale state must be a dict with version 1 or 2")
        sqr, var = np.asarray(state["sqr"], dtype=float), np.asarray(state["var"], dtype=float)
        if sqr.shape != (self._num_groups,) or var.shape != (self._num_groups,):
            raise ValueError(f"GradientNoiseScale state has {sqr.size} parameter groups, "
                             f"the optimizer has {self._num_groups}")
        with self._lock:
            self._pending = None
            self._prev_meta = None
            self._ema.sqr, self._ema.var = sqr.copy(), var.copy()
            self._ema.weight = float(state["weight"])
            self._magnitude = _Magnitude()
            if "magnitude" in state:
                self._magnitude.load_state_dict(state["magnitude"])
            if state["version"] == 1 and self._ema.weight > 0:  # unweighted averages: weigh them as one
                magnitude = float(np.sum(sqr + var)) / self._ema.weight  # measurement of that size
                if magnitude > 0:
                    self._ema.discount(1.0 / magnitude)
            saved_init = int(state.get("init_batch_size", 0))
            if saved_init and self._config is not None and saved_init != self._config.init_batch_size:
                self._ema.var *= saved_init / self._config.init_batch_size
            self._ema_estimator = state.get("estimator") or None
            self._updates, self._skipped = int(state["updates"]), int(state["skipped"])

    # ------------------------------------------------------------ step life
    def _reset_step(self) -> None:
        self._step_open = False
        self._measuring = False
        self._storing = False
        self._hooked = False  # the micro-step hooks saw this step from its start
        self._micro_steps = 0
        self._step_scale: Optional[torch.Tensor] = None

    def _begin_step(self) -> None:
        """First backward of an optimizer step (in the autograd thread)."""
        with self._lock:
            self._flush()
        self._reset_step()
        self._step_open = True
        self._step_index = self._steps
        ready = self._enabled and self._config is not None and self._ddp is not None
        self._measuring = ready and self._step_index % self._measure_interval == 0
        self._storing = ready and (self._step_index + 1) % self._measure_interval == 0
        if ready and self._preconditioner is not None:
            self._preconditioner.maybe_refresh(self._step_index)
            if self._preconditioner.state == "waiting":
                self._measuring = self._storing = False
        if self._measuring or self._storing:
            self._step_scale = self._loss_scale()
        self._hooked = bool(self._micro_handles)
        if self._hooked and self._measuring:
            self._micro_sq.zero_()

    def _loss_scale(self) -> Optional[torch.Tensor]:
        scaler = self.grad_scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, torch.Tensor):
            return scale.detach().reshape(()).to(torch.float32).clone()
        return torch.tensor(float(scaler.get_scale()), dtype=torch.float32)

    def _precondition_active(self) -> bool:
        return self._preconditioner is not None and self._preconditioner.state == "ready"

    # ------------------------------------------------------------ hooks
    def _on_forward(self, module: Any, inputs: Any, output: Any) -> None:
        """DDP forward hook: mark where this forward's backward will start."""
        if not torch.is_grad_enabled():
            return
        self._in_backward = False  # (stale only if a backward raised before its callbacks ran)
        sync = bool(self._is_last_micro_step())
        for tensor in _output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._on_backward_start, sync))

    def _on_backward_start(self, sync: bool, grad: torch.Tensor) -> None:
        """Gradient hook on the model's output: a backward through the model begins."""
        if self._in_backward:  # another output of the same forward
            return
        self._in_backward = True
        if not self._step_open:
            try:
                self._begin_step()
            except Exception:  # never break the user's backward; keep averaging micro-steps
                self._reset_step()
                self._step_open = True
                self._fail("backward-start hook")
        self._micro_steps += 1
        Variable._execution_engine.queue_callback(functools.partial(self._after_backward, sync))

    def _after_backward(self, sync: bool) -> None:
        """End of a backward, before DDP's finalisation (queued ahead of it)."""
        self._in_backward = False
        if sync:  # runs after DDP has written the reduced gradients back
            Variable._execution_engine.queue_callback(self._end_of_step)

    def _update_micro_hooks(self) -> None:
        wanted = (self._ddp is not None and self._enabled and self._config is not None
                  and self._config.accum_steps * self._world_size > 1)
        if wanted and not self._micro_handles:
            self._micro_handles = [p.register_hook(functools.partial(self._micro_hook, i))
                                   for i, p in enumerate(self._params)]
        elif not wanted:
            self._remove_micro_hooks()

    def _remove_micro_hooks(self) -> None:
        for handle in self._micro_handles:
            handle.remove()
        self._micro_handles = []

    def _micro_hook(self, index: int, grad: torch.Tensor) -> None:
        """Squared norm of one parameter's gradient from this backward (tensor hook)."""
        if not self._measuring or not self._hooked:
            return
        try:
            with torch.no_grad():
                root = self._preconditioner.roots[index] if self._precondition_active() else None
                self._micro_sq[index].add_(self._sq_norm(grad, root).to(self._device))
        except Exception:  # never break the user's backward
            self._fail("micro-step hook")

    # ------------------------------------------------------------ end of step
    def _end_of_step(self) -> None:
        """After the synchronising backward: average the micro-steps, measure."""
        try:
            with torch.no_grad():
                steps = max(self._micro_steps, 1)
                if steps > 1 and self._average_micro_steps:
                    self._divide_grads(steps)
                if self._step_open and (self._measuring or self._storing):
                    self._collect(steps)
        except Exception:
            self._fail("end-of-backward measurement")
        finally:
            if self._step_open:
                self._steps += 1
            self._reset_step()

    def _divide_grads(self, divisor: int) -> None:
        dense = []
        for param in self._trained:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad.div_(divisor)
            else:
                dense.append(grad)
        if dense:
            torch._foreach_div_(dense, divisor)

    def _collect(self, micro_steps: int) -> None:
        config, world = self._config, self._world_size
        count = world * micro_steps
        present = [i for i, p in enumerate(self._params) if p.grad is not None and not p.grad.is_sparse]
        if count > 1:
            if not (self._measuring and self._hooked):
                self._prev_meta = None
                return
            big = self._group_sq(present)
            if not self._average_micro_steps:
                big /= micro_steps ** 2
            local = torch.zeros_like(big).index_add_(0, self._group_index, self._micro_sq)
            work = None
            if world > 1:
                work = dist.all_reduce(local, group=self._process_group, async_op=True)
            self._pending = _StepRecord(_DIRECT, config, count, big, local=local, work=work,
                                        scale=self._step_scale)
            self._prev_meta = None
            return
        key = (self._step_index, config, tuple(present))
        if self._measuring and self._prev_meta == (self._step_index - 1,) + key[1:]:
            big, prev_sq, cross = self._differenced(present)
            self._pending = _StepRecord(_DIFFERENCED, config, 2, big, scale=self._step_scale,
                                        prev=prev_sq, prev_scale=self._prev_scale, cross=cross)
        if self._storing:
            self._store(present)
            self._prev_scale, self._prev_meta = self._step_scale, key
        else:
            self._prev_meta = None

    # ------------------------------------------------------------ norms
    def _workspace(self, like: torch.Tensor) -> torch.Tensor:
        work = self._workspaces.get(like.device)
        if work is None or work.numel() < like.numel():
            work = self._workspaces[like.device] = torch.empty(like.numel(), dtype=torch.float32,
                                                               device=like.device)
        return work[:like.numel()].view(like.shape)

    def _preconditioned(self, grad: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """``grad * root`` in the reusable workspace (valid until the next call)."""
        return torch.mul(grad, root, out=self._workspace(grad))

    def _sq_norm(self, grad: torch.Tensor, root: Optional[torch.Tensor]) -> torch.Tensor:
        source = grad if root is None else self._preconditioned(grad, root)
        return torch.linalg.vector_norm(source, dtype=torch.float32).square()

    def _roots(self) -> Sequence[Optional[torch.Tensor]]:
        if self._precondition_active():
            return self._preconditioner.roots
        return [None] * len(self._params)

    def _by_group(self, indices: Sequence[int], values: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(self._num_groups, dtype=torch.float32, device=self._device)
        if indices:
            groups = self._group_index[list(indices)]
            out.index_add_(0, groups, torch.stack([v.to(self._device) for v in values]))
        return out

    def _group_sq(self, indices: Sequence[int]) -> torch.Tensor:
        """Per-group squared norms of the (preconditioned) gradients of ``indices``."""
        roots = self._roots()
        plain = [i for i in indices if roots[i] is None]
        values = []
        if plain:
            norms = torch._foreach_norm([self._params[i].grad for i in plain], 2, dtype=torch.float32)
            values += [norm.square() for norm in norms]
        scaled = [i for i in indices if roots[i] is not None]
        values += [self._sq_norm(self._params[i].grad, roots[i]) for i in scaled]
        return self._by_group(plain + scaled, values)

    def _differenced(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``|g_t|^2``, ``|g_{t-1}|^2`` and ``g_{t-1} . g_t`` per group.

        The previous gradient is kept raw and preconditioned here with the
        *current* preconditioner, so both partners are measured in the same
        geometry even across a refresh.
        """
        roots = self._roots()
        cur, prev, cross = [], [], []
        for i in indices:
            saved, root = self._prev_grads[i], roots[i]
            grad = self._params[i].grad
            if root is not None:
                saved.mul_(root)
                grad = self._preconditioned(grad, root)
            cur.append(torch.linalg.vector_norm(grad, dtype=torch.float32).square())
            prev.append(torch.linalg.vector_norm(saved).square())
            cross.append(torch.dot(grad.reshape(-1).float(), saved.reshape(-1)))
        return self._by_group(indices, cur), self._by_group(indices, prev), self._by_group(indices, cross)

    def _store(self, indices: Sequence[int]) -> None:
        """Keep this step's raw gradients as the next step's partner."""
        for i in indices:
            grad = self._params[i].grad
            saved = self._prev_grads.get(i)
            if saved is None or saved.shape != grad.shape or saved.device != grad.device:
                saved = self._prev_grads[i] = torch.empty_like(grad, dtype=torch.float32)
            saved.copy_(grad)

    # ------------------------------------------------------------ averaging
    def _flush(self) -> None:
        """Fold the pending step into the moving averages (caller holds the lock)."""
        record, self._pending = self._pending, None
        if record is None:
            return
        if record.work is not None:
            record.work.wait()
        parts = [record.big, record.local, record.prev, record.cross, record.scale, record.prev_scale]
        present = [p.reshape(-1).to(self._device, torch.float32) for p in parts if p is not None]
        values = iter(np.split(torch.cat(present).double().cpu().numpy(),
                               np.cumsum([p.numel() for p in present])[:-1]))
        big, local, prev, cross, scale, prev_scale = (next(values) if p is not None else None for p in parts)
        scale_sq = float(scale[0]) ** 2 if scale is not None else 1.0
        config = record.config
        if record.estimator == _DIRECT:
            small = local / record.count / scale_sq
            big = big / scale_sq
            samples = config.local_bsz * record.count * self._measure_interval  # all steps since the last
        else:
            prev_sq = float(prev_scale[0]) ** 2 if prev_scale is not None else 1.0
            cur, prev = big / scale_sq, prev / prev_sq
            cross = cross / math.sqrt(scale_sq * prev_sq)
            small, big = (cur + prev) / 2.0, (cur + prev + 2.0 * cross) / 4.0
            samples = max(2, self._measure_interval) * config.local_bsz
        with np.errstate(invalid="ignore", over="ignore"):
            sqr, var = estimate_from_norms(small, big, record.count, config.local_bsz, config.init_batch_size)
        if not (np.all(np.isfinite(sqr)) and np.all(np.isfinite(var))):
            self._skipped += 1
            self._prev_meta = None
            logger.debug("skipping a gradient-noise measurement with non-finite gradients")
            return
        total = float(np.sum(small))
        if not total > 0:  # all gradients exactly zero: nothing to learn from
            self._prev_meta = None
            return
        importance = 1.0 / self._magnitude.value(default=total)
        self._magnitude.update(total)
        if self._ema_estimator not in (None, record.estimator):
            logger.info("gradient noise estimator changed from %s to %s; discounting earlier estimates",
                        self._ema_estimator, record.estimator)
            self._ema.discount(_SWITCH_DISCOUNT)
        self._ema_estimator = record.estimator
        # Weighted by 1 / |g_small|^2 (as recent measurements had it: a weight taken from
        # this measurement's own noise would bias the averages): early in training
        # gradients shrink by orders of magnitude, and plain averages of sqr and var would
        # stay dominated by the first steps long after their ratio has moved on.
        self._ema.update(sqr, var, self._smoothing ** (samples / config.init_batch_size), importance=importance)
        self._updates += 1

    def _fail(self, where: str) -> None:
        logger.exception("gradient noise measurement failed in the %s; measurement is disabled", where)
        self._measuring = self._storing = False
        self.enabled = False
