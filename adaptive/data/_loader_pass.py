"""The running half of :class:`~adaptive.AdaptiveDataLoader`: one pass of a loader loop.

``AdaptiveDataLoader`` holds the settings and the checkpointed position;
the methods here run a pass over them, as torch's ``DataLoader`` leaves
its passes to ``_BaseDataLoaderIter``.  A pass enters its loop (or resumes
it at the checkpointed sample; a pass abandoned before any step was trained,
such as ``next(iter(loader))``, consumed nothing and leaves the loop to the
next pass), plans steps from the committed position,
yields each step's micro-batches, agrees with the other replicas at step
boundaries (stops and checkpoints, :mod:`adaptive.elastic.sync_points`),
configures loss weights, the LR factor and the models' noise-scale
measurement for each step, and commits a step once all its micro-batches
were trained.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterator

import torch

from adaptive.batchsize.step_lr import resolve_lr_scaling
from adaptive.batchsize.step_lr_rules import step_lr_factor
from adaptive.data._loop import Lookahead, Plan
from adaptive.data._workers import signals_blocked
from adaptive.data.steps import PlannedStep
from adaptive.data.weighting import loss_weight
from adaptive._utils.mix import mix64
from adaptive.elastic import env, epoch, random_state, sync_points
from adaptive.elastic.job import current_job

__all__ = ["LoaderPasses", "rank0_info"]

logger = logging.getLogger("adaptive.data.dataloader")  # the loader's own lines, under the loader's logger


def _mix(values: tuple[int, ...]) -> int:
    """A seed from integers (SplitMix64 over each in turn): the same on every platform and run."""
    key = 0
    for value in values:
        key = mix64(key ^ (value & ((1 << 64) - 1)))
    return key & ((1 << 63) - 1)


def rank0_info() -> int:
    """INFO on rank 0, DEBUG elsewhere: one line per event, not one per replica."""
    return logging.INFO if env.rank() == 0 else logging.DEBUG


class LoaderPasses:
    """Runs passes of a loader loop; mixed into :class:`~adaptive.AdaptiveDataLoader`, whose fields it uses."""

    def _enter_loop(self, key: int | None, loop: int) -> None:
        state = self._state
        for old in [k for k in state.finished if k is not None and key is not None and k < key]:
            del state.finished[old]
        if (state.epoch, state.loop) == (key, loop) and self._batching.resuming(state):
            logger.log(rank0_info(), "loader %s: resuming loop %d of epoch %s at sample %d of %d",
                       self.name, loop, key, state.index, self.sampler.num_samples)
        else:
            state.epoch, state.loop = key, loop
            self._batching.reset(state)
        self.sampler.set_epoch(0 if key is None else key)

    def _warn_if_out_of_scope(self, key: int | None) -> None:
        scope = self._state.scope
        if scope is not None and key != scope and not self._scope_warned:
            self._scope_warned = True
            logger.warning("loader %s was created inside epoch %d and is iterated in epoch %s: objects created "
                           "inside an epoch are checkpointed only until that epoch ends, so its position is not "
                           "saved now; create it before the epoch loop", self.name, scope, key)

    def _steps(self, key: int | None) -> Iterator[Any]:
        plan: Plan | None = None
        trained, optimizer_steps = 0, current_job().training.optimizer_steps
        random_state.restore_at("loop")  # the first pass after a restart resumes the random generators too
        self._timing.reset()
        sync_points.restart_spacing()  # this loop's steps may be much longer or shorter than the last loop's
        try:
            while not epoch.training_finished():  # finish_training() in the loop body ends the loop
                first = plan is None
                if first:  # a stop that arrived between loops is acted on before the first step
                    sync_points.settle(self._checkpoint_metadata)
                else:
                    sync_points.step_boundary(self._checkpoint_metadata)
                self._after_boundary(first=first)
                plan_key = self._controller.current() if self._controller is not None else None
                if plan is None or plan.key != plan_key:
                    if plan is not None:  # a new batch size: new step times
                        sync_points.restart_spacing()
                    plan = self._start_plan(plan_key)
                step = next(plan.steps, None)
                if step is None:
                    break
                if not first and not plan.steps.has_next():
                    # A stop known now is taken before the loop's last step, so that a replay runs
                    # that step (and the loop body that binds its variables) again.
                    sync_points.settle(self._checkpoint_metadata)
                self._begin_step(step)
                count = step.num_micro_steps
                for micro in range(count):
                    self._micro = (micro, count)
                    yield self._timing.fetch(plan.batches, last=micro == count - 1)
                self._commit(step)
                trained += 1
        except GeneratorExit:
            # ``break`` (or the loop abandoned): the loop counts as done.  No
            # collective here: the pending agreement settles at the next boundary.
            step, micro = self._step_now, self._micro
            if epoch.training_finished() and step is not None and micro is not None and micro[0] == micro[1] - 1:
                self._commit(step)  # finish_training() then break after the step's last micro-batch: it was taken
                trained += 1
            else:
                self._end_step(None)
            if not trained and current_job().training.optimizer_steps == optimizer_steps:
                # Abandoned before it trained a step (``next(iter(loader))`` to learn a batch's shape): it
                # consumed nothing, and the next pass is this loop again, after a restart as well.
                self._loops[key] -= 1
                raise
            self._mark_finished(key)
            epoch.save_pending_finish()  # all replicas called finish_training(): this collective is safe
            raise
        self._mark_finished(key)
        if epoch.training_finished():  # finish_training() in the loop body: checkpointed, nothing left to agree on
            epoch.save_pending_finish()
        else:
            sync_points.final_boundary(self._checkpoint_metadata)

    def _commit(self, step: PlannedStep) -> None:
        """The step's micro-batches were all trained: advance the position past it."""
        self._batching.commit(self._state, step)
        self._state.step += 1
        current_job().training.steps_committed += 1
        self._end_step(step)

    def _start_plan(self, key: Any) -> Plan:
        """(Re)start planning from the committed position; the fetching side follows the same plan."""
        steps = self._batching.plan(self._state, self._sizer, env.num_replicas(), env.rank())
        position = (self.sampler.seed, -1 if self._state.epoch is None else self._state.epoch, self._state.loop,
                    self._state.index, env.rank())
        self._worker_seeds.manual_seed(_mix(position))
        outer, inner = itertools.tee(steps)
        self._batches.source = (indices for step in inner for indices in step.indices)
        with signals_blocked(self._workers):  # workers start here (each loop, unless persistent)
            batches = iter(self._inner)
        return Plan(key, Lookahead(outer), batches)

    def _begin_step(self, step: PlannedStep) -> None:
        """Loss weights, LR factor and gradient-statistics configuration of the step about to run."""
        replicas, count = env.num_replicas(), step.num_micro_steps
        model = current_job().training.model
        total = step.num_tokens if self._average_by == "tokens" else step.num_samples
        divisor = model.gradient_divisor(count) if model is not None else replicas
        self._weights = [loss_weight(step, m, total or 0, divisor) for m in range(count)]
        rule = resolve_lr_scaling(self._lr_scaling, model.scaling_rule if model is not None else None)
        self._lr_factor = step_lr_factor(max(step.size, 1), step.planned_size, rule)
        self._step_now = step
        local = step.shape.micro if self._sizer.per_replica else max(1, step.shape.micro // replicas)
        self._last_step = (local, count)
        if torch.is_grad_enabled():  # not for evaluation loops under no_grad
            for trained in list(current_job().training.models):  # every model the step trains (DCGAN: netD and netG)
                trained.gns.set_batch_config(init_batch_size=self._init_batch_size, local_bsz=local,
                                             accum_steps=count, num_replicas=replicas,
                                             batch_size=step.planned_size)  # 128 on 3 replicas, not 3 x 42

    def _end_step(self, step: PlannedStep | None) -> None:
        if step is not None:
            self._report.interval.add(step)
        self._micro = None
        self._step_now = None

    def _after_boundary(self, first: bool) -> None:
        """Per-step bookkeeping at a boundary: timing, batch-size decisions, metrics."""
        model = current_job().training.model
        step_time, compute_time, data_time = self._timing.step_done()
        if self._controller is not None and step_time is not None and self._last_step is not None:
            self._controller.observe(*self._last_step, step_time, compute_time, data_time)
        if self._controller is not None and model is not None:
            force = first and self._controller.replicas_changed()
            if force or (not first and self._state.step % self._controller.config.adapt_every == 0):
                before = self._controller.current()
                grad_params = model.gns.to_grad_params()
                decision = self._controller.decide(grad_params, force=force)
                self._controller.report_hints(grad_params, model.scaling_rule.progress, self._completed_fraction())
                if decision is not None:
                    self._report.decision(decision, *before)
        if not first and torch.is_grad_enabled():  # not for evaluation loops under no_grad
            self._report.step_taken(model, self._state.index, self._init_batch_size)

    def _completed_fraction(self) -> float | None:
        """The job's declared training done, for the hints: finished epochs plus this loop's position.

        The position is the share of the epoch's samples this loop has
        taken (``state.index`` counts samples with a token budget too), over
        the sampler's epoch length; None without a declared epoch count.
        """
        total = self.sampler.num_samples
        return epoch.completed_fraction(min(1.0, self._state.index / total) if total > 0 else 0.0)

    def _mark_finished(self, key: int | None) -> None:
        self._state.finished[key] = self._state.loop
        self._batching.reset(self._state)

    def _checkpoint_metadata(self) -> dict:
        return {"epoch": epoch.current_epoch(), "step": self._state.step, "loader": self.name,
                "index": self._state.index, "batch_size": self.batch_size, "consumed": self._state.consumed,
                "unit": self.unit}
