"""The noise scale's arithmetic: the unbiased estimator and the batch configuration."""

from __future__ import annotations

import pytest

from adaptive.goodput import BatchConfig, estimate_from_norms


def test_estimate_from_norms_inverts_expectations():
    sqr, trace, b, n = 2.0, 300.0, 8, 4
    small, big = sqr + trace / b, sqr + trace / (b * n)
    est_sqr, est_var = estimate_from_norms(small, big, n, b, init_batch_size=32)
    assert est_sqr == pytest.approx(sqr) and est_var == pytest.approx(trace / 32)
    with pytest.raises(ValueError, match="count"):
        estimate_from_norms(1.0, 1.0, 1, 8, 8)


def test_batch_config():
    config = BatchConfig(init_batch_size=64, local_bsz=32, accum_steps=4, num_replicas=2)
    assert config.global_batch_size == 256 and config.scale == 4.0
    with pytest.raises(ValueError, match="local_bsz"):
        BatchConfig(64, 0)
    with pytest.raises(TypeError, match="accum_steps"):  # a bool is not an integer (adaptive._utils.checks)
        BatchConfig(64, 8, accum_steps=True)


def test_batch_config_with_the_actual_global_batch():
    """Unequal shares (128 over 3 replicas: 43 + 43 + 42): the actual batch sets the scale."""
    assert BatchConfig(128, 42, num_replicas=3).scale == pytest.approx(126 / 128)
    config = BatchConfig(128, 42, num_replicas=3, batch_size=128)
    assert config.global_batch_size == 128 and config.scale == 1.0
    assert config != BatchConfig(128, 42, num_replicas=3)
    with pytest.raises(ValueError, match="batch_size"):
        BatchConfig(128, 42, num_replicas=3, batch_size=0)
    with pytest.raises(TypeError, match="batch_size"):
        BatchConfig(128, 42, num_replicas=3, batch_size=128.0)
