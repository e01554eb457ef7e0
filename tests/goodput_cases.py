"""Reference cases shared by the goodput-model tests (test_goodput, test_throughput_fit,
test_throughput_profile): true parameters, the step-time formula written out
independently of the library, and synthetic measurements made with it."""

from __future__ import annotations

import numpy as np

from adaptive.goodput import PerfParams

TRUE = PerfParams(alpha_c=0.02, beta_c=0.001, alpha_n=0.08, beta_n=0.01, alpha_r=0.03, beta_r=0.004, gamma=2.5)


def reference_step_time(p: PerfParams, nodes, replicas, local_bsz, accum) -> float:
    """The contract's formula, written out independently of the module."""
    compute = p.alpha_c + p.beta_c * local_bsz
    if replicas == 1:
        sync = 0.0
    elif nodes > 1:
        sync = p.alpha_n + p.beta_n * max(replicas - 2, 0)
    else:
        sync = p.alpha_r + p.beta_r * max(replicas - 2, 0)
    return (accum - 1) * compute + (compute ** p.gamma + sync ** p.gamma) ** (1 / p.gamma)


def synthetic(params: PerfParams, noise: float = 0.0, seed: int = 0):
    """Measurements of 42 configurations under ``params`` (log-normal noise of ``noise``)."""
    rng = np.random.default_rng(seed)
    rows = [(n, r, m, a) for n, r in [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 16)]
            for m in (16, 64, 256) for a in (1, 2)]
    nodes, replicas, local_bsz, accum = (np.array(v) for v in zip(*rows))
    step = np.array([reference_step_time(params, *row) for row in rows])
    compute = params.alpha_c + params.beta_c * local_bsz
    extra = np.maximum(replicas - 2, 0)
    sync = np.where(replicas == 1, np.nan, np.where(nodes > 1, params.alpha_n + params.beta_n * extra,
                                                    params.alpha_r + params.beta_r * extra))

    def jitter(x):
        return x * np.exp(rng.normal(0.0, noise, size=x.shape)) if noise else x

    return nodes, replicas, local_bsz, accum, jitter(step), jitter(compute), jitter(sync)
