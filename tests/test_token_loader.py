"""AdaptiveDataLoader with token budgets: budgets, lock-step, exact resume, gradient weighting, LR factor."""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaptive
from adaptive.elastic import sync_points
from adaptive.data.sampler import ElasticSampler
from adaptive.data.steps import StepShape, StepSizer
from adaptive.data.tokens.lengths import OversizeSampleError, SampleLengths
from adaptive.data.tokens.batching import TokenBatching
from conftest import restart_process_state

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])
FEATURES = 3


def make_lengths(n: int, seed: int, high: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, high + 1, n)


class Sequences(torch.utils.data.Dataset):
    """Sample i: ``lengths[i]`` tokens of FEATURES fixed features and one target each."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = np.asarray(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(int(index))
        length = int(self.lengths[index])
        return index, torch.randn(length, FEATURES, generator=generator), torch.randn(length, generator=generator)


def pad(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices, x [B, T, F], y [B, T], mask [B, T]) padded to the longest sample."""
    longest = max(len(y) for _, _, y in batch)
    x = torch.zeros(len(batch), longest, FEATURES)
    y = torch.zeros(len(batch), longest)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool)
    for row, (_, xs, ys) in enumerate(batch):
        x[row, :len(ys)], y[row, :len(ys)], mask[row, :len(ys)] = xs, ys, True
    return torch.tensor([i for i, _, _ in batch]), x, y, mask


def token_loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token squared errors over the real (unpadded) tokens."""
    return ((model(x).squeeze(-1) - y).pow(2) * mask).sum()


# --------------------------------------------------------------------------- planning across replicas


def plan_steps(lengths: np.ndarray, max_tokens: int, replicas: int, accum: int, *, epoch: int = 0,
               state=None, stop_after: int | None = None, window: int = 32):
    """Every rank's planned steps from ``state`` (a loader-like state object)."""
    sampler = ElasticSampler(len(lengths), shuffle=True, seed=5)
    sampler.set_epoch(epoch)
    batching = TokenBatching(sampler, SampleLengths(lengths), max_tokens, window_size=window, seed=5)
    sizer = StepSizer("tokens", None, lambda r: StepShape(max_tokens, accum), max_micro=max_tokens)
    state = state or _State()
    per_rank = [list(batching.plan(state, sizer, replicas, rank)) for rank in range(replicas)]
    if stop_after is not None:
        per_rank = [steps[:stop_after] for steps in per_rank]
        for step in per_rank[0]:
            batching.commit(state, step)
    return per_rank, state


class _State:
    def __init__(self) -> None:
        self.index, self.consumed, self.plan = 0, 0, None


@PROPERTY
@given(n=st.integers(1, 300), seed=st.integers(0, 10**6), max_tokens=st.integers(40, 300),
       replicas=st.integers(1, 4), accum=st.integers(1, 3))
def test_every_replica_takes_the_same_steps_within_budget_and_each_sample_once(n, seed, max_tokens, replicas,
                                                                                accum):
    lengths = make_lengths(n, seed)
    per_rank, _ = plan_steps(lengths, max_tokens, replicas, accum)
    counts = [[step.num_micro_steps for step in steps] for steps in per_rank]
    assert all(c == counts[0] for c in counts), "replicas disagree on steps or micro-steps"
    seen = np.zeros(n, dtype=np.int64)
    padding = 0
    for steps in per_rank:
        for step in steps:
            for indices, is_padding in zip(step.indices, step.padding):
                assert indices, "an empty micro-batch"
                assert lengths[indices].max() * len(indices) <= max_tokens
                if is_padding:
                    padding += 1
                else:
                    np.add.at(seen, indices, 1)
    assert seen.tolist() == [1] * n
    assert padding < replicas


@PROPERTY
@given(n=st.integers(20, 300), seed=st.integers(0, 10**6), first=st.integers(1, 4), second=st.integers(1, 4),
       stop=st.integers(1, 6))
