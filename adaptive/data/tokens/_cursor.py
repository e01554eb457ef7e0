"""The cursor that walks an epoch's micro-batch stream, packing one window at a time.

Internal to the token planner (:mod:`adaptive.data.tokens.planner`): a
:class:`MicroBatchCursor` starts at a :class:`~adaptive.data.tokens.plan_state.TokenPlanState`,
rebuilds the packing that state recorded (re-packing the rest of the window
if the budget changed), hands out micro-batches in stream order and says
where it stands for the next state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from adaptive.data.tokens._packing import WindowPlan, pack_window, shuffle_key
from adaptive.data.tokens.micro_batches import MicroBatch
from adaptive.data.tokens.plan_state import TokenPlanState
from adaptive.data.tokens.streams import Source

if TYPE_CHECKING:
    from adaptive.data.tokens.planner import TokenBudgetPlanner

__all__ = ["MicroBatchCursor"]

logger = logging.getLogger(__name__)


class MicroBatchCursor:
    """Walks the epoch's micro-batch stream window by window, packing each lazily.

    ``pending_skips`` collects over-long samples reported by packings done
    since the last call to :meth:`pop_skips`.
    """

    def __init__(
        self,
        planner: TokenBudgetPlanner,
        source: Source,
        state: TokenPlanState,
    ) -> None:
        self._planner = planner
        self._source = source
        self.epoch = state.epoch
        self.window = state.window
        self.max_tokens = planner.max_tokens
        self.excluded = np.asarray(state.excluded, dtype=np.int64)
        self.plan: WindowPlan | None = None
        self.next_batch = 0
        self.num_batches = 0  # of self.plan
        self.pending_skips: list[WindowPlan] = []
        if state.packed_max_tokens:
            self._resume(state)

    # -- packing

    def _window_indices(self, window: int) -> np.ndarray:
        size = self._planner.window_size
        return self._source.read(window * size, (window + 1) * size)

    def _pack(
        self, window_indices: np.ndarray, max_tokens: int, oversize_error: bool
    ) -> WindowPlan:
        key = shuffle_key(self._planner.seed, self.epoch, self.window)
        return pack_window(
            window_indices, self.excluded, self._planner.lengths, max_tokens, key, oversize_error
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
        self.plan = self._pack(
            window_indices, self.max_tokens, self._planner.on_oversize == "error"
        )
        self.next_batch, self.num_batches = 0, self.plan.num_batches
        if self.plan.skipped_indices.size:
            self.pending_skips.append(self.plan)
            self._planner._report_skips(self.epoch, self.window, self.plan, self.max_tokens)

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

