"""Elastic sampling: one seeded global stream per epoch, split across replicas.

This module implements guarantee G2 (exact data accounting; README.md and docs/restarts.md).

Contract
--------
* In every epoch the training data is visited in the order of one global
  permutation of ``range(num_samples)``. The permutation is a pure function
  of ``(num_samples, seed, epoch, shuffle)``; it never depends on the number
  of replicas, on the rank, or on the batch sizes used so far.
* The caller (the data loader) owns the *position* ``start`` in that stream
  and the *global batch size*. A step takes the global positions
  ``[start, start + global_batch_size)`` (clipped to the end of the epoch),
  splits them across the replicas as evenly as possible (:func:`split_evenly`,
  larger shares to lower ranks) and each replica reads a contiguous slice in
  rank order. The caller then advances ``start += step_size(...)``.
* Because every answer is a function of ``(epoch, start, batch size,
  replicas, rank)`` only, a job may restart, change its replica count or its
  batch size between any two steps and still yield each sample exactly once
  per epoch.
* The only exception is the final step of an epoch: when fewer samples remain
  than there are replicas, every replica without a fresh sample receives one
  padding sample (the step's first sample), so fewer than ``num_replicas``
  samples are repeated and all replicas run the same number of steps. With
  ``drop_last=True`` a final global batch smaller than the requested global
  batch size is dropped instead.
* Memory is O(1) in the dataset size: the permutation is a keyed Feistel
  network with cycle walking (:class:`GlobalPermutation`), so a dataset of
  10**9 samples starts immediately and any position is reachable in O(1).
"""

from __future__ import annotations

import logging
import operator
from typing import Iterator

import numpy as np

from adaptive._utils.checks import check_bool, check_int
from adaptive._utils.mix import GOLDEN_GAMMA, MASK64, MIX_MULTIPLIER_1, MIX_MULTIPLIER_2, splitmix64_step

logger = logging.getLogger(__name__)

__all__ = ["GlobalPermutation", "ElasticSampler", "split_evenly"]

#: Multipliers of the Feistel round function (SplitMix64's increment and first finaliser multiplier).
_FEISTEL_MULTIPLIER_1 = np.uint64(GOLDEN_GAMMA)
_FEISTEL_MULTIPLIER_2 = np.uint64(MIX_MULTIPLIER_1)
_SHIFT32 = np.uint64(32)


def _derive_keys(n: int, seed: int, epoch: int, count: int) -> tuple[int, ...]:
    """Derive ``count`` round keys from ``(n, seed, epoch)``.

    Each input is folded through a full SplitMix64 step before the next one
    is absorbed, so nearby seeds or epochs give unrelated key schedules.
    Pure integer arithmetic, so the keys are the same on every process and
    platform (unlike Python's salted ``hash()``).
    """
    state = 0
    for word in (n, seed, epoch):
        state, out = splitmix64_step(state ^ word)
        state ^= out
    keys = []
    for _ in range(count):
        state, out = splitmix64_step(state)
        keys.append(out)
    return tuple(keys)


def split_evenly(total: int, parts: int) -> list[int]:
    """Split ``total`` items into ``parts`` sizes that differ by at most one.

    Larger sizes come first, e.g. ``split_evenly(5, 3) == [2, 2, 1]``; this is
    how a global batch is shared among replicas in rank order.
    """
    total = check_int("total", total, 0)
    parts = check_int("parts", parts, 1)
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