def test_resume_on_a_different_replica_count_trains_each_sample_once(n, seed, first, second, stop):
    lengths = make_lengths(n, seed)
    before, state = plan_steps(lengths, 60, first, 2, stop_after=stop)
    after, _ = plan_steps(lengths, 60, second, 1, state=state)
    seen = np.zeros(n, dtype=np.int64)
    for steps in before + after:
        for step in steps:
            for indices, is_padding in zip(step.indices, step.padding):
                if not is_padding:
                    np.add.at(seen, indices, 1)
    assert seen.tolist() == [1] * n


# --------------------------------------------------------------------------- the loader in one process


def make_loader(lengths: np.ndarray, **kwargs) -> adaptive.AdaptiveDataLoader:
    options = dict(max_tokens=64, lengths=lengths, shuffle=True, seed=3, collate_fn=pad, window_size=32)
    options.update(kwargs)
    return adaptive.AdaptiveDataLoader(Sequences(lengths), **options)


def test_loader_batches_stay_within_budget_and_cover_each_epoch_once(job):
    lengths = make_lengths(150, 1, high=30)
    loader = make_loader(lengths, accumulation_steps=2)
    assert loader.unit == "tokens" and loader.max_tokens == 64 and loader.batch_size == 128
    micro_steps = len(loader)
    for _ in adaptive.remaining_epochs_until(2):
        seen = np.zeros(150, dtype=np.int64)
        taken = 0
        for index, x, y, mask in loader:
            taken += 1
            assert x.shape[0] * x.shape[1] <= 64
            assert loader.micro_step[1] in (1, 2)
            np.add.at(seen, index.numpy(), 1)
        assert seen.tolist() == [1] * 150
        assert taken == micro_steps


def test_worker_processes_fetch_the_same_micro_batches_as_the_main_process(job):
    """Workers prefetch ahead of training; the plan they read from is the one training follows."""
    lengths = make_lengths(120, 3, high=30)
    orders = []
    for workers in (0, 2):
        loader = make_loader(lengths, accumulation_steps=2, num_workers=workers, name=f"w{workers}")
        orders.append([(loader.micro_step, index.tolist()) for index, *_ in loader])
    assert orders[0] == orders[1]


def _train(lengths, epochs, stop_at=None, log=None, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = adaptive.AdaptiveDataParallel(model, optimizer, scaling_rule="linear")
    loader = make_loader(lengths, **kwargs)
    for epoch in adaptive.remaining_epochs_until(epochs):
        for i, (index, x, y, mask) in enumerate(loader):
            loss = token_loss_sum(model, x, y, mask) * loader.loss_weight
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if log is not None:
                log.append((epoch, loader.step, index.tolist()))
            if stop_at == (epoch, i):
                sync_points.request_stop()
    return model


def test_graceful_stop_mid_epoch_resumes_the_same_micro_batch_stream(job):
    lengths = make_lengths(120, 2, high=30)
    interrupted: list = []
    with pytest.raises(SystemExit):
        _train(lengths, 2, stop_at=(1, 5), log=interrupted, accumulation_steps=2)
    restart_process_state()
    model = _train(lengths, 2, log=interrupted, accumulation_steps=2)
    weights = [p.detach().clone() for p in model.module.parameters()]
    restart_process_state()
    for path in (job / "checkpoints").iterdir():
        path.unlink() if path.is_file() else __import__("shutil").rmtree(path)
    uninterrupted: list = []
    reference = _train(lengths, 2, log=uninterrupted, accumulation_steps=2)
    # The micro-step taken when the stop was agreed (one boundary later) is replayed after the resume.
    dedup = {(epoch, step, tuple(index)): None for epoch, step, index in interrupted}
    assert list(dedup) == [(e, s, tuple(i)) for e, s, i in uninterrupted]
    for mine, theirs in zip(weights, reference.module.parameters()):
        torch.testing.assert_close(mine, theirs.detach())


def test_accumulated_gradient_equals_the_token_mean_of_the_whole_step(job):
    lengths = make_lengths(90, 4, high=25)
    dataset = Sequences(lengths)
    torch.manual_seed(1)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ddp = adaptive.AdaptiveDataParallel(model, optimizer, scaling_rule="none")
    loader = make_loader(lengths, accumulation_steps=3, max_tokens=50)
    checked = 0
    for index, x, y, mask in loader:
        optimizer.zero_grad()
        (token_loss_sum(ddp, x, y, mask) * loader.loss_weight).backward()
        if loader.is_accumulation_step():
            continue
        step = loader.current_step
        everything = pad([dataset[i] for indices in step.indices for i in indices])
        reference = copy.deepcopy(model)  # a backward through the tracked model would count as a micro-step
        expected = torch.autograd.grad(token_loss_sum(reference, *everything[1:]) / step.num_tokens,
                                       list(reference.parameters()))
        for param, grad in zip(model.parameters(), expected):
            torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6)
        optimizer.step()
        checked += 1
    assert checked >= 3


