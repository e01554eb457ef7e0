"""Where stops and checkpoints happen, how objects are named and restored, in one process.

These pin the rules of docs/restarts.md that ordinary scripts rely on: a stop
at a loop's last step replays that step, per-epoch accumulators never mix
epochs, building is local, a finished job is checkpointed, one save per
interval, and a stop that cannot checkpoint does not pretend it did.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import adaptive
from adaptive.checkpoint import states
from adaptive.runtime import collectives
from adaptive.runtime import env
from adaptive.elastic import sync_points
from adaptive.runtime.step import stream as step_stream
from adaptive.runtime.job import current_job
from adaptive.checkpoint.store import CheckpointStore
from conftest import Indices, restart_process_state

REPO = Path(__file__).resolve().parent.parent


def _latest(job: Path):
    return CheckpointStore(job / "checkpoints").latest()


def _train_epochs(epochs: int, stop_at: tuple[int, int] | None = None, log: list | None = None) -> None:
    """The pytorch-cifar pattern: accumulators created inside train() and valid(), every epoch."""
    train_loader = adaptive.AdaptiveDataLoader(Indices(12), batch_size=4, shuffle=True)
    valid_loader = adaptive.AdaptiveDataLoader(Indices(5), batch_size=2)

    def train(epoch: int) -> None:
        stats = adaptive.Accumulator()
        for step, batch in enumerate(train_loader):
            stats["total"] += len(batch)
            stats["sum"] += int(batch.sum())
            if stop_at == (epoch, step):
                sync_points.request_stop()
        with stats.synchronized():
            log.append(("train", epoch, stats["total"], stats["sum"]))

    def valid(epoch: int) -> None:
        stats = adaptive.Accumulator()
        for batch in valid_loader:
            stats["total"] += len(batch)
        with stats.synchronized():
            log.append(("valid", epoch, stats["total"]))

    for epoch in adaptive.remaining_epochs_until(epochs):
        train(epoch)
        valid(epoch)


@pytest.mark.parametrize("stop_at", [(1, 0), (1, 1), (1, 2), (2, 2)])
def test_per_epoch_accumulators_keep_their_epochs_totals_across_a_stop(job, stop_at):
    log: list = []
    with pytest.raises(SystemExit) as stopped:
        _train_epochs(3, stop_at=stop_at, log=log)
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    restart_process_state()
    _train_epochs(3, log=log)
    results = {entry[:2]: entry[2:] for entry in log}  # a replayed synchronized() repeats its saved result
    assert sorted(results) == sorted((kind, epoch) for epoch in range(3) for kind in ("train", "valid"))
    for epoch in range(3):
        assert results[("train", epoch)] == (12, sum(range(12))), log
        assert results[("valid", epoch)] == (5,), log


def test_default_names_count_within_each_epoch_and_leave_with_it(job):
    outer = adaptive.Accumulator()
    names = []
    for _ in adaptive.remaining_epochs_until(2):
        first, second = adaptive.Accumulator(), adaptive.Accumulator()
        loader = adaptive.AdaptiveDataLoader(Indices(4), batch_size=2)
        names.append([state.name for state in states.registered_states()])
        list(loader)
    assert outer._state.name == "adaptive.accumulator.0"
    assert "adaptive.accumulator.e0.0@epoch0" in names[0] and "adaptive.accumulator.e0.1@epoch0" in names[0]
    assert "adaptive.dataloader.e1.0@epoch1" in names[1]
    assert not any("@epoch0" in name for name in names[1]), "epoch 0's objects left the checkpoint"
    assert first._state.name == "adaptive.accumulator.e1.0@epoch1" and second._state.name.endswith("e1.1@epoch1")


def test_explicit_names_may_be_reused_every_epoch(job):
    for epoch in adaptive.remaining_epochs_until(3):
        stats = adaptive.Accumulator(name="train")
        stats["n"] += epoch
        with stats.synchronized():
            assert stats["n"] == epoch


def test_a_stop_known_before_the_last_step_replays_that_step(job):
    """DCGAN uses a variable set in the loop body after the loop: it must be bound after a replay."""
    after_loop = []

    def run(stop_at_step: int | None) -> None:
        loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=2)  # 4 steps
        for _ in adaptive.remaining_epochs_until(2):
            for step, batch in enumerate(loader):
                b_size = len(batch)
                if step == stop_at_step:
                    sync_points.request_stop()
            after_loop.append(b_size)

    with pytest.raises(SystemExit):
        run(stop_at_step=2)  # known at the boundary before the last step
    latest = _latest(job)
    assert latest.info.metadata["step"] == 3 and latest.info.metadata["index"] == 6
    restart_process_state()
    run(stop_at_step=None)
    assert after_loop == [2, 2]


def test_a_stop_in_a_loops_last_step_waits_for_the_end_of_the_epoch(job):
    ran_after_loop = []

    def run(stop: bool) -> None:
        loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=2)
        for epoch in adaptive.remaining_epochs_until(2):
            for step, batch in enumerate(loader):
                b_size = len(batch)
                if stop and step == 3:
                    sync_points.request_stop()
            ran_after_loop.append((epoch, b_size))

    with pytest.raises(SystemExit) as stopped:
        run(stop=True)
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    assert ran_after_loop == [(0, 2)]  # the code after the loop ran before the stop
    meta = _latest(job).info.metadata
    assert meta["epoch"] == 1 and meta["epoch_finished"] and meta["reason"] == "stop"
    restart_process_state()
    run(stop=False)
    assert ran_after_loop == [(0, 2), (1, 2)]


def test_a_stop_between_loops_is_taken_before_the_next_loops_first_step(job):
    def run(stop: bool) -> list:
        seen = []
        first = adaptive.AdaptiveDataLoader(Indices(4), batch_size=2)
        second = adaptive.AdaptiveDataLoader(Indices(4), batch_size=2)
        for _ in adaptive.remaining_epochs_until(1):
            seen += [int(i) for batch in first for i in batch]
            if stop:
                sync_points.request_stop()  # e.g. SIGTERM while the script logs between loops
            seen += [int(i) + 100 for batch in second for i in batch]
        return seen

    with pytest.raises(SystemExit):
        run(stop=True)
    meta = _latest(job).info.metadata
    assert meta["loader"] == "1" and meta["index"] == 0 and meta["step"] == 0
    restart_process_state()
    assert run(stop=False) == [100, 101, 102, 103]  # the first loop finished before the stop


def test_a_finished_job_is_checkpointed_and_a_relaunch_trains_nothing(job, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "3600")  # no periodic checkpoint before the end
    loader = adaptive.AdaptiveDataLoader(Indices(6), batch_size=3)
    for _ in adaptive.remaining_epochs_until(2):
        list(loader)
    latest = _latest(job)
    assert latest is not None and latest.info.metadata["reason"] == "finished"
    assert latest.info.metadata["epoch"] == 2
    restart_process_state()
    loader = adaptive.AdaptiveDataLoader(Indices(6), batch_size=3)
    trained = [batch for _ in adaptive.remaining_epochs_until(2) for batch in loader]
    assert trained == [] and adaptive.finished_epochs() == 2
    assert _latest(job).info.seq == latest.info.seq  # nothing new to save


def test_a_periodic_checkpoint_is_written_once_per_interval(job, monkeypatch):
    """The flag raised at the agreement before a save must not cause a second save right after it."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(env, "num_replicas", lambda: 2)
    monkeypatch.setattr(sync_points.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(states.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(collectives, "allreduce_max_async",
                        lambda values: collectives._Ready(torch.tensor(values, dtype=torch.float64)))
    saves: list[float] = []

    def save(metadata=None, blocking=True):
        saves.append(clock["now"])
        current_job().part(states.CheckpointSession).save_count += 1
        current_job().part(states.CheckpointSession).last_save_time = clock["now"]
        return len(saves)

    monkeypatch.setattr(states, "save_all_states", save)
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "1")
    current_job().started = clock["now"]
    for _ in range(400):  # 4 s of 10 ms steps
        clock["now"] += 0.01
        step_stream().steps_committed += 1  # a step was trained
        sync_points.step_boundary(dict)
    gaps = [b - a for a, b in zip(saves, saves[1:])]
    assert 3 <= len(saves) <= 4 and min(gaps) >= 0.99, saves


def test_replicas_that_resumed_different_checkpoints_fail_clearly(job, monkeypatch):
    monkeypatch.setattr(env, "num_replicas", lambda: 2)

    def peer_resumed_seq_7(values):
        agreed = list(values)
        agreed[3] = max(values[3], 7.0)  # the peer saw checkpoint 7, this replica none (-1)
        return collectives._Ready(torch.tensor(agreed, dtype=torch.float64))

    monkeypatch.setattr(collectives, "allreduce_max_async", peer_resumed_seq_7)
    with pytest.raises(adaptive.CheckpointError, match="different checkpoints.*ADAPTIVE_CHECKPOINT_PATH"):
        sync_points.settle(dict)


def test_building_is_local_even_with_several_replicas_and_no_process_group(job, monkeypatch):
    """The MNIST tutorial builds its loaders before init_process_group; rank 0 may build while others wait."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(current_job().groups, "control", None)  # as before init_process_group: any collective fails
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=4)
    loader.autoscale_batch_size(8, local_bsz_bounds=(1, 4))
    stats = adaptive.Accumulator()
    assert loader.batch_size == 4 and len(stats) == 0
    with pytest.raises(RuntimeError, match="init_process_group"):
        next(iter(loader))  # the first step agrees with the other replica: that needs the group


def test_a_stop_whose_checkpoint_fails_exits_with_1_and_says_why(job, caplog):
    class Unsaveable(adaptive.State):
        def state_dict(self):
            return {"f": lambda: None}

        def load_state_dict(self, state):
            pass

    Unsaveable("unsaveable")
    loader = adaptive.AdaptiveDataLoader(Indices(8), batch_size=2)
    with pytest.raises(SystemExit) as stopped:
        for _ in loader:
            sync_points.request_stop()
    assert stopped.value.code == sync_points.STOP_FAILED_EXIT_CODE
    assert "the stop could not write its checkpoint" in caplog.text and "function" in caplog.text
    assert _latest(job) is None


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), [
    (("not a scheduler",), {}, TypeError, "lr_scheduler must be a torch.optim.lr_scheduler"),
    ((None, "netD"), {}, TypeError, "scaler must be a torch.amp.GradScaler.*name="),
    ((), {"name": ""}, TypeError, "name must be a non-empty str"),
    ((), {"name": 3}, TypeError, "name must be a non-empty str"),
])
def test_adaptive_data_parallel_names_the_bad_argument(job, args, kwargs, error, match):
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        adaptive.AdaptiveDataParallel(net, optimizer, *args, **kwargs)


def test_an_lr_scheduler_of_another_optimizer_is_refused(job):
    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        adaptive.AdaptiveDataParallel(net, optimizer, torch.optim.lr_scheduler.StepLR(other, 1))


def test_multistep_lr_and_counters_checkpoint_and_restore(job):
    def build():
        net = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [1, 1, 3], 0.5)
        return adaptive.AdaptiveDataParallel(net, optimizer, scheduler), optimizer, scheduler

    model, optimizer, scheduler = build()
    loader = adaptive.AdaptiveDataLoader(Indices(4), batch_size=2)
    with pytest.raises(SystemExit) as stopped:
        for epoch in adaptive.remaining_epochs_until(4):
            for batch in loader:
                optimizer.zero_grad()
                model(batch.float()[:, None].repeat(1, 2)).sum().backward()
                optimizer.step()
            scheduler.step()
            if epoch == 1:
                sync_points.request_stop()
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    saved = _latest(job).load("adaptive.parallel.model")
    restart_process_state()
    model, optimizer, scheduler = build()
    assert scheduler.state_dict()["milestones"] == collections.Counter({1: 2, 3: 1})
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)
    for key, value in saved["model"].items():
        torch.testing.assert_close(model.module.state_dict()[key], value, rtol=0, atol=0)
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.module.parameters()]
    for mine, theirs in zip(momentum, saved["optimizer"]["state"].values()):
        torch.testing.assert_close(mine, theirs["momentum_buffer"], rtol=0, atol=0)


_WORKER_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import adaptive

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 100000
        def __getitem__(self, index):
            time.sleep(0.001)
            return index

    out = sys.argv[1]
    loader = adaptive.AdaptiveDataLoader(Slow(), batch_size=8, num_workers=2,
                                         persistent_workers=sys.argv[2] == "persistent")
    for epoch in adaptive.remaining_epochs_until(1):
        for step, batch in enumerate(loader):
            if step == 5:
                with open(os.path.join(out, "running"), "w") as f:
                    json.dump({"pid": os.getpid()}, f)
""")


