"""Token-budget batching: plan an epoch as steps of micro-batches bounded in padded tokens.

Why
---
With sequences of varied length, a fixed number of samples per batch makes
memory and the learning signal per step swing with the lengths. Bounding
each micro-batch by a *token budget* keeps both steady. Memory depends on
the padded tensor, so the budget counts **padded tokens**: the longest
sample of a micro-batch times the number of samples in it.

How an epoch is planned
-----------------------
1. The epoch's global index stream (G2 in docs/restarts.md: a seeded permutation
   that depends only on ``(seed, epoch)``) is cut into fixed *windows* of
   ``window_size`` consecutive stream positions.
2. Each window is sorted by length (longest first, ties in stream order) and
   cut greedily into micro-batches: each takes as many of the next samples
   as fit in ``max_tokens`` padded tokens. Grouping similar lengths is what
   removes most of the padding.
3. The micro-batches of a window are shuffled with a key derived only from
   ``(seed, epoch, window)`` (a SplitMix64 hash, stable across numpy
   versions and platforms).
4. The concatenation over windows is the epoch's *micro-batch stream*. It is
   a function of the index stream, the lengths, ``max_tokens``,
   ``window_size`` and ``seed``: it never depends on the replica count or on
   the accumulation steps.
5. A step takes the next ``num_replicas * accumulation_steps`` micro-batches
   of the stream and deals them to the replicas largest-first, each to the
   replica with the fewest padded tokens so far that still has a free
   micro-step, so every replica gets exactly ``accumulation_steps``
   micro-batches and per-step work is balanced by tokens.
6. The final step of an epoch takes the ``k < num_replicas *
   accumulation_steps`` micro-batches left. It uses ``ceil(k /
   num_replicas)`` micro-steps; micro-batches are split (any part of a
   micro-batch fits the budget) until every replica has that many non-empty
   ones. Only when fewer samples than slots remain, at most
   ``num_replicas - 1`` *padding* micro-batches repeat the shortest sample of
   the step; they are flagged ``is_padding`` and get zero gradient weight
   (:func:`adaptive.data.weighting.loss_weights`).

What depends on the replica count: only the grouping of the micro-batch
stream into steps (so the number of steps per epoch), the dealing of each
step to replicas, and the splitting and padding of the final step. Which
samples share a micro-batch and the order of the micro-batches do not.

Exact resume
------------
A :class:`~adaptive.data.tokens.plan_state.TokenPlanState` records the first window not yet finished, how
many micro-batches of its current packing were consumed, the budget that
packing used, and the window offsets excluded from that packing (consumed
or skipped before a budget change; usually empty, at most ``window_size``
entries). Resuming with the same ``max_tokens`` rebuilds the same packing
and continues with the same micro-batch stream, whatever the new replica
count or accumulation steps. Resuming with a different ``max_tokens`` (for
example chosen by the goodput model) marks what the old packing consumed or
skipped as excluded and re-packs the rest of that window with the new
budget. Either way every sample is trained or reported as skipped exactly
once per epoch, across any sequence of restarts and rescales. The same
re-planning happens when :attr:`TokenBudgetPlanner.max_tokens` is changed
while an epoch is being planned.

Gradient weighting
------------------
DDP averages gradients over replicas, and each replica accumulates over its
micro-steps, so averaging per replica would weight a replica with 3 short
samples like one with 300. :func:`adaptive.data.weighting.loss_weights`
gives the factor each micro-batch's *summed* loss is multiplied by so that
the step's gradient is the mean over all real tokens (or samples) of the
whole step: exactly the single-process gradient of the same samples.

Learning rate
-------------
A token-budget step holds a varying number of tokens (and samples). With
``average_by="tokens"`` the gradient is a mean, so its scale does not grow
with the step, but its noise shrinks as the step grows.
:func:`adaptive.batchsize.step_lr_rules.step_lr_factor` turns the step's
actual size (``step.num_tokens``) relative to a reference size (the size the
base LR was tuned for) into an LR multiplier: ``"linear"`` (SGD), ``"sqrt"``
(Adam) or ``"none"``. Apply it on top of the user's LR scheduler at every
optimizer step (multiply, then restore), so the two compose.

When to use a token budget
--------------------------
Use it when sample lengths vary a lot (text, speech, code): memory per
micro-batch stays under the budget whatever the lengths, length grouping
removes most padding (over 99% real tokens on the standard library's source
in ``benchmarks/bench_token_batching.py``, against 31% for filling batches in
shuffled order), and every step carries a similar number of tokens. With
near-constant lengths, plain sample batches are simpler and equivalent.

Modules
-------
This module is :class:`TokenBudgetPlanner`. The sample lengths and
:class:`~adaptive.data.tokens.lengths.OversizeSampleError` are in
:mod:`.lengths`, the accepted index streams in :mod:`.streams`, the records
it yields (:class:`~adaptive.data.tokens.micro_batches.MicroBatch`,
:class:`~adaptive.data.tokens.micro_batches.TokenStep`) in
:mod:`.micro_batches` and its saved position in :mod:`.plan_state`; the
packing and dealing (steps 2, 3, 5 and 6) are internal (``_packing``), and
the planner walks its stream with a cursor that resumes from a saved
position (internal, ``_cursor``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from adaptive._utils.checks import check_choice, check_int
from adaptive._utils.mix import MASK64
from adaptive.data.tokens._cursor import MicroBatchCursor
from adaptive.data.tokens._packing import WindowPlan, deal, fill_final_step
from adaptive.data.tokens.lengths import SampleLengths
from adaptive.data.tokens.micro_batches import MicroBatch, TokenStep
from adaptive.data.tokens.plan_state import DEFAULT_WINDOW_SIZE, TokenPlanState
from adaptive.data.tokens.streams import Source, StreamLike, make_source

logger = logging.getLogger(__name__)

__all__ = ["ON_OVERSIZE", "TokenBudgetPlanner"]

#: What to do with a sample longer than ``max_tokens``.
ON_OVERSIZE = ("error", "skip")
_NO_SAMPLES = np.empty(0, dtype=np.int64)
_NO_SAMPLES.flags.writeable = False


class TokenBudgetPlanner:
    """Plan epochs as steps of token-budget micro-batches (see the module docstring).

    Args:
        lengths: token count per sample: an integer table indexed by sample
            index, or a function ``index -> length``.
        max_tokens: budget of one replica's micro-batch in padded tokens
            (longest sample x number of samples).
        num_replicas: replicas (data-parallel ranks) that share each step.
        accumulation_steps: micro-steps per replica per step (gradient
            accumulation); a step has ``num_replicas * accumulation_steps``
            micro-batches, except the epoch's final step, which may have fewer
            micro-steps.
        window_size: stream positions sorted together. Larger windows give
            less padding; the sort costs O(window log window). Must stay the
            same across resumes of an epoch. It is a sample count, not derived
            from the replica count, so the windows are the same on any number
            of replicas.
        seed: seeds the shuffle of micro-batches within windows (combined with
            the epoch and the window index).
        on_oversize: ``"error"`` raises :class:`OversizeSampleError` for a
            sample longer than ``max_tokens``; ``"skip"`` logs a warning,
            counts it in :attr:`num_skipped`, lists it in the step's
            ``skipped`` and leaves it out of the epoch.

    ``max_tokens``, ``num_replicas`` and ``accumulation_steps`` may be
    assigned between steps, also while :meth:`plan_epoch` is being iterated:
    the change applies from the next step on and keeps the exact-once
    guarantee.
    """

    def __init__(
        self,
        lengths: SampleLengths | Callable[[int], int] | Sequence[int] | np.ndarray,
        max_tokens: int,
        num_replicas: int = 1,
        accumulation_steps: int = 1,
        *,
        window_size: int = DEFAULT_WINDOW_SIZE,
        seed: int = 0,
        on_oversize: str = "error",
    ) -> None:
        self._lengths = SampleLengths(lengths)
        self.max_tokens = max_tokens
        self.num_replicas = num_replicas
        self.accumulation_steps = accumulation_steps
        self._window_size = check_int("window_size", window_size, 1)
        self._seed = check_int("seed", seed, 0, MASK64)
        self._on_oversize = check_choice("on_oversize", on_oversize, ON_OVERSIZE)
        self._num_skipped = 0

    # -- configuration

    @property
    def lengths(self) -> SampleLengths:
        return self._lengths

    @property
    def max_tokens(self) -> int:
        """Padded-token budget of one micro-batch."""
        return self._max_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self._max_tokens = check_int("max_tokens", value, 1)

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = check_int("num_replicas", value, 1)

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        self._accumulation_steps = check_int("accumulation_steps", value, 1)

    @property
    def window_size(self) -> int:
        return self._window_size

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def on_oversize(self) -> str:
        return self._on_oversize

    @property
    def num_skipped(self) -> int:
        """Over-long samples this planner has reported and skipped (``on_oversize='skip'``)."""
        return self._num_skipped

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_tokens={self._max_tokens}, "
            f"num_replicas={self._num_replicas}, accumulation_steps={self._accumulation_steps}, "
            f"window_size={self._window_size}, seed={self._seed}, "
            f"on_oversize={self._on_oversize!r})"
        )

    # -- planning

    def initial_state(self, epoch: int = 0) -> TokenPlanState:
        """The state at the start of ``epoch``."""
        epoch = check_int("epoch", epoch, 0)
        return TokenPlanState(epoch=epoch, window_size=self._window_size, seed=self._seed)

    def plan_epoch(
        self,
        stream: StreamLike,
        epoch: int | None = None,
        state: TokenPlanState | Mapping[str, Any] | None = None,
    ) -> Iterator[TokenStep]:
        """Yield the steps of one epoch, starting at ``state`` (default: the epoch's start).

        ``stream`` is the epoch's global sample order: a 1-D integer array,
        an object with ``take(start, stop)`` and ``len()`` such as
        :class:`adaptive.data.sampler.GlobalPermutation`, or an iterable of index
        arrays (read forward only). It must be the same stream on every
        replica and in every resume of the epoch. ``state`` is a
        :class:`TokenPlanState` or its ``state_dict()``; ``epoch`` defaults
        to the state's epoch, or 0.
        """
        state = self._start_state(epoch, state)
        source = make_source(stream)
        if source.length is not None:
            if state.num_samples not in (-1, source.length):
                raise ValueError(
                    f"token plan state was saved for a stream of {state.num_samples} samples, "
                    f"but this stream has {source.length}"
                )
            state = state._replace(num_samples=source.length)
        return iter(()) if state.finished else self._steps(source, state)

    def _start_state(
        self, epoch: int | None, state: TokenPlanState | Mapping[str, Any] | None
    ) -> TokenPlanState:
        if state is None:
            return self.initial_state(0 if epoch is None else epoch)
        if not isinstance(state, TokenPlanState):
            state = TokenPlanState.from_state_dict(state)
        if epoch is not None and check_int("epoch", epoch, 0) != state.epoch:
            raise ValueError(f"epoch={epoch} does not match the state's epoch {state.epoch}")
        for name in ("window_size", "seed"):
            if getattr(state, name) != getattr(self, name):
                raise ValueError(
                    f"token plan state was saved with {name}={getattr(state, name)}, but this "
                    f"planner has {name}={getattr(self, name)}; it must not change within an epoch"
                )
        return state

    def _steps(
        self, source: Source, state: TokenPlanState
    ) -> Iterator[TokenStep]:
        cursor = self._cursor(source, state)
        while True:
            if cursor.max_tokens != self._max_tokens:
                window, batches_done, packed, excluded = cursor.position()
                state = state._replace(
                    window=window,
                    batches_done=batches_done,
                    packed_max_tokens=packed,
                    excluded=excluded,
                )
                cursor = self._cursor(source, state)
            step = self._next_step(cursor, state)
            if step is None:
                return
            state = step.state
            yield step
            if step.final:
                return

    def _cursor(self, source: Source, state: TokenPlanState) -> MicroBatchCursor:
        return MicroBatchCursor(
            source, state, self._lengths, self._max_tokens, self._on_oversize == "error", self._report_skips
        )

    def _next_step(self, cursor: MicroBatchCursor, state: TokenPlanState) -> TokenStep | None:
        """Take the next step's micro-batches from ``cursor`` and deal them to replicas."""
        replicas, wanted = self._num_replicas, self._num_replicas * self._accumulation_steps
        taken: list[MicroBatch] = []
        while len(taken) < wanted and cursor.has_next():
            taken.append(cursor.take())
        final = not cursor.has_next()
        skipped_plans = cursor.pop_skips()
        skipped = (
            np.concatenate([p.skipped_indices for p in skipped_plans])
            if skipped_plans
            else _NO_SAMPLES
        )
        if not taken:
            if skipped.size:
                logger.warning(
                    "epoch %d ends with %d skipped samples and no step to report them in",
                    state.epoch, skipped.size,
                )  # fmt: skip
            return None
        if len(taken) < wanted:
            taken = fill_final_step(taken, replicas)
        samples = tokens = padding = 0
        for mb in taken:
            if mb.is_padding:
                padding += 1
            else:
                samples += mb.indices.size
                tokens += mb.num_tokens
        new_state = TokenPlanState(  # positional: built once per step, and field order is fixed
            state.epoch,
            *cursor.position(),
            state.steps_done + 1,
            state.samples_done + samples,
            state.tokens_done + tokens,
            state.skipped_done + int(skipped.size),
            state.padding_done + padding,
            final,
            state.window_size,
            state.seed,
            state.num_samples,
        )
        return TokenStep(
            state.epoch, state.steps_done, deal(taken, replicas), skipped, final, new_state
        )

    def _report_skips(self, epoch: int, window: int, plan: WindowPlan, max_tokens: int) -> None:
        count = int(plan.skipped_indices.size)
        self._num_skipped += count
        logger.warning(
            "skipping %d samples longer than max_tokens=%d in epoch %d, window %d "
            "(first: sample %d with %d tokens); %d skipped so far",
            count, max_tokens, epoch, window, int(plan.skipped_indices[0]),
            int(plan.skipped_lengths[0]), self._num_skipped,
        )  # fmt: skip

