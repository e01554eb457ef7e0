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
1. The epoch's global index stream (G2 of DESIGN.md: a seeded permutation
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
   (:func:`loss_weights`).

What depends on the replica count: only the grouping of the micro-batch
stream into steps (so the number of steps per epoch), the dealing of each
step to replicas, and the splitting and padding of the final step. Which
samples share a micro-batch and the order of the micro-batches do not.

Exact resume
------------
A :class:`TokenPlanState` records the first window not yet finished, how
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
samples like one with 300. :func:`loss_weights` gives the factor each
micro-batch's *summed* loss is multiplied by so that the step's gradient is
the mean over all real tokens (or samples) of the whole step: exactly the
single-process gradient of the same samples.

Learning rate
-------------
A token-budget step holds a varying number of tokens (and samples). With
``average_by="tokens"`` the gradient is a mean, so its scale does not grow
with the step, but its noise shrinks as the step grows. :func:`step_lr_factor`
turns the step's actual size (``step.num_tokens``) relative to a reference
size (the size the base LR was tuned for) into an LR multiplier: ``"linear"``
(SGD), ``"sqrt"`` (Adam) or ``"none"``. Apply it on top of the user's LR
scheduler at every optimizer step (multiply, then restore), so the two
compose.

When to use a token budget
--------------------------
Use it when sample lengths vary a lot (text, speech, code): memory per
micro-batch stays under the budget whatever the lengths, length grouping
removes most padding (over 99% real tokens on the standard library's source
in ``benchmarks/bench_token_batching.py``, against 31% for filling batches in
shuffled order), and every step carries a similar number of tokens. With
near-constant lengths, plain sample batches are simpler and equivalent.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, Union, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "AVERAGE_BY",
    "DEFAULT_WINDOW_SIZE",
    "GRADIENT_REDUCTIONS",
    "IndexStream",
    "LOSS_REDUCTIONS",
    "LR_RULES",
    "MicroBatch",
    "ON_OVERSIZE",
    "OversizeSampleError",
    "SampleLengths",
    "TokenBudgetPlanner",
    "TokenPlanState",
    "TokenStep",
    "loss_weights",
    "sample_loss_weights",
    "step_lr_factor",
]

