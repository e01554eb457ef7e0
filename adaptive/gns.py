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
parameter group, and derives

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
:meth:`GradientNoiseScale.attach` registers a DDP communication hook that
does the all-reduce itself (by default dividing by ``replicas * k``, so
after the synchronising backward ``.grad`` holds the mean gradient over
all micro-batches of all replicas) and measures around it:

* before the all-reduce (``R > 1``, ``k = 1``): one norm per contiguous run
  of same-group parameters in the bucket (a read of the bucket);
* after it, at the end of backward: the same on the reduced bucket;
* with accumulation: one norm per parameter per micro-step in a tensor
  hook (hooks are only installed while ``accum_steps > 1``);
* with preconditioning: additionally a copy of each bucket into a reusable
  float32 workspace (largest bucket) and one fused multiply;
* the differenced estimator: one persistent float32 copy of the previous
  step's raw gradient (preconditioned in place when used, so both partners
  share the current preconditioner), and a norm and a dot product per run;
* results stay on the device; a handful of floats is copied to the host
  once per measured step, at the first read-out (``gain``, ``sqr_avg``...)
  or at the start of the next step.  No per-parameter synchronisation and
  no full-size temporaries beyond the reusable workspace.

Integration
-----------
::

    gns = GradientNoiseScale(optimizer, grad_scaler=scaler)
    gns.attach(ddp_model)                       # before the first backward
    gns.set_batch_config(init_batch_size=256, local_bsz=64, accum_steps=2)
    ... ordinary training; under accumulation the forward *and* backward of
    every micro-step but the last run in ddp_model.no_sync() ...
    gns.gain(gns.scale), gns.noise_scale(), gns.to_grad_params()

``set_batch_config`` must describe the steps that follow (the hook divides
by the micro-step count it observes, or by the declared ``accum_steps``
while measurement is off).  Losses must be means over the micro-batch (the
usual reduction).  Extra backward passes through the tracked parameters
outside training steps (e.g. ``torch.autograd.grad`` for a gradient
penalty) would be counted as micro-steps.  The end-of-backward measurement
runs from torch's autograd-engine callback queue, as DDP's own
finalisation does.
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

from adaptive.goodput import GradParams

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
    """Bias-corrected exponential moving averages of per-group sqr and var."""

    def __init__(self, num_groups: int) -> None:
        self.sqr = np.zeros(num_groups)
        self.var = np.zeros(num_groups)
        self.weight = 0.0

    def update(self, sqr: np.ndarray, var: np.ndarray, decay: float) -> None:
        self.sqr = decay * self.sqr + (1.0 - decay) * sqr
        self.var = decay * self.var + (1.0 - decay) * var
        self.weight = decay * self.weight + (1.0 - decay)

    def discount(self, factor: float) -> None:
        """Keep the current estimate but let new data outweigh it sooner."""
        self.sqr *= factor
        self.var *= factor
        self.weight *= factor

    def reset(self) -> None:
        self.sqr[:] = 0.0
        self.var[:] = 0.0
        self.weight = 0.0


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
        self.version = 0
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
            self.version += 1
        elif stepped:
            self.state = "off"
            logger.info("optimizer state has no exp_avg_sq; the gradient noise scale is measured "
                        "without preconditioning")


def _step_value(step: Any) -> Any:
    """Adam's step count as a float, or a device tensor (no host sync)."""
    if isinstance(step, torch.Tensor):
        return float(step) if step.device.type == "cpu" else step.to(torch.float32)
    return float(step)


