"""The exact search behind :meth:`adaptive.goodput.model.GoodputFunction.optimize` (numpy only).

For one placement (nodes, replicas) it finds the ``(local_bsz,
accum_steps)`` of highest goodput among every feasible integer
configuration, without evaluating all of them; see :func:`optimize_one`.
A module of its own because it has a contract of its own: it takes any
unvalidated goodput callable (:data:`GoodputOf`) whose step time never
decreases with more accumulation steps, and knows nothing else of the
model (it imports no part of it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from adaptive._utils.checks import check_int

__all__ = ["GoodputOf", "optimize_one", "validate_placements", "resolve_bounds"]

#: ``(nodes, replicas, local_bsz, accum_steps) -> goodput``, unvalidated,
#: for arrays of local batch sizes and accumulation steps.
GoodputOf = Callable[[int, int, np.ndarray, np.ndarray], np.ndarray]


def optimize_one(goodput: GoodputOf, init_batch_size: int, nodes: int, replicas: int, max_bs: int, lo: int,
                 hi: int, accumulation: bool) -> tuple[float, int, int]:
    """Best ``(goodput, local_bsz, accum_steps)`` for one placement.

    Candidates are indexed by ``n = local_bsz * accum_steps`` (samples
    per replica per step).  For a fixed ``n`` the global batch, hence
    the efficiency, is fixed, and the step time never decreases with
    more accumulation steps: ``T(n, a) - T(n, a') >= (a - a') alpha_c``
    for ``a > a'`` because the overlap term is 1-Lipschitz in compute.
    So each ``n`` only needs its smallest feasible ``a``.  The bound
    ``a >= ceil(n / hi)`` gives an upper bound on every ``n``'s goodput
    (exact when that ``a`` divides ``n``); only the few ``n`` whose
    bound beats the best exact value are searched for a divisor.
    """
    n_max = max_bs // replicas
    if n_max < lo:
        return 0.0, lo, 1
    n_pref = -(-init_batch_size // replicas)  # smallest n with replicas * n >= init
    if not accumulation:
        n = np.arange(lo, min(hi, n_max) + 1, dtype=np.int64)
        pool = n >= n_pref
        if not pool.any():
            pool[:] = True
        values = np.where(pool, goodput(nodes, replicas, n, np.ones_like(n)), -np.inf)
        best = int(np.argmax(values))
        return float(values[best]), int(n[best]), 1
    n = np.arange(lo, n_max + 1, dtype=np.int64)
    a_low = np.maximum(-(-n // hi), 1)
    exact = (n % a_low == 0) & (n // a_low >= lo)
    bound = goodput(nodes, replicas, n / a_low, a_low)
    pool = n >= n_pref
    if not (exact & pool).any() and not _any_divisible(n[pool & ~exact], a_low[pool & ~exact], lo):
        pool[:] = True
    exact_values = np.where(exact & pool, bound, -np.inf)
    best = int(np.argmax(exact_values))
    best_value, best_n, best_a = float(exact_values[best]), int(n[best]), int(a_low[best])
    open_mask = pool & ~exact & (bound > best_value)
    for i in np.flatnonzero(open_mask)[np.argsort(-bound[open_mask], kind="stable")]:
        if bound[i] <= best_value:
            break
        a = _smallest_divisor(int(n[i]), int(a_low[i]), int(n[i]) // lo)
        if a is None:
            continue
        value = float(goodput(nodes, replicas, np.array([n[i] / a]), np.array([a]))[0])
        if value > best_value or (value == best_value and n[i] < best_n):
            best_value, best_n, best_a = value, int(n[i]), a
    if best_value == -np.inf:
        return 0.0, lo, 1
    return best_value, best_n // best_a, best_a


def _any_divisible(n: np.ndarray, a_low: np.ndarray, lo: int) -> bool:
    """Whether any ``n`` has a divisor ``a`` in ``[a_low, n // lo]``."""
    return any(_smallest_divisor(int(v), int(a), int(v) // lo) is not None for v, a in zip(n, a_low))


def _smallest_divisor(n: int, low: int, high: int) -> int | None:
    """Smallest divisor of ``n`` in ``[low, high]``, or None."""
    if high < low:
        return None
    candidates = np.arange(low, high + 1, dtype=np.int64)
    hits = np.flatnonzero(n % candidates == 0)
    return int(candidates[hits[0]]) if hits.size else None


def validate_placements(nodes: np.ndarray, replicas: np.ndarray) -> None:
    """ValueError unless every placement has integers ``1 <= nodes <= replicas``."""
    for array, name in ((nodes, "num_nodes"), (replicas, "num_replicas")):
        if array.dtype.kind not in "iu" and not (array.dtype.kind == "f" and np.all(array == np.round(array))):
            raise ValueError(f"{name} must hold integers, got {array!r}")
        if np.any(array < 1):
            raise ValueError(f"{name} must be >= 1, got {array!r}")
    if np.any(nodes > replicas):
        raise ValueError("num_nodes must be <= num_replicas (every node runs at least one replica)")


def resolve_bounds(bounds: Sequence[int | None] | None, max_bs: int) -> tuple[int, int]:
    """``(lo, hi)`` of the local batch size: None bounds become 1 and ``max_bs``."""
    if bounds is None:
        return 1, max_bs
    if len(bounds) != 2:
        raise ValueError(f"local_bsz_bounds must be (lo, hi), got {bounds!r}")
    lo = 1 if bounds[0] is None else check_int("local_bsz_bounds[0]", bounds[0], 1)
    hi = max_bs if bounds[1] is None else check_int("local_bsz_bounds[1]", bounds[1], 1)
    if lo > hi:
        raise ValueError(f"local_bsz_bounds must have lo <= hi, got {bounds!r}")
    return lo, hi
