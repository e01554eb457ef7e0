"""Micro-batches and steps: what the token planner hands each replica.

A :class:`MicroBatch` is the samples one replica processes in one
forward/backward pass; a :class:`TokenStep` is one global optimizer step,
``micro_batches[replica][micro_step]``, with the plan position to checkpoint
after it (:class:`adaptive.data.tokens.plan_state.TokenPlanState`).  Both are
created once per micro-batch or step while planning, so they are slotted
records rather than frozen dataclasses.  Pure numpy (no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from adaptive._utils.checks import check_int

if TYPE_CHECKING:
    from adaptive.data.tokens.plan_state import TokenPlanState

__all__ = ["MicroBatch", "TokenStep"]


@dataclasses.dataclass(eq=False, slots=True)
class MicroBatch:
    """The samples one replica processes in one forward/backward pass.

    ``indices``/``lengths`` are int64 arrays, longest sample first. A padding
    micro-batch (only in an epoch's final step) repeats one sample so that a
    replica without fresh data still takes part in the step; its loss weight
    is zero. ``num_tokens`` is the sum of ``lengths``, ``max_length`` the
    longest one. Treat it as read-only (a slotted, non-frozen record: one is
    created per micro-batch, so construction cost matters).
    """

    indices: np.ndarray
    lengths: np.ndarray
    num_tokens: int
    max_length: int
    is_padding: bool

    @property
    def num_samples(self) -> int:
        """Samples in the micro-batch (including repeated ones if ``is_padding``)."""
        return int(self.indices.size)

    @property
    def padded_tokens(self) -> int:
        """Tokens of the padded tensor: ``max_length * num_samples`` (what memory depends on)."""
        return self.max_length * int(self.indices.size)

    def split(self) -> tuple["MicroBatch", "MicroBatch"]:
        """Two non-empty halves (first half gets the extra sample); both fit the same budget."""
        if self.indices.size < 2:
            raise ValueError("a micro-batch of one sample cannot be split")
        cut = (self.indices.size + 1) // 2
        halves = []
        for part in (slice(0, cut), slice(cut, None)):
            lens = self.lengths[part]
            halves.append(
                MicroBatch(self.indices[part], lens, int(lens.sum()), int(lens[0]), self.is_padding)
            )
        return halves[0], halves[1]



@dataclasses.dataclass(eq=False, slots=True)
class TokenStep:
    """One global optimizer step: ``micro_batches[replica][micro_step]``.

    Every replica has the same number of micro-steps (``num_micro_steps``)
    and every micro-batch holds at least one sample. ``skipped`` lists the
    over-long samples reported (and skipped) with this step. ``state`` is the
    position to checkpoint once this step's optimizer update is done;
    ``index`` counts the steps before this one in the epoch. Treat it as
    read-only.
    """

    epoch: int
    index: int
    micro_batches: tuple[tuple[MicroBatch, ...], ...]
    skipped: np.ndarray
    final: bool
    state: TokenPlanState

    @property
    def num_replicas(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_steps(self) -> int:
        return len(self.micro_batches[0])

    def local(self, rank: int) -> tuple[MicroBatch, ...]:
        """The micro-batches of replica ``rank``, in micro-step order."""
        rank = check_int("rank", rank, 0, self.num_replicas - 1)
        return self.micro_batches[rank]

    def _matrix(self, value: Callable[[MicroBatch], int], real_only: bool) -> np.ndarray:
        return np.array(
            [
                [0 if (real_only and mb.is_padding) else value(mb) for mb in replica]
                for replica in self.micro_batches
            ],
            dtype=np.int64,
        )

    def tokens(self) -> np.ndarray:
        """Real tokens per ``[replica, micro_step]`` (0 for padding micro-batches)."""
        return self._matrix(lambda mb: mb.num_tokens, real_only=True)

    def samples(self) -> np.ndarray:
        """Real samples per ``[replica, micro_step]`` (0 for padding micro-batches)."""
        return self._matrix(lambda mb: mb.num_samples, real_only=True)

    def padded(self) -> np.ndarray:
        """Padded tokens computed per ``[replica, micro_step]``, padding micro-batches included."""
        return self._matrix(lambda mb: mb.padded_tokens, real_only=False)

    def padding_mask(self) -> np.ndarray:
        """True where ``[replica, micro_step]`` is a padding micro-batch."""
        return np.array([[mb.is_padding for mb in r] for r in self.micro_batches], dtype=bool)

    @property
    def num_tokens(self) -> int:
        """Real tokens of the step: what ``average_by='tokens'`` averages the gradient over."""
        return int(self.tokens().sum())

    @property
    def num_samples(self) -> int:
        """Real (non-padding) samples of the step."""
        return int(self.samples().sum())

    @property
    def padded_tokens(self) -> int:
        """Padded tokens processed by all replicas in this step."""
        return int(self.padded().sum())

    @property
    def num_padding(self) -> int:
        """Repeated samples (padding micro-batches) in this step; at most ``num_replicas - 1``."""
        return int(self.padding_mask().sum())