@pytest.mark.parametrize("workers", ["persistent", "per-loop"])
def test_dataloader_workers_survive_the_process_group_sigterm(tmp_path, workers):
    """torchrun signals the worker's whole process group, DataLoader workers included."""
    script = tmp_path / "train.py"
    script.write_text(_WORKER_SCRIPT)
    environ = dict(os.environ, PYTHONPATH=str(REPO), ADAPTIVE_CHECKPOINT_PATH=str(tmp_path / "ck"),
                   OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"):
        environ.pop(name, None)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), workers], env=environ,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = 120
        for _ in range(deadline * 10):
            if (tmp_path / "running").exists() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert (tmp_path / "running").exists(), proc.communicate(timeout=30)[0].decode()
        os.killpg(proc.pid, signal.SIGTERM)  # the main process and its DataLoader workers
        output = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == sync_points.GRACEFUL_EXIT_CODE, output
    assert "killed by signal" not in output
    latest = CheckpointStore(tmp_path / "ck").latest()
    assert latest is not None and latest.info.metadata["reason"] == "stop"
    assert latest.info.metadata["step"] >= 6


_UNSAVEABLE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import adaptive

    class Unsaveable(adaptive.State):
        def state_dict(self):
            return {"handle": open(os.devnull)}   # a file object cannot be checkpointed
        def load_state_dict(self, state):
            pass

    adaptive.init_process_group("gloo")
    Unsaveable("unsaveable")
    loader = adaptive.AdaptiveDataLoader(list(range(1000000)), batch_size=4)
    for step, batch in enumerate(loader):
        if step == 20:
            with open(os.path.join(os.environ["WORKER_OUT"], f"running.{os.environ['RANK']}"), "w") as f:
                json.dump({"pid": os.getpid()}, f)