ON_OVERSIZE = ("error", "skip")
AVERAGE_BY = ("tokens", "samples")
GRADIENT_REDUCTIONS = ("mean", "sum")
LOSS_REDUCTIONS = ("sum", "mean")
LR_RULES = ("linear", "sqrt", "none")
DEFAULT_WINDOW_SIZE = 16384
_STATE_VERSION = 1
_STATE_INT_FIELDS = (
    "epoch", "window", "batches_done", "packed_max_tokens", "steps_done", "samples_done",
    "tokens_done", "skipped_done", "padding_done", "window_size", "seed", "num_samples",
)  # fmt: skip
_NO_SAMPLES = np.empty(0, dtype=np.int64)
_NO_SAMPLES.flags.writeable = False

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_SHUFFLE_DOMAIN = (
    0x746F6B656E5F6D62  # "token_mb": separates these keys from other users of the seed
)


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """Return ``value`` as a Python int, or raise naming the argument and the allowed range."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer {allowed}, got bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be an integer {allowed}, got {type(value).__name__} {value!r}"
        ) from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be {allowed}, got {number}")
    return number


def _check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``allowed``, else raise naming the argument and choices."""
    if not isinstance(value, str) or value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _as_index_array(name: str, values: object) -> np.ndarray:
    """Return ``values`` as a 1-D int64 array, or raise naming ``name``."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got an array of shape {array.shape}")
    if array.size and (array.dtype == np.bool_ or array.dtype.kind not in "iu"):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- sample lengths


class OversizeSampleError(ValueError):
    """A sample is longer than the token budget of a micro-batch and cannot be batched."""

    def __init__(self, index: int, length: int, max_tokens: int) -> None:
        self.index = index
        self.length = length
        self.max_tokens = max_tokens
        super().__init__(
            f"sample {index} has {length} tokens, more than max_tokens={max_tokens}; "
            "raise max_tokens, truncate or split the sample, or pass on_oversize='skip' "
            "to report and skip such samples"
        )


class SampleLengths:
    """Token count of every sample: a validated table, or a function of the sample index.

    A table (list, array, tensor converted with ``.numpy()``) is validated
    once, vectorised: 1-D, integer dtype, every entry ``>= 1``. A callable
    ``index -> length`` is evaluated lazily for the samples being planned
    (one window at a time) and each answer is validated; prefer a table for
    large datasets, since planning calls the function once per sample.
    """

    def __init__(
        self, lengths: Union["SampleLengths", Callable[[int], int], Sequence[int], np.ndarray]
    ) -> None:
        if isinstance(lengths, SampleLengths):
            self._table, self._function = lengths._table, lengths._function
        elif callable(lengths) and not isinstance(lengths, np.ndarray):
            self._table, self._function = None, lengths
        else:
            self._table, self._function = self._validate_table(lengths), None

    @staticmethod
    def _validate_table(lengths: object) -> np.ndarray:
        table = np.asarray(lengths)
        if table.ndim != 1:
            raise ValueError(
                f"lengths must be 1-D (one length per sample), got shape {table.shape}"
            )
        if table.size == 0:
            raise ValueError("lengths must not be empty: give one token count per sample")
        if table.dtype == np.bool_ or table.dtype.kind not in "iu":
            raise TypeError(
                f"lengths must hold integers (token counts), got dtype {table.dtype}; "
                "convert with .astype(int) if the values are whole numbers"
            )
        bad = np.flatnonzero(table < 1)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"lengths[{i}] = {int(table[i])}: sample lengths must be positive integers "
                f"(>= 1 token); {bad.size} entries are invalid"
            )
        return table.astype(np.int64, copy=False)

    @property
    def num_samples(self) -> int | None:
        """Length of the table, or None for a callable."""
        return None if self._table is None else int(self._table.size)

    def __len__(self) -> int:
        if self._table is None:
            raise TypeError("lengths given as a function have no len(); pass a table instead")
        return int(self._table.size)

    def __getitem__(self, index: int) -> int:
        return int(self.lookup(np.array([index], dtype=np.int64))[0])

    def lookup(self, indices: np.ndarray) -> np.ndarray:
        """Return the lengths of ``indices`` (1-D int array) as an int64 array."""
        if self._table is not None:
            if indices.size:
                low, high = int(indices.min()), int(indices.max())
                if low < 0 or high >= self._table.size:
                    bad = low if low < 0 else high
                    raise IndexError(
                        f"sample index {bad} is out of range for lengths of "
                        f"{self._table.size} samples"
                    )
            return self._table[indices]
        return np.fromiter(
            (self._call(int(i)) for i in indices), dtype=np.int64, count=indices.size
        )

    def _call(self, index: int) -> int:
        value = self._function(index)  # type: ignore[misc]
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(
                f"lengths({index}) returned bool {value!r}; expected a positive integer"
            )
        try:
            length = operator.index(value)
        except TypeError:
            raise TypeError(
                f"lengths({index}) returned {type(value).__name__} {value!r}; "
                "expected a positive integer"
            ) from None
        if length < 1:
            raise ValueError(
                f"lengths({index}) returned {length}: sample lengths must be positive integers"
            )
        return length


# --------------------------------------------------------------------------- index streams


@runtime_checkable
class IndexStream(Protocol):
    """A random-access global index stream, e.g. :class:`adaptive.data.sampler.GlobalPermutation`."""

    def __len__(self) -> int: ...

    def take(self, start: int, stop: int) -> np.ndarray: ...


class _ArraySource:
    """An in-memory stream."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    @property
    def length(self) -> int | None:
        return int(self._array.size)

    def read(self, start: int, stop: int) -> np.ndarray:
        return self._array[start:stop]


