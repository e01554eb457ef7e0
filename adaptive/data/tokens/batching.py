"""Token-budget batches for AdaptiveDataLoader: the ``max_tokens=`` batching strategy.

``AdaptiveDataLoader(dataset, max_tokens=4096, lengths=...)`` bounds every
replica's micro-batch by a budget of *padded* tokens (longest sample x
samples, what memory depends on) instead of a sample count.  The planning
itself is :class:`adaptive.data.tokens.planner.TokenBudgetPlanner`: every
replica builds the same planner over the epoch's global permutation (G2)
and takes its own share of each step (``step.local(rank)``), so all
replicas take the same number of steps and micro-steps, and per-step work
is balanced by tokens.  This module connects it to the loader:

* the planner's position (:class:`~adaptive.data.tokens.plan_state.TokenPlanState`,
  independent of the replica count) is checkpointed in the loader's state
  after every step, so a resume on any number of replicas continues the
  same micro-batch stream and trains each sample once per epoch;
* the step's shape (budget per micro-batch, micro-steps) comes from a
  :class:`~adaptive.data.steps.StepSizer`: ``max_tokens`` and
  ``accumulation_steps`` as given, or a global token batch (``batch_size``
  or a ramp-up schedule in tokens) that is split into micro-steps of at
  most ``max_tokens`` each, or the goodput model's choice (autoscale, batch
  measured in tokens);
* over-long samples raise :class:`~adaptive.data.tokens.lengths.OversizeSampleError`
  or are reported and skipped (``on_oversize``).

The step's gradient weighting (:mod:`adaptive.data.weighting`) and
learning-rate factor (:mod:`adaptive.batchsize.step_lr_rules`) are derived
by the loader from the :class:`~adaptive.data.steps.PlannedStep` records
produced here (see :mod:`adaptive.data.dataloader`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import numpy as np

from adaptive.data.sampler import ElasticSampler
from adaptive.data.steps import Batching, PlannedStep, StepShape, StepSizer
from adaptive.data.tokens.lengths import SampleLengths
from adaptive.data.tokens.micro_batches import TokenStep
from adaptive.data.tokens.plan_state import DEFAULT_WINDOW_SIZE, TokenPlanState
from adaptive.batchsize.rampup import ConstantSchedule
from adaptive.data.tokens.planner import TokenBudgetPlanner

__all__ = ["TokenBatching", "check_lengths"]

logger = logging.getLogger(__name__)


def check_lengths(lengths: Any, num_samples: int) -> SampleLengths:
    """Validate ``lengths=`` against the dataset: a table of ``num_samples`` ints >= 1, or a function."""
    if lengths is None:
        raise ValueError("max_tokens= needs lengths=: the token count of every sample, as a list/array "
                         "indexed by sample index or a function index -> length")
    table = SampleLengths(lengths)
    if table.num_samples is not None and table.num_samples != num_samples:
        raise ValueError(f"lengths has {table.num_samples} entries but the dataset has {num_samples} samples; "
                         "give one token count per sample")
    return table


class TokenBatching(Batching):
    """Steps of token-budget micro-batches planned by :class:`TokenBudgetPlanner`.

    Args:
        sampler: the loader's elastic sampler (its permutation is the epoch's stream).
        lengths: token count per sample.
        max_tokens: the largest padded-token budget of one micro-batch.
        window_size: stream positions sorted together for length grouping.
        seed: seeds the shuffle of micro-batches within windows.
        on_oversize: ``"error"`` or ``"skip"`` for samples longer than the budget.
        name: the loader's name, for messages.
    """

    unit = "tokens"

    def __init__(self, sampler: ElasticSampler, lengths: SampleLengths, max_tokens: int, *,
                 window_size: int = DEFAULT_WINDOW_SIZE, seed: int = 0, on_oversize: str = "error",
                 name: str = "0") -> None:
        self.sampler = sampler
        self.lengths = lengths
        # Built once to validate the arguments the same way the planner does.
        probe = TokenBudgetPlanner(lengths, max_tokens, window_size=window_size, seed=seed, on_oversize=on_oversize)
        self.max_tokens: int = probe.max_tokens  # never None here, unlike Batching's
        self.window_size, self.seed, self.on_oversize = probe.window_size, probe.seed, probe.on_oversize
        self.name = name
        self.skipped = 0  # over-long samples skipped by this process's plans

    def longest_sample(self) -> int | None:
        """The longest sample that fits the budget, if the lengths are a table (else None)."""
        if self.lengths.num_samples is None:
            return None
        table = self.lengths.lookup(np.arange(self.lengths.num_samples, dtype=np.int64))
        fitting = table[table <= self.max_tokens]
        return int(fitting.max()) if fitting.size else None

    def default_batch_size(self, accumulation_steps: int, replicas: int) -> int:
        return self.max_tokens * accumulation_steps * replicas  # the planned step of the first launch

    def make_sizer(self, batch_size: int, schedule: Any, accumulation_steps: int, global_size: bool) -> StepSizer:
        floor = self.longest_sample() or self.max_tokens
        if global_size:
            schedule = ConstantSchedule(batch_size, "tokens")
        native = StepShape(self.max_tokens, accumulation_steps)
        return StepSizer("tokens", schedule, lambda replicas: native, max_micro=self.max_tokens,
                         min_micro=lambda replicas: floor)

    def autoscale_bounds(self, max_batch_size: int, bounds: tuple[int, int] | None) -> tuple[int, int]:
        """Bounds in tokens per micro-batch: at most ``max_tokens`` (the memory limit), at least the longest sample."""
        longest = self.longest_sample()
        if bounds is None:  # lengths given as a function: the longest sample is unknown, keep the budget
            return (longest or self.max_tokens, self.max_tokens)
        lo, hi = tuple(bounds)
        if isinstance(hi, int) and hi > self.max_tokens:
            raise ValueError(f"local_bsz_bounds[1]={hi} exceeds max_tokens={self.max_tokens}: with token "
                             "budgets the bounds are tokens per micro-batch and max_tokens is the memory limit")
        if isinstance(lo, int) and longest is not None and lo < longest and self.on_oversize == "error":
            raise ValueError(f"local_bsz_bounds[0]={lo} is below the longest sample ({longest} tokens): a smaller "
                             "budget would make it oversize; raise the lower bound or use on_oversize='skip'")
        return lo, hi

    def _planner(self, shape: StepShape, replicas: int) -> TokenBudgetPlanner:
        return TokenBudgetPlanner(self.lengths, shape.micro, replicas, shape.accum, window_size=self.window_size,
                                  seed=self.seed, on_oversize=self.on_oversize)

    def _start_state(self, state: Any) -> TokenPlanState:
        if state.plan is None:
            return TokenPlanState(epoch=self.sampler.epoch, window_size=self.window_size, seed=self.seed)
        return TokenPlanState.from_state_dict(state.plan)

    def plan(self, state: Any, sizer: StepSizer, replicas: int, rank: int) -> Iterator[PlannedStep]:
        return self._steps(self._start_state(state), state.consumed, sizer, replicas, rank)

    def _steps(self, start: TokenPlanState, consumed: int, sizer: StepSizer, replicas: int,
               rank: int) -> Iterator[PlannedStep]:
        shape = sizer.shape(consumed, replicas)
        planner = self._planner(shape, replicas)
        for step in planner.plan_epoch(self.sampler.permutation, state=start):
            yield self._planned(step, shape, sizer, replicas, rank)
            consumed += step.num_tokens
            shape = sizer.shape(consumed, replicas)
            planner.max_tokens, planner.accumulation_steps = shape.micro, shape.accum  # from the next step on

    def _planned(self, step: TokenStep, shape: StepShape, sizer: StepSizer, replicas: int,
                 rank: int) -> PlannedStep:
        local = step.local(rank)
        if step.skipped.size:
            self.skipped += int(step.skipped.size)
        return PlannedStep(
            indices=tuple(mb.indices.tolist() for mb in local),
            padding=tuple(mb.is_padding for mb in local),
            unit="tokens",
            size=step.num_tokens,
            planned_size=sizer.planned_size(shape, replicas, step.num_micro_steps),
            num_samples=step.num_samples,
            num_tokens=step.num_tokens,
            padded_tokens=step.padded_tokens,
            shape=shape,
            position=step.state,
        )

    def commit(self, state: Any, step: PlannedStep) -> None:
        plan: TokenPlanState = step.position
        state.plan = plan.state_dict()
        state.index = plan.samples_done + plan.skipped_done
        state.consumed += step.size

    def reset(self, state: Any) -> None:
        state.index = 0
        state.plan = None

    def resuming(self, state: Any) -> bool:
        return state.plan is not None

    def remaining_micro_steps(self, state: Any, sizer: StepSizer, replicas: int) -> int:
        """Micro-steps of a whole epoch at the current shape (plans the epoch: O(dataset size))."""
        shape = sizer.shape(state.consumed, replicas)
        planner = self._planner(shape, replicas)
        start = TokenPlanState(epoch=self.sampler.epoch, window_size=self.window_size, seed=self.seed)
        return sum(step.num_micro_steps for step in planner.plan_epoch(self.sampler.permutation, state=start))