""")


@pytest.mark.distributed
def test_adaptive_run_reports_a_stop_that_could_not_checkpoint(tmp_path):
    from elastic_harness import Jobs, tail, wait_exit, wait_for

    script = tmp_path / "unsaveable.py"
    script.write_text(_UNSAVEABLE_SCRIPT)
    jobs = Jobs(tmp_path)
    out = tmp_path / "job"
    try:
        proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job.log", script=script,
                           ADAPTIVE_CHECKPOINT_INTERVAL="0")
        wait_for(lambda: (out / "running.0").exists() and (out / "running.1").exists(), 120, "both ranks to train")
        os.killpg(proc.pid, signal.SIGTERM)
        code = wait_exit(proc, 60, out / "job.log")
    finally:
        jobs.cleanup()
    log = (out / "job.log").read_text()
    assert code == 1, tail(out / "job.log")
    assert "the stop could not write its checkpoint" in log and "TextIOWrapper" in log, tail(out / "job.log")
    assert "every worker checkpointed" not in log
    assert CheckpointStore(out / "checkpoints").latest() is None


def _peeking_run(epochs: int, seen: list, stop_at: tuple[int, int] | None = None, crash_at=None) -> None:
    """PyTorch's torchrun tutorial: ``b_sz = len(next(iter(loader))[0])`` at the start of every epoch."""
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = adaptive.AdaptiveDataLoader(Indices(24), batch_size=4, shuffle=True)
    for epoch in adaptive.remaining_epochs_until(epochs):
        b_sz = len(next(iter(loader)))
        assert b_sz == 4
        for step, batch in enumerate(loader):
            if crash_at is not None and (epoch, step) == (crash_at[0], crash_at[1] - 1):
                adaptive.save_all_states({"reason": "test"})  # what the crash rolls back to: mid-loop
            optimizer.zero_grad()
            model(batch.float().unsqueeze(1)).sum().backward()
            optimizer.step()
            seen.append((epoch, step, tuple(batch.tolist())))
            if stop_at == (epoch, step):
                sync_points.request_stop()
            if crash_at == (epoch, step):
                raise KeyboardInterrupt  # a crash: nothing is saved