class _TakeSource:
    """A stream with ``take(start, stop)`` and ``len()``, read one window at a time."""

    def __init__(self, stream: IndexStream) -> None:
        self._stream = stream
        self._length = _check_int("len(stream)", len(stream), 0)

    @property
    def length(self) -> int | None:
        return self._length

    def read(self, start: int, stop: int) -> np.ndarray:
        start, stop = min(start, self._length), min(stop, self._length)
        return _as_index_array("stream.take() result", self._stream.take(start, stop))


class _ChunkSource:
    """A forward-only stream given as an iterable of index arrays (length unknown up front)."""

    def __init__(self, chunks: Iterable[object]) -> None:
        self._chunks = iter(chunks)
        self._buffer = np.empty(0, dtype=np.int64)
        self._offset = 0  # stream position of self._buffer[0]
        self._exhausted = False

    @property
    def length(self) -> int | None:
        return None

    def read(self, start: int, stop: int) -> np.ndarray:
        if start < self._offset:
            raise ValueError(
                f"an iterator stream cannot go back to position {start} (already at "
                f"{self._offset}); pass an array or an object with take() to re-read"
            )
        parts, available = [self._buffer], self._offset + self._buffer.size
        while not self._exhausted and available < stop:
            chunk = next(self._chunks, None)
            if chunk is None:
                self._exhausted = True
            else:
                parts.append(_as_index_array("stream chunk", chunk))
                available += parts[-1].size
        if len(parts) > 1:
            self._buffer = np.concatenate(parts)
        lo = min(start - self._offset, self._buffer.size)
        out = self._buffer[lo : stop - self._offset]
        self._buffer = self._buffer[lo:]
        self._offset += lo
        return out


StreamLike = Union[np.ndarray, Sequence[int], IndexStream, Iterable[np.ndarray]]


def _make_source(stream: StreamLike) -> _ArraySource | _TakeSource | _ChunkSource:
    """Wrap the accepted stream types behind one ``read(start, stop)`` interface."""
    if isinstance(stream, (np.ndarray, range)) or hasattr(stream, "__array__"):
        # arrays, ranges and array-likes such as CPU tensors (whose take() means something else)
        return _ArraySource(_as_index_array("stream", stream))
    if hasattr(stream, "take") and hasattr(stream, "__len__"):
        return _TakeSource(stream)  # type: ignore[arg-type]
    if isinstance(stream, (list, tuple)):
        if stream and isinstance(stream[0], np.ndarray):
            return _ChunkSource(stream)
        return _ArraySource(_as_index_array("stream", stream))
    if isinstance(stream, Iterable):
        return _ChunkSource(stream)
    raise TypeError(
        "stream must be a 1-D integer array, an object with take(start, stop) and len() "
        f"(e.g. GlobalPermutation), or an iterable of index arrays; got {type(stream).__name__}"
    )


# --------------------------------------------------------------------------- window packing


def _splitmix_key(*words: int) -> int:
    """Fold integers into one 64-bit key with SplitMix64 (pure integer arithmetic)."""
    state = _SHUFFLE_DOMAIN
    for word in words:
        state = (state ^ (word & _MASK64)) & _MASK64
        state = (state + _GOLDEN) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
        z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
        state = z ^ (z >> 31)
    return state


def _shuffle_order(count: int, key: int) -> np.ndarray:
    """A permutation of ``range(count)``: argsort of a keyed SplitMix64 hash of each position."""
    with np.errstate(over="ignore"):
        z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z ^= z >> np.uint64(31)
    return np.argsort(z, kind="stable")


def _greedy_starts(lengths_desc: np.ndarray, max_tokens: int) -> np.ndarray:
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


class _WindowPlan:
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

    def micro_batch(self, b: int) -> "MicroBatch":
        lo, hi = self._bounds[b], self._bounds[b + 1]
        return MicroBatch(
            self.indices[lo:hi], self.lengths[lo:hi], self._tokens[b], self._longest[b], False
        )


