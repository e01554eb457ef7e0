"""Gradient noise scale, measured during ordinary data-parallel training.

What is estimated
-----------------
Let per-sample gradients have mean ``G`` and covariance ``Sigma``.  The
gradient of a minibatch of ``b`` samples satisfies
``E|g_b|^2 = |G|^2 + tr(Sigma) / b``.  :class:`GradientNoiseScale` keeps
moving averages of ``sqr = |G|^2`` and ``var = tr(Sigma) / init_batch_size``
per optimizer parameter group (the arithmetic, and why each measurement
is weighted, is in :mod:`adaptive.goodput.noise_estimate`), and derives

* ``noise_scale() = tr(Sigma) / |G|^2`` (the simple noise scale, in samples);
* ``gain(scale) = (var + sqr) / (var / scale + sqr)``: how many reference
  steps (batch ``init_batch_size``) one step with ``scale`` times that batch
  is worth (AdaScale's gain ratio).

The small and big gradients of each measurement come from the replicas, the
accumulation micro-steps or, with one replica and no accumulation, two
consecutive steps; they are read by autograd hooks without touching DDP's
reduction (see :mod:`adaptive.batchsize.gns._probe` for how, and what it
costs).  For Adam-type optimizers gradients are measured in the geometry
the optimizer steps in (see :mod:`adaptive.batchsize.gns._precondition`).

Under FSDP2 sharding
--------------------
:meth:`GradientNoiseScale.attach` also takes the root module of a
``fully_shard``-ed model (FSDP, or HSDP on a 2-D mesh).  The small gradients
are then each rank's micro-step gradients, read by tensor hooks on FSDP's
unsharded parameters (the reduce-scatter input); the big one is the reduced
gradient, summed over the ranks' local shards.  Big and small sums share
one asynchronous all-reduce of a few floats per measured step; no unsharded
gradient is kept or copied.  With Adam the sharded preconditioner weighs
each rank's own rows only (an unbiased estimate with more variance).  See
:mod:`adaptive.batchsize.gns._sharded`.

Integration
-----------
::

    gns = GradientNoiseScale(optimizer, grad_scaler=scaler)
    gns.attach(ddp_model)                       # before the first forward
    gns.set_batch_config(init_batch_size=256, local_bsz=64, accum_steps=2)
    ... ordinary training; under accumulation the forward *and* backward of
    every micro-step but the last run in ddp_model.no_sync() (FSDP2: after
    model.set_requires_gradient_sync(False)) ...
    gns.gain(gns.scale), gns.noise_scale(), gns.to_grad_params()

``set_batch_config`` must describe the steps that follow.  Inside the
adaptive wrappers nobody calls it by hand: each wrapper configures its
estimator at every forward from the step the loader published
(:class:`adaptive.runtime.step.StepContext`).  Losses must be
means over the micro-batch (the usual reduction).  Extra backward passes
through the model outside training steps (e.g. ``torch.autograd.grad`` for
a gradient penalty) would be counted as micro-steps.

Checkpoints: :meth:`GradientNoiseScale.state_dict` is format version 2
(version 1, of releases before the measurements were weighted, still
loads: its averages count as one measurement).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from adaptive.runtime import peer_failure
from adaptive._utils.checks import check_float, check_int
from adaptive._utils.types import StateDict
from adaptive.batchsize.gns._probe import BackwardProbe, ProbeOptions
from adaptive.batchsize.gns._schedule import MeasureInterval, check_measure_interval
from adaptive.checkpoint.versions import StateFormatError, check_fields, read_state
from adaptive.goodput.model import GradParams
from adaptive.goodput.noise_estimate import BatchConfig, NoiseAverages

__all__ = ["GradientNoiseScale"]

logger = logging.getLogger(__name__)

_STATE_FIELDS = ("sqr", "var", "weight", "estimator", "magnitude", "updates", "skipped", "init_batch_size")


def _weigh_unweighted(fields: StateDict) -> StateDict:
    """Version 1 -> 2: version 1 kept plain averages; weigh them as one measurement
    of their size (version 2 weighs each by 1 / |g|^2) and start the magnitude afresh."""
    fields = dict(fields, magnitude=[0.0, 0.0])
    weight = float(fields["weight"])
    if weight > 0:
        sqr, var = np.asarray(fields["sqr"], dtype=float), np.asarray(fields["var"], dtype=float)
        magnitude = float(np.sum(sqr + var)) / weight
        if magnitude > 0:
            factor = 1.0 / magnitude
            fields.update(sqr=(sqr * factor).tolist(), var=(var * factor).tolist(), weight=weight * factor)
    return fields


class GradientNoiseScale:
    """Gradient statistics of a DDP or FSDP2 model, measured as it trains.

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
            every step; larger values cut the cost proportionally), or
            ``"auto"``: as often as keeps the measurement within 1% of the
            training time, every 1 to 32 steps, agreed by the replicas
            (:mod:`adaptive.batchsize.gns._schedule`).
        grad_scaler: the AMP ``GradScaler`` scaling the loss, if any (its
            scale is divided out; overflowing steps are skipped).
    """

    #: Format of :meth:`state_dict`: 2 weighs each measurement (adds "magnitude").
    version = 2
    migrations = {1: _weigh_unweighted}

    def __init__(self, optimizer: torch.optim.Optimizer, *, smoothing: float = 0.999,
                 precondition: bool | None = None, precondition_interval: int = 10,
                 measure_interval: MeasureInterval = 1, grad_scaler: torch.amp.GradScaler | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        smoothing = check_float("smoothing", smoothing, 0.0, strict_minimum=True)
        if smoothing >= 1.0:
            raise ValueError(f"smoothing must be in (0, 1), got {smoothing!r}")
        self._optimizer = optimizer
        self._smoothing = smoothing
        self._precondition_interval = check_int("precondition_interval", precondition_interval, 1)
        self._measure_interval = check_measure_interval("measure_interval", measure_interval)
        if precondition is None:
            precondition = all("betas" in g and "eps" in g for g in optimizer.param_groups)
        self._wants_precondition = bool(precondition)
        #: The AMP ``GradScaler`` whose loss scale is divided out (or None).
        self.grad_scaler = grad_scaler
        self._enabled = True
        self._num_groups = len(optimizer.param_groups)
        self._averages = NoiseAverages(self._num_groups)
        self._config: BatchConfig | None = None
        self._lock = threading.RLock()
        self._probe: BackwardProbe | None = None

    # ------------------------------------------------------------ set-up
    @property
    def measure_interval(self) -> int:
        """Optimizer steps from one measurement to the next, as now in force (with ``"auto"``: as the
        replicas last agreed; 1 before the model is attached)."""
        return self._probe.measure_interval if self._probe is not None else 1

    @property
    def enabled(self) -> bool:
        """Whether steps are measured; while False the micro-steps of a step
        are still averaged."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        if self._probe is not None:
            self._probe.set_enabled(self._enabled)

    def attach(self, model: torch.nn.Module, *, process_group: dist.ProcessGroup | None = None,
               average_micro_steps: bool = True,
               is_last_micro_step: Callable[[], bool] | None = None) -> None:
        """Measure ``model``'s gradients; call once, before its first forward.

        Only autograd hooks are registered: DDP (or FSDP) reduces as it
        would without measurement, with any communication hook the user
        registers (it must average over replicas, as torch's hooks do).

        Args:
            model: the ``DistributedDataParallel`` model trained with this
                optimizer, or the root module on which
                ``torch.distributed.fsdp.fully_shard`` was called (FSDP on a
                1-D mesh, HSDP on a 2-D one; see
                :mod:`adaptive.batchsize.gns._sharded`), after
                ``fully_shard`` and before its first forward.
            process_group: the group the model reduces over (default: DDP's;
                for FSDP the mesh's ranks: the 1-D mesh's group, or the
                default group when a 2-D mesh spans it).
            average_micro_steps: divide the accumulated gradient by the
                number of micro-steps, so ``.grad`` is the mean over the
                whole global batch (DDP and FSDP average over replicas).
            is_last_micro_step: called after each forward; whether its
                backward ends the optimizer step.  Default: whether DDP
                synchronises it (``no_sync()`` marks the other micro-steps),
                or whether FSDP reduces it (``set_requires_gradient_sync``).
        """
        if self._probe is not None:
            raise RuntimeError("this GradientNoiseScale is already attached to a model")
        common = ProbeOptions(average_micro_steps=bool(average_micro_steps), precondition=self._wants_precondition,
                               precondition_interval=self._precondition_interval,
                               measure_interval=self._measure_interval, grad_scaler=lambda: self.grad_scaler,
                               on_step_start=self.flush, on_failure=self.detach)
        if isinstance(model, DistributedDataParallel):
            group = process_group if process_group is not None else getattr(model, "process_group", None)
            world_size = dist.get_world_size(group)
            self._check_replicas(world_size)
            if is_last_micro_step is None:
                is_last_micro_step = lambda: bool(model.require_backward_grad_sync)
            probe: BackwardProbe = BackwardProbe(self._optimizer, model, process_group=group,
                                                 world_size=world_size, is_last_micro_step=is_last_micro_step,
                                                 **common)
        else:
            from adaptive.batchsize.gns._sharded import ShardedProbe, fsdp_layout, is_fsdp_module
            if not is_fsdp_module(model):
                raise TypeError("model must be a DistributedDataParallel or a module on which fully_shard "
                                f"was called, got {type(model).__name__}")
            layout = fsdp_layout(model, process_group)
            self._check_replicas(layout.world_size)
            probe = ShardedProbe(self._optimizer, model, layout=layout, is_last_micro_step=is_last_micro_step,
                                 **common)
        probe.set_enabled(self._enabled)
        probe.set_config(self._config)
        self._probe = probe

    def reattach(self, model: torch.nn.Module, *, is_last_micro_step: Callable[[], bool] | None = None) -> None:
        """Measure ``model``, which replaced the attached one (a live membership change resharded it).

        As after :meth:`follow_group`, a step in progress is not measured and
        the next configured step is: the batch configuration is set anew for
        the new replica count.
        """
        average = self._probe._average_micro_steps if self._probe is not None else True
        self._probe, self._config = None, None
        self.attach(model, average_micro_steps=average, is_last_micro_step=is_last_micro_step)

    def follow_group(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        """The model now reduces over ``process_group`` of ``world_size`` replicas (a live membership change).

        A step in progress is not measured; the next configured step is.  The
        configuration is forgotten, as in :meth:`reattach`: the probe forgot
        it, and the next :meth:`set_batch_config` must reach the probe also
        when the replica count did not change (a join and a leave at one
        boundary), or this member would not measure the step a joiner measures.

        The last measured step not yet folded in is folded in first, on the
        schedule it was measured under: folded later, its agreed interval
        would set the restarted schedule's next measurement from a step
        counted before the change (step 57's, say), and this member would
        skip the steps a joiner, whose schedule starts at 0, measures, and
        all-reduce out of step with it (a model whose loader reads another
        wrapper's noise scale is not folded at the change's boundary).
        """
        if isinstance(self._probe, BackwardProbe):
            with self._lock:
                self._flush()
                self._probe.follow_group(process_group, world_size)
                self._config = None

    def _check_replicas(self, world_size: int) -> None:
        if self._config is not None and self._config.num_replicas != world_size:
            raise ValueError(f"batch config has num_replicas={self._config.num_replicas} but the process "
                             f"group has {world_size}")

    def detach(self) -> None:
        """Stop measuring for good; micro-steps are still averaged."""
        self.enabled = False

    def set_batch_config(self, *, init_batch_size: int, local_bsz: int, accum_steps: int = 1,
                         num_replicas: int | None = None, batch_size: int | None = None) -> None:
        """Tell the estimator the batch sizes of the coming steps.

        Call before the first step and whenever the loader changes the
        batch size, the number of accumulation steps or (after a restart)
        the replicas, between optimizer steps.  ``num_replicas`` defaults
        to the attached process group's size.  ``batch_size`` is the actual
        global batch of those steps when replicas hold unequal shares (128
        samples over 3 replicas): the scale and gain use it instead of
        ``local_bsz * accum_steps * num_replicas``.
        """
        world_size = self._probe.world_size if self._probe is not None else 1
        replicas = world_size if num_replicas is None else num_replicas
        config = BatchConfig(init_batch_size, local_bsz, accum_steps, replicas, batch_size)
        if self._probe is not None and replicas != world_size:
            raise ValueError(f"num_replicas={replicas} but the process group has {world_size} replicas")
        with self._lock:
            if config == self._config:
                return
            self._flush()
            old = self._config
            if old is not None and old.init_batch_size != config.init_batch_size:
                self._averages.rescale_var(old.init_batch_size / config.init_batch_size)
            self._config = config
            if self._probe is not None:
                self._probe.set_config(config)

    @property
    def config(self) -> BatchConfig | None:
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

    def _flush(self) -> None:
        """Fold the pending step in (caller holds the lock); a discarded one breaks
        the differenced estimator's chain of partners."""
        probe = self._probe
        record = probe.take_record() if probe is not None else None
        if probe is None or record is None:
            return
        try:
            measured, votes = record.read()
        except (RuntimeError, torch.distributed.DistError) as error:
            if not peer_failure.absorb_in_live_mode(error):
                raise
            probe.forget_partner()  # a peer was lost: the members re-form; this measurement is gone
            return
        probe.agree_interval(record, votes)
        if not self._averages.add(measured, self._smoothing, record.span):
            probe.forget_partner()

    def _totals(self, group: int | None) -> tuple[float, float] | None:
        if group is not None:
            check_int("group", group, 0, self._num_groups - 1)
        self.flush()
        return self._averages.totals(group)

    def sqr_avg(self, group: int | None = None) -> float:
        """Estimated ``|G|^2`` (all groups, or one), 0.0 before any estimate."""
        totals = self._totals(group)
        return 0.0 if totals is None else totals[0]

    def var_avg(self, group: int | None = None) -> float:
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

    def gain(self, scale: float | None = None, group: int | None = None) -> float:
        """Gain ratio ``(var + sqr) / (var / scale + sqr)`` at ``scale``
        (default: the current one); 1.0 before any estimate."""
        scale = self.scale if scale is None else check_float("scale", scale, 0.0, strict_minimum=True)
        totals = self._totals(group)
        if totals is None or totals[0] + totals[1] <= 0:
            return 1.0
        sqr, var = totals
        return (var + sqr) / (var / scale + sqr)

    def to_grad_params(self) -> GradParams | None:
        """The estimates as :class:`~adaptive.goodput.model.GradParams`, or None before any."""
        totals = self._totals(None)
        if totals is None or totals[0] + totals[1] <= 0:
            return None
        return GradParams(sqr=totals[0], var=totals[1])

    @property
    def num_updates(self) -> int:
        """Measured steps folded into the averages."""
        self.flush()
        return self._averages.updates

    @property
    def num_skipped(self) -> int:
        """Measured steps discarded for non-finite gradients (AMP overflow)."""
        self.flush()
        return self._averages.skipped

    def reset(self) -> None:
        """Forget all estimates."""
        with self._lock:
            self._drop_pending()
            self._averages.reset()

    def _drop_pending(self) -> None:
        if self._probe is not None:
            self._probe.take_record()
            self._probe.forget_partner()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> StateDict:
        """The estimates as plain floats, ints, lists and strings (format :attr:`version`)."""
        with self._lock:
            self._flush()
            return {"version": self.version, **self._averages.state_fields(),
                    "init_batch_size": self._config.init_batch_size if self._config else 0}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict` (same number of parameter groups; versions 1 and 2)."""
        fields = read_state("GradientNoiseScale", state, self)
        check_fields("GradientNoiseScale state", fields, _STATE_FIELDS)
        sqr, var = np.asarray(fields["sqr"], dtype=float), np.asarray(fields["var"], dtype=float)
        if sqr.shape != (self._num_groups,) or var.shape != (self._num_groups,):
            raise StateFormatError(f"GradientNoiseScale state has {sqr.size} parameter groups, "
                                   f"the optimizer has {self._num_groups}")
        with self._lock:
            self._drop_pending()
            self._averages.load_fields(fields)
            saved_init = int(fields["init_batch_size"])  # 0: saved before any batch configuration
            if saved_init and self._config is not None and saved_init != self._config.init_batch_size:
                self._averages.rescale_var(saved_init / self._config.init_batch_size)
