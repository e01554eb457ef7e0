"""AdaptiveAccelerator (adaptive.integrations.accelerate): an Accelerate script made elastic.

Single-process tests of what ``prepare`` returns and how accumulation,
``backward`` and metrics behave, then one real ``adaptive-run`` job on
127.0.0.1 (gloo) stopped on 2 processes and resumed on 3.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="the huggingface extra is not installed "
                                 "(pip install adaptive-elastic[huggingface])")

import adaptive  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.scheduler import AcceleratedScheduler  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from conftest import Indices  # noqa: E402
from elastic_harness import REPO, Jobs, exit_codes, progress, tail, wait_exit, wait_for  # noqa: E402

WORKER = REPO / "tests" / "workers" / "accelerate_worker.py"


@pytest.fixture
def accel(job):
    """The AdaptiveAccelerator class in a fresh single-process job with Accelerate's shared state reset.

    (``_reset_state`` is Accelerate's own way, used by its tests, to build a
    new Accelerator in the same process.)
    """
    from adaptive.integrations.accelerate import AdaptiveAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield AdaptiveAccelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _trio(lr=0.1):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return model, optimizer, scheduler


def _regression(n=24):
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, generator=generator), torch.randn(n, 1, generator=generator))


def test_import_without_accelerate_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # what `import accelerate` meets when it is not installed
    monkeypatch.delitem(sys.modules, "adaptive.integrations.accelerate", raising=False)
    with pytest.raises(ImportError, match=r"pip install adaptive-elastic\[huggingface\]"):
        importlib.import_module("adaptive.integrations.accelerate")


def test_checked_accelerate_version_and_private_registries(accel):
    """The one place with private attributes (``_register_prepared``) was checked on this accelerate."""
    from adaptive.integrations.accelerate import CHECKED_ACCELERATE_VERSIONS

    assert ".".join(accelerate.__version__.split(".")[:2]) in CHECKED_ACCELERATE_VERSIONS
    accelerator = accel()
    assert isinstance(accelerator._optimizers, list) and isinstance(accelerator._schedulers, list)


def test_prepare_returns_adaptive_objects_in_the_order_given(accel):
    accelerator = accel()
    assert torch.distributed.is_initialized() and accelerator.num_processes == 1
    model, optimizer, scheduler = _trio()
    collated = []

    def collate(samples):
        collated.append(len(samples))
        return torch.utils.data.default_collate(samples)

    train = torch.utils.data.DataLoader(_regression(), batch_size=4, shuffle=True, drop_last=True, collate_fn=collate)
    evaluation = torch.utils.data.DataLoader(_regression(), batch_size=6)
    out = accelerator.prepare(train, model, scheduler, optimizer, evaluation)
    p_train, p_model, p_scheduler, p_optimizer, p_eval = out
    assert isinstance(p_train, adaptive.AdaptiveDataLoader) and isinstance(p_eval, adaptive.AdaptiveDataLoader)
    assert isinstance(p_model, adaptive.AdaptiveDataParallel) and p_model.module is model
    assert p_model.optimizer is optimizer and p_model.lr_scheduler is scheduler
    assert isinstance(p_optimizer, AcceleratedOptimizer) and p_optimizer.optimizer is optimizer
    assert isinstance(p_scheduler, AcceleratedScheduler) and p_scheduler.scheduler is scheduler
    assert p_optimizer in accelerator._optimizers and p_scheduler in accelerator._schedulers
    assert p_train.dataset is train.dataset and p_train.sampler.shuffle and p_train.sampler.drop_last
    assert not p_eval.sampler.shuffle and not p_eval.sampler.drop_last
    assert (p_train.batch_size, p_eval.batch_size) == (4, 6)  # x 1 process x 1 accumulation step
    for epoch in adaptive.remaining_epochs_until(1):
        assert sum(len(x) for x, y in p_train) == 24
    assert collated == [4] * 6  # the DataLoader's collate_fn makes the batches
    # a single object comes back as itself, not a tuple, as Accelerate does
    assert isinstance(accelerator.prepare(torch.utils.data.DataLoader(Indices(5))), adaptive.AdaptiveDataLoader)


def test_global_batch_is_per_process_x_first_launch_processes_x_accumulation(accel):
    accelerator = accel(gradient_accumulation_steps=3)
    loader = accelerator.prepare(torch.utils.data.DataLoader(Indices(100), batch_size=4))
    assert loader.batch_size == 4 * 1 * 3
    # a relaunch restores the first launch's record: with 2 processes then, the global batch stays 4 x 2 x 3
    accelerator._first_launch.num_processes = 2
    assert accelerator.prepare(torch.utils.data.DataLoader(Indices(100), batch_size=4)).batch_size == 24


def test_a_relaunch_keeps_the_first_launch_batch_and_resumes_model_scheduler_and_position(accel):
    """Stopped mid-epoch, relaunched with another gradient_accumulation_steps: the first launch's global batch,
    the scheduler's count and the loader's position carry on; each sample once per epoch."""
    from conftest import restart_process_state
    from adaptive.elastic import sync_points

    def launch(accumulation):
        accelerator = accel(gradient_accumulation_steps=accumulation)
        model, optimizer, scheduler = _trio()
        data = torch.utils.data.TensorDataset(torch.randn(24, 3), torch.randn(24, 1), torch.arange(24))
        loader = torch.utils.data.DataLoader(data, batch_size=3, shuffle=True)
        return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))

    seen: dict[int, list[int]] = {0: [], 1: []}
    accelerator, model, optimizer, loader, scheduler = launch(2)
    start = model.module.weight.detach().clone()
    assert loader.batch_size == 6
    with pytest.raises(SystemExit) as stopped:
        for epoch in adaptive.remaining_epochs_until(2):
            for x, y, index in loader:
                seen[epoch] += index.tolist()
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if len(seen[0]) == 12:
                    adaptive.request_stop()
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    weight = model.module.weight.detach().clone()

    restart_process_state()  # a new process: only the checkpoint is left
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator, model, optimizer, loader, scheduler = launch(1)
    assert loader.batch_size == 6  # 3 x 1 process x 2 accumulation steps of the first launch
    assert 2 <= loader.step == len(seen[0]) // 6 < 4, (loader.step, seen[0])  # continues after the last step trained
    assert not torch.equal(weight, start) and torch.equal(model.module.weight, weight)
    assert scheduler.scheduler.last_epoch == loader.step
    for epoch in adaptive.remaining_epochs_until(2):
        for x, y, index in loader:
            seen[epoch] += index.tolist()
            optimizer.step()
            scheduler.step()
    assert all(sorted(seen[epoch]) == list(range(24)) for epoch in (0, 1)), seen
    assert loader.step == scheduler.scheduler.last_epoch == 8


def test_split_batches_makes_batch_size_the_global_batch(accel):
    from accelerate.utils import DataLoaderConfiguration

    accelerator = accel(dataloader_config=DataLoaderConfiguration(split_batches=True))
    accelerator._first_launch.num_processes = 4
    assert accelerator.prepare(torch.utils.data.DataLoader(Indices(100), batch_size=8)).batch_size == 8


def test_adaptive_loader_passes_through_and_is_not_sharded_again(accel):
    accelerator = accel()
    loader = adaptive.AdaptiveDataLoader(Indices(10), batch_size=5)
    assert accelerator.prepare(loader) is loader
    assert [int(i) for batch in loader for i in batch] == list(range(10))


def test_refusals_name_what_to_do(accel):
    accelerator = accel()
    model, optimizer, scheduler = _trio()
    sampler = torch.utils.data.SubsetRandomSampler(range(5))
    with pytest.raises(ValueError, match="sampler SubsetRandomSampler cannot be honoured"):
        accelerator.prepare(torch.utils.data.DataLoader(Indices(10), sampler=sampler))
    with pytest.raises(ValueError, match="optimizer at position 0 .* has no model"):
        accelerator.prepare(optimizer)
    with pytest.raises(ValueError, match=r"prepare\(model, optimizer"):
        accelerator.prepare_model(model)
    with pytest.raises(AttributeError, match="follows the loader's plan"):
        accelerator.gradient_accumulation_steps = 4


def test_accumulation_follows_the_loader_plan(accel):
    """A loader with 2 micro-steps per step: sync_gradients, the reported plan, optimizer and scheduler steps
    and zero_grad (after step, Accelerate's order) follow it."""
    accelerator = accel()
    model, optimizer, scheduler = _trio()
    loader = adaptive.AdaptiveDataLoader(_regression(24), max_tokens=3, lengths=[1] * 24, accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    assert accelerator.gradient_accumulation_steps == 2
    steps = []
    optimizer.optimizer.register_step_post_hook(lambda *args: steps.append(loader.step))
    pattern, kept = [], []
    for epoch in adaptive.remaining_epochs_until(1):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                pattern.append((accelerator.sync_gradients, accelerator.gradient_accumulation_steps))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                kept.append(model.module.weight.grad is not None)
    assert pattern == [(False, 2), (True, 2)] * 4  # 24 samples, 3 per micro-batch, 2 micro-batches per step
    assert kept == [True, False] * 4  # the first micro-batch's gradient waits for the second; zeroed after the step
    assert len(steps) == loader.step == 4
    assert scheduler.scheduler.last_epoch == 4  # once per optimizer step x 1 process


def test_backward_leaves_the_averaging_to_the_model_wrapper(accel):
    """Accelerate divides the loss by gradient_accumulation_steps; here the wrapper averages micro-steps, and the
    loader plans one micro-batch per step for sample batches, so the gradient is the plain mean loss's."""
    accelerator = accel(gradient_accumulation_steps=4)
    model, optimizer, _ = _trio()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    data = _regression(8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=2))
    assert loader.batch_size == 8 and accelerator.gradient_accumulation_steps == 1
    for epoch in adaptive.remaining_epochs_until(1):
        for x, y in loader:
            assert accelerator.sync_gradients
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            torch.nn.functional.mse_loss(reference(x), y).backward()
            assert torch.allclose(model.module.weight.grad, reference.weight.grad)


def test_gather_for_metrics_returns_each_sample_once(accel):
    accelerator = accel()
    model, optimizer, _ = _trio()
    evaluation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=4)
    model, optimizer, evaluation = accelerator.prepare(model, optimizer, evaluation)
    got = [accelerator.gather_for_metrics({"index": index})["index"] for (index,) in evaluation]
    assert torch.cat(got).tolist() == list(range(10))
    assert [accelerator.gather_for_metrics(["a", "b"]) for _ in evaluation][0] == ["a", "b"]
    assert accelerator.gather_for_metrics(torch.ones(2)).tolist() == [1.0, 1.0]  # outside a loop: Accelerate's


