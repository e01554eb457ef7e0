"""Public features of ``adaptive`` that a training script relies on, in one process.

Each test runs a job, "restarts" it the way a new process would
(``restart_process_state``: every in-memory registry forgotten, only the
checkpoint folder kept) and checks what the documentation promises:
``current_epoch`` / ``finished_epochs``, ``State`` subclasses with
``load_state``, ``save_all_states(metadata=...)``, ``ADAPTIVE_CHECKPOINT_KEEP``,
the restore of optimizer, LR scheduler and GradScaler state through
``AdaptiveDataParallel``, Adam in training, and the progress lines.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import re
import shutil

import pytest
import torch

import adaptive
from adaptive.elastic import epoch as epoch_module
from adaptive.elastic import sync_points
from adaptive.checkpoint.states import resumed_checkpoint
from adaptive.checkpoint.store import CheckpointError, CheckpointStore
from conftest import Indices, restart_process_state

MODEL_STATE = "adaptive.parallel.model"


class Regression(torch.utils.data.Dataset):
    """y = x . w + small fixed noise, 4 features."""

    def __init__(self, n: int = 256) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=generator)
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.01 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def store(job) -> CheckpointStore:
    return CheckpointStore(job / "checkpoints")


def assert_identical(actual, expected, path="state"):
    """Exact equality of nested state dicts: same keys, same types of containers, bitwise-equal tensors."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} instead of a tensor"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{path}: {actual} != {expected}"
        assert torch.equal(actual, expected), f"{path}: {actual} != {expected}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual).__name__} instead of a dict"
        assert sorted(map(str, actual)) == sorted(map(str, expected)), \
            f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: {actual} != {expected}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ------------------------------------------------------------------ epochs

def test_current_epoch_and_finished_epochs_follow_the_loop_across_a_restart(job):
    assert adaptive.current_epoch() is None and adaptive.finished_epochs() == 0
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=4, name="train")
    trained: dict[int, list[int]] = collections.defaultdict(list)
    ended = []
    with pytest.raises(SystemExit) as stopped:
        for epoch in adaptive.remaining_epochs_until(4):
            assert adaptive.current_epoch() == epoch and adaptive.finished_epochs() == epoch
            for i, batch in enumerate(loader):
                assert adaptive.current_epoch() == epoch
                trained[epoch] += batch.tolist()
                if (epoch, i) == (2, 0):
                    adaptive.request_stop()
            ended.append(epoch)
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    assert ended == [0, 1]

    restart_process_state()  # a new process: only the checkpoint is left
    assert adaptive.finished_epochs() == 2 and adaptive.current_epoch() is None
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=4, name="train")
    epochs = []
    for epoch in adaptive.remaining_epochs_until(4):
        epochs.append((epoch, adaptive.current_epoch(), adaptive.finished_epochs()))
        for batch in loader:
            trained[epoch] += batch.tolist()
    assert epochs == [(2, 2, 2), (3, 3, 3)]  # resumed in epoch 2, not from scratch
    assert adaptive.current_epoch() is None and adaptive.finished_epochs() == 4
    for epoch in range(4):  # every sample once per epoch, across the restart
        assert sorted(trained[epoch]) == list(range(12)), (epoch, trained[epoch])
    assert list(adaptive.remaining_epochs_until(4)) == []  # nothing left in this process
    assert list(adaptive.remaining_epochs_until(5)) == [4]  # a longer run continues the count
    assert adaptive.finished_epochs() == 5


def test_a_finished_job_is_not_retrained_after_a_restart(job):
    """docs/quickstart.md: "A finished job is not retrained", also without periodic checkpoints."""
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=4)
    for _ in adaptive.remaining_epochs_until(3):
        for _ in loader:
            pass
    restart_process_state()
    assert adaptive.finished_epochs() == 3
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=4)
    assert list(adaptive.remaining_epochs_until(3)) == []
    assert loader.step == 6
    latest = store(job).latest()
    assert latest is not None and latest.info.metadata.get("reason") == "finished", latest.info.metadata