def test_lr_follows_the_actual_step_size_and_is_restored_exactly(job):
    lengths = make_lengths(60, 6, high=20)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    ddp = adaptive.AdaptiveDataParallel(model, optimizer, scheduler, scaling_rule="linear")
    loader = make_loader(lengths, max_tokens=40, batch_size=80, lr_scaling="linear")
    seen_lrs = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen_lrs.append(opt.param_groups[0]["lr"]))
    for index, x, y, mask in loader:
        base = optimizer.param_groups[0]["lr"]
        step = loader.current_step
        optimizer.zero_grad()
        (token_loss_sum(ddp, x, y, mask) * loader.loss_weight).backward()
        optimizer.step()
        if loader.is_accumulation_step():
            continue
        assert step.num_micro_steps <= 2
        # the rule scales by planned / reference, the loader by actual / planned: actual / reference
        assert seen_lrs[-1] == pytest.approx(base * step.num_tokens / 80)
        assert step.padded_tokens <= 80 and loader.lr_factor == pytest.approx(step.num_tokens / step.planned_size)
        assert optimizer.param_groups[0]["lr"] == base  # restored exactly, before the scheduler moves it
        scheduler.step()


def test_oversize_samples_raise_or_are_skipped_and_reported(job, caplog):
    lengths = make_lengths(40, 7, high=10)
    lengths[[3, 17]] = 100
    with pytest.raises(OversizeSampleError, match="max_tokens=64"):
        list(make_loader(lengths))
    restart_process_state()
    loader = make_loader(lengths, on_oversize="skip", name="skip")
    seen = np.zeros(40, dtype=np.int64)
    with caplog.at_level("WARNING"):
        for index, *_ in loader:
            np.add.at(seen, index.numpy(), 1)
    assert seen[[3, 17]].tolist() == [0, 0] and np.delete(seen, [3, 17]).tolist() == [1] * 38
    assert "skipping 2 samples longer than max_tokens=64" in caplog.text