@pytest.fixture
def jobs(tmp_path):
    harness = Jobs(tmp_path)
    yield harness
    harness.cleanup()


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.distributed
def test_stop_on_2_processes_resume_on_3_keeps_the_global_batch_and_sees_each_sample_once(jobs, tmp_path):
    out = tmp_path / "accelerate"
    log2, log3 = out / "job2.log", out / "job3.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0")
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 5, 60, "2 processes to take 5 steps")
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does to the launcher
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    stopped = progress(out, 0)
    codes = exit_codes(out, started)
    assert codes == [143, 143], f"{codes}\n{tail(log2)}"
    assert stopped["world"] == 2 and stopped["step"] < 36, f"{stopped}\n{tail(log2)}"

    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0")
    assert wait_exit(proc, 90, log3) == 0, tail(log3)
    text = log3.read_text()
    assert "resuming from checkpoint" in text, tail(log3)
    steps = _jsonl(out / "steps.jsonl")
    worlds = [record["world"] for record in steps]
    assert worlds[0] == 2 and worlds[-1] == 3 and worlds == sorted(worlds), worlds
    # the global batch of the first launch (4 per process x 2 processes) at 3 processes too; no step twice
    assert {(r["planned"], r["size"], r["batch_size"]) for r in steps} == {(8, 8, 8)}, steps
    assert [r["step"] for r in steps] == list(range(36)), [r["step"] for r in steps]
    assert all(r["sync"] for r in steps)
    epochs = {record["epoch"]: record for record in _jsonl(out / "epochs.jsonl")}
    assert sorted(epochs) == [0, 1, 2], epochs
    for record in epochs.values():
        assert (record["missing"], record["extra"]) == (0, 0), record  # every sample exactly once per epoch
        assert record["eval"] == list(range(10)), record  # gather_for_metrics: each evaluation sample once
    done = json.loads((out / "done.json").read_text())
    # 36 optimizer steps; the scheduler steps once per process of the first launch at each, as Accelerate's would
    assert done == {"step": 36, "world": 3, "scheduler_steps": 72}, done


def test_a_tiny_transformers_model_trains_through_prepare(accel):
    """The shape of transformers' *_no_trainer scripts: dict batches, ``model(**batch).loss``, ``get_scheduler``."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the huggingface extra)")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(config)  # random init: nothing is downloaded
    samples = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.tensor(i % 2)} for i in range(16)]
    loader = torch.utils.data.DataLoader(samples, batch_size=4, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=8)
    accelerator = accel()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    assert isinstance(model, adaptive.AdaptiveDataParallel)
    losses = []
    for epoch in adaptive.remaining_epochs_until(2):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(accelerator.gather_for_metrics(loss.detach()).mean().item())
    assert loader.step == scheduler.scheduler.last_epoch == 8 and len(losses) == 8
    assert scheduler.get_last_lr() == [0.0]  # the linear schedule ends where training ends
