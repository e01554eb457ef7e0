"""The pieces of one pass of a loader loop: step lookahead, local batches, timing, interval statistics.

Kept apart from :mod:`adaptive.data.dataloader`, which strings them together
(planning steps, fetching their micro-batches, agreeing at boundaries).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Iterator

import torch.utils.data

from adaptive.data.steps import PlannedStep

__all__ = ["Lookahead", "LocalBatches", "Plan", "StepTiming", "IntervalStats"]


class Lookahead:
    """An iterator that can tell whether another item follows (the last step of a loop)."""

    _EMPTY = object()

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self._next: Any = self._EMPTY

    def __iter__(self) -> "Lookahead":
        return self

    def __next__(self) -> Any:
        if self._next is not self._EMPTY:
            item, self._next = self._next, self._EMPTY
            return item
        return next(self._iterator)

    def has_next(self) -> bool:
        if self._next is self._EMPTY:
            self._next = next(self._iterator, self._EMPTY)
        return self._next is not self._EMPTY


class LocalBatches(torch.utils.data.Sampler):
    """This replica's index lists, read from the current plan.

    Serves as the ``batch_sampler`` of the inner DataLoader (iterated in the
    main process, possibly ahead of training when workers prefetch); the
    outer loader re-points it whenever the plan restarts.
    """

    def __init__(self) -> None:
        self.source: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        return self.source


@dataclasses.dataclass
class Plan:
    """A running plan: the steps for the outer loop and the batches fetched for them."""

    key: Any
    steps: Lookahead
    batches: Iterator[Any]


class StepTiming:
    """Wall time of each optimizer step, split into data waiting and compute."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._boundary: float | None = None
        self._data = 0.0
        self._compute: list[float] = []
        self._yielded: float | None = None
        self._recent: collections.deque = collections.deque(maxlen=20)

    def fetch(self, iterator: Iterator[Any], last: bool) -> Any:
        now = time.perf_counter()
        if self._boundary is None:
            self._boundary = now
        if self._yielded is not None:  # the previous micro-batch (an accumulation step) is done
            self._compute.append(now - self._yielded)
        batch = next(iterator)
        done = time.perf_counter()
        self._data += done - now
        self._yielded = None if last else done
        return batch

    def step_done(self) -> tuple[float | None, float | None, float | None]:
        """(step time, compute time per micro-batch or None, data wait) of the step just finished."""
        now = time.perf_counter()
        start, self._boundary = self._boundary, now
        data, compute = self._data, self._compute
        self._data, self._compute, self._yielded = 0.0, [], None
        if start is None:
            return None, None, None
        self._recent.append(now - start)
        return now - start, (sum(compute) / len(compute) if compute else None), data

    def per_sec(self, size: float) -> float | None:
        """``size`` per second at the recent step rate."""
        if not self._recent:
            return None
        return size / (sum(self._recent) / len(self._recent))


class IntervalStats:
    """Sizes of the steps since the last metrics record (cheap sums)."""

    def __init__(self) -> None:
        self.steps = self.samples = self.tokens = self.padded = 0

    def add(self, step: PlannedStep) -> None:
        self.steps += 1
        self.samples += step.num_samples
        self.tokens += step.num_tokens or 0
        self.padded += step.padded_tokens or 0

    def fields(self) -> dict[str, Any]:
        if not self.steps:
            return {}
        out: dict[str, Any] = {"samples_per_step": self.samples / self.steps}
        if self.padded:
            out.update(tokens_per_step=self.tokens / self.steps, padding_efficiency=self.tokens / self.padded)
        return out