def _pack_window(
    window_indices: np.ndarray,
    excluded: np.ndarray,
    lengths: SampleLengths,
    max_tokens: int,
    key: int,
    oversize_error: bool,
) -> _WindowPlan:
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
    starts = _greedy_starts(lens, max_tokens)
    sizes = np.diff(np.append(starts, lens.size))
    real = np.add.reduceat(lens, starts) if starts.size else np.empty(0, dtype=np.int64)
    perm = _shuffle_order(starts.size, key)
    sizes, starts, real = sizes[perm], starts[perm], real[perm]
    bounds = np.zeros(starts.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    gather = np.repeat(starts - bounds[:-1], sizes) + np.arange(lens.size, dtype=np.int64)
    return _WindowPlan(indices[gather], offsets[gather], lens[gather], bounds, real, skipped)


# --------------------------------------------------------------------------- public records


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


class TokenPlanState(NamedTuple):
    """Where an epoch's token-budget plan stands; checkpoint it after each step.

    Plain ints, bools and a list of ints (:meth:`state_dict`), independent of
    the replica count: any planner with the same ``window_size`` and ``seed``
    resumes from it exactly (see the module docstring).

    Fields: ``window`` is the first window not finished; ``batches_done`` the
    micro-batches of its current packing already consumed; ``packed_max_tokens``
    the budget of that packing (0: not packed yet, its skipped samples not
    reported); ``excluded`` window offsets left out of that packing because
    they were consumed or skipped under an earlier budget. The ``*_done``
    counters are totals for the epoch so far (``steps_done`` depends on the
    replica history, the others do not).

    A named tuple: immutable and cheap to create once per step.
    """

    epoch: int = 0
    window: int = 0
    batches_done: int = 0
    packed_max_tokens: int = 0
    excluded: tuple[int, ...] = ()
    steps_done: int = 0
    samples_done: int = 0
    tokens_done: int = 0
    skipped_done: int = 0
    padding_done: int = 0
    finished: bool = False
    window_size: int = DEFAULT_WINDOW_SIZE
    seed: int = 0
    num_samples: int = -1  # length of the index stream, -1 if unknown (iterator streams)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python snapshot (JSON-serialisable, safe for ``torch.load(weights_only=True)``)."""
        out: dict[str, Any] = {"version": _STATE_VERSION, **self._asdict()}
        out["excluded"] = list(self.excluded)
        return out

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "TokenPlanState":
        """Validate and rebuild a state saved by :meth:`state_dict`; clear errors for bad input."""
        if not isinstance(state, Mapping):
            raise TypeError(f"token plan state must be a mapping, got {type(state).__name__}")
        expected = set(cls._fields) | {"version"}
        missing, unknown = expected - set(state), set(state) - expected
        if missing or unknown:
            raise ValueError(
                f"token plan state has missing keys {sorted(missing)} and unknown keys "
                f"{sorted(unknown)}; was it written by TokenPlanState.state_dict()?"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"token plan state version {state['version']!r} is not supported "
                f"(expected {_STATE_VERSION})"
            )
        values: dict[str, Any] = {}
        for name in _STATE_INT_FIELDS:
            minimum = -1 if name == "num_samples" else (1 if name == "window_size" else 0)
            values[name] = _check_int(f"state[{name!r}]", state[name], minimum)
        if not isinstance(state["finished"], bool):
            raise TypeError(f"state['finished'] must be a bool, got {state['finished']!r}")
        values["finished"] = state["finished"]
        values["excluded"] = cls._check_excluded(state["excluded"], values["window_size"])
        result = cls(**values)
        if result.packed_max_tokens == 0 and (result.batches_done or result.excluded):
            raise ValueError(
                "token plan state is inconsistent: batches_done and excluded must be empty "
                "when packed_max_tokens is 0"
            )
        return result

    @staticmethod
    def _check_excluded(excluded: object, window_size: int) -> tuple[int, ...]:
        if not isinstance(excluded, (list, tuple)):
            raise TypeError(
                f"state['excluded'] must be a list of ints, got {type(excluded).__name__}"
            )
        out = tuple(_check_int("state['excluded'] entry", v, 0, window_size - 1) for v in excluded)
        if any(a >= b for a, b in zip(out, out[1:])):
            raise ValueError("state['excluded'] must be strictly increasing window offsets")
        return out


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
        rank = _check_int("rank", rank, 0, self.num_replicas - 1)
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


# --------------------------------------------------------------------------- the planner


class _Cursor:
    """Walks the epoch's micro-batch stream window by window, packing each lazily.

    ``pending_skips`` collects over-long samples reported by packings done
    since the last call to :meth:`pop_skips`.
    """

    def __init__(
        self,
        planner: "TokenBudgetPlanner",
        source: _ArraySource | _TakeSource | _ChunkSource,
        state: TokenPlanState,
    ) -> None:
        self._planner = planner
        self._source = source
        self.epoch = state.epoch
        self.window = state.window
        self.max_tokens = planner.max_tokens
        self.excluded = np.asarray(state.excluded, dtype=np.int64)
        self.plan: _WindowPlan | None = None
        self.next_batch = 0
        self.num_batches = 0  # of self.plan
        self.pending_skips: list[_WindowPlan] = []
        if state.packed_max_tokens:
            self._resume(state)

    # -- packing

    def _window_indices(self, window: int) -> np.ndarray:
        size = self._planner.window_size
        return self._source.read(window * size, (window + 1) * size)

    def _pack(
        self, window_indices: np.ndarray, max_tokens: int, oversize_error: bool
    ) -> _WindowPlan:
        key = _splitmix_key(self._planner.seed, self.epoch, self.window)
        return _pack_window(
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
        return self.plan.micro_batch(batch)  # type: ignore[union-attr]

    def pop_skips(self) -> list[_WindowPlan]:
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
        self._window_size = _check_int("window_size", window_size, 1)
        self._seed = _check_int("seed", seed, 0, _MASK64)
        self._on_oversize = _check_choice("on_oversize", on_oversize, ON_OVERSIZE)
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
        self._max_tokens = _check_int("max_tokens", value, 1)

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._num_replicas = _check_int("num_replicas", value, 1)

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        self._accumulation_steps = _check_int("accumulation_steps", value, 1)

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
        epoch = _check_int("epoch", epoch, 0)
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
        source = _make_source(stream)
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
        if epoch is not None and _check_int("epoch", epoch, 0) != state.epoch:
            raise ValueError(f"epoch={epoch} does not match the state's epoch {state.epoch}")
        for name in ("window_size", "seed"):
            if getattr(state, name) != getattr(self, name):
                raise ValueError(
                    f"token plan state was saved with {name}={getattr(state, name)}, but this "
                    f"planner has {name}={getattr(self, name)}; it must not change within an epoch"
                )
        return state

    def _steps(
        self, source: _ArraySource | _TakeSource | _ChunkSource, state: TokenPlanState
    ) -> Iterator[TokenStep]:
        cursor = _Cursor(self, source, state)
        while True:
            if cursor.max_tokens != self._max_tokens:
                window, batches_done, packed, excluded = cursor.position()
                state = state._replace(
                    window=window,
                    batches_done=batches_done,
                    packed_max_tokens=packed,
                    excluded=excluded,
                )
                cursor = _Cursor(self, source, state)
            step = self._next_step(cursor, state)
            if step is None:
                return
            state = step.state
            yield step
            if step.final:
                return

    def _next_step(self, cursor: _Cursor, state: TokenPlanState) -> TokenStep | None:
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
            taken = _fill_final_step(taken, replicas)
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
            state.epoch, state.steps_done, _deal(taken, replicas), skipped, final, new_state
        )

    def _report_skips(self, epoch: int, window: int, plan: _WindowPlan, max_tokens: int) -> None:
        count = int(plan.skipped_indices.size)
        self._num_skipped += count
        logger.warning(
            "skipping %d samples longer than max_tokens=%d in epoch %d, window %d "
            "(first: sample %d with %d tokens); %d skipped so far",
            count, max_tokens, epoch, window, int(plan.skipped_indices[0]),
            int(plan.skipped_lengths[0]), self._num_skipped,
        )  # fmt: skip


def _fill_final_step(taken: list[MicroBatch], replicas: int) -> list[MicroBatch]:
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


def _deal(batches: list[MicroBatch], replicas: int) -> tuple[tuple[MicroBatch, ...], ...]:
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


# --------------------------------------------------------------------------- weights and LR


def _loss_scale(step: TokenStep, average_by: str, gradient_reduction: str) -> float:
    _check_choice("average_by", average_by, AVERAGE_BY)
    _check_choice("gradient_reduction", gradient_reduction, GRADIENT_REDUCTIONS)
    total = step.num_tokens if average_by == "tokens" else step.num_samples
    divisor = step.num_replicas if gradient_reduction == "mean" else 1
    return divisor / total


def loss_weights(
    step: TokenStep,
    average_by: str = "tokens",
    gradient_reduction: str = "mean",
    loss_reduction: str = "sum",
) -> np.ndarray:
    """Multipliers ``w[replica, micro_step]`` for each micro-batch's loss before ``backward()``.

    Replica ``r`` computes for micro-step ``m`` the loss ``L[r, m]`` of its
    micro-batch over the real tokens (``average_by="tokens"``; mask the
    padded positions) or over its samples (``average_by="samples"``), calls
    ``(w[r, m] * L[r, m]).backward()`` and lets gradients accumulate over
    micro-steps. ``loss_reduction`` says how ``L`` was reduced: ``"sum"`` of
    the per-token (per-sample) losses, or their ``"mean"`` over the
    micro-batch (what most loss functions return by default; ``w`` then
    includes the micro-batch's token or sample count).

    With ``gradient_reduction="mean"`` (DDP, which divides the all-reduced
    sum by the world size) the resulting gradient is exactly the mean over
    all real tokens (samples) of the whole step, i.e. the single-process
    gradient of the same samples, however unevenly the tokens are spread
    over replicas and micro-steps; use ``"sum"`` if gradients are summed
    across replicas instead. Padding micro-batches get weight 0.
    """
    _check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
    scale = _loss_scale(step, average_by, gradient_reduction)
    if loss_reduction == "sum":
        return np.where(step.padding_mask(), 0.0, scale)
    counts = step.tokens() if average_by == "tokens" else step.samples()  # 0 for padding
    return scale * counts.astype(np.float64)


def sample_loss_weights(
    step: TokenStep,
    rank: int,
    micro_step: int,
    average_by: str = "tokens",
    gradient_reduction: str = "mean",
) -> np.ndarray:
    """Per-sample weights (float64) for one micro-batch, in its sample order.

    Multiply each sample's summed token loss (``"tokens"``) or its per-sample
    loss (``"samples"``) by its weight and sum: the same result as
    :func:`loss_weights` with ``loss_reduction="sum"``, for code that weights
    samples rather than micro-batches.
    """
    micro_batch = step.local(rank)[
        _check_int("micro_step", micro_step, 0, step.num_micro_steps - 1)
    ]
    scale = 0.0 if micro_batch.is_padding else _loss_scale(step, average_by, gradient_reduction)
    return np.full(micro_batch.num_samples, scale, dtype=np.float64)


def step_lr_factor(actual_size: float, reference_size: float, rule: str = "linear") -> float:
    """Learning-rate factor for a step of ``actual_size`` relative to ``reference_size``.

    ``"linear"``: ``actual / reference`` (SGD-style); ``"sqrt"``:
    ``sqrt(actual / reference)`` (Adam-style); ``"none"``: 1. Sizes are in
    the same unit (real tokens or samples of the step). Multiply the LR the
    user's scheduler produces by this factor, so both compose.
    """
    _check_choice("rule", rule, LR_RULES)
    for name, value in (("actual_size", actual_size), ("reference_size", reference_size)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a positive number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if rule == "none":
        return 1.0
    ratio = float(actual_size) / float(reference_size)
    return ratio if rule == "linear" else math.sqrt(ratio)