def test_completed_fraction_counts_the_declared_epochs_across_a_restart(job):
    """The part of the declared training done: (finished epochs + position in the epoch) / N, inside the loop."""
    from adaptive.elastic.epoch import completed_fraction

    assert completed_fraction(0.5) is None  # no loop: no declared epoch count
    seen = []
    with pytest.raises(SystemExit):
        for epoch in adaptive.remaining_epochs_until(4):
            seen.append((completed_fraction(0.0), completed_fraction(0.5), completed_fraction(1.0)))
            if epoch == 1:
                adaptive.request_stop()  # acted on at the end of epoch 1
    assert seen == [(0.0, 0.125, 0.25), (0.25, 0.375, 0.5)]
    assert completed_fraction(0.5) is None  # the loop was left

    restart_process_state()  # a new process: the finished epochs come from the checkpoint
    assert completed_fraction(0.0) is None
    for epoch in adaptive.remaining_epochs_until(4):
        seen.append(completed_fraction(0.5))
        if epoch == 3:
            assert completed_fraction(1.0) == 1.0
            adaptive.finish_training()
            assert completed_fraction(0.0) == 1.0  # ended: nothing left to train
    assert seen[2:] == [0.625, 0.875]
    assert completed_fraction(1.0) is None
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="within_epoch"):
            completed_fraction(bad)


def test_completed_fraction_is_none_for_a_loop_that_declares_no_epochs(job):
    from adaptive.elastic.epoch import completed_fraction
    from adaptive.runtime.job import current_job

    assert list(adaptive.remaining_epochs_until(0)) == []
    progress = current_job().part(epoch_module.EpochProgress)
    assert progress.total is None and not progress.looping  # forgotten when the loop ends
    progress.looping, progress.total = True, 0  # as inside remaining_epochs_until(0), which yields nothing
    try:
        assert completed_fraction(0.5) is None  # 0 epochs declared: no fraction
    finally:
        progress.looping, progress.total = False, None


def test_the_autoscaled_loader_reports_the_completed_fraction_in_its_hints(job, monkeypatch):
    """Each report carries (finished epochs + the loader's share of the epoch's samples) / N."""
    from adaptive.batchsize.autoscale import BatchSizeController

    reported = []

    def record(controller, grad_params, progress, completed_fraction=None):
        reported.append((adaptive.current_epoch(), completed_fraction))

    monkeypatch.setattr(BatchSizeController, "report_hints", record)
    net = torch.nn.Linear(1, 1)
    adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=4, name="train")
    loader.autoscale_batch_size(8, local_bsz_bounds=(4, 8), adapt_every=1)
    for _ in adaptive.remaining_epochs_until(2):
        for _ in loader:
            pass
    # a report at every step boundary after the first (no gradient statistics: the batch stays at 4),
    # the last one after the epoch's last step, with all 12 samples of the epoch taken
    assert [epoch for epoch, _ in reported] == [0, 0, 0, 1, 1, 1]
    assert [fraction for _, fraction in reported] == pytest.approx([k / 6 for k in range(1, 7)])
    reported.clear()
    for _ in loader:  # outside the epoch loop: no declared epoch count
        pass
    assert reported and all(fraction is None for _, fraction in reported), reported


# ------------------------------------------------------------ custom states

class StepCounter(adaptive.State):
    """The example of docs/api.md, with a tensor and a list besides the number."""

    def __init__(self, name: str = "my.counter") -> None:
        super().__init__(name)
        self.value = 0
        self.history: list[int] = []
        self.restored = adaptive.load_state(self)

    def state_dict(self):
        return {"value": self.value, "history": torch.tensor(self.history, dtype=torch.long),
                "label": f"after {self.value} steps"}

    def load_state_dict(self, state):
        assert state["label"] == f"after {state['value']} steps"
        self.value = state["value"]
        self.history = state["history"].tolist()


