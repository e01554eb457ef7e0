"""Sample lengths: the token count of every sample, and the error for one that cannot fit.

The token planner needs each sample's length before it can pack micro-batches
(:mod:`adaptive.data.tokens.planner`).  :class:`SampleLengths` holds them as
a validated table or asks a function lazily; :class:`OversizeSampleError`
reports a sample longer than the budget of a micro-batch.  Pure numpy (no
torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

import numpy as np

from adaptive._utils.checks import check_int

__all__ = ["OversizeSampleError", "SampleLengths"]


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
        self._table: np.ndarray | None
        self._function: Callable[[int], int] | None
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
            found: np.ndarray = self._table[indices]
            return found
        return np.fromiter(
            (self._call(int(i)) for i in indices), dtype=np.int64, count=indices.size
        )

    def _call(self, index: int) -> int:
        """The function's answer for ``index``, checked to be a positive integer."""
        # only called when the lengths are a function, so _function is set (mypy cannot see it)
        return check_int(f"the length lengths({index}) returned", self._function(index), 1)  # type: ignore[misc]
