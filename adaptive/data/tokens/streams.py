"""Index streams: the epoch's global sample order, as the token planner reads it.

The planner reads the stream one window of positions at a time.  It accepts
an in-memory array, a random-access stream with ``take(start, stop)`` and
``len()`` (:class:`IndexStream`, e.g.
:class:`adaptive.data.sampler.GlobalPermutation`), or a forward-only
iterable of index arrays; :func:`make_source` puts each behind one
``read(start, stop)`` interface.  Pure numpy (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, Union, runtime_checkable

import numpy as np

from adaptive._utils.checks import check_int

__all__ = ["IndexStream", "Source", "StreamLike", "as_index_array", "make_source"]


def as_index_array(name: str, values: object) -> np.ndarray:
    """Return ``values`` as a 1-D int64 array, or raise naming ``name``."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got an array of shape {array.shape}")
    if array.size and (array.dtype == np.bool_ or array.dtype.kind not in "iu"):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


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
        self._length = check_int("len(stream)", len(stream), 0)

    @property
    def length(self) -> int | None:
        return self._length

    def read(self, start: int, stop: int) -> np.ndarray:
        start, stop = min(start, self._length), min(stop, self._length)
        return as_index_array("stream.take() result", self._stream.take(start, stop))


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
                parts.append(as_index_array("stream chunk", chunk))
                available += parts[-1].size
        if len(parts) > 1:
            self._buffer = np.concatenate(parts)
        lo = min(start - self._offset, self._buffer.size)
        out = self._buffer[lo : stop - self._offset]
        self._buffer = self._buffer[lo:]
        self._offset += lo
        return out


#: What :meth:`adaptive.data.tokens.planner.TokenBudgetPlanner.plan_epoch` accepts as a stream.
StreamLike = Union[np.ndarray, Sequence[int], IndexStream, Iterable[np.ndarray]]

#: A stream behind ``length`` (None if unknown) and ``read(start, stop)``.
Source = Union[_ArraySource, _TakeSource, _ChunkSource]


def make_source(stream: StreamLike) -> Source:
    """Wrap the accepted stream types behind one ``read(start, stop)`` interface."""
    if isinstance(stream, (np.ndarray, range)) or hasattr(stream, "__array__"):
        # arrays, ranges and array-likes such as CPU tensors (whose take() means something else)
        return _ArraySource(as_index_array("stream", stream))
    if hasattr(stream, "take") and hasattr(stream, "__len__"):
        return _TakeSource(stream)  # type: ignore[arg-type]  # duck-typed: has take() and len()
    if isinstance(stream, (list, tuple)):
        if stream and isinstance(stream[0], np.ndarray):
            return _ChunkSource(stream)
        return _ArraySource(as_index_array("stream", stream))
    if isinstance(stream, Iterable):
        return _ChunkSource(stream)
    raise TypeError(
        "stream must be a 1-D integer array, an object with take(start, stop) and len() "
        f"(e.g. GlobalPermutation), or an iterable of index arrays; got {type(stream).__name__}"
    )