def _count_steps(counter: StepCounter, stop_at: int | None = None) -> adaptive.AdaptiveDataLoader:
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=3, shuffle=True, seed=5)
    for _ in adaptive.remaining_epochs_until(3):
        for _ in loader:
            counter.value += 1
            counter.history.append(loader.step)
            if counter.value == stop_at:
                adaptive.request_stop()
    return loader


def test_user_state_is_checkpointed_with_the_loader_and_restored_by_load_state(job):
    counter = StepCounter()
    assert counter.restored is False  # a fresh job: nothing to restore
    with pytest.raises(SystemExit):
        _count_steps(counter, stop_at=5)
    restart_process_state()
    counter = StepCounter()
    assert counter.restored is True
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=3, shuffle=True, seed=5)
    # the counter was saved at the same step boundary as the loader's position
    assert counter.value == loader.step >= 5 and counter.history == list(range(counter.value))
    restart_process_state()
    counter = StepCounter()
    loader = _count_steps(counter)
    assert counter.value == loader.step == 12  # 3 epochs of 4 steps, each counted once
    assert counter.history == list(range(12))

    restart_process_state()
    other = StepCounter("my.other")  # a name the checkpoint does not have
    assert other.restored is False and other.value == 0
    with pytest.raises(ValueError, match="already exists"):
        StepCounter("my.other")


def test_save_all_states_writes_the_metadata_into_the_manifest(job):
    counter = StepCounter()
    counter.value = 7
    adaptive.save_all_states(metadata={"note": "before evaluation", "score": 0.25, "tags": ["a", "b"]})
    latest = store(job).latest()
    assert latest is not None and "my.counter" in latest.names()
    assert latest.load("my.counter")["value"] == 7
    meta = latest.info.metadata
    assert meta["note"] == "before evaluation" and meta["score"] == 0.25 and meta["tags"] == ["a", "b"]
    assert meta["replicas"] == 1 and meta["nodes"] == 1  # added by the library
    manifest = json.loads((latest.info.path / "manifest.json").read_text())
    assert manifest["metadata"] == meta
    adaptive.save_all_states(metadata={"replicas": 5})  # what the caller gives wins over the defaults
    assert store(job).latest().info.metadata["replicas"] == 5
    adaptive.save_all_states()
    plain = store(job).latest().info.metadata
    assert plain["replicas"] == 1 and plain["nodes"] == 1 and "note" not in plain
    with pytest.raises((TypeError, ValueError)):
        adaptive.save_all_states(metadata={"tensor": torch.zeros(1)})  # not JSON
    restart_process_state()
    assert resumed_checkpoint().info.metadata == plain
    assert StepCounter().value == 7


class Opaque:
    """Not something ``torch.load(weights_only=True)`` may rebuild."""


class Unsafe(adaptive.State):
    def state_dict(self):
        return {"fine": 1, "bad": Opaque()}

    def load_state_dict(self, state):
        raise AssertionError("never loaded")


def test_unsafe_state_is_refused_before_anything_is_written_and_unregister_leaves_the_checkpoint(job):
    StepCounter()
    unsafe = Unsafe("my.unsafe")
    with pytest.raises((TypeError, ValueError, CheckpointError), match="my.unsafe"):
        adaptive.save_all_states()
    assert store(job).list() == []
    unsafe.unregister()
    adaptive.save_all_states()
    names = store(job).latest().names()
    assert "my.counter" in names and "my.unsafe" not in names


@pytest.mark.parametrize("keep, kept", [(None, 2), ("1", 1), ("4", 4)])
def test_adaptive_checkpoint_keep_bounds_the_checkpoints_on_disk(job, monkeypatch, keep, kept):
    if keep is not None:
        monkeypatch.setenv("ADAPTIVE_CHECKPOINT_KEEP", keep)
    counter = StepCounter()
    for i in range(6):
        counter.value = i
        adaptive.save_all_states(metadata={"i": i})
    infos = store(job).list()
    assert [info.metadata["i"] for info in infos] == list(range(6))[-kept:]
    assert len(list((job / "checkpoints").glob("checkpoint-*"))) == kept
    restart_process_state()
    assert StepCounter().value == 5  # the newest one is resumed


