"""AdaptiveDataLoader with a ramp-up schedule: sizes follow the schedule, exact resume mid-ramp, autoscale cap."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import adaptive
from adaptive.elastic import sync_points
from adaptive.batchsize.rampup import LinearRampup, StagedSchedule
from adaptive.data.sampler import ElasticSampler
from adaptive.data.sample_batches import SampleBatching
from adaptive.data.steps import StepShape, StepSizer
from conftest import Indices, restart_process_state


def _run(schedule, epochs: int, n: int = 60, stop_at: tuple[int, int] | None = None, log: list | None = None,
         model: bool = True, **kwargs):
    """Train a tiny model; log (epoch, step, consumed before the step, global size, indices) per step."""
    torch.manual_seed(0)
    net = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    ddp = adaptive.AdaptiveDataParallel(net, optimizer, scaling_rule="linear") if model else None
    loader = adaptive.AdaptiveDataLoader(Indices(n), shuffle=True, seed=2, batch_size_schedule=schedule, **kwargs)
    for epoch in adaptive.remaining_epochs_until(epochs):
        for i, batch in enumerate(loader):
            step = loader.current_step
            if log is not None:
                log.append((epoch, loader.step, loader.consumed, step.size, tuple(batch.tolist())))
            if ddp is not None:
                optimizer.zero_grad()
                ddp(batch.float()[:, None] / n).pow(2).mean().backward()
                optimizer.step()
            if stop_at == (epoch, i):
                sync_points.request_stop()
    return loader


def _check_follows(schedule, log, n: int, epochs: int) -> None:
    """Every step's size is the schedule's size at its start (epoch ends aside); each sample once per epoch."""
    consumed = 0
    for epoch in range(epochs):
        seen = np.zeros(n, dtype=np.int64)
        steps = [entry for entry in log if entry[0] == epoch]
        for position, (_, _, before, size, indices) in enumerate(steps):
            assert before == consumed
            last = position == len(steps) - 1
            assert size == schedule.batch_size_at(consumed) or (last and size < schedule.batch_size_at(consumed))
            np.add.at(seen, list(indices), 1)
            consumed += size
        assert seen.tolist() == [1] * n


def test_sample_batches_follow_a_staged_schedule_across_epochs(job):
    schedule = StagedSchedule("0:4 20:8 70:16")
    log: list = []
    loader = _run("0:4 20:8 70:16", 3, log=log)
    _check_follows(schedule, log, 60, 3)
    assert {entry[3] for entry in log} >= {4, 8, 16}
    assert loader.schedule == schedule and loader.batch_size == 16 and loader.consumed == 180


def test_graceful_stop_mid_ramp_resumes_the_schedule_exactly(job):
    schedule = LinearRampup(start=2, increment=2, rampup=90, target=12)
    log: list = []
    with pytest.raises(SystemExit):
        _run(schedule, 2, stop_at=(0, 9), log=log)
    restart_process_state()
    _run(schedule, 2, log=log)
    resumed = list({entry[:2]: entry for entry in log}.values())  # the replayed step replaces its first run
    _check_follows(schedule, resumed, 60, 2)
    shutil.rmtree(job / "checkpoints")
    restart_process_state()
    uninterrupted: list = []
    _run(schedule, 2, log=uninterrupted)
    assert resumed == uninterrupted


def test_ramp_is_independent_of_the_replica_count():
    """Plans for 1, 2 and 3 replicas take the same global batches; a rescale mid-ramp continues them."""
    schedule = StagedSchedule("0:6 30:12 80:24")
    sampler = ElasticSampler(100, shuffle=True, seed=1)
    batching = SampleBatching(sampler, "x")
    sizer = StepSizer("samples", schedule, lambda r: StepShape(1, 1), min_micro=lambda r: r)

    class State:
        index = consumed = 0

    def global_batches(state, replicas, stop=None):
        steps = [list(batching.plan(state, sizer, replicas, rank))[:stop] for rank in range(replicas)]
        for step in steps[0]:
            batching.commit(state, step)
        return [sorted(i for rank in range(replicas) for i in steps[rank][k].indices[0])
                for k in range(len(steps[0]))]

    single = global_batches(State(), 1)
    for first, second in ((2, 3), (3, 1)):
        state = State()
        assert global_batches(state, first, stop=5) + global_batches(state, second) == single


def test_token_ramp_keeps_every_step_within_the_scheduled_tokens(job):
    lengths = np.random.default_rng(0).integers(1, 16, 200)
    dataset = [torch.zeros(int(length)) for length in lengths]
    schedule = StagedSchedule("0:64 400:160 1500:320", unit="tokens")
    loader = adaptive.AdaptiveDataLoader(dataset, max_tokens=80, lengths=lengths, shuffle=True,
                                         batch_size_schedule=schedule, collate_fn=lambda batch: batch)
    consumed = 0
    for _ in adaptive.remaining_epochs_until(2):
        for batch in loader:
            step = loader.current_step
            scheduled = schedule.batch_size_at(consumed)
            assert max(len(t) for t in batch) * len(batch) <= min(80, scheduled)
            if loader.is_accumulation_step():
                continue
            assert loader.consumed == consumed and step.padded_tokens <= scheduled
            if not step.position.finished:  # an epoch's last step holds what is left
                assert step.planned_size <= scheduled < step.planned_size + step.num_micro_steps  # rounded down
            consumed += step.size
    assert loader.consumed == consumed == 2 * int(lengths.sum())
    assert loader.accumulation_steps == 4 and loader.current_local_bsz == 80  # 320 tokens = 4 x 80


def test_schedule_caps_autoscale(job):
    loader = _run_autoscaled_loader()
    assert loader.batch_size == 8  # autoscale starts from the reference 64, capped by the schedule's 8
    sizer = StepSizer("samples", StagedSchedule("0:8 100:32"), lambda r: StepShape(1, 1),
                      min_micro=lambda r: r)
    sizer.autoscale = lambda: (16, 3)  # 16 per replica x 3 micro-steps on 2 replicas: 96
    assert sizer.shape(0, 2) == StepShape(8, 1)  # one micro-step, shrunk to the cap
    assert sizer.shape(100, 2) == StepShape(32, 1)  # one micro-step of 32 fits the cap of 32
    sizer.autoscale = lambda: (4, 3)  # 24 <= 32: autoscale's choice stands
    assert sizer.shape(100, 2) == StepShape(8, 3)


def _run_autoscaled_loader():
    net = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    adaptive.AdaptiveDataParallel(net, optimizer)
    loader = adaptive.AdaptiveDataLoader(Indices(50), batch_size=64, batch_size_schedule="0:8 40:64")
    loader.autoscale_batch_size(128, (1, 64), gradient_accumulation=True)
    return loader


@pytest.mark.parametrize("spec, error", [
    ("0:64 200X:128", "200X"),
    ("10:64", "first threshold must be 0"),
    ("0:64 100:0", "size must be >= 1"),
    ("0:64 50:128 40:256", "must exceed the previous threshold"),
    (StagedSchedule("0:64", unit="tokens"), "counts tokens but this loader batches by samples"),
    (2.5, "batch-size schedule must be"),
])
def test_bad_schedules_are_refused_with_the_reason(job, spec, error):
    with pytest.raises((ValueError, TypeError), match=error):
        adaptive.AdaptiveDataLoader(Indices(10), batch_size_schedule=spec)


def test_schedule_smaller_than_the_replica_count_is_an_error_naming_batch_size():
    sampler = ElasticSampler(10)
    batching = SampleBatching(sampler, "x")
    sizer = StepSizer("samples", StagedSchedule("0:2"), lambda r: StepShape(1, 1), min_micro=lambda r: r)

    class State:
        index = consumed = 0

    with pytest.raises(ValueError, match="batch_size=2 is smaller than the number of replicas"):
        list(batching.plan(State(), sizer, 3, 0))