class GlobalPermutation:
    """A seeded bijection of ``range(n)`` with O(1) memory and O(1) random access.

    With ``shuffle=False`` it is the identity. Otherwise ``perm[i]`` is computed
    by an 8-round keyed Feistel network over the smallest power-of-two domain
    ``2**w >= n``, using unbalanced halves when ``w`` is odd so the domain is
    always smaller than ``2 * n``; values that land outside ``range(n)`` are
    re-encrypted ("cycle walking") until they land inside, which keeps the map
    a bijection of ``range(n)``. Round keys come from ``(n, seed, epoch)``
    through SplitMix64, so the permutation is the same on every process and
    platform, and different seeds or epochs give unrelated orders.
    :meth:`take` evaluates whole ranges vectorised with numpy.

    Feistel networks over tiny domains reach only a skewed subset of all
    permutations (for instance only even ones), so for ``n <= 1024`` the
    permutation is instead an explicit table (at most 8 KiB) obtained by
    sorting keyed SplitMix64 outputs, which is uniform up to 64-bit ties.
    """

    ROUNDS = 8
    MAX_SIZE = 2**63 - 1  # largest len() Python allows; int64 holds every index
    TABLE_MAX = 1024  # sizes up to this use an explicit table (see class docstring)
    _CHUNK = 1 << 16  # positions per vectorised block; keeps temporaries in cache
    #: Small reads (one step's indices) are served from one cached, aligned
    #: block of this many positions: the per-call cost of the numpy rounds is
    #: then paid once per block rather than once per step (32 KiB at most).
    _BLOCK = 1 << 12

    def __init__(self, n: int, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> None:
        self._n = check_int("n", n, 1, self.MAX_SIZE)
        self._seed = check_int("seed", seed, 0, MASK64)
        self._epoch = check_int("epoch", epoch, 0, MASK64)
        self._shuffle = check_bool("shuffle", shuffle)
        width = (self._n - 1).bit_length()
        self._high_bits = width - width // 2
        self._low_bits = width // 2
        self._keys = tuple(
            np.uint64(k) for k in _derive_keys(self._n, self._seed, self._epoch, self.ROUNDS)
        )
        self._table: np.ndarray | None = None
        self._cached_block: tuple[int, np.ndarray] | None = None
        if self._shuffle and self._n <= self.TABLE_MAX:
            self._table = self._small_table()

    @property
    def n(self) -> int:
        """Number of elements permuted."""
        return self._n

    @property
    def seed(self) -> int:
        """Seed the round keys are derived from."""
        return self._seed

    @property
    def epoch(self) -> int:
        """Epoch the round keys are derived from."""
        return self._epoch

    @property
    def shuffle(self) -> bool:
        """False means the identity permutation."""
        return self._shuffle

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n={self._n}, seed={self._seed}, "
            f"epoch={self._epoch}, shuffle={self._shuffle})"
        )

    def __getitem__(self, index: int) -> int:
        """Return the element at position ``index`` (``0 <= index < n``)."""
        if isinstance(index, bool):
            raise TypeError("permutation index must be an integer, got bool")
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(
                f"permutation index must be an integer, got {type(index).__name__}"
            ) from None
        if position < 0:
            raise IndexError(f"negative permutation index {position} is not supported")
        if position >= self._n:
            raise IndexError(f"permutation index {position} out of range [0, {self._n})")
        if not self._shuffle:
            return position
        if self._table is not None:
            return int(self._table[position])
        return int(self._permute(np.array([position], dtype=np.uint64))[0])

    def __iter__(self) -> Iterator[int]:
        """Iterate over the whole permutation, computing it in vectorised chunks."""
        for lo in range(0, self._n, self._CHUNK):
            yield from self.take(lo, min(lo + self._CHUNK, self._n)).tolist()

    def take(self, start: int, stop: int) -> np.ndarray:
        """Return ``[self[i] for i in range(start, stop)]`` as an int64 array.

        ``0 <= start <= stop <= n``. Work is O(stop - start) and independent of
        ``start``, which is what makes resuming at any position O(1).
        """
        start = check_int("start", start, 0, self._n)
        stop = check_int("stop", stop, start, self._n)
        if not self._shuffle:
            return np.arange(start, stop, dtype=np.int64)
        if self._table is not None:
            return self._table[start:stop].copy()
        if stop - start < self._BLOCK:
            return self._take_cached(start, stop)
        out = np.empty(stop - start, dtype=np.int64)
        for lo in range(start, stop, self._CHUNK):
            hi = min(lo + self._CHUNK, stop)
            positions = np.arange(lo, hi, dtype=np.uint64)
            out[lo - start : hi - start] = self._permute(positions)
        return out

    def _take_cached(self, start: int, stop: int) -> np.ndarray:
        """``take`` for short ranges, through aligned blocks of ``_BLOCK``."""
        pieces = []
        for index in range(start // self._BLOCK, (stop - 1) // self._BLOCK + 1 if stop > start else 0):
            offset = index * self._BLOCK
            block = self._block(index)
            pieces.append(block[max(start - offset, 0):stop - offset])
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)

    def _block(self, index: int) -> np.ndarray:
        cached = self._cached_block
        if cached is None or cached[0] != index:
            lo = index * self._BLOCK
            hi = min(lo + self._BLOCK, self._n)
            cached = (index, self._permute(np.arange(lo, hi, dtype=np.uint64)).astype(np.int64))
            self._cached_block = cached
        return cached[1]

    def _small_table(self) -> np.ndarray:
        """Uniform shuffle of a small range: argsort of a keyed SplitMix64 stream.

        SplitMix64's outputs (:func:`adaptive._utils.mix.splitmix64_step`)
        from state ``keys[0]``, vectorised (uint64 arithmetic wraps like ``& MASK64``).
        """
        stream = np.arange(1, self._n + 1, dtype=np.uint64)
        np.multiply(stream, np.uint64(GOLDEN_GAMMA), out=stream)
        np.add(stream, self._keys[0], out=stream)
        stream ^= stream >> np.uint64(30)
        stream *= np.uint64(MIX_MULTIPLIER_1)
        stream ^= stream >> np.uint64(27)
        stream *= np.uint64(MIX_MULTIPLIER_2)
        stream ^= stream >> np.uint64(31)
        return np.argsort(stream, kind="stable").astype(np.int64)

    def _permute(self, positions: np.ndarray) -> np.ndarray:
        """Map in-range uint64 positions to their images, cycle-walking out-of-range values.

        Terminates because the Feistel network is a bijection of the domain:
        following the cycle through an in-range start must reach an in-range
        value again. Since the domain is smaller than ``2 * n``, an element
        needs fewer than one extra encryption on average; each pass only
        re-encrypts the elements still out of range.
        """
        values = self._encrypt(positions)
        bound = np.uint64(self._n)
        pending = np.flatnonzero(values >= bound)
        while pending.size:
            walked = self._encrypt(values[pending])
            values[pending] = walked
            pending = pending[walked >= bound]
        return values

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        """Apply the Feistel network to uint64 values of the ``2**w`` domain."""
        high_bits, low_bits = self._high_bits, self._low_bits
        high = values >> np.uint64(low_bits)
        low = values & np.uint64((1 << low_bits) - 1)
        scratch = np.empty_like(values)
        for key in self._keys:
            # high ^= F_key(low), with F keeping the top `high_bits` bits of a
            # multiply-xorshift-multiply hash; then swap halves (and widths).
            np.bitwise_xor(low, key, out=scratch)
            np.multiply(scratch, _FEISTEL_MULTIPLIER_1, out=scratch)
            np.bitwise_xor(scratch, scratch >> _SHIFT32, out=scratch)
            np.multiply(scratch, _FEISTEL_MULTIPLIER_2, out=scratch)
            np.right_shift(scratch, np.uint64(64 - high_bits), out=scratch)
            np.bitwise_xor(high, scratch, out=high)
            high, low = low, high
            high_bits, low_bits = low_bits, high_bits
        return (high << np.uint64(low_bits)) | low