def test_adaptive_checkpoint_keep_must_be_a_positive_integer(job, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_KEEP", "0")
    with pytest.raises(ValueError, match="ADAPTIVE_CHECKPOINT_KEEP"):
        StepCounter()
        adaptive.save_all_states()
    assert not (job / "checkpoints").exists() or store(job).list() == []


# --------------------------------------- optimizer, LR scheduler, GradScaler

OPTIMIZERS = {
    "SGD-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05),
}
SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    # its milestones are a collections.Counter
    "MultiStepLR": lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4, 7], gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40),
    # threshold=10: no step counts as an improvement, so the LR is cut after every bad step
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0,
                                                                                threshold=10.0),
    "CosineAnnealingWarmRestarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3),
}
COMBINATIONS = [("SGD-momentum", "StepLR"), ("Adam", "MultiStepLR"), ("AdamW", "OneCycleLR"),
                ("Adagrad", "ReduceLROnPlateau"), ("SGD-momentum", "CosineAnnealingWarmRestarts")]


def _build(optimizer: str, scheduler: str, seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = OPTIMIZERS[optimizer](net.parameters())
    sched = SCHEDULERS[scheduler](opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    model = adaptive.AdaptiveDataParallel(net, opt, sched, scaler)
    return model, opt, sched, scaler


def _train(parts, steps: range) -> None:
    model, opt, sched, scaler = parts
    for i in steps:
        generator = torch.Generator().manual_seed(i)
        x = torch.randn(16, 4, generator=generator)
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(loss.item())
        else:
            sched.step()


def _states(parts) -> dict:
    model, opt, sched, scaler = parts
    return copy.deepcopy({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                          "lr_scheduler": sched.state_dict(), "scaler": scaler.state_dict()})


@pytest.mark.parametrize("optimizer, scheduler", COMBINATIONS)
def test_optimizer_scheduler_and_grad_scaler_state_are_restored_exactly(job, optimizer, scheduler):
    parts = _build(optimizer, scheduler, seed=0)
    _train(parts, range(5))
    saved = _states(parts)
    assert saved["optimizer"]["state"], "the optimizer has no state to restore"
    assert saved["scaler"]["scale"] != 1024.0  # the scale grew: not the constructor's value
    adaptive.save_all_states()
    _train(parts, range(5, 9))
    continued = _states(parts)
    on_disk = store(job).latest().load(MODEL_STATE)
    for key in ("model", "optimizer", "lr_scheduler", "scaler"):
        assert_identical(on_disk[key], saved[key], f"checkpoint[{key!r}]")

    restart_process_state()  # a new process builds everything again, from another seed
    fresh = _build(optimizer, scheduler, seed=1)
    restored = _states(fresh)
    for key in ("model", "optimizer", "lr_scheduler", "scaler"):
        assert_identical(restored[key], saved[key], key)
    _train(fresh, range(5, 9))  # and training continues as if it never stopped
    after = _states(fresh)
    for key in ("model", "optimizer", "lr_scheduler", "scaler"):
        assert_identical(after[key], continued[key], f"continued {key}")


def test_restore_warns_when_the_checkpoint_has_no_scheduler_or_scaler(job, caplog):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    adaptive.AdaptiveDataParallel(net, opt)
    opt.zero_grad()
    net(torch.ones(3, 2)).sum().backward()
    opt.step()
    adaptive.save_all_states()
    restart_process_state()
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with caplog.at_level(logging.WARNING):
        adaptive.AdaptiveDataParallel(net, opt, sched, torch.amp.GradScaler("cpu"))
    assert "no lr_scheduler state" in caplog.text and "no scaler state" in caplog.text
    assert opt.state_dict()["state"][0]["momentum_buffer"] is not None  # what was saved is restored


# ------------------------------------------------------------------- Adam

def _train_adam(epochs: int, stop_at: tuple[int, int] | None = None, losses: list | None = None):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    model = adaptive.AdaptiveDataParallel(net, opt)
    restored = copy.deepcopy(opt.state_dict())
    loader = adaptive.AdaptiveDataLoader(Regression(), batch_size=32, shuffle=True, seed=3)
    stats = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(epochs):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats["loss"] += loss.item() * len(x)
            stats["n"] += len(x)
            if stop_at == (epoch, loader.step):
                adaptive.request_stop()
        with stats.synchronized():
            if losses is not None:
                losses.append(stats["loss"] / stats["n"])
            stats.clear()
    return model, opt, restored


def test_adam_trains_through_adaptive_data_parallel_and_resumes_its_moments(job):
    losses: list[float] = []
    with pytest.raises(SystemExit):
        _train_adam(6, stop_at=(2, 19), losses=losses)
    saved = store(job).latest().load(MODEL_STATE)
    restart_process_state()
    model, opt, restored = _train_adam(6, losses=losses)
    assert model.scaling_rule.name == "adamscale"  # the default rule for Adam-type optimizers
    assert_identical(restored, saved["optimizer"], "optimizer after the restart")
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(restored["state"][0])
    assert len(losses) == 6 and losses[-1] < 0.05 * losses[0], losses  # it learned the regression
    state = opt.state_dict()["state"][0]
    assert float(state["step"]) == 6 * 8  # one Adam step per loader step, none lost or repeated

    resumed = {k: v.clone() for k, v in model.module.state_dict().items()}
    resumed_moments = copy.deepcopy(opt.state_dict())
    restart_process_state()  # the same job without interruption ends at the same weights
    shutil.rmtree(job / "checkpoints")
    model, opt, _ = _train_adam(6)
    assert_identical(model.module.state_dict(), resumed, "weights")
    assert_identical(opt.state_dict(), resumed_moments, "Adam state")


# --------------------------------------------------------------- progress

PROGRESS = re.compile(r"loader train: epoch (\d+), step (\d+), sample (\d+) of (\d+)(.*) \(batch (\d+) samples\)$")


def _progress_lines(caplog) -> list[tuple]:
    found = []
    for record in caplog.records:
        match = PROGRESS.match(record.getMessage())
        if match:
            found.append(match.groups())
    return found


def _run_epochs(epochs: int) -> None:
    loader = adaptive.AdaptiveDataLoader(Indices(40), batch_size=8, name="train")
    for _ in adaptive.remaining_epochs_until(epochs):
        for _ in loader:
            pass


def test_progress_lines_follow_adaptive_progress_interval(job, monkeypatch, caplog):
    monkeypatch.setenv("ADAPTIVE_PROGRESS_INTERVAL", "0.000001")  # a line at every step
    with caplog.at_level(logging.INFO, logger="adaptive"):
        _run_epochs(2)
    lines = _progress_lines(caplog)
    assert len(lines) >= 8, caplog.text[-3000:]
    steps = [int(step) for _, step, _, _, _, _ in lines]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    for epoch, step, sample, total, _, batch in lines:
        assert (int(total), int(batch)) == (40, 8)
        assert int(sample) == 8 * (int(step) - 5 * int(epoch))  # the position within the epoch
    assert {int(epoch) for epoch, *_ in lines} == {0, 1}

    restart_process_state()
    caplog.clear()
    monkeypatch.setenv("ADAPTIVE_PROGRESS_INTERVAL", "0")  # off
    with caplog.at_level(logging.INFO, logger="adaptive"):
        _run_epochs(2)
    assert _progress_lines(caplog) == []
    restart_process_state()
    caplog.clear()
    monkeypatch.delenv("ADAPTIVE_PROGRESS_INTERVAL")  # the default: every 30 s, none in a short run
    with caplog.at_level(logging.INFO, logger="adaptive"):
        _run_epochs(1)
    assert _progress_lines(caplog) == []
    monkeypatch.setenv("ADAPTIVE_PROGRESS_INTERVAL", "soon")
    with pytest.raises(ValueError, match="ADAPTIVE_PROGRESS_INTERVAL"):
        adaptive.env.progress_interval()