@pytest.mark.parametrize("how", ["stop", "crash"])
def test_a_peek_at_the_loader_consumes_nothing_before_or_after_a_restart(job, how):
    seen: list = []
    with pytest.raises((SystemExit, KeyboardInterrupt)):
        _peeking_run(2, seen, stop_at=(1, 2) if how == "stop" else None,
                     crash_at=(1, 3) if how == "crash" else None)
    if how == "crash":  # rolled back to the checkpoint before step 2 of epoch 1: steps 2 and 3 run again
        seen[:] = [entry for entry in seen if entry[:2] < (1, 2)]
    restart_process_state()
    _peeking_run(2, seen)  # the peek works again in the interrupted epoch, and the loop resumes where it was
    for epoch in range(2):
        samples = sorted(i for e, _, batch in seen if e == epoch for i in batch)
        assert samples == list(range(24)), (epoch, seen)


def _dropout_run(seen: dict, crash_at=None, save_before=None, stop_after_loop=None) -> torch.Tensor:
    """Dropout in the model, numpy and ``random`` draws in the loop and before it, every epoch."""
    import random as pyrandom

    import numpy as np

    torch.manual_seed(1)
    np.random.seed(1)
    pyrandom.seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    model = adaptive.AdaptiveDataParallel(net, optimizer)
    loader = adaptive.AdaptiveDataLoader(Indices(24), batch_size=4, shuffle=True)
    for epoch in adaptive.remaining_epochs_until(3):
        seen[(epoch, "before")] = (pyrandom.random(), float(np.random.rand()))  # code before the loop
        for batch in loader:
            step = loader.step % 6  # the step of the epoch (enumerate would count from the resumed step)
            if save_before == (epoch, step):
                adaptive.save_all_states({"reason": "test"})
            x = torch.stack([batch.float() / 24, torch.rand(len(batch)), torch.full((len(batch),), np.random.rand())], 1)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen[(epoch, step)] = loss.item()
            if crash_at == (epoch, step):
                raise KeyboardInterrupt  # a crash
        if stop_after_loop == epoch:
            sync_points.request_stop()  # taken at the end of the epoch: a checkpoint between two epochs
    return torch.cat([p.detach().flatten() for p in net.parameters()])


