"""The cursor over an epoch's micro-batch stream, which makes a saved plan position resumable.

Internal to the token planner (:mod:`adaptive.data.tokens.planner`, whose
docstring describes the plan and its exact resume). A
:class:`MicroBatchCursor` starts at a
:class:`~adaptive.data.tokens.plan_state.TokenPlanState`, rebuilds the
packing that state recorded (re-packing the rest of the window when the
budget changed), hands out micro-batches in stream order, packing each window
only when it is reached, and says where it stands for the next state
(:meth:`MicroBatchCursor.position`). The planner turns what it takes into
steps; a budget change between steps is a new cursor from the position of
the old one.

It is given the planner's settings, not the planner, so that it reads
nothing private of it and the two modules do not import each other. The
lines it logs are the planner's, under the planner's logger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeAlias

import numpy as np

from adaptive.data.tokens._packing import WindowPlan, pack_window, shuffle_key
from adaptive.data.tokens.lengths import SampleLengths
from adaptive.data.tokens.micro_batches import MicroBatch
from adaptive.data.tokens.plan_state import TokenPlanState
from adaptive.data.tokens.streams import Source

__all__ = ["MicroBatchCursor", "SkipReport"]

logger = logging.getLogger("adaptive.data.tokens.planner")  # the planner's own lines, under its logger

#: Called with ``(epoch, window, plan, max_tokens)`` when a fresh packing left over-long samples out.
SkipReport: TypeAlias = Callable[[int, int, WindowPlan, int], None]


class MicroBatchCursor:
    """Walks the epoch's micro-batch stream window by window, packing each lazily.

    Args:
        source: the epoch's index stream.
        state: where to start; its ``window_size`` and ``seed`` are the
            planner's (the planner checked them).
        lengths: the samples' token counts.
        max_tokens: the budget of the packings this cursor makes.
        oversize_error: whether an over-long sample raises
            (:class:`~adaptive.data.tokens.lengths.OversizeSampleError`)
            instead of being skipped.
        report_skips: told of each fresh packing that skipped samples, as it is made.

    ``pending_skips`` collects over-long samples reported by packings done
    since the last call to :meth:`pop_skips`.
    """

    def __init__(
        self,
        source: Source,
        state: TokenPlanState,
        lengths: SampleLengths,
        max_tokens: int,
        oversize_error: bool,
        report_skips: SkipReport,
    ) -> None:
        self._source = source
        self._lengths = lengths
        self._window_size = state.window_size
        self._seed = state.seed
        self._oversize_error = oversize_error
        self._report_skips = report_skips
        self.epoch = state.epoch
        self.window = state.window
        self.max_tokens = max_tokens
        self.excluded = np.asarray(state.excluded, dtype=np.int64)
        self.plan: WindowPlan | None = None
        self.next_batch = 0
        self.num_batches = 0  # of self.plan
        self.pending_skips: list[WindowPlan] = []
        if state.packed_max_tokens:
            self._resume(state)

    # -- packing

    def _window_indices(self, window: int) -> np.ndarray:
        size = self._window_size
        return self._source.read(window * size, (window + 1) * size)

    def _pack(
        self, window_indices: np.ndarray, max_tokens: int, oversize_error: bool
    ) -> WindowPlan:
        key = shuffle_key(self._seed, self.epoch, self.window)
        return pack_window(
            window_indices, self.excluded, self._lengths, max_tokens, key, oversize_error
        )

    def _resume(self, state: TokenPlanState) -> None:
        """Rebuild the packing recorded in ``state``; re-pack the rest if the budget changed."""
        window_indices = self._window_indices(self.window)
        if state.excluded and state.excluded[-1] >= window_indices.size:
            raise ValueError(
                f"token plan state excludes offset {state.excluded[-1]} of window {self.window}, "
                f"which has only {window_indices.size} samples: is it from another dataset?"
            )
        old = self._pack(window_indices, state.packed_max_tokens, oversize_error=False)
        if state.batches_done > old.num_batches:
            raise ValueError(
                f"token plan state says {state.batches_done} micro-batches of window "
                f"{self.window} were consumed, but its packing has only {old.num_batches}: "
                "the lengths or the index stream differ from the checkpointed run"
            )
        if state.packed_max_tokens == self.max_tokens:
            self.plan, self.next_batch, self.num_batches = old, state.batches_done, old.num_batches
            return
        consumed = old.offsets[: int(old.bounds[state.batches_done])]
        self.excluded = np.union1d(self.excluded, np.concatenate([consumed, old.skipped_offsets]))
        logger.info(
            "token budget changed from %d to %d: re-planning the rest of window %d "
            "(%d of %d samples already consumed or skipped)",
            state.packed_max_tokens, self.max_tokens, self.window,
            self.excluded.size, window_indices.size,
        )  # fmt: skip
        self._pack_fresh(window_indices)

    def _pack_fresh(self, window_indices: np.ndarray) -> None:
        """Pack the current window with the current budget and report its over-long samples."""
        self.plan = self._pack(window_indices, self.max_tokens, self._oversize_error)
        self.next_batch, self.num_batches = 0, self.plan.num_batches
        if self.plan.skipped_indices.size:
            self.pending_skips.append(self.plan)
            self._report_skips(self.epoch, self.window, self.plan, self.max_tokens)

    # -- walking

    def has_next(self) -> bool:
        """Whether a micro-batch is left; packs (and reports) windows ahead as needed."""
        while self.next_batch >= self.num_batches:
            if self.plan is not None:
                self.window += 1
                self.plan, self.next_batch, self.num_batches = None, 0, 0
                self.excluded = np.empty(0, dtype=np.int64)
            window_indices = self._window_indices(self.window)
            if window_indices.size == 0:
                return False
            self._pack_fresh(window_indices)
        return True

    def take(self) -> MicroBatch:
        """The next micro-batch of the stream; call :meth:`has_next` first."""
        batch = self.next_batch
        self.next_batch = batch + 1
        return self.plan.micro_batch(batch)  # type: ignore[union-attr]  # has_next() set the plan

    def pop_skips(self) -> list[WindowPlan]:
        """Packings with over-long samples reported since the last call."""
        if not self.pending_skips:
            return self.pending_skips
        skips, self.pending_skips = self.pending_skips, []
        return skips

    def position(self) -> tuple[int, int, int, tuple[int, ...]]:
        """``(window, batches_done, packed_max_tokens, excluded)`` for :class:`TokenPlanState`."""
        if self.next_batch >= self.num_batches:
            return self.window + (self.plan is not None), 0, 0, ()
        excluded = tuple(self.excluded.tolist()) if self.excluded.size else ()
        return self.window, self.next_batch, self.max_tokens, excluded
