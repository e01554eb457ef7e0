"""LR scaling rules: factors, per-step application with schedulers, progress, defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from adaptive.batchsize.scaling_rules import (
    LEGW,
    AdamScale,
    AdaScale,
    LinearScale,
    NoScaling,
    ScalingRule,
    SqrtScale,
    default_scaling_rule,
    make_scaling_rule,
)
from adaptive.checkpoint.versions import StateFormatError
from adaptive.goodput import BatchConfig


@dataclass
class FixedGain:
    """A GainSource with a set batch configuration and a gain function of the scale."""

    config: BatchConfig
    var: float = 3.0
    sqr: float = 1.0

    @property
    def scale(self) -> float:
        return self.config.scale

    def gain(self, scale=None):
        scale = self.scale if scale is None else scale
        return (self.var + self.sqr) / (self.var / scale + self.sqr)


def _sgd(lr=0.1, groups=1):
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(groups)]
    return params, torch.optim.SGD([{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(params)])


def _step_with_unit_grads(params, optimizer):
    """One step with grad = 1; returns each parameter's LR as applied (from its update)."""
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return [float((b - p.detach())[0]) for b, p in zip(before, params)]


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0, 7.5, 64.0])
def test_factors_match_formulas(scale):
    gain = FixedGain(BatchConfig(32, 32)).gain(scale)
    assert AdaScale().factor(scale, gain) == pytest.approx(gain)
    assert AdamScale().factor(scale, gain) == pytest.approx(math.sqrt(gain))
    assert LinearScale().factor(scale, gain) == pytest.approx(scale)
    assert SqrtScale().factor(scale, gain) == pytest.approx(math.sqrt(scale))
    assert NoScaling().factor(scale, gain) == 1.0
    assert 1.0 <= gain <= scale or scale < 1


@pytest.mark.parametrize("rule_cls,formula", [
    (AdaScale, lambda s, g: g), (AdamScale, lambda s, g: math.sqrt(g)),
    (LinearScale, lambda s, g: s), (SqrtScale, lambda s, g: math.sqrt(s)), (NoScaling, lambda s, g: 1.0)])
def test_rule_scales_each_step_and_restores(rule_cls, formula):
    params, optimizer = _sgd(lr=0.1, groups=2)
    source = FixedGain(BatchConfig(init_batch_size=32, local_bsz=64, accum_steps=2, num_replicas=2))
    rule = rule_cls()
    rule.attach(optimizer, source)
    expected = formula(source.scale, source.gain())
    applied = _step_with_unit_grads(params, optimizer)
    assert applied == pytest.approx([0.1 * expected, 0.2 * expected])
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.2]  # base LR restored
    assert rule.last_factor == pytest.approx(expected)
    assert rule.progress == pytest.approx(source.gain())
    assert rule.steps == 1 and rule.samples == 256


@pytest.mark.parametrize("rule_cls", [AdaScale, AdamScale])
def test_rule_with_lr_scheduler(rule_cls):
    params, optimizer = _sgd(lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    source = FixedGain(BatchConfig(16, 64))
    rule = rule_cls()
    rule.attach(optimizer, source)
    factor = rule.factor(source.scale, source.gain())
    for step in range(4):
        applied = _step_with_unit_grads(params, optimizer)
        scheduler.step()
        assert applied[0] == pytest.approx(0.5 ** step * factor)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 ** (step + 1))
    assert rule.progress == pytest.approx(4 * source.gain())


def test_batch_change_changes_factor_and_progress():
    params, optimizer = _sgd()
    source = FixedGain(BatchConfig(32, 32))
    rule = AdaScale()
    rule.attach(optimizer, source)
    _step_with_unit_grads(params, optimizer)
    assert rule.last_factor == pytest.approx(1.0)
    source.config = BatchConfig(32, 128)
    applied = _step_with_unit_grads(params, optimizer)
    assert applied[0] == pytest.approx(0.1 * source.gain(4.0))
    assert rule.progress == pytest.approx(1.0 + source.gain(4.0))
    assert rule.samples == 32 + 128