@pytest.mark.parametrize("checkpoint", ["mid-loop", "epoch-end"])
def test_a_rollback_replays_the_same_random_numbers(job, checkpoint):
    reference: dict = {}
    final = _dropout_run(reference)
    import shutil

    shutil.rmtree(job / "checkpoints")
    restart_process_state()
    replay: dict = {}
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        if checkpoint == "mid-loop":  # a checkpoint inside epoch 1's loop, then a crash: steps 2-4 run again
            _dropout_run(replay, crash_at=(1, 4), save_before=(1, 2))
        else:  # a stop at the end of epoch 0
            _dropout_run(replay, stop_after_loop=0)
    restart_process_state()
    resumed: dict = {}
    assert torch.equal(_dropout_run(resumed), final)  # bit-identical to the uninterrupted run
    # Every step replayed drew what the uninterrupted run drew, and so did the code before each later epoch's
    # loop; mid-loop, the code before the interrupted loop runs again before the generators are restored.
    replayed = {key: value for key, value in resumed.items() if not (checkpoint == "mid-loop" and key == (1, "before"))}
    assert replayed == {key: reference[key] for key in replayed}
    if checkpoint == "mid-loop":
        assert (1, 2) in resumed and (1, 1) not in resumed
    else:
        assert (1, "before") in replayed and (1, 0) in resumed and (0, 5) not in resumed


def test_a_relaunch_writes_no_periodic_checkpoint_before_it_trained_a_step(job, monkeypatch):
    def run(stop_at=None):
        loader = adaptive.AdaptiveDataLoader(Indices(40), batch_size=4)
        for epoch in adaptive.remaining_epochs_until(2):
            for batch in loader:
                if stop_at == loader.step:
                    sync_points.request_stop()

    with pytest.raises(SystemExit):
        run(stop_at=3)
    stopped = _latest(job)
    assert stopped.info.metadata["reason"] == "stop"
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_INTERVAL", "0.000001")  # due at every agreement
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_KEEP", "100")
    restart_process_state()
    run()
    after = [info for info in CheckpointStore(job / "checkpoints").list() if info.seq > stopped.info.seq]
    assert after and all(info.metadata.get("step") != stopped.info.metadata["step"] for info in after), \
        [(info.seq, info.metadata.get("reason"), info.metadata.get("step")) for info in after]
