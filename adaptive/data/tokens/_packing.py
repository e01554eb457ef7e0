"""Packing samples into micro-batches, and dealing a step's micro-batches to replicas.

Internal to the token planner (:mod:`adaptive.data.tokens.planner`, whose
docstring describes the plan):

* a window of stream positions is sorted by length and cut greedily into
  micro-batches that fit the budget, which are then shuffled with a key
  derived from ``(seed, epoch, window)`` (:func:`pack_window`);
* a step's micro-batches are dealt to the replicas largest-first
  (:func:`deal`), after the epoch's final step is split or padded so that
  every replica gets the same number (:func:`fill_final_step`).

The shuffle keys and orders are SplitMix64 (:mod:`adaptive._utils.mix`):
pure integer arithmetic, the same on every process, platform and numpy
version.  They must never change, since a checkpointed plan position only
means something under the same micro-batch order.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from adaptive._utils.mix import GOLDEN_GAMMA, MASK64, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2, splitmix64_step
from adaptive.data.tokens.lengths import OversizeSampleError, SampleLengths
from adaptive.data.tokens.micro_batches import MicroBatch

__all__ = ["WindowPlan", "deal", "fill_final_step", "greedy_starts", "pack_window", "shuffle_key",
           "shuffle_order"]

_SHUFFLE_DOMAIN = (
    0x746F6B656E5F6D62  # "token_mb": separates these keys from other users of the seed
)


def shuffle_key(*words: int) -> int:
    """Fold integers into one 64-bit key with SplitMix64 (pure integer arithmetic).

    Each word is xor-ed into the state, which then takes one SplitMix64
    step; the step's output is the next state.
    """
    state = _SHUFFLE_DOMAIN
    for word in words:
        _, state = splitmix64_step(state ^ (word & MASK64))
    return state


def shuffle_order(count: int, key: int) -> np.ndarray:
    """A permutation of ``range(count)``: argsort of a keyed SplitMix64 hash of each position.

    The SplitMix64 finaliser of :func:`adaptive._utils.mix.mix64`, vectorised
    over positions ``1..count`` (numpy's uint64 arithmetic wraps like ``& MASK64``).
    """
    with np.errstate(over="ignore"):
        z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(GOLDEN_GAMMA) + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_MULTIPLIER_1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_MULTIPLIER_2)
        z ^= z >> np.uint64(31)
    return np.argsort(z, kind="stable")


def greedy_starts(lengths_desc: np.ndarray, max_tokens: int) -> np.ndarray:
    """Start positions of the greedy micro-batches of lengths sorted in descending order.

    A micro-batch starting at ``i`` has its longest sample first, so it holds
    ``max_tokens // lengths[i]`` samples. That capacity is non-decreasing
    along the sorted array, so it is constant on runs, and within a run the
    starts form an arithmetic progression: the loop runs once per distinct
    capacity, not once per micro-batch. Greedy maximal batches give the fewest
    micro-batches for a sorted sequence (any sub-range of a feasible range is
    feasible).
    """
    n = lengths_desc.size
    capacity = max_tokens // lengths_desc
    change = np.flatnonzero(np.diff(capacity)) + 1
    run_ends = np.append(change, n).tolist()
    parts = []
    position = 0
    for run_end in run_ends:
        if position >= run_end:
            continue
        step = int(capacity[position])
        starts = np.arange(position, run_end, step, dtype=np.int64)
        parts.append(starts)
        position = int(starts[-1]) + step
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class WindowPlan:
    """One packing of (part of) a window: samples in micro-batch order and batch bounds.

    Micro-batch ``b`` is ``[bounds[b], bounds[b + 1])`` of the sample arrays.
    Python-list copies of the per-batch numbers make :meth:`micro_batch`
    cheap, since it runs once per micro-batch of the epoch.
    """

    __slots__ = (
        "indices", "offsets", "lengths", "bounds", "skipped_indices", "skipped_offsets",
        "skipped_lengths", "num_batches", "_bounds", "_tokens", "_longest",
    )  # fmt: skip

    def __init__(
        self,
        indices: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        bounds: np.ndarray,
        real_tokens: np.ndarray,
        skipped: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> None:
        self.indices, self.offsets, self.lengths, self.bounds = indices, offsets, lengths, bounds
        self.skipped_indices, self.skipped_offsets, self.skipped_lengths = skipped
        self.num_batches = int(bounds.size - 1)
        self._bounds = bounds.tolist()
        self._tokens = real_tokens.tolist()
        self._longest = lengths[bounds[:-1]].tolist()

    def micro_batch(self, b: int) -> MicroBatch:
        lo, hi = self._bounds[b], self._bounds[b + 1]
        return MicroBatch(
            self.indices[lo:hi], self.lengths[lo:hi], self._tokens[b], self._longest[b], False
        )


def pack_window(
    window_indices: np.ndarray,
    excluded: np.ndarray,
    lengths: SampleLengths,
    max_tokens: int,
    key: int,
    oversize_error: bool,
) -> WindowPlan:
    """Sort the window's remaining samples by length, cut them into micro-batches, shuffle them."""
    keep = np.ones(window_indices.size, dtype=bool)
    keep[excluded] = False
    offsets = np.flatnonzero(keep).astype(np.int64)
    indices = window_indices[offsets]
    lens = lengths.lookup(indices)
    oversize = lens > max_tokens
    if oversize.any():
        first = int(np.flatnonzero(oversize)[0])
        if oversize_error:
            raise OversizeSampleError(int(indices[first]), int(lens[first]), max_tokens)
        fit = ~oversize
        skipped = (indices[oversize], offsets[oversize], lens[oversize])
        offsets, indices, lens = offsets[fit], indices[fit], lens[fit]
    else:
        empty = np.empty(0, dtype=np.int64)
        skipped = (empty, empty, empty)
    order = np.argsort(-lens, kind="stable")
    offsets, indices, lens = offsets[order], indices[order], lens[order]
    starts = greedy_starts(lens, max_tokens)
    sizes = np.diff(np.append(starts, lens.size))
    real = np.add.reduceat(lens, starts) if starts.size else np.empty(0, dtype=np.int64)
    perm = shuffle_order(starts.size, key)
    sizes, starts, real = sizes[perm], starts[perm], real[perm]
    bounds = np.zeros(starts.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    gather = np.repeat(starts - bounds[:-1], sizes) + np.arange(lens.size, dtype=np.int64)
    return WindowPlan(indices[gather], offsets[gather], lens[gather], bounds, real, skipped)


def fill_final_step(taken: list[MicroBatch], replicas: int) -> list[MicroBatch]:
    """Give every replica ``ceil(len(taken) / replicas)`` non-empty micro-batches.

    Splits the micro-batch with the most samples until there are enough;
    if the step has fewer samples than slots, adds padding micro-batches that
    repeat the step's shortest sample. Padding count <= replicas - 1 because
    the step has at least ``len(taken)`` samples.
    """
    slots = replicas * math.ceil(len(taken) / replicas)
    batches = list(taken)
    while len(batches) < slots:
        largest = max(range(len(batches)), key=lambda i: batches[i].num_samples)
        if batches[largest].num_samples < 2:
            break
        batches[largest : largest + 1] = batches[largest].split()
    if len(batches) < slots:
        shortest = min(batches, key=lambda mb: int(mb.lengths[-1]))
        index, length = shortest.indices[-1:], shortest.lengths[-1:]
        pad = MicroBatch(index, length, int(length[0]), int(length[0]), is_padding=True)
        batches.extend([pad] * (slots - len(batches)))
    return batches


def deal(batches: list[MicroBatch], replicas: int) -> tuple[tuple[MicroBatch, ...], ...]:
    """Deal ``batches`` (a multiple of ``replicas``) so each replica gets the same number.

    Largest padded size first, each to the replica with the fewest padded
    tokens so far among those with a free slot (ties: lowest rank): the LPT
    rule, which keeps per-step work balanced.
    """
    if len(batches) == 1:
        return ((batches[0],),)
    per_replica = len(batches) // replicas
    order = sorted(batches, key=lambda mb: -mb.padded_tokens)
    if per_replica == 1:  # every replica starts empty: the largest goes to rank 0, and so on
        return tuple((mb,) for mb in order)
    heap = [(0, rank) for rank in range(replicas)]
    dealt: list[list[MicroBatch]] = [[] for _ in range(replicas)]
    for mb in order:
        load, rank = heapq.heappop(heap)
        dealt[rank].append(mb)
        if len(dealt[rank]) < per_replica:
            heapq.heappush(heap, (load + mb.padded_tokens, rank))
    return tuple(tuple(d) for d in dealt)