class _BucketLayout:
    """Where a DDP bucket's tracked gradients lie in its flat buffer."""

    def __init__(self, bucket: Any, index_of: Mapping[int, int], group_of: Sequence[int],
                 device: torch.device) -> None:
        buffer = bucket.buffer()
        self.numel = buffer.numel()
        base = (buffer.untyped_storage().data_ptr(), buffer.storage_offset())
        items, cursor = [], 0
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            shares = grad.untyped_storage().data_ptr() == base[0]
            offset = grad.storage_offset() - base[1] if shares else cursor
            cursor = offset + grad.numel()
            items.append((offset, grad.numel(), index_of.get(id(param), -1), tuple(grad.shape), grad.stride()))
        items.sort(key=lambda item: item[0])
        runs: List[List[int]] = []
        self.tracked: List[Tuple[int, int, Tuple[int, ...], Tuple[int, ...]]] = []
        for offset, numel, index, shape, stride in items:
            if index < 0 or numel == 0:
                continue
            self.tracked.append((index, offset, shape, stride))
            group = group_of[index]
            if runs and runs[-1][2] == group and runs[-1][1] == offset:
                runs[-1][1] = offset + numel
            else:
                runs.append([offset, offset + numel, group])
        self.runs = [(start, end) for start, end, _ in runs]
        self.run_groups = torch.tensor([group for _, _, group in runs], dtype=torch.long, device=device)
        self._views: Dict[Tuple[int, int], Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}

    def preconditioned_views(self, flat: torch.Tensor, roots: Sequence[Optional[torch.Tensor]],
                             version: int) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Views of the tracked gradients inside ``flat`` (a workspace or a
        saved gradient with this layout) and their preconditioner roots."""
        key = (flat.data_ptr(), version)
        cached = self._views.get(key)
        if cached is None:
            views, factors = [], []
            for index, offset, shape, stride in self.tracked:
                if roots[index] is not None:
                    views.append(flat.as_strided(shape, stride, offset))
                    factors.append(roots[index])
            if len(self._views) >= 4:
                self._views.clear()
            cached = self._views[key] = (views, factors)
        return cached


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
        self._index_of: Dict[int, int] = {}
        self._num_groups = len(optimizer.param_groups)
        self._ema = _GroupEma(self._num_groups)
        self._ema_estimator: Optional[str] = None
        self._updates = 0
        self._skipped = 0
        self._config: Optional[BatchConfig] = None
        self._lock = threading.RLock()
        self._ddp: Optional[DistributedDataParallel] = None
        self._world_size = 1
        self._process_group: Any = None
        self._average_micro_steps = True
        self._inner_hook: Optional[Callable[[Any, Any], Any]] = None
        self._inner_state: Any = None
        self._params: List[torch.Tensor] = []
        self._group_of: List[int] = []
        self._device = torch.device("cpu")
        self._preconditioner: Optional[_Preconditioner] = None
        self._micro_handles: List[Any] = []
        self._micro_sq: Optional[torch.Tensor] = None
        self._micro_calls: List[int] = []
        self._group_index: Optional[torch.Tensor] = None
        self._layouts: Dict[Tuple[int, int, int], _BucketLayout] = {}
        self._workspaces: Dict[torch.device, torch.Tensor] = {}
        self._prev_buffers: Dict[int, torch.Tensor] = {}
        self._prev_meta: Any = None
        self._prev_scale: Optional[torch.Tensor] = None
        self._pending: Optional[_StepRecord] = None
        self._steps = 0
        self._reset_step()

    # ------------------------------------------------------------ set-up
    @property
    def enabled(self) -> bool:
        """Whether steps are measured; while False the communication hook
        still reduces gradients (and averages micro-steps)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        self._update_micro_hooks()

    def attach(self, ddp_model: DistributedDataParallel, *, process_group: Any = None,
               average_micro_steps: bool = True, inner_hook: Optional[Callable[[Any, Any], Any]] = None,
               inner_state: Any = None) -> None:
        """Measure ``ddp_model``'s gradients; call once, before its first backward.

        Registers the DDP communication hook (DDP allows one), so
        gradients are reduced here.

        Args:
            ddp_model: the ``DistributedDataParallel`` model trained with
                this optimizer.
            process_group: the group reducing gradients (default: the
                model's).
            average_micro_steps: divide the accumulated gradient by the
                number of micro-steps as well as by the replicas, so
                ``.grad`` is the mean over the whole global batch.
            inner_hook: a communication hook ``(state, bucket) -> Future``
                to reduce with instead of the plain averaging all-reduce
                (it must average over replicas, like torch's hooks).
            inner_state: its ``state``.
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
        self._inner_hook, self._inner_state = inner_hook, inner_state
        self._track_params(ddp_model)
        ddp_model.register_comm_hook(None, self._comm_hook)
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
        self._device = self._params[0].device
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        self._group_index = torch.tensor(self._group_of, dtype=torch.long, device=self._device)
        self._micro_sq = torch.zeros(len(self._params), dtype=torch.float32, device=self._device)
        if self._wants_precondition:
            self._preconditioner = _Preconditioner(self._optimizer, self._params, self._group_of,
                                                   self._precondition_interval)

    def detach(self) -> None:
        """Stop measuring for good; the communication hook keeps reducing gradients."""
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
        """The estimates as :class:`~adaptive.goodput.GradParams`, or None before any."""
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
            self._ema_estimator = None
            self._prev_meta = None

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """The estimates as plain floats, ints, lists and strings."""
        with self._lock:
            self._flush()
            return {"version": 1, "sqr": self._ema.sqr.tolist(), "var": self._ema.var.tolist(),
                    "weight": self._ema.weight, "estimator": self._ema_estimator or "",
                    "updates": self._updates, "skipped": self._skipped,
                    "init_batch_size": self._config.init_batch_size if self._config else 0}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (same number of parameter groups)."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("GradientNoiseScale state must be a dict with version 1")
        sqr, var = np.asarray(state["sqr"], dtype=float), np.asarray(state["var"], dtype=float)
        if sqr.shape != (self._num_groups,) or var.shape != (self._num_groups,):
            raise ValueError(f"GradientNoiseScale state has {sqr.size} parameter groups, "
                             f"the optimizer has {self._num_groups}")
        with self._lock:
            self._pending = None
            self._prev_meta = None
            self._ema.sqr, self._ema.var = sqr.copy(), var.copy()
            self._ema.weight = float(state["weight"])
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
        self._mode: Optional[str] = None
        self._micro_steps = 1
        self._local_parts: List[torch.Tensor] = []
        self._reduced: List[Tuple[Any, _BucketLayout, int]] = []
        self._step_scale: Optional[torch.Tensor] = None

    def _begin_step(self) -> None:
        """First hook of an optimizer step (in the autograd thread)."""
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
        if self._micro_handles:
            self._micro_calls = [0] * len(self._params)
            if self._measuring:
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
    def _update_micro_hooks(self) -> None:
        wanted = (self._ddp is not None and self._enabled and self._config is not None
                  and self._config.accum_steps > 1)
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
        """Squared norm of one parameter's micro-step gradient (tensor hook)."""
        try:
            if not self._step_open:
                self._begin_step()
            self._micro_calls[index] += 1
            if not self._measuring:
                return
            with torch.no_grad():
                root = self._preconditioner.roots[index] if self._precondition_active() else None
                if root is not None:
                    work = self._workspace(grad.device, grad.numel())[:grad.numel()].view(grad.shape)
                    torch.mul(grad, root, out=work)
                    norm = torch.linalg.vector_norm(work)
                else:
                    norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
                self._micro_sq[index].add_(norm.to(self._device).square())
        except Exception:  # never break the user's backward
            self._fail("micro-step hook")

    # No annotations on (state, bucket): DDP compares them to dist.GradBucket.
    def _comm_hook(self, state, bucket):  # noqa: ANN001,ANN202
        """DDP communication hook: measure, reduce, measure again at the end."""
        buffer = bucket.buffer()
        layout = None
        try:
            if not self._step_open:
                self._begin_step()
            if self._mode is None:
                self._start_reduction()
            if self._mode:
                layout = self._layout(bucket)
                if self._mode == _DIRECT and not self._micro_handles:
                    self._local_parts.append(self._group_sq(buffer, layout)[0])
        except Exception:
            self._fail("communication hook")
            layout = None
        future = self._reduce(buffer, bucket)
        if layout is not None:
            self._reduced.append((future, layout, bucket.index()))
        if bucket.is_last():
            self._step_open = False
            self._steps += 1
            if self._reduced:
                self._after_backward(self._end_of_backward)
        return future

    @staticmethod
    def _after_backward(callback: Callable[[], None]) -> None:
        """Run ``callback`` once the current backward pass has finished
        (torch's engine callback queue, which DDP itself relies on); if no
        backward is running (DDP reducing from its own final callback), now."""
        try:
            Variable._execution_engine.queue_callback(callback)
        except RuntimeError:
            callback()

    def _start_reduction(self) -> None:
        """At the step's first bucket: micro-step count and which estimator runs."""
        if self._micro_handles:
            self._micro_steps = max(max(self._micro_calls), 1)
        else:  # not measuring micro-steps: trust the declared accumulation
            self._micro_steps = self._config.accum_steps if self._config is not None else 1
        count = self._world_size * self._micro_steps
        measured_micro = bool(self._micro_handles) or self._micro_steps == 1
        if count > 1 and self._measuring and measured_micro:
            self._mode = _DIRECT
        elif count == 1 and not self._micro_handles and (self._measuring or self._storing):
            self._mode = _DIFFERENCED
        else:
            self._mode = ""  # decided: nothing to measure this step

    def _reduce(self, buffer: torch.Tensor, bucket: Any) -> torch.futures.Future:
        divisor = self._micro_steps if self._average_micro_steps else 1
        if self._inner_hook is not None:
            if divisor != 1:
                buffer.div_(divisor)
            return self._inner_hook(self._inner_state, bucket)
        divisor *= self._world_size
        if divisor != 1:
            buffer.div_(divisor)
        if self._world_size == 1:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(buffer)
            return future
        work = dist.all_reduce(buffer, group=self._process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _end_of_backward(self) -> None:
        """After the synchronising backward: norms of the reduced gradient."""
        try:
            with torch.no_grad():
                self._collect()
        except Exception:
            self._fail("end-of-backward measurement")
        finally:
            self._reduced = []
            self._local_parts = []

    def _collect(self) -> None:
        config = self._config
        big = torch.zeros(self._num_groups, dtype=torch.float32, device=self._device)
        differenced = self._mode == _DIFFERENCED
        pair = differenced and self._measuring and self._prev_meta == self._pair_key(self._step_index - 1)
        prev_sq = torch.zeros_like(big) if pair else None
        cross = torch.zeros_like(big) if pair else None
        for future, layout, index in self._reduced:
            reduced = future.wait()
            reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            part, source = self._group_sq(reduced, layout)
            big += part.to(self._device)
            if differenced:
                self._difference_bucket(index, layout, reduced, source, prev_sq, cross)
        if self._mode == _DIRECT:
            if not self._average_micro_steps:
                big /= self._micro_steps ** 2
            if self._micro_handles:
                local = torch.zeros_like(big).index_add_(0, self._group_index, self._micro_sq)
            elif self._local_parts:
                local = torch.stack(self._local_parts).sum(0).to(self._device)
            else:
                return
            work = None
            if self._world_size > 1:
                work = dist.all_reduce(local, group=self._process_group, async_op=True)
            self._pending = _StepRecord(_DIRECT, config, self._world_size * self._micro_steps, big,
                                        local=local, work=work, scale=self._step_scale)
            return
        if pair:
            self._pending = _StepRecord(_DIFFERENCED, config, 2, big, scale=self._step_scale,
                                        prev=prev_sq, prev_scale=self._prev_scale, cross=cross)
        if self._storing:
            self._prev_scale = self._step_scale
            self._prev_meta = self._pair_key(self._step_index)
        else:
            self._prev_meta = None

    def _pair_key(self, step: int) -> Any:
        layouts = tuple(sorted(id(layout) for _, layout, _ in self._reduced))
        return (step, self._config, layouts)

    def _difference_bucket(self, index: int, layout: _BucketLayout, reduced: torch.Tensor, source: torch.Tensor,
                           prev_sq: Optional[torch.Tensor], cross: Optional[torch.Tensor]) -> None:
        """Differenced estimator for one bucket.

        The previous step's gradient is kept raw and preconditioned here
        with the *current* preconditioner, so both gradients of a pair are
        measured in the same geometry even across a refresh.
        """
        prev = self._prev_buffers.get(index)
        if cross is not None and prev is not None and layout.runs:
            saved = prev[:layout.numel]
            if self._precondition_active():
                views, roots = layout.preconditioned_views(saved, self._preconditioner.roots,
                                                           self._preconditioner.version)
                if views:
                    torch._foreach_mul_(views, roots)
            norms = [torch.linalg.vector_norm(saved[a:b]) for a, b in layout.runs]
            dots = [torch.dot(source[a:b].float(), saved[a:b]) for a, b in layout.runs]
            prev_sq.index_add_(0, layout.run_groups, torch.stack(norms).square().to(prev_sq.device))
            cross.index_add_(0, layout.run_groups, torch.stack(dots).to(cross.device))
        if self._storing:
            if prev is None or prev.numel() < layout.numel or prev.device != reduced.device:
                prev = self._prev_buffers[index] = torch.empty(layout.numel, dtype=torch.float32,
                                                               device=reduced.device)
            prev[:layout.numel].copy_(reduced.reshape(-1)[:layout.numel])

    # ------------------------------------------------------------ norms
    def _layout(self, bucket: Any) -> _BucketLayout:
        buffer = bucket.buffer()
        key = (bucket.index(), buffer.data_ptr(), buffer.numel())
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 4096:  # buckets were rebuilt many times; start over
                self._layouts.clear()
            layout = self._layouts[key] = _BucketLayout(bucket, self._index_of, self._group_of, buffer.device)
        return layout

    def _workspace(self, device: torch.device, numel: int) -> torch.Tensor:
        work = self._workspaces.get(device)
        if work is None or work.numel() < numel:
            work = self._workspaces[device] = torch.empty(numel, dtype=torch.float32, device=device)
        return work

    def _group_sq(self, flat: torch.Tensor, layout: _BucketLayout) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-group squared norms of a flat bucket (preconditioned if active)."""
        source = flat
        if self._precondition_active():
            source = self._workspace(flat.device, layout.numel)[:layout.numel]
            source.copy_(flat.reshape(-1)[:layout.numel])
            views, roots = layout.preconditioned_views(source, self._preconditioner.roots,
                                                       self._preconditioner.version)
            if views:
                torch._foreach_mul_(views, roots)
        out = torch.zeros(self._num_groups, dtype=torch.float32, device=flat.device)
        if layout.runs:
            norms = [torch.linalg.vector_norm(source[a:b], dtype=torch.float32) for a, b in layout.runs]
            out.index_add_(0, layout.run_groups, torch.stack(norms).square())
        return out, source

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
        if self._ema_estimator not in (None, record.estimator):
            logger.info("gradient noise estimator changed from %s to %s; discounting earlier estimates",
                        self._ema_estimator, record.estimator)
            self._ema.discount(_SWITCH_DISCOUNT)
        self._ema_estimator = record.estimator
        self._ema.update(sqr, var, self._smoothing ** (samples / config.init_batch_size))
        self._updates += 1

    def _fail(self, where: str) -> None:
        logger.exception("gradient noise measurement failed in the %s; measurement is disabled", where)
        self._measuring = self._storing = False
        self.enabled = False