@pytest.mark.parametrize("kwargs, error", [
    ({"max_tokens": 64}, "needs lengths="),
    ({"max_tokens": 64, "lengths": [3] * 7}, "7 entries but the dataset has 20"),
    ({"max_tokens": 0, "lengths": [3] * 20}, "max_tokens"),
    ({"lengths": [3] * 20}, "only apply to token-budget batches"),
    ({"accumulation_steps": 2}, "only apply to token-budget batches"),
    ({"max_tokens": 64, "lengths": [3] * 20, "drop_last": True}, "drop_last"),
    ({"max_tokens": 64, "lengths": [3] * 20, "on_oversize": "truncate"}, "on_oversize"),
    ({"max_tokens": 64, "lengths": [3] * 20, "average_by": "words"}, "average_by"),
    ({"max_tokens": 64, "lengths": [3] * 20, "lr_scaling": "cubic"}, "lr_scaling"),
    ({"max_tokens": 64, "lengths": [3] * 20, "accumulation_steps": 0}, "accumulation_steps"),
    ({"max_tokens": 64, "lengths": [0] * 20}, "positive"),
    ({"max_tokens": 64, "lengths": [3] * 20, "batch_size": 256, "accumulation_steps": 2}, "cannot be combined"),
    ({"max_tokens": 64, "lengths": [3] * 20, "batch_size_schedule": "0:64 1K:128 2K:64x"}, "2K:64x"),
])
def test_token_options_are_validated(job, kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
        adaptive.AdaptiveDataLoader(Sequences(np.full(20, 3)), **kwargs)


def test_hints_completed_fraction_counts_samples_with_a_token_budget(job, monkeypatch):
    """With a token budget the epoch position is still in samples (of the sampler's epoch): each report of
    the autoscaled loader lies within its epoch's share, grows, and reaches 1 after the last step."""
    from adaptive.batchsize.autoscale import BatchSizeController

    reported = []
    monkeypatch.setattr(BatchSizeController, "report_hints",
                        lambda self, grad, progress, completed_fraction=None: reported.append(
                            (adaptive.current_epoch(), completed_fraction)))
    net = torch.nn.Linear(1, 1)
    adaptive.AdaptiveDataParallel(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = make_loader(make_lengths(60, 4, high=30))
    loader.autoscale_batch_size(256, adapt_every=1)
    for _ in adaptive.remaining_epochs_until(2):
        for _ in loader:
            pass
    fractions = [fraction for _, fraction in reported]
    assert {epoch for epoch, _ in reported} == {0, 1} and fractions == sorted(fractions), reported
    assert all(epoch / 2 <= fraction <= (epoch + 1) / 2 for epoch, fraction in reported), reported
    assert fractions[-1] == 1.0 and 0.5 in fractions  # every sample of each epoch taken (none dropped here)


def test_autoscale_bounds_are_tokens_and_checked_against_the_budget(job):
    lengths = make_lengths(50, 8, high=30)
    loader = make_loader(lengths)
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        loader.autoscale_batch_size(256, (32, 128))
    with pytest.raises(ValueError, match="below the longest sample"):
        loader.autoscale_batch_size(256, (8, 64))
    loader.autoscale_batch_size(256, gradient_accumulation=True)
    assert loader.current_local_bsz <= 64 and loader.batch_size >= 64


def test_metrics_record_tokens_per_step_and_padding_efficiency(job, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_METRICS_INTERVAL", "2")
    monkeypatch.setenv("ADAPTIVE_SHARE_PATH", str(job / "share"))
    lengths = make_lengths(80, 9, high=20)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = make_loader(lengths)
    for index, x, y, mask in loader:
        optimizer.zero_grad()
        (token_loss_sum(ddp, x, y, mask) * loader.loss_weight).backward()
        optimizer.step()
    records = [json.loads(line) for line in (job / "share" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert steps and all(r["unit"] == "tokens" and 0 < r["padding_efficiency"] <= 1 for r in steps)
    assert all(0 < r["tokens_per_step"] <= 64 for r in steps)


# --------------------------------------------------------------------------- two real replicas (gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample_loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's mean squared error over its real tokens."""
    per_token = (model(x).squeeze(-1) - y).pow(2) * mask
    return (per_token.sum(1) / mask.sum(1)).sum()


def _case_loader(name: str, lengths: list[int], max_tokens: int | None, accum: int) -> adaptive.AdaptiveDataLoader:
    if max_tokens is None:  # sample batches of 7: shares of 4 and 3, and a padding sample in the last step
        return adaptive.AdaptiveDataLoader(Sequences(np.asarray(lengths)), batch_size=7, shuffle=True, seed=3,
                                           collate_fn=pad, lr_scaling="none", name=name)
    return make_loader(np.asarray(lengths), max_tokens=max_tokens, accumulation_steps=accum, lr_scaling="none",
                       name=name)


def _replica(rank: int, world: int, port: int, out: str, cases: list) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ADAPTIVE_CHECKPOINT_PATH=f"{out}/ckpt",
                      ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_METRICS_INTERVAL="0", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    adaptive.init_process_group("gloo")
    for name, lengths, max_tokens, accum in cases:
        torch.manual_seed(0)
        model = torch.nn.Linear(FEATURES, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = adaptive.AdaptiveDataParallel(model, optimizer, scaling_rule="none", name=name)
        loader = _case_loader(name, lengths, max_tokens, accum)
        loss_sum = token_loss_sum if max_tokens else sample_loss_sum
        records = []
        for index, x, y, mask in loader:
            if loader.micro_step[0] == 0:
                weights = [p.detach().clone() for p in model.parameters()]
                indices: list[int] = []
            indices += index.tolist() if not loader.is_padding else []
            optimizer.zero_grad()
            (loss_sum(ddp, x, y, mask) * loader.loss_weight).backward()
            if not loader.is_accumulation_step():
                records.append({"weights": weights, "grads": [p.grad.detach().clone() for p in model.parameters()],
                                "indices": indices, "padding": any(loader.current_step.padding)})
                optimizer.step()
        torch.save(records, f"{out}/{name}.rank{rank}.pt")


CASES = [("plain", make_lengths(45, 11, high=24).tolist(), 48, 1),
         ("accumulated", make_lengths(45, 11, high=24).tolist(), 48, 2),
         ("padded", [20, 20, 20], 20, 2),  # 3 micro-batches for 2 x 2 slots: the last one is padding
         ("samples", make_lengths(15, 12, high=10).tolist(), None, 1)]


def test_two_replicas_give_the_single_process_gradient_of_the_same_tokens(tmp_path):
    mp.start_processes(_replica, args=(2, _free_port(), str(tmp_path), CASES), nprocs=2, start_method="spawn",
                       join=True)
    for name, lengths, max_tokens, _ in CASES:
        ranks = [torch.load(tmp_path / f"{name}.rank{r}.pt") for r in range(2)]
        assert len(ranks[0]) == len(ranks[1]) >= 1
        dataset = Sequences(np.asarray(lengths))
        model = torch.nn.Linear(FEATURES, 1)
        seen = []
        for mine, theirs in zip(*ranks):
            for param, weight in zip(model.parameters(), mine["weights"]):
                param.data.copy_(weight)
            indices = mine["indices"] + theirs["indices"]
            seen += indices
            batch = pad([dataset[i] for i in indices])
            if max_tokens:  # the mean over the step's real tokens
                loss = token_loss_sum(model, *batch[1:]) / int(batch[3].sum())
            else:  # the mean over the step's samples
                loss = sample_loss_sum(model, *batch[1:]) / len(indices)
            expected = torch.autograd.grad(loss, list(model.parameters()))
            for got_a, got_b, want in zip(mine["grads"], theirs["grads"], expected):
                torch.testing.assert_close(got_a, got_b)
                torch.testing.assert_close(got_a, want, rtol=1e-5, atol=1e-6)
        assert sorted(seen) == list(range(len(lengths))), name
        if name in ("padded", "samples"):
            assert ranks[0][-1]["padding"] or ranks[1][-1]["padding"]
        else:
            assert len(ranks[0]) >= 3


def test_token_lm_example_runs_a_few_steps(tmp_path):
    """The example trains a few token-budget steps on standard-library docstrings and logs its epoch."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo), ADAPTIVE_CHECKPOINT_PATH=str(tmp_path / "ckpt"),
               ADAPTIVE_SHARE_PATH=str(tmp_path / "share"), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(repo / "examples" / "token_lm.py"), "--files", "12", "--steps", "3",
                           "--epochs", "1", "--dim", "16", "--max-tokens", "1024", "--ramp", "0:1K 2K:2K"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch 0: train loss" in done.stderr and "stopping after 3 optimizer steps" in done.stderr