def test_legw_warms_up_in_proportion_to_scale():
    params, optimizer = _sgd(lr=1.0)
    source = FixedGain(BatchConfig(init_batch_size=10, local_bsz=40))  # scale 4
    rule = LEGW(base_warmup_steps=2)  # 2 steps x 10 samples x scale 4 = 80 samples = 2 steps here
    rule.attach(optimizer, source)
    factors = []
    for _ in range(10):
        _step_with_unit_grads(params, optimizer)
        factors.append(rule.last_factor)
    warmup_samples = 2 * 10 * 4.0
    expected = [2.0 * min(1.0, 40 * (i + 1) / warmup_samples) for i in range(10)]
    assert factors == pytest.approx(expected)
    assert LEGW(0).factor(9.0, 1.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="base_warmup_steps"):
        LEGW(-1)


def test_interrupted_step_does_not_leave_scaled_lr():
    params, optimizer = _sgd(lr=0.1)
    rule = LinearScale()
    rule.attach(optimizer, FixedGain(BatchConfig(8, 32)))

    def failing_closure():
        raise RuntimeError("boom")

    params[0].grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(failing_closure)
    applied = _step_with_unit_grads(params, optimizer)
    assert applied[0] == pytest.approx(0.4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert rule.steps == 1
    rule.detach()
    assert _step_with_unit_grads(params, optimizer)[0] == pytest.approx(0.1)


def test_state_dict_round_trip():
    params, optimizer = _sgd()
    rule = AdaScale()
    rule.attach(optimizer, FixedGain(BatchConfig(8, 32)))
    for _ in range(3):
        _step_with_unit_grads(params, optimizer)
    restored = AdaScale()
    restored.load_state_dict(rule.state_dict())
    assert restored.state_dict() == rule.state_dict()
    assert restored.progress == pytest.approx(3 * FixedGain(BatchConfig(8, 32)).gain())
    with pytest.raises(ValueError, match="dict"):
        restored.load_state_dict([1])


def test_state_format_versions():
    """Version 1 carries a version key; release 0.1 wrote the same counters without
    one (read as version 1); a later format, or a state missing a counter, is refused."""
    rule = LEGW(4)
    state = rule.state_dict()
    assert state == {"version": 1, "name": "legw", "progress": 0.0, "steps": 0, "samples": 0,
                     "last_factor": 1.0, "last_gain": 1.0, "base_warmup_steps": 4.0}
    release_01 = {"name": "adascale", "progress": 12.5, "steps": 10, "samples": 640, "last_factor": 1.5,
                  "last_gain": 1.5}
    restored = AdaScale()
    restored.load_state_dict(release_01)
    assert restored.state_dict() == {"version": 1, **release_01}
    with pytest.raises(StateFormatError, match="version 2"):
        restored.load_state_dict(dict(release_01, version=2))
    with pytest.raises(StateFormatError, match="samples"):
        restored.load_state_dict({k: v for k, v in release_01.items() if k != "samples"})
    with pytest.raises(TypeError, match="base_warmup_steps"):
        LEGW("5")


def test_defaults_and_names():
    model = torch.nn.Linear(2, 2)
    assert isinstance(default_scaling_rule(torch.optim.SGD(model.parameters(), lr=0.1)), AdaScale)
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad):
        assert isinstance(default_scaling_rule(cls(model.parameters(), lr=0.1)), AdamScale), cls
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(make_scaling_rule(None, sgd), AdaScale)
    assert isinstance(make_scaling_rule("SQRT", sgd), SqrtScale)
    rule = LEGW(5)
    assert make_scaling_rule(rule, sgd) is rule
    with pytest.raises(ValueError, match="legw"):
        make_scaling_rule("legw", sgd)
    with pytest.raises(ValueError, match="unknown scaling rule 'cubic'"):
        make_scaling_rule("cubic", sgd)
    with pytest.raises(TypeError, match="ScalingRule"):  # a wrong type (adaptive._utils.checks rule)
        make_scaling_rule(3, sgd)
    assert issubclass(AdaScale, ScalingRule)