class ElasticSampler:
    """Per-epoch global sample stream, sliced per replica (see the module docstring).

    The sampler holds only configuration and the current epoch; the caller
    owns the stream position ``start`` and the global batch size, which may
    change from step to step. Typical use by a loader::

        sampler.set_epoch(epoch)
        while sampler.step_size(start, batch) > 0:
            idx = sampler.local_indices(start, batch, world_size, rank)
            ...
            start += sampler.step_size(start, batch)
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self._num_samples = check_int(
            "num_samples",
            num_samples,
            1,
            GlobalPermutation.MAX_SIZE,
            hint=" (cannot sample from an empty dataset)" if num_samples == 0 else "",
        )
        self._shuffle = check_bool("shuffle", shuffle)
        self._seed = check_int("seed", seed, 0, MASK64)
        self._drop_last = check_bool("drop_last", drop_last)
        self._permutation = GlobalPermutation(self._num_samples, self._seed, 0, self._shuffle)

    @property
    def num_samples(self) -> int:
        """Dataset size ``n``."""
        return self._num_samples

    @property
    def shuffle(self) -> bool:
        """Whether each epoch uses a seeded permutation (else dataset order)."""
        return self._shuffle

    @property
    def seed(self) -> int:
        """Seed shared by all replicas."""
        return self._seed

    @property
    def drop_last(self) -> bool:
        """Whether a short final global batch is dropped."""
        return self._drop_last

    @property
    def epoch(self) -> int:
        """Current epoch (selects the permutation)."""
        return self._permutation.epoch

    @property
    def permutation(self) -> GlobalPermutation:
        """The current epoch's global order of sample indices."""
        return self._permutation

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self._num_samples}, shuffle={self._shuffle}, "
            f"seed={self._seed}, drop_last={self._drop_last}, epoch={self.epoch})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (O(1); call on every replica)."""
        epoch = check_int("epoch", epoch, 0, MASK64)
        if epoch != self.epoch:
            self._permutation = GlobalPermutation(
                self._num_samples, self._seed, epoch, self._shuffle
            )
            logger.debug("sampler switched to epoch %d", epoch)

    def step_size(self, start: int, global_batch_size: int) -> int:
        """Fresh samples consumed by the step at ``start``; 0 when the epoch is over."""
        start = self._check_start(start)
        global_batch_size = check_int("global_batch_size", global_batch_size, 1)
        remaining = self._num_samples - start
        if remaining == 0 or (self._drop_last and remaining < global_batch_size):
            return 0
        return min(global_batch_size, remaining)

    def num_steps(self, start: int, global_batch_size: int) -> int:
        """Steps left in the epoch from ``start`` if the global batch size stays constant."""
        start = self._check_start(start)
        global_batch_size = check_int("global_batch_size", global_batch_size, 1)
        full, rest = divmod(self._num_samples - start, global_batch_size)
        return full + (1 if rest and not self._drop_last else 0)

    def local_range(
        self, start: int, global_batch_size: int, num_replicas: int, rank: int
    ) -> tuple[int, int]:
        """Global positions ``[lo, hi)`` of the fresh samples ``rank`` gets in this step.

        An empty range (only possible in an epoch's final step) means the
        replica receives one padding sample instead. Raises ``ValueError`` if
        no step starts at ``start``.
        """
        start = self._check_start(start)
        global_batch_size = check_int("global_batch_size", global_batch_size, 1)
        num_replicas = check_int("num_replicas", num_replicas, 1)
        rank = check_int("rank", rank, 0, num_replicas - 1)
        if global_batch_size < num_replicas:
            raise ValueError(
                f"global_batch_size must be >= num_replicas ({num_replicas}) so that every "
                f"replica gets a fresh sample, got {global_batch_size}"
            )
        size = self.step_size(start, global_batch_size)
        if size == 0:
            raise ValueError(
                f"no step starts at position {start}: the epoch has {self._num_samples} samples"
                f" and drop_last={self._drop_last} (check step_size() first)"
            )
        base, extra = divmod(size, num_replicas)
        lo = start + rank * base + min(rank, extra)
        return lo, lo + base + (1 if rank < extra else 0)

    def local_indices(
        self, start: int, global_batch_size: int, num_replicas: int, rank: int
    ) -> np.ndarray:
        """Sample indices (int64) for ``rank`` in the global batch beginning at ``start``.

        The global batch is positions ``[start, min(start + global_batch_size, n))``
        of the current epoch's permutation, split with :func:`split_evenly`
        into contiguous slices in rank order. A replica whose slice is empty
        (final step, fewer samples left than replicas) gets the step's first
        sample as a single padding element.
        """
        lo, hi = self.local_range(start, global_batch_size, num_replicas, rank)
        if lo == hi:
            return self._permutation.take(start, start + 1)
        return self._permutation.take(lo, hi)

    def _check_start(self, start: int) -> int:
        return check_int("start", start, 0, self._num_samples)
