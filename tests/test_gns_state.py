"""GradientNoiseScale without a model: its saved formats, and the batch it is told about."""

from __future__ import annotations

import pytest
import torch

from adaptive.batchsize.gns import GradientNoiseScale
from adaptive.batchsize.scaling_rules import AdaScale
from adaptive.goodput import BatchConfig
from adaptive.checkpoint.versions import StateFormatError


def _two_group_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                            {"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=0.1)


# Saved states exactly as this and earlier releases wrote them (two parameter groups).
STATE_V2 = {"version": 2, "sqr": [1.0, 2.0], "var": [30.0, 40.0], "weight": 0.5, "estimator": "direct",
            "magnitude": [0.1, 0.2], "updates": 7, "skipped": 1, "init_batch_size": 16}
STATE_V1 = {"version": 1, "sqr": [1.0, 2.0], "var": [30.0, 40.0], "weight": 0.5, "estimator": "",
            "updates": 7, "skipped": 0, "init_batch_size": 16}


def test_saved_state_formats():
    """Version 2 (this release) and version 1 load; a later version, a state without
    one and a state with missing fields are refused with a clear error."""
    gns = GradientNoiseScale(_two_group_optimizer())
    gns.load_state_dict(STATE_V2)
    gns.set_batch_config(init_batch_size=16, local_bsz=16)
    assert (gns.sqr_avg(), gns.var_avg(), gns.num_updates, gns.num_skipped) == (6.0, 140.0, 7, 1)
    assert gns.state_dict() == STATE_V2
    old = GradientNoiseScale(_two_group_optimizer())
    old.load_state_dict(STATE_V1)  # plain averages, weighed as one measurement of their size
    old.set_batch_config(init_batch_size=16, local_bsz=16)
    assert old.sqr_avg() == pytest.approx(6.0) and old.var_avg() == pytest.approx(140.0)
    migrated = old.state_dict()
    assert migrated["version"] == 2 and migrated["magnitude"] == [0.0, 0.0]
    assert migrated["weight"] == pytest.approx(0.5 / 146.0) and migrated["updates"] == 7
    with pytest.raises(StateFormatError, match="version 3"):
        gns.load_state_dict(dict(STATE_V2, version=3))
    with pytest.raises(StateFormatError, match="version"):
        gns.load_state_dict({k: v for k, v in STATE_V2.items() if k != "version"})
    with pytest.raises(StateFormatError, match="magnitude"):
        gns.load_state_dict({k: v for k, v in STATE_V2.items() if k != "magnitude"})
    with pytest.raises(StateFormatError, match="mapping"):
        gns.load_state_dict([1, 2])
    assert (gns.sqr_avg(), gns.var_avg()) == (6.0, 140.0)  # a refused state leaves the estimates alone


def test_actual_global_batch_sets_scale_and_gain():
    """3 replicas sharing a global batch of 128 (43 + 43 + 42): the batch did not change,
    so the scale, the gain and the LR factor are 1, not 126 / 128."""
    optimizer = _two_group_optimizer()
    gns = GradientNoiseScale(optimizer)
    gns.load_state_dict(STATE_V2)
    gns.set_batch_config(init_batch_size=128, local_bsz=42, num_replicas=3)
    assert gns.scale == pytest.approx(126 / 128) and gns.gain() < 1.0
    gns.set_batch_config(init_batch_size=128, local_bsz=42, num_replicas=3, batch_size=128)
    assert gns.config == BatchConfig(128, 42, 1, 3, batch_size=128)
    assert gns.config.global_batch_size == 128 and gns.scale == 1.0 and gns.gain() == 1.0
    rule = AdaScale()
    rule.attach(optimizer, gns)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    assert rule.last_factor == 1.0 and rule.last_gain == 1.0 and rule.samples == 128
    with pytest.raises(ValueError, match="batch_size"):
        gns.set_batch_config(init_batch_size=128, local_bsz=42, num_replicas=3, batch_size=0)
