"""Which AdaptiveDataLoader loop is running right now, if any.

Kept apart from :mod:`adaptive.data.dataloader` so that accumulators and the
data-parallel wrapper can ask without importing the loader.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["current_dataloader", "active_loop"]

_current: Any = None


def current_dataloader() -> Any:
    """The AdaptiveDataLoader whose loop is running, or None."""
    return _current


@contextlib.contextmanager
def active_loop(loader: Any) -> Iterator[None]:
    """Mark ``loader``'s loop as running; loops of two loaders may not overlap."""
    global _current
    if _current is not None:
        raise RuntimeError(
            f"overlapping AdaptiveDataLoader iterations: {loader!r} started while {_current!r} "
            "is still iterating; finish (or break out of) one loop before starting another"
        )
    _current = loader
    try:
        yield
    finally:
        _current = None
