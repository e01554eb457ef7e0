"""The step-time and efficiency formulas of the goodput model (numpy only).

Unvalidated and numpy-broadcastable: :class:`~adaptive.batchsize.goodput.GoodputFunction`
checks its arguments and calls these, and the fit
(:mod:`adaptive.batchsize.throughput_fit`) evaluates :func:`overlap` for
many parameter vectors at once.  The formulas are in the docstring of
:mod:`adaptive.batchsize.goodput`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from adaptive.batchsize.goodput import GradParams, PerfParams

__all__ = ["compute_time", "sync_time", "overlap", "step_time", "efficiency"]


def compute_time(p: PerfParams, local_bsz: Any) -> np.ndarray:
    """Seconds of one micro-batch's forward and backward."""
    return p.alpha_c + p.beta_c * np.asarray(local_bsz, dtype=float)


def sync_time(p: PerfParams, num_nodes: Any, num_replicas: Any) -> np.ndarray:
    """Seconds of one gradient synchronisation (0 for one replica)."""
    nodes = np.asarray(num_nodes, dtype=float)
    replicas = np.asarray(num_replicas, dtype=float)
    extra = np.maximum(replicas - 2.0, 0.0)
    multi_node = p.alpha_n + p.beta_n * extra
    one_node = p.alpha_r + p.beta_r * extra
    return np.where(replicas > 1, np.where(nodes > 1, multi_node, one_node), 0.0)


def overlap(compute: np.ndarray, sync: np.ndarray, gamma: Any) -> np.ndarray:
    """``(compute**gamma + sync**gamma) ** (1/gamma)`` without overflow."""
    high = np.maximum(compute, sync)
    low = np.minimum(compute, sync)
    ratio = np.divide(low, high, out=np.zeros_like(high, dtype=float), where=high > 0)
    return high * (1.0 + ratio ** gamma) ** (1.0 / gamma)


def step_time(p: PerfParams, num_nodes: Any, num_replicas: Any, local_bsz: Any, accum_steps: Any) -> np.ndarray:
    """Seconds of one optimizer step: ``accum_steps - 1`` plain micro-batches,
    then one whose backward overlaps the synchronisation."""
    compute = compute_time(p, local_bsz)
    sync = sync_time(p, num_nodes, num_replicas)
    accum = np.asarray(accum_steps, dtype=float)
    return (accum - 1.0) * compute + overlap(compute, sync, p.gamma)


def efficiency(g: GradParams, init_batch_size: int, batch_size: Any) -> np.ndarray:
    """``gain / scale`` of a global batch (batches below the reference count as 1)."""
    scale = np.maximum(np.asarray(batch_size, dtype=float) / init_batch_size, 1.0)
    return (g.var + g.sqr) / (g.var + scale * g.sqr)
