"""The elastic core in one process: loaders, epochs, accumulators, checkpoints and replay."""

from __future__ import annotations

import copy
from typing import Any

import shutil

import numpy as np
import pytest
import torch

import adaptive
from adaptive.runtime import env
from adaptive.elastic import sync_points
from conftest import restart_process_state


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def test_env_defaults_to_one_replica(job):
    assert (env.rank(), env.num_replicas(), env.num_nodes(), env.local_rank()) == (0, 1, 1, 0)
    assert env.checkpoint_path() == str(job / "checkpoints")


def test_env_reads_torchrun_variables_and_rejects_garbage(job, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert (env.num_replicas(), env.rank(), env.num_nodes()) == (6, 4, 2)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    assert env.num_nodes() == 3
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "soon")
    with pytest.raises(ValueError, match="ADAPTIVE_CHECKPOINT_INTERVAL"):
        env.checkpoint_interval()
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        env.num_replicas()


def test_default_checkpoint_path_is_per_job_under_cwd(job, monkeypatch):
    monkeypatch.delenv("ADAPTIVE_CHECKPOINT_PATH")
    monkeypatch.chdir(job)
    monkeypatch.setenv("ADAPTIVE_JOB_ID", "my job/1")
    assert env.checkpoint_path() == str(job / ".adaptive" / "my_job_1" / "checkpoints")


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"sampler": torch.utils.data.SequentialSampler(range(3))}, "sampler"),
        ({"batch_sampler": [[0]]}, "batch_sampler"),
        ({"generator": torch.Generator()}, "generator"),
        ({"colate_fn": None}, "colate_fn"),
    ],
)
def test_loader_rejects_options_it_cannot_honour(job, kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        adaptive.AdaptiveDataLoader(Indices(), **kwargs)


def test_loader_rejects_empty_dataset(job):
    with pytest.raises(ValueError, match="empty"):
        adaptive.AdaptiveDataLoader(Indices(0))


def test_from_dataloader_keeps_settings_and_refuses_custom_samplers(job):
    plain = torch.utils.data.DataLoader(Indices(), batch_size=8, shuffle=True, drop_last=True)
    loader = adaptive.AdaptiveDataLoader.from_dataloader(plain)
    assert loader.batch_size == 8 and loader.sampler.shuffle and loader.sampler.drop_last
    assert len(loader) == 50 // 8
    weighted = torch.utils.data.DataLoader(Indices(), batch_size=8,
                                           sampler=torch.utils.data.WeightedRandomSampler([1.0] * 50, 50))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        adaptive.AdaptiveDataLoader.from_dataloader(weighted)


def test_each_epoch_is_a_seeded_permutation(job):
    loader = adaptive.AdaptiveDataLoader(Indices(), batch_size=8, shuffle=True, seed=3)
    orders = []
    for _ in adaptive.remaining_epochs_until(2):
        orders.append(torch.cat(list(loader)).tolist())
    assert all(sorted(order) == list(range(50)) for order in orders)
    assert orders[0] != orders[1]


def test_overlapping_loops_and_accumulator_in_loop_are_errors(job):
    first = adaptive.AdaptiveDataLoader(Indices(), batch_size=5)
    second = adaptive.AdaptiveDataLoader(Indices(), batch_size=5)
    for _ in first:
        with pytest.raises(RuntimeError, match="overlapping"):
            next(iter(second))
        with pytest.raises(RuntimeError, match="inside an AdaptiveDataLoader loop"):
            adaptive.Accumulator()
        break


def test_accumulator_sums_numbers_arrays_and_tensors(job):
    acc = adaptive.Accumulator(base=1.0)
    acc["n"] += 3
    acc["n"] += 4
    acc["v"] += np.array([1, 2])
    acc["t"] += torch.tensor([0.5])
    assert acc["n"] == 7  # pending increments, before synchronization
    with acc.synchronized():
        assert acc["n"] == 7 and acc["base"] == 1.0
        assert acc["v"].tolist() == [1, 2] and acc["t"].tolist() == [0.5]
        acc["n"] = 0
    acc["n"] += 1
    with acc.synchronized():
        assert acc["n"] == 1
        acc.clear()
    with acc.synchronized():
        assert dict(acc) == {}
    with pytest.raises(TypeError, match="numbers, numpy arrays or CPU tensors"):
        acc["s"] = "text"


def _train(epochs: int, stop_at: tuple[int, int] | None = None, log: list | None = None):
    """A tiny job; stop_at=(epoch, step_in_epoch) requests a graceful stop there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = adaptive.AdaptiveDataParallel(model, optimizer)
    train = adaptive.AdaptiveDataLoader(Indices(40), batch_size=6, shuffle=True)
    valid = adaptive.AdaptiveDataLoader(Indices(10), batch_size=4)
    stats = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(epochs):
        for i, batch in enumerate(train):
            stats["seen"] += np.bincount(batch.numpy(), minlength=40)
            loss = model(batch.float()[:, None] / 40).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if stop_at == (epoch, i):
                sync_points.request_stop()
        for batch in valid:
            stats["valid"] += len(batch)
        with stats.synchronized():
            if log is not None:
                log.append((epoch, stats["seen"].copy(), stats["valid"]))
            stats.clear()
    return model


def test_graceful_stop_mid_epoch_resumes_at_the_exact_step(job):
    log: list = []
    with pytest.raises(SystemExit) as stopped:
        _train(3, stop_at=(1, 2), log=log)
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    restart_process_state()
    model = _train(3, log=log)
    assert [epoch for epoch, _, _ in log] == [0, 1, 2]
    for _, seen, valid in log:
        assert seen.tolist() == [1] * 40 and valid == 10
    reference_state = model.module.state_dict()
    # A fresh job without interruption reaches the same weights.
    shutil.rmtree(job / "checkpoints")
    restart_process_state()
    uninterrupted = _train(3)
    for key, value in uninterrupted.module.state_dict().items():
        torch.testing.assert_close(value, reference_state[key])


def test_replay_skips_finished_loops_and_reuses_synchronized_results(job):
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=4)
    acc = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(1):
        for batch in loader:
            acc["n"] += len(batch)
        with acc.synchronized():
            first = acc["n"]
        sync_points.request_stop()
        with pytest.raises(SystemExit):
            for _ in adaptive.AdaptiveDataLoader(Indices(3), batch_size=1):
                pass
        break  # the process exits with the stop
    restart_process_state()
    loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=4)
    acc = adaptive.Accumulator()
    replayed = []
    for epoch in adaptive.remaining_epochs_until(1):
        assert list(loader) == []  # the finished loop is skipped
        with acc.synchronized():  # returns the saved result, no new increments
            replayed.append(acc["n"])
    assert replayed == [first] == [12]


def test_break_counts_as_finished_loop(job):
    loader = adaptive.AdaptiveDataLoader(Indices(20), batch_size=2)
    for _ in adaptive.remaining_epochs_until(1):
        for i, _ in enumerate(loader):
            if i == 2:
                break
        assert len(list(loader)) == 10  # a second loop in the same epoch starts from the beginning
    assert loader.step == 12  # the step broken out of is not counted as taken


def _train_until(max_steps: int, where: str, epochs: int = 4) -> tuple[list[int], Any]:
    """The ``--max-steps`` pattern: the samples trained, and the loader.

    ``where``: finish_training() after the epoch's loop ("after-loop"), or in
    the loop body on the last step, then leaving it ("in-loop-break") or not
    ("in-loop", the loop ends at its next step).
    """
    trained: list[int] = []
    loader = adaptive.AdaptiveDataLoader(Indices(20), batch_size=4, shuffle=True)
    for _ in adaptive.remaining_epochs_until(epochs):
        for batch in loader:
            trained.extend(batch.tolist())
            if where != "after-loop" and loader.step + 1 >= max_steps:
                adaptive.finish_training()
                if where == "in-loop-break":
                    break
        if loader.step >= max_steps:
            if where == "after-loop":
                adaptive.finish_training()
            break
    return trained, loader


@pytest.mark.parametrize("where", ["after-loop", "in-loop", "in-loop-break"])
def test_finish_training_checkpoints_an_early_end_that_a_relaunch_keeps(job, where):
    trained, loader = _train_until(7, where)
    steps = 10 if where == "after-loop" else 7  # after the loop: the epoch's loop ran to its end (5 steps each)
    assert loader.step == steps and len(trained) == 4 * steps and adaptive.training_finished()
    latest = adaptive.checkpoint.fencing.checkpoint_store().latest()
    assert latest.info.metadata["reason"] == "finished" and latest.info.metadata["training_ended"] is True
    restart_process_state()
    replayed, loader = _train_until(7, where)
    assert replayed == [] and loader.step == steps  # nothing trained again, the position is the saved one
    assert adaptive.training_finished() and list(adaptive.remaining_epochs_until(4)) == []


def test_break_without_finish_training_warns_and_resumes_from_the_last_checkpoint(job, caplog):
    loader = adaptive.AdaptiveDataLoader(Indices(20), batch_size=4)
    with caplog.at_level("WARNING", logger="adaptive.elastic.epoch"):
        for _ in adaptive.remaining_epochs_until(3):
            for _ in loader:
                pass
            break
        assert "without finish_training()" not in caplog.text  # a break or an exception? Known at the end
        assert not adaptive.training_finished()
        restart_process_state()  # the job ends as if the process exited normally: it was a break
    assert "without finish_training()" in caplog.text
    assert list(adaptive.remaining_epochs_until(3)) == [0, 1, 2]  # no finished checkpoint: all epochs remain


def test_periodic_checkpoints_and_resume_after_crash_roll_back_together(job, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "0.0001")
    seen_before = []
    loader = adaptive.AdaptiveDataLoader(Indices(30), batch_size=3, shuffle=True)
    for _ in adaptive.remaining_epochs_until(1):
        for i, batch in enumerate(loader):
            seen_before.extend(batch.tolist())
            if i == 5:
                break  # a "crash" here: state on disk is from a boundary before it
    restart_process_state()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "0")
    resumed = adaptive.AdaptiveDataLoader(Indices(30), batch_size=3, shuffle=True)
    assert resumed.step in (5, 6)  # the last periodic checkpoint was at one of the last boundaries


def test_gns_interval_measures_every_nth_step(job):
    net = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"gns_interval must be an integer >= 1 \(optimizer steps\) or .auto."):
        adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1), gns_interval=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    model = adaptive.AdaptiveDataParallel(model, optimizer, gns_interval=3, scaling_rule="none")
    loader = adaptive.AdaptiveDataLoader(Indices(40), batch_size=4, shuffle=True)
    for _ in adaptive.remaining_epochs_until(3):
        for batch in loader:
            x = batch.float()[:, None] / 40
            for net, opt in ((model, optimizer), (reference, reference_optimizer)):
                opt.zero_grad()
                net(x).pow(2).mean().backward()
            # one replica: DDP's reduction is skipped, the gradient is the module's own
            torch.testing.assert_close(model.module.weight.grad, reference.weight.grad)
            optimizer.step()
            reference_optimizer.step()
    # 30 steps, one replica: the differenced estimator stores steps 2, 5, ..., 26
    # and pairs them with steps 3, 6, ..., 27
    assert model.gns.num_updates == 9


def test_replicas_agree_about_every_agreement_interval_and_stop_together(job, monkeypatch):
    """With several replicas the stop/checkpoint agreement runs about every
    AGREEMENT_INTERVAL seconds, at the spacing the slowest replica proposes,
    and a stop is still acted on within two agreements (two replicas faked:
    the other one proposes ``peer`` boundaries; the clock is fake)."""
    from adaptive.runtime import collectives

    clock = {"now": 0.0}
    peer = {"spacing": 1000}
    reduced: list[list[float]] = []

    def fake_allreduce(values):
        agreed = [max(values[0], 0.0), max(values[1], 0.0), max(values[2], -float(peer["spacing"])), *values[3:]]
        reduced.append(agreed)
        return collectives._Ready(torch.tensor(agreed, dtype=torch.float64))

    monkeypatch.setattr(env, "num_replicas", lambda: 2)
    monkeypatch.setattr(sync_points.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(collectives, "allreduce_max_async", fake_allreduce)
    saved: list[dict] = []
    monkeypatch.setattr(sync_points.states, "save_all_states", lambda info, blocking=True: saved.append(info))
    step_time = 0.01  # 10 ms steps: 10 boundaries per 0.1 s
    for _ in range(200):
        clock["now"] += step_time
        sync_points.step_boundary(dict)
    expected = sync_points.AGREEMENT_INTERVAL / step_time
    assert reduced[-1][2] == -round(expected)
    assert len(reduced) < 200 / expected + 5
    peer["spacing"] = 3  # a slower peer: its (smaller) spacing wins at the next agreements
    for _ in range(40):
        clock["now"] += step_time
        sync_points.step_boundary(dict)
    assert reduced[-1][2] == -3
    sync_points.request_stop()
    with pytest.raises(SystemExit) as stopped:
        for boundary in range(1, 100):
            clock["now"] += step_time
            sync_points.step_boundary(dict)
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE and boundary <= 2 * 3
    assert [info["reason"] for info in saved] == ["stop"]


def test_a_live_copy_brings_back_the_learning_rate_a_discarded_step_scheduled(job):
    """A step a lost member discarded is trained again from the last commit point: its LR scheduler stepped
    once, and a scheduler that scales the current LR (StepLR) must not scale it twice when it steps again."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    wrapped = adaptive.AdaptiveDataParallel(model, optimizer, scheduler)
    state = wrapped._state
    committed = state.live_copy()  # the commit point: after a step, before the next
    scheduler.step()  # the step in flight, discarded: its scheduler stepped
    assert optimizer.param_groups[0]["lr"] == 0.5
    state.restore_live_copy(committed)
    assert optimizer.param_groups[0]["lr"] == 1.0 and scheduler.last_epoch == 0
    scheduler.step()  # the same step, trained again
    assert optimizer.param_groups[0]["lr"] == 0.5
