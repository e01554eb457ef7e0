"""One pass of an ``AdaptiveDataLoader`` loop: plan steps, yield their micro-batches, commit them.

As torch's ``DataLoader`` leaves its passes to ``_BaseDataLoaderIter``, an
:class:`~adaptive.data.dataloader.AdaptiveDataLoader` holds the settings and
the position, and each ``for batch in loader`` runs a :class:`LoaderPass`:
it enters or resumes the loop at the committed position, plans steps for
the current replica count and batch size, publishes each micro-step to the
models and optimizers (:class:`~adaptive.runtime.step.StepContext`) and
commits each step's samples once its micro-batches were trained.  What
happens *between* two steps (agreements, membership changes, recovery from
a lost member) is the elastic runtime's, asked through
:class:`~adaptive.elastic.boundaries.LoopBoundaries`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch

from adaptive._utils.mix import mix64
from adaptive.elastic import epoch, random_state, sync_points
from adaptive.elastic.boundaries import LoopBoundaries
from adaptive.parallel._training import trained_models
from adaptive.runtime import env, membership, peer_failure
from adaptive.runtime.errors import CollectiveError
from adaptive.runtime.job import current_job
from adaptive.runtime.step import StepContext, begin_step, stream
from adaptive.data._loop import Lookahead, Plan
from adaptive.data._workers import signals_blocked
from adaptive.data.steps import PlannedStep
from adaptive.data.weighting import loss_weight

if TYPE_CHECKING:
    import collections

    from adaptive.batchsize.autoscale import BatchSizeController
    from adaptive.data._loader_report import LoaderReport
    from adaptive.data._loader_state import LoaderState
    from adaptive.data._loop import LocalBatches, StepTiming
    from adaptive.data.sampler import ElasticSampler
    from adaptive.data.steps import Batching, StepSizer

__all__ = ["LoaderPass", "rank0_info", "running_loop", "running_loader"]

logger = logging.getLogger(__name__)


def rank0_info() -> int:
    """INFO on rank 0, DEBUG elsewhere: one line per event, not one per replica."""
    return logging.INFO if env.rank() == 0 else logging.DEBUG


def _mix(values: tuple[int, ...]) -> int:
    """A seed from integers (SplitMix64 over each in turn): the same on every platform and run."""
    key = 0
    for value in values:
        key = mix64(key ^ (value & ((1 << 64) - 1)))
    return key & ((1 << 63) - 1)


class PassedLoader(Protocol):
    """What a pass reads and moves of its loader (an :class:`~adaptive.data.dataloader.AdaptiveDataLoader`):
    its settings, its position and the parts that plan and fetch its steps."""

    name: str
    sampler: ElasticSampler
    _state: LoaderState
    _batching: Batching
    _sizer: StepSizer
    _controller: BatchSizeController | None
    _inner: torch.utils.data.DataLoader[Any]
    _batches: LocalBatches
    _worker_seeds: torch.Generator
    _workers: bool
    _timing: StepTiming
    _report: LoaderReport
    _init_batch_size: int
    _lr_scaling: str
    _average_by: str
    _loops: collections.Counter[int | None]

    @property
    def batch_size(self) -> int: ...

    @property
    def unit(self) -> str: ...


@dataclasses.dataclass
class _RunningLoop:
    """The loader whose loop is running: its record on the job context (:mod:`adaptive.runtime.job`)."""

    loader: PassedLoader | None = None


@contextlib.contextmanager
def running_loop(loader: PassedLoader) -> Iterator[None]:
    """Mark ``loader``'s loop as the job's running loop; loops of two loaders may not overlap."""
    running, steps = current_job().part(_RunningLoop), stream()
    if running.loader is not None:
        raise RuntimeError(
            f"overlapping AdaptiveDataLoader iterations: {loader!r} started while {running.loader!r} "
            "is still iterating; finish (or break out of) one loop before starting another"
        )
    running.loader, steps.loop = loader, loader.name
    try:
        yield
    finally:
        running.loader, steps.loop, steps.current = None, None, None


def running_loader() -> PassedLoader | None:
    """The loader whose loop is running now, or None between loops."""
    return current_job().part(_RunningLoop).loader


class LoaderPass:
    """One pass of ``loader``'s loop ``loop`` in epoch ``key`` (see the module docstring)."""

    def __init__(self, loader: PassedLoader, key: int | None, loop: int) -> None:
        self.loader, self.key, self.loop = loader, key, loop
        self.plan: Plan | None = None
        self.step_now: PlannedStep | None = None  # the step being trained
        self.context: StepContext | None = None  # the micro-step published for the models and optimizers
        self._weights: list[float] = []  # the step's micro-batches' loss weights
        self._last_step: tuple[int, int] | None = None  # (micro size, micro-steps) of the last step taken
        self._optimizer_steps_before = 0  # the optimizer steps taken before the step being trained began

    # ------------------------------------------------------------------ the loop

    def run(self) -> Iterator[object]:
        """Yield the loop's micro-batches from the committed position; ``break`` counts as finishing it.

        The plan, and with it the DataLoader iterator of a pass without
        persistent workers, is let go when the pass ends, here in this
        process: left to the garbage collector, a copy of it could be
        collected in a DataLoader worker forked later, which cannot shut
        down workers that are not its own.
        """
        try:
            yield from self._run()
        finally:
            self.plan = None

    def _run(self) -> Iterator[object]:
        loader = self.loader
        if loader._state.finished.get(self.key, 0) >= self.loop:
            logger.log(rank0_info(), "loader %s: loop %d of epoch %s already finished before the restart; "
                       "skipping it", loader.name, self.loop, self.key)
            return
        self._enter()
        trained, optimizer_steps = 0, stream().optimizer_steps
        random_state.restore_at("loop")  # the first pass after a restart resumes the random generators too
        loader._timing.reset()
        sync_points.restart_spacing()  # this loop's steps may be much longer or shorter than the last loop's
        boundaries = LoopBoundaries(self.checkpoint_metadata, self.where)
        try:
            while not epoch.training_finished():  # finish_training() in the loop body ends the loop
                step = boundaries.cross(self._after_boundary, self._next_step)
                if step is None:
                    break
                assert self.plan is not None
                self._begin_step(step)
                count = step.num_micro_steps
                for micro in range(count):
                    self._publish(step, micro)
                    yield loader._timing.fetch(self.plan.batches, last=micro == count - 1)
                if boundaries.step_lost():  # live mode: discarded, not committed; the boundary goes back
                    self._end_step(None)
                    continue
                self._commit(step)
                boundaries.step_committed()
                trained += 1
        except GeneratorExit:
            # ``break`` (or the loop abandoned): the loop counts as done.  No
            # collective here: the pending agreement settles at the next boundary.
            step, context = self.step_now, self.context
            if step is not None and context is not None and not context.is_accumulation_step and (
                    epoch.training_finished() or stream().optimizer_steps > self._optimizer_steps_before):
                # finish_training(), or the optimizer stepped, then break after the step's last micro-batch: the
                # step was taken (a --max-steps break), so its samples and its step count
                self._commit(step)
                trained += 1
            else:
                self._end_step(None)
            if not trained and stream().optimizer_steps == optimizer_steps:
                # Abandoned before it trained a step (``next(iter(loader))`` to learn a batch's shape): it
                # consumed nothing, and the next pass is this loop again, after a restart as well.
                loader._loops[self.key] -= 1
                raise
            self._mark_finished()
            epoch.save_pending_finish()  # all replicas called finish_training(): this collective is safe
            raise
        self._mark_finished()
        if epoch.training_finished():  # finish_training() in the loop body: checkpointed, nothing left to agree on
            epoch.save_pending_finish()

    def _enter(self) -> None:
        """Resume the loop at the committed position, or start it at the epoch's beginning."""
        loader, state = self.loader, self.loader._state
        for old in [k for k in state.finished if k is not None and self.key is not None and k < self.key]:
            del state.finished[old]
        if (state.epoch, state.loop) == (self.key, self.loop) and loader._batching.resuming(state):
            logger.log(rank0_info(), "loader %s: resuming loop %d of epoch %s at sample %d of %d",
                       loader.name, self.loop, self.key, state.index, loader.sampler.num_samples)
        else:
            state.epoch, state.loop = self.key, self.loop
            loader._batching.reset(state)
        loader.sampler.set_epoch(0 if self.key is None else self.key)

    def where(self) -> tuple[object, ...]:
        """The loop in progress (live mode: a snapshot is good for its own loop only)."""
        return (epoch.current_epoch(), self.loader.name, self.loader._state.loop)

    def checkpoint_metadata(self) -> dict[str, object]:
        """The loop's position, for a checkpoint's manifest."""
        loader, state = self.loader, self.loader._state
        return {"epoch": epoch.current_epoch(), "step": state.step, "loader": loader.name, "index": state.index,
                "batch_size": loader.batch_size, "consumed": state.consumed, "unit": loader.unit}

    # ------------------------------------------------------------------ planning

    def _next_step(self) -> tuple[PlannedStep, bool] | None:
        """The next planned step and whether it is the loop's last (re-planned when the batch size or the
        membership changed); None when the plan is done."""
        controller = self.loader._controller
        plan_key = (controller.current() if controller is not None else None, membership.generation_number())
        if self.plan is None or self.plan.key != plan_key:
            if self.plan is not None:  # a new batch size: new step times
                sync_points.restart_spacing()
            self.plan = self._start_plan(plan_key)
        step = next(self.plan.steps, None)
        return None if step is None else (step, not self.plan.steps.has_next())

    def _start_plan(self, key: object) -> Plan:
        """(Re)start planning from the committed position; the fetching side follows the same plan."""
        loader, state = self.loader, self.loader._state
        steps = loader._batching.plan(state, loader._sizer, env.num_replicas(), env.rank())
        position = (loader.sampler.seed, -1 if state.epoch is None else state.epoch, state.loop, state.index,
                    env.rank())
        loader._worker_seeds.manual_seed(_mix(position))
        outer, inner = itertools.tee(steps)
        loader._batches.source = (indices for step in inner for indices in step.indices)
        with signals_blocked(loader._workers):  # workers start here (each loop, unless persistent)
            batches = iter(loader._inner)
        return Plan(key, Lookahead(outer), batches)

    # ------------------------------------------------------------------ one step

    def _begin_step(self, step: PlannedStep) -> None:
        """The loss weights of the step about to run; its micro-steps are published one by one."""
        loader = self.loader
        replicas, count = env.num_replicas(), step.num_micro_steps
        model = trained_models().latest
        total = step.num_tokens if loader._average_by == "tokens" else step.num_samples
        divisor = model.gradient_divisor(count) if model is not None else replicas
        self._weights = [loss_weight(step, m, total or 0, divisor) for m in range(count)]
        self.step_now = step
        self._optimizer_steps_before = stream().optimizer_steps
        begin_step()
        local = step.shape.micro if loader._sizer.per_replica else max(1, step.shape.micro // replicas)
        self._last_step = (local, count)

    def _publish(self, step: PlannedStep, micro: int) -> None:
        """Tell the models and optimizers what the micro-step about to be trained is (one way: they read it)."""
        loader = self.loader
        self.context = stream().current = StepContext(
            loader=loader.name, index=loader._state.step, micro_step=micro, num_micro_steps=step.num_micro_steps,
            size=step.size, planned_size=step.planned_size, init_batch_size=loader._init_batch_size,
            local_batch_size=self._last_step[0] if self._last_step is not None else step.shape.micro,
            num_replicas=env.num_replicas(), loss_weight=self._weights[micro], padding=bool(step.padding[micro]),
            lr_scaling=loader._lr_scaling)

    def _commit(self, step: PlannedStep) -> None:
        """The step's micro-batches were all trained: advance the position past it."""
        self.loader._batching.commit(self.loader._state, step)
        self.loader._state.step += 1
        stream().steps_committed += 1
        self._end_step(step)

    def _end_step(self, step: PlannedStep | None) -> None:
        if step is not None:
            self.loader._report.interval.add(step)
        self.context = stream().current = None
        self.step_now = None

    def _mark_finished(self) -> None:
        state = self.loader._state
        state.finished[self.key] = state.loop
        self.loader._batching.reset(state)

    # ------------------------------------------------------------------ between steps

    def _after_boundary(self, first: bool) -> None:
        """Per-step bookkeeping at a boundary: timing, batch-size decisions, metrics."""
        loader, controller = self.loader, self.loader._controller
        model = trained_models().latest
        step_time, compute_time, data_time = loader._timing.step_done()
        if controller is not None and step_time is not None and self._last_step is not None:
            controller.observe(*self._last_step, step_time, compute_time, data_time)
        if controller is not None and model is not None:
            force = first and controller.replicas_changed()
            if force or (not first and loader._state.step % controller.config.adapt_every == 0):
                before = controller.current()
                grad_params = model.gns.to_grad_params()
                try:
                    decision = controller.decide(grad_params, force=force)
                except CollectiveError as error:  # live mode: recorded on the step; the members re-form
                    if not peer_failure.absorb_in_live_mode(error):
                        raise
                    return
                controller.report_hints(grad_params, model.scaling_rule.progress, self._completed_fraction())
                if decision is not None:
                    loader._report.decision(decision, *before)
        if not first and torch.is_grad_enabled():  # not for evaluation loops under no_grad
            loader._report.step_taken(model, loader._state.index, loader._init_batch_size)

    def _completed_fraction(self) -> float | None:
        """The job's declared training done, for the hints: finished epochs plus this loop's position.

        The position is the share of the epoch's samples this loop has
        taken (``state.index`` counts samples with a token budget too), over
        the sampler's epoch length; None without a declared epoch count.
        """
        total = self.loader.sampler.num_samples
        return epoch.completed_fraction(min(1.0, self.loader._state.index / total) if total > 0 else 0.0)
