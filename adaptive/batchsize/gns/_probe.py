"""Autograd hooks that measure a DDP model's gradients for the noise scale.

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
  noise scale is biased upwards by a term of order ``lr^2``.

Each replica's small-gradient sums are averaged over replicas (one
all-reduce of a few floats per measured step, asynchronous), so every
replica holds the same estimates.

How it runs, and what it costs
------------------------------
DDP's reduction is left alone (its fused C++ all-reduce, or any
communication hook the user registers):

* a forward hook on the DDP model marks where each backward starts, which
  counts the micro-steps and tells the synchronising one;
* with several replicas or micro-steps, a tensor hook per parameter reads
  the norm of each backward's gradient contribution as autograd hands it
  over (before it is added to ``.grad`` and before DDP reduces it);
* at the end of the synchronising backward (after DDP has written the
  reduced gradient back), ``.grad`` is divided by the number of micro-steps
  (so it is the mean over all micro-batches of all replicas) and its
  per-group norms are read: one multi-tensor norm;
* with preconditioning (:mod:`._gns_precondition`): additionally one fused
  multiply per parameter into a reusable float32 workspace (the largest
  parameter);
* the differenced estimator: one persistent float32 copy of the previous
  step's gradient (preconditioned in place when used, so both partners
  share the current preconditioner), and a norm and a dot product per
  parameter;
* results stay on the device (a :class:`StepRecord`); a handful of floats
  is copied to the host once per measured step, when the estimator folds
  the record in (at the first read-out or the start of the next step).  No
  per-parameter synchronisation and no full-size temporaries beyond the
  reusable workspace.

A measured step therefore reads the gradient about twice more; steps that
are not measured cost one Python call per backward.  Which steps are
measured is :mod:`._schedule`'s: every ``measure_interval``-th, or with
``"auto"`` as often as keeps that work within a small share of the training
time (the replicas agree on it through the measured step's all-reduce).
The end-of-backward work runs from torch's autograd-engine callback queue,
after DDP's own finalisation.

:class:`BackwardProbe` is written for DDP; its subclass
:class:`adaptive.batchsize.gns._sharded.ShardedProbe` measures an FSDP2
model and overrides only where the gradients are read (which tensors carry
the micro-step hooks, local shards instead of whole gradients, and one
all-reduce of big and small sums together).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Mapping, TypedDict

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle
from torch.nn.parallel import DistributedDataParallel

from adaptive._utils import torch_internals
from adaptive.runtime import step as step_records
from adaptive.batchsize.gns._norms import GroupNorms
from adaptive.batchsize.gns._precondition import Preconditioner
from adaptive.batchsize.gns._record import StepRecord
from adaptive.batchsize.gns._schedule import MeasureInterval, MeasureSchedule
from adaptive.goodput.noise_estimate import DIFFERENCED, DIRECT, BatchConfig

__all__ = ["BackwardProbe", "ProbeOptions", "StepRecord"]

logger = logging.getLogger(__name__)


class ProbeOptions(TypedDict):
    """The keyword arguments that :meth:`GradientNoiseScale.attach` gives either probe."""

    average_micro_steps: bool
    precondition: bool
    precondition_interval: int
    measure_interval: MeasureInterval
    grad_scaler: Callable[[], torch.amp.GradScaler | None]
    on_step_start: Callable[[], None]
    on_failure: Callable[[], None]


def _output_tensors(output: object) -> list[torch.Tensor]:
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


class BackwardProbe:
    """The hooks on one DDP model, and the device-side measurement of each step.

    Created by :meth:`GradientNoiseScale.attach`, which hands it the batch
    configuration (:meth:`set_config`), switches it on and off
    (:meth:`set_enabled`) and takes its :class:`StepRecord` of each measured
    step (:meth:`take_record`).

    Args:
        optimizer: the model's optimizer (groups give the statistics' groups).
        model: the model whose backward passes are watched (a DDP model here).
        process_group, world_size: the group the model reduces over, and its size
            (the number of data-parallel replicas).
        average_micro_steps: divide the accumulated gradient by the number
            of micro-steps.
        is_last_micro_step: whether the coming backward ends the step.
        precondition, precondition_interval: measure in Adam's geometry,
            refreshed every this many optimizer steps.
        measure_interval: measure every this many optimizer steps, or
            ``"auto"`` (:mod:`adaptive.batchsize.gns._schedule`).
        grad_scaler: returns the AMP ``GradScaler`` in use (or None).
        on_step_start: called as an optimizer step's first backward begins
            (the estimator folds the previous record in).
        on_failure: called after a measurement raised (it is logged; the
            estimator switches measurement off).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                 process_group: dist.ProcessGroup | None, world_size: int, average_micro_steps: bool,
                 is_last_micro_step: Callable[[], bool], precondition: bool, precondition_interval: int,
                 measure_interval: MeasureInterval, grad_scaler: Callable[[], torch.amp.GradScaler | None],
                 on_step_start: Callable[[], None],
                 on_failure: Callable[[], None]) -> None:
        self._optimizer = optimizer
        self._num_groups = len(optimizer.param_groups)
        self._process_group, self.world_size = process_group, world_size
        self._average_micro_steps = average_micro_steps
        self._is_last_micro_step = is_last_micro_step
        self._schedule = MeasureSchedule(measure_interval)
        self._grad_scaler = grad_scaler
        self._on_step_start, self._on_failure = on_step_start, on_failure
        self._enabled = True
        self._config: BatchConfig | None = None
        self._params: list[torch.Tensor] = []  # tracked: trainable, in the model and in the optimizer
        self._group_of: list[int] = []
        self._trained: list[torch.Tensor] = []  # every trainable parameter of the model (gradients averaged)
        self._preconditioner: Preconditioner | None = None
        self._micro_handles: list[RemovableHandle] = []
        #: (step, configuration, measured parameters) of the step whose gradients are stored, for differencing.
        self._prev_meta: tuple[int, BatchConfig, tuple[int, ...]] | None = None
        self._prev_scale: torch.Tensor | None = None
        self._pending: StepRecord | None = None
        self._in_backward = False
        self._steps = 0
        self._reset_step()
        in_model, self._trained = self._model_params(model)
        for index, group in enumerate(self._optimizer.param_groups):
            for param in group["params"]:
                if id(param) in in_model:
                    self._params.append(param)
                    self._group_of.append(index)
        if not self._params:
            raise ValueError("the optimizer holds none of the model's trainable parameters")
        if precondition:
            self._preconditioner = Preconditioner(self._optimizer, self._params, self._group_of,
                                                  precondition_interval, local=self._local)
        self._norms = GroupNorms(self._params, self._group_of, self._num_groups, self._preconditioner,
                                 grad_of=self._grad)
        self._micro_sq = torch.zeros(len(self._params), dtype=torch.float32, device=self._norms.device)
        model.register_forward_hook(self._on_forward)

    # ------------------------------------------------------------ model specifics (overridden)
    def _model_params(self, model: torch.nn.Module) -> tuple[set[int], list[torch.Tensor]]:
        """Ids of the measurable parameters, and every trainable parameter (its gradient is averaged)."""
        ddp_model: DistributedDataParallel = model  # type: ignore[assignment]
        ignored = set(getattr(ddp_model, "parameters_to_ignore", ()) or ())
        in_model = {id(p) for name, p in ddp_model.module.named_parameters()
                    if p.requires_grad and name not in ignored}
        return in_model, [p for p in ddp_model.module.parameters() if p.requires_grad]

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the norms read of a parameter or its optimizer state (DDP: the tensor itself)."""
        return tensor

    def _grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """What the norms read of a parameter's gradient (DDP: ``.grad``)."""
        return param.grad

    def _micro_sq_norm(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """One backward's contribution to the small squared norm of parameter ``index``."""
        norms = self._norms
        return norms.sq_norm(grad, norms.root(index))

    def _register_micro_hooks(self) -> list[RemovableHandle]:
        return [p.register_hook(functools.partial(self._micro_hook, i)) for i, p in enumerate(self._params)]

    def _micro_hooks_complete(self) -> bool:
        """Whether the micro-step hooks will see every gradient of the coming backward."""
        return bool(self._micro_handles)

    def _reduce_direct(self, big: torch.Tensor, local: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
        """Start combining the replicas' sums: ``(big, local, work)``, read after ``work.wait()``."""
        work = None
        if self.world_size > 1:
            work = dist.all_reduce(local, group=self._process_group, async_op=True)
        return big, local, work

    # ------------------------------------------------------------ control
    def follow_group(self, process_group: dist.ProcessGroup | None, world_size: int) -> None:
        """Reduce over ``process_group`` (``world_size`` replicas) from the next step on.

        Which steps are measured (and when the preconditioner is refreshed)
        counts from here again, as in a joiner's new probe: every member of
        the new group must measure the same steps, since a measured step
        all-reduces.
        """
        self._process_group, self.world_size = process_group, world_size
        self._steps = 0
        self._schedule.restart()
        if self._preconditioner is not None:
            self._preconditioner.restart()
        self.set_config(None)

    def set_config(self, config: BatchConfig | None) -> None:
        """The batch configuration of the coming steps (a step in progress is not measured)."""
        self._config = config
        self._prev_meta = None
        if self._step_open:
            logger.debug("batch configuration changed within a step; that step is not measured")
            self._measuring = self._storing = False
        self._update_micro_hooks()

    def set_enabled(self, enabled: bool) -> None:
        """Measure or not; while off the micro-steps of a step are still averaged."""
        self._enabled = enabled
        self._update_micro_hooks()

    @property
    def measure_interval(self) -> int:
        """Optimizer steps from one measurement to the next, as now in force."""
        return self._schedule.interval

    def agree_interval(self, record: StepRecord, votes: float) -> None:
        """``record`` was read: its replicas' votes (summed) set when the next measurement is due."""
        self._schedule.agree(record.step, votes, record.voters)

    def take_record(self) -> StepRecord | None:
        """The last measured step not yet taken (None if none)."""
        record, self._pending = self._pending, None
        return record

    def forget_partner(self) -> None:
        """The next step is not differenced against the last one."""
        self._prev_meta = None

    def _fail(self, where: str) -> None:
        logger.exception("gradient noise measurement failed in the %s; measurement is disabled", where)
        self._measuring = self._storing = False
        self._on_failure()

    # ------------------------------------------------------------ step life
    def _reset_step(self) -> None:
        self._step_open = False
        self._measuring = False
        self._storing = False
        self._hooked = False  # the micro-step hooks saw this step from its start
        self._micro_steps = 0
        self._span = 1  # optimizer steps the step's measurement stands for
        self._step_scale: torch.Tensor | None = None

    def _begin_step(self) -> None:
        """First backward of an optimizer step (in the autograd thread)."""
        self._on_step_start()  # fold the previous step's measurement in first
        self._reset_step()
        self._step_open = True
        self._step_index = step = self._steps
        schedule = self._schedule
        schedule.step_began(step)
        ready = self._enabled and self._config is not None
        self._measuring = ready and schedule.measures(step)
        if self._measuring:
            self._span = schedule.measuring(step)  # the next measurement is due from here
        self._storing = ready and schedule.stores(step)
        if (self._measuring or self._storing) and self._preconditioner is not None:
            with schedule.timed():  # (refreshed on the steps that read gradients only)
                self._preconditioner.maybe_refresh(step)
            if self._preconditioner.state == "waiting":
                self._measuring = self._storing = False
        if self._measuring or self._storing:
            self._step_scale = self._loss_scale()
        self._hooked = self._micro_hooks_complete()
        if self._hooked and self._measuring:
            if self._micro_sq.device != self._norms.device:  # built on the meta device, materialised since
                self._micro_sq = torch.zeros(len(self._params), dtype=torch.float32, device=self._norms.device)
            self._micro_sq.zero_()

    def _loss_scale(self) -> torch.Tensor | None:
        scaler = self._grad_scaler()
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        scale = torch_internals.grad_scaler_scale(scaler)
        if scale is not None:
            return scale.detach().reshape(()).to(torch.float32).clone()
        return torch.tensor(float(scaler.get_scale()), dtype=torch.float32)

    # ------------------------------------------------------------ hooks
    def _on_forward(self, module: torch.nn.Module, inputs: tuple[object, ...], output: object) -> None:
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
        torch_internals.queue_autograd_callback(functools.partial(self._after_backward, sync))

    def _after_backward(self, sync: bool) -> None:
        """End of a backward, before DDP's finalisation (queued ahead of it)."""
        self._in_backward = False
        if sync:  # runs after DDP has written the reduced gradients back
            torch_internals.queue_autograd_callback(self._end_of_step)

    def _wants_micro_hooks(self) -> bool:
        """Whether steps have several small gradients (replicas or micro-steps) to read."""
        return (self._enabled and self._config is not None
                and self._config.accum_steps * self.world_size > 1)

    def _update_micro_hooks(self) -> None:
        wanted = self._wants_micro_hooks()
        if wanted and not self._micro_handles:
            self._micro_handles = self._register_micro_hooks()
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
            with self._schedule.timed(), torch.no_grad():
                self._micro_sq[index].add_(self._micro_sq_norm(index, grad).to(self._norms.device))
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
                if self._step_open and (self._measuring or self._storing) and not step_records.faulted():
                    with self._schedule.timed():
                        self._collect(steps)  # (a step that lost a peer is discarded: nothing to measure)
                    if self._measuring:
                        self._schedule.step_measured()
        except Exception:
            self._fail("end-of-backward measurement")
        finally:
            if self._step_open:
                self._steps += 1
            self._reset_step()

    def _divide_grads(self, divisor: int) -> None:
        dense = []
        for param in self._trained:
            grad = self._grad(param)
            if grad is None:
                continue
            if grad.is_sparse:
                grad.div_(divisor)
            else:
                dense.append(grad)
        if dense:
            torch_internals.foreach_div_(dense, divisor)

    def _vote(self, device: torch.device) -> torch.Tensor:
        """This replica's vote for the next measurement interval, as a one-element tensor on ``device``
        (filled there: no copy from the host, which would wait for the device's queue)."""
        return torch.full((1,), float(self._schedule.proposal()), dtype=torch.float32, device=device)

    def _collect(self, micro_steps: int) -> None:
        config, world = self._config, self.world_size
        assert config is not None, "a step is measured or stored only under a batch configuration"
        count = world * micro_steps
        present = [i for i, p in enumerate(self._params)
                   if (grad := self._grad(p)) is not None and not grad.is_sparse]
        if count > 1:
            if not (self._measuring and self._hooked):
                self._prev_meta = None
                return
            big = self._norms.group_sq(present)
            if not self._average_micro_steps:
                big /= micro_steps ** 2
            local = torch.zeros_like(big).index_add_(0, self._norms.group_index, self._micro_sq)
            local = torch.cat([local, self._vote(local.device)])  # the vote travels with the sums
            big, local, work = self._reduce_direct(big, local)
            self._pending = StepRecord(DIRECT, config, count, big, local=local[:-1], work=work,
                                        scale=self._step_scale, step=self._step_index, span=self._span,
                                        votes=local[-1:], voters=self.world_size)
            self._prev_meta = None
            return
        key = (self._step_index, config, tuple(present))
        if self._measuring and self._prev_meta == (self._step_index - 1,) + key[1:]:
            big, prev_sq, cross = self._norms.differenced(present)
            self._pending = StepRecord(DIFFERENCED, config, 2, big, scale=self._step_scale,
                                        prev=prev_sq, prev_scale=self._prev_scale, cross=cross,
                                        step=self._step_index, span=self._span, votes=self._vote(big.device))
        if self._storing:
            self._norms.store(present)
            self._prev_scale, self._prev_meta = self._step_scale, key
        else:
            self._prev_meta = None
