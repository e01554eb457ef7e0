"""AdaptiveAccelerator (adaptive.integrations.accelerate): an Accelerate script made elastic.

Single-process tests of what ``prepare`` returns and how accumulation,
``backward``, metrics, the step and sample counters and ``save_state`` /
``load_state`` behave, then real ``adaptive-run`` jobs on 127.0.0.1 (gloo):
stopped on 2 processes and resumed on 3, a SIGKILLed worker, save_state on
2 processes and load_state on 3 (each ending with the weights of an
uninterrupted run; marked slow), and the example script.
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
from elastic_harness import (REPO, exit_codes, live_pids, newest_checkpoint_step, progress, read_jsonl,  # noqa: E402
                             tail, wait_exit, wait_for)
from elastic_harness import jobs  # noqa: E402,F401  (the fixture)

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


def _reset_accelerate():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize("how", ["finish_training", "plain-break"])
def test_completed_steps_and_samples_seen_count_the_job_and_come_back_after_a_relaunch(accel, job, monkeypatch, how):
    """The counters a ``--max_train_steps`` script needs: optimizer steps (the one just taken included) and
    samples of the training loader only (not the evaluation loader's), restored with the loader on a relaunch;
    a script counting from ``accelerator.completed_steps`` stops where an uninterrupted run stops.  Leaving the
    loop with ``finish_training(); break``, or with transformers' plain ``break`` (then evaluating, then
    ``finish_training()``): the step broken out of was taken and counts."""
    from conftest import restart_process_state

    def launch():
        accelerator = accel()
        model, optimizer, scheduler = _trio()
        train = torch.utils.data.DataLoader(_regression(22), batch_size=4, shuffle=True)  # 5 + 1 short step
        evaluation = torch.utils.data.DataLoader(_regression(10), batch_size=5)
        return (accelerator, *accelerator.prepare(model, optimizer, train, evaluation, scheduler))

    def run(stop_at=None, max_steps=9):
        accelerator, model, optimizer, train, evaluation, scheduler = launch()
        completed = accelerator.completed_steps  # as a script reads it before its loop
        seen = []
        for epoch in adaptive.remaining_epochs_until(3):
            for x, y in train:
                assert accelerator.completed_steps == completed
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                completed += 1
                seen.append((accelerator.completed_steps, accelerator.samples_seen))
                if completed == stop_at:
                    adaptive.request_stop()
                if completed >= max_steps:
                    if how == "finish_training":
                        adaptive.finish_training()
                    break
            evaluated = sum(len(x) for x, y in evaluation)
            assert evaluated == (0 if adaptive.training_finished() else 10)  # loops after finish_training: empty
            assert accelerator.completed_steps == completed == train.step  # evaluation steps are not counted
            if completed >= max_steps:
                adaptive.finish_training()
                break
        return accelerator, seen

    accelerator, uninterrupted = run()
    assert uninterrupted == [(1, 4), (2, 8), (3, 12), (4, 16), (5, 20), (6, 22), (7, 26), (8, 30), (9, 34)]
    assert (accelerator.completed_steps, accelerator.samples_seen) == (9, 34)

    restart_process_state()
    _reset_accelerate()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / "interrupted"))  # another job
    with pytest.raises(SystemExit):
        run(stop_at=4)
    restart_process_state()
    _reset_accelerate()
    accelerator, resumed = run()
    stopped_after = len(uninterrupted) - len(resumed)  # the stop is agreed on at a step boundary after the request
    assert 4 <= stopped_after < 9 and resumed == uninterrupted[stopped_after:]  # ends after the 9th, as uninterrupted
    restart_process_state()
    _reset_accelerate()
    accelerator, finished = run()
    assert finished == [] and (accelerator.completed_steps, accelerator.samples_seen) == (9, 34)


def test_save_state_and_load_state_carry_the_loader_position_epoch_and_random_state(accel, job, monkeypatch):
    """``save_state`` in the loop body after ``optimizer.step()``, as transformers' scripts call it; a new
    process (with no library checkpoint) ``load_state``s it: it goes on with the next step, each sample once per
    epoch, drawing the same random numbers, and ends with the uninterrupted run's weights."""
    from conftest import restart_process_state

    saved = job / "saved"

    def run(save_after=None, load=False):
        accelerator = accel()
        torch.manual_seed(1)
        model, optimizer, scheduler = _trio()
        data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randn(20, 1), torch.arange(20))
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        if load:
            accelerator.load_state(str(saved))
        trained = []
        for epoch in adaptive.remaining_epochs_until(2):
            for x, y, index in loader:
                noise = torch.randn(len(x), 1)  # the random generators must come back too
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y + noise))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                trained.append((epoch, index.tolist(), noise.flatten().tolist()))
                if accelerator.completed_steps == save_after:
                    accelerator.save_state(str(saved))
        return accelerator, model, trained

    accelerator, model, uninterrupted = run(save_after=7)  # in epoch 1 (5 steps per epoch)
    assert (saved / "adaptive").is_dir() and (saved / "model.safetensors").is_file()
    final = {key: value.clone() for key, value in model.module.state_dict().items()}
    restart_process_state()
    _reset_accelerate()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / "elsewhere"))  # nothing to resume by itself
    accelerator, model, resumed = run(load=True)
    assert resumed == uninterrupted[7:]
    assert accelerator.completed_steps == 10 and accelerator.samples_seen == 40
    for key, value in model.module.state_dict().items():
        torch.testing.assert_close(value, final[key], rtol=0, atol=0)


def test_load_state_of_a_plain_accelerate_folder_warns_and_refuses_inside_the_loop(accel, job, caplog):
    accelerator = accel()
    model, optimizer, scheduler = _trio()
    loader = torch.utils.data.DataLoader(_regression(8), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.save_state(str(job / "saved"))
    import shutil
    shutil.rmtree(job / "saved" / "adaptive")  # what Accelerate alone writes
    with caplog.at_level("WARNING", logger="adaptive.integrations._accelerate_state"):
        accelerator.load_state(str(job / "saved"))
    assert "holds no library state" in caplog.text
    with pytest.raises(RuntimeError, match="load_state must be called before the epoch loop"):
        for epoch in adaptive.remaining_epochs_until(1):
            accelerator.load_state(str(job / "saved"))


def test_sample_batches_accumulate_with_accumulation_steps_and_the_keyword_is_validated(job):
    """What the accelerator builds on: ``AdaptiveDataLoader(batch_size=8, accumulation_steps=2)`` steps in 2
    micro-batches of 4 samples (a short last step keeps what is left), each sample once."""
    loader = adaptive.AdaptiveDataLoader(Indices(20), batch_size=8, accumulation_steps=2)
    assert (loader.batch_size, loader.accumulation_steps, loader.current_local_bsz) == (8, 2, 4)
    batches = [(batch.tolist(), loader.micro_step) for batch in loader]
    assert [b for b, _ in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
    assert [m for _, m in batches] == [(0, 2), (1, 2), (0, 2), (1, 2), (0, 1)] and loader.step == 3
    for kwargs, error in [({"batch_size": 6, "accumulation_steps": 4}, "batch_size=6 must be a multiple of "
                                                                       "accumulation_steps=4"),
                          ({"accumulation_steps": 2}, "only apply to token-budget batches .* or to sample batches"),
                          ({"batch_size": 8, "accumulation_steps": 0}, "accumulation_steps"),
                          ({"batch_size": 8, "accumulation_steps": 2, "batch_size_schedule": "0:4 40:8"},
                           "cannot be combined with batch_size_schedule")]:
        with pytest.raises(ValueError, match=error):
            adaptive.AdaptiveDataLoader(Indices(20), name="bad", **kwargs)


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


def test_gradient_accumulation_steps_makes_micro_batches_and_backward_leaves_the_averaging_to_the_wrapper(accel):
    """``gradient_accumulation_steps=4``: each optimizer step is 4 micro-batches of the DataLoader's batch_size,
    as in Accelerate; Accelerate divides the loss by the steps, here the wrapper averages the micro-steps, so the
    step's gradient is that of the plain mean loss over the step's 8 samples."""
    accelerator = accel(gradient_accumulation_steps=4)
    model, optimizer, _ = _trio()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    data = _regression(16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=2))
    assert loader.batch_size == 8 and accelerator.gradient_accumulation_steps == 4
    pattern, samples = [], []
    for epoch in adaptive.remaining_epochs_until(1):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                pattern.append((len(x), accelerator.sync_gradients, accelerator.gradient_accumulation_steps))
                samples.append((x, y))
                if accelerator.sync_gradients:
                    xs, ys = torch.cat([x for x, _ in samples]), torch.cat([y for _, y in samples])
                    reference.zero_grad()
                    torch.nn.functional.mse_loss(reference(xs), ys).backward()
                    torch.testing.assert_close(model.module.weight.grad, reference.weight.grad)
                    samples.clear()
                optimizer.step()
                optimizer.zero_grad()
            reference.load_state_dict(model.module.state_dict())
    assert pattern == [(2, False, 4)] * 3 + [(2, True, 4)] + [(2, False, 4)] * 3 + [(2, True, 4)]
    assert loader.step == accelerator.completed_steps == 2


def test_gather_for_metrics_returns_each_sample_once(accel):
    accelerator = accel()
    model, optimizer, _ = _trio()
    evaluation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=4)
    model, optimizer, evaluation = accelerator.prepare(model, optimizer, evaluation)
    got = [accelerator.gather_for_metrics({"index": index})["index"] for (index,) in evaluation]
    assert torch.cat(got).tolist() == list(range(10))
    assert [accelerator.gather_for_metrics(["a", "b"]) for _ in evaluation][0] == ["a", "b"]
    assert accelerator.gather_for_metrics(torch.ones(2)).tolist() == [1.0, 1.0]  # outside a loop: Accelerate's




#: The distributed tests' job: 96 samples, 6 per process on 2 processes (a global batch of 12, which 3 processes
#: split evenly, so that the weights can equal the 2-process run's), in float64, 20 of its 24 steps (epoch 2
#: stops after 4 steps: the script counts ``accelerator.completed_steps`` against a --max_train_steps).
_JOB = dict(WORKER_SAMPLES="96", WORKER_BATCH="6", WORKER_EPOCHS="3", WORKER_DTYPE="float64", WORKER_MAX_STEPS="20")


@pytest.fixture
def uninterrupted(accel, job, monkeypatch):
    """``done.json`` of the same script run without interruption, here, on one process (the global batch of 12
    is one process's batch: the same mean gradient as 2 processes' 6 each, up to rounding)."""
    import runpy

    out = job / "uninterrupted"
    out.mkdir()
    for key, value in dict(_JOB, WORKER_BATCH="12", WORKER_OUT=str(out), WORKER_STEP_SLEEP="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(WORKER.parent))  # worker_common, as for the script run by a launcher
    runpy.run_path(str(WORKER), run_name="uninterrupted")["main"]()
    done = json.loads((out / "done.json").read_text())
    _assert_counts(out, done, first_launch=1)
    return done


def _assert_counts(out, done, first_launch=2):
    """20 optimizer steps of 12 samples, every sample once in epochs 0 and 1, 4 steps of epoch 2."""
    assert (done["completed_steps"], done["samples_seen"], done["step"]) == (20, 240, 20), done
    # the scheduler steps once per process of the first launch at each optimizer step, as Accelerate's would
    assert done["scheduler_steps"] == 20 * first_launch, done
    epochs = {record["epoch"]: record for record in read_jsonl(out / "epochs.jsonl")}  # the last record of each
    assert sorted(epochs) == [0, 1, 2], epochs
    assert [(epochs[e]["missing"], epochs[e]["extra"]) for e in (0, 1, 2)] == [(0, 0), (0, 0), (96 - 48, 0)], epochs
    # gather_for_metrics: each evaluation sample once; after finish_training() loader loops yield nothing
    assert [epochs[e]["eval"] for e in (0, 1, 2)] == [list(range(10))] * 2 + [[]], epochs


def _assert_weights(done, reference):
    # float64; 3 processes average 3 means of 4 samples where 2 averaged 2 means of 6: equal up to rounding
    torch.testing.assert_close(torch.tensor(done["weights"], dtype=torch.float64),
                               torch.tensor(reference["weights"], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 20-25 s on 2 shared cores (two launches); the example's test covers the default suite
def test_stop_on_2_processes_resume_on_3_keeps_the_global_batch_and_ends_with_the_uninterrupted_weights(
        jobs, tmp_path, uninterrupted):
    out = tmp_path / "accelerate"
    log2, log3 = out / "job2.log", out / "job3.log"
    started = time.time()
    # 3 per process x 2 processes x 2 micro-batches; a DataLoader worker per loader
    job = dict(_JOB, WORKER_BATCH="3", WORKER_ACCUMULATION="2", WORKER_LOADER_WORKERS="1")
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_SAVE_EVERY="5", **job)
    # (well before epoch 0's last step, 7: a stop in the evaluation loop resumes it at its next batch, and the
    # evaluation record would hold only the samples gathered after the resume)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 3, 60, "2 processes to take 3 steps")
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does to the launcher
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    stopped = progress(out, 0)
    codes = exit_codes(out, started)
    assert codes == [143, 143], f"{codes}\n{tail(log2)}"
    assert stopped["world"] == 2 and stopped["step"] < 20, f"{stopped}\n{tail(log2)}"

    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_SAVE_EVERY="5", **dict(job, WORKER_STEP_SLEEP="0"))
    assert wait_exit(proc, 90, log3) == 0, tail(log3)
    text = log3.read_text()
    assert "resuming from checkpoint" in text, tail(log3)
    micro = read_jsonl(out / "steps.jsonl")  # one record per micro-batch
    worlds = [record["world"] for record in micro]
    assert worlds[0] == 2 and worlds[-1] == 3 and worlds == sorted(worlds), worlds
    # the global batch of the first launch (3 per process x 2 processes x 2 micro-batches) at 3 processes too,
    # in 2 micro-batches of 6 samples, split 3 + 3 and then 2 + 2 + 2; the gradients synchronised on the second
    assert {(r["planned"], r["size"], r["batch_size"], r["accumulation"]) for r in micro} == {(12, 12, 12, 2)}, micro
    assert {(r["world"], r["local"]) for r in micro} == {(2, 3), (3, 2)}, micro
    assert [r["sync"] for r in micro] == [False, True] * 20, micro
    steps = [r for r in micro if r["sync"]]
    assert [r["step"] for r in steps] == list(range(20)), [r["step"] for r in steps]  # no step twice
    # the counters a script reads, restored on the relaunch: the step just taken included
    assert [(r["completed"], r["samples"]) for r in steps] == [(n, 12 * n) for n in range(1, 21)], steps
    done = json.loads((out / "done.json").read_text())
    assert done["world"] == 3
    _assert_counts(out, done)
    _assert_weights(done, uninterrupted)
    assert (out / "saved" / "adaptive").is_dir()  # save_state on every process wrote the library's part too


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 20-30 s on 2 shared cores: a start, a kill, a restart round
def test_a_sigkilled_worker_rolls_back_to_the_checkpoint_and_ends_with_the_uninterrupted_weights(
        jobs, tmp_path, uninterrupted):
    out = tmp_path / "killed"
    log = out / "job.log"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=2"], out, "job.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.3", ADAPTIVE_CHECKPOINT_KEEP="1000", **_JOB)
    victim = wait_for(lambda: (p := progress(out, 1)) and p["step"] >= 9 and newest_checkpoint_step(out) >= 4
                      and p, 60, "rank 1 to reach epoch 1 with a checkpoint taken")
    ended = [victim["pid"], progress(out, 0)["pid"]]  # the incarnation the kill ends: both workers
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_exit(proc, 90, log) == 0, tail(log)
    assert live_pids(ended) == [], "a worker of the killed incarnation outlived it"
    assert "resuming from checkpoint" in log.read_text(), tail(log)
    taken = [r["step"] for r in read_jsonl(out / "steps.jsonl")]
    assert sorted(set(taken)) == list(range(20)), taken  # the steps after the checkpoint were trained again
    done = json.loads((out / "done.json").read_text())
    _assert_counts(out, done)  # each sample once per epoch after the rollback, the step counters rolled back too
    _assert_weights(done, uninterrupted)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-25 s on 2 shared cores: two launches
def test_save_state_on_2_processes_load_state_on_3_goes_on_exactly(jobs, tmp_path, uninterrupted):
    """transformers' --checkpointing_steps / --resume_from_checkpoint: a job on 2 processes save_states after
    steps 7 and 14; another job (its own checkpoint folder: nothing to resume by itself) on 3 processes
    load_states the folder and trains steps 14 to 20: each sample once per epoch (the per-sample counts of the
    epoch in progress came back too) and the uninterrupted run's weights."""
    saver, loader = tmp_path / "saver", tmp_path / "loader"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], saver, "job.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_SAVE_EVERY="7", WORKER_STEP_SLEEP="0", **_JOB)
    assert wait_exit(proc, 90, saver / "job.log") == 0, tail(saver / "job.log")
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], loader, "job.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_STEP_SLEEP="0", WORKER_LOAD_FROM=str(saver / "saved"),
                       **_JOB)
    assert wait_exit(proc, 90, loader / "job.log") == 0, tail(loader / "job.log")
    assert "resuming from checkpoint" not in (loader / "job.log").read_text()  # only load_state restored it
    steps = read_jsonl(loader / "steps.jsonl")
    assert [(r["step"], r["world"], r["completed"]) for r in steps] == [(n, 3, n + 1) for n in range(14, 20)], steps
    done = json.loads((loader / "done.json").read_text())
    assert (done["completed_steps"], done["samples_seen"], done["scheduler_steps"]) == (20, 240, 40), done
    epochs = {record["epoch"]: record for record in read_jsonl(loader / "epochs.jsonl")}
    assert [(epochs[e]["missing"], epochs[e]["extra"]) for e in (1, 2)] == [(0, 0), (96 - 48, 0)], epochs
    _assert_weights(done, uninterrupted)


@pytest.mark.distributed
@pytest.mark.slow
def test_live_a_node_joins_and_leaves_and_the_job_ends_with_the_uninterrupted_weights(jobs, tmp_path, uninterrupted):
    """``adaptive-run --live``: one node trains alone, a second joins (Accelerate's process count and index follow,
    the global batch stays 12: 12 on one, 6 + 6 on two), then leaves on SIGTERM (143) while the first goes on in
    the same process; every sample once per epoch, every step once, the uninterrupted run's weights."""
    import portpicker

    out = tmp_path / "live"
    port = portpicker.pick_unused_port()
    live = ["--live", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    full_speed = tmp_path / "full-speed"  # the steps sleep until the test made its changes
    job = dict(_JOB, WORKER_BATCH="12", WORKER_STEP_SLEEP="0.6", WORKER_SLEEP_UNTIL=str(full_speed),
               ADAPTIVE_CHECKPOINT_INTERVAL="0")
    first = jobs.launch(live, out, "first.log", script=WORKER, **job)
    micro = lambda: read_jsonl(out / "steps.jsonl") if (out / "steps.jsonl").exists() else []  # noqa: E731
    wait_for(lambda: len(micro()) >= 3, 60, "the first node to train")
    second = jobs.launch(live, out, "second.log", script=WORKER, **job)
    wait_for(lambda: sum(r["world"] == 2 for r in micro()) >= 3, 90, "the second node to join and train")
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, tail(out / "second.log")
    wait_for(lambda: micro()[-1]["world"] == 1, 30, "the first node to train alone again")
    full_speed.touch()
    assert wait_exit(first, 90, out / "first.log") == 0, tail(out / "first.log")
    records = micro()
    worlds = [r["world"] for r in records]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1, worlds
    assert {(r["planned"], r["size"]) for r in records} == {(12, 12)}, records  # the first launch's global batch
    assert {(r["world"], r["local"]) for r in records} == {(1, 12), (2, 6)}, records
    assert [r["step"] for r in records] == list(range(20)), [r["step"] for r in records]  # no step twice
    done = json.loads((out / "done.json").read_text())
    _assert_counts(out, done, first_launch=1)
    _assert_weights(done, uninterrupted)


@pytest.mark.distributed
def test_the_accelerate_example_trains_on_2_processes_under_adaptive_run_and_a_relaunch_trains_nothing(tmp_path):
    """``examples/hf_accelerate_classifier.py`` as its docstring runs it, shortened by its own options."""
    pytest.importorskip("transformers", reason="the example needs transformers (the huggingface extra)")
    import subprocess

    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                       ADAPTIVE_CHECKPOINT_PATH=str(tmp_path / "checkpoints"), ADAPTIVE_SHARE_PATH=str(tmp_path / "share"),
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    script = [str(REPO / "examples" / "hf_accelerate_classifier.py"), "--train-samples", "768",
              "--num-train-epochs", "3", "--max-train-steps", "30", "--checkpointing-steps", "20",
              "--output-dir", str(tmp_path / "saved")]

    def run(*launcher):
        result = subprocess.run([sys.executable, *launcher, *script], env=environment, cwd=str(tmp_path),
                                capture_output=True, text=True, timeout=120)
        log = result.stdout + result.stderr
        assert result.returncode == 0, log[-4000:]
        return log

    log = run("-m", "adaptive.elastic.launcher", "--standalone", "--nproc-per-node=2")
    epochs = [line for line in log.splitlines() if "accuracy" in line]
    assert len(epochs) == 2 and all("2 processes" in line for line in epochs), log[-4000:]
    assert float(epochs[-1].split("accuracy ")[1].split("%")[0]) > 60.0  # two classes: chance is 50% (30 steps: 70%)
    assert "done: 30 optimizer steps, 960 samples" in log  # --max-train-steps 30 of 32 samples each
    assert "lr 0.00e+00" in epochs[-1]  # the linear schedule ends where training ends
    assert (tmp_path / "saved" / "adaptive").is_dir()  # save_state at step 20 wrote the library's state too
    log = run()  # relaunched, on one process: finished, nothing is trained again
    assert "accuracy" not in log and "done: 30 optimizer steps, 960 samples" in log, log[-4000:]


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


@pytest.mark.distributed
@pytest.mark.parametrize("scripted", [
    # the goodput model's own choices follow timings (20-45 s here): the slow sample; scripted ones: every run
    pytest.param("", id="goodput-model", marks=[pytest.mark.slow, pytest.mark.ci_sample]),
    pytest.param("2x2,4x2,2x3,4x4,3x2,4x3", id="scripted")])
def test_autoscale_on_a_prepared_loader_follows_the_plan_across_a_stop_on_2_and_a_resume_on_3(jobs, tmp_path,
                                                                                            scripted):
    """``train_loader.autoscale_batch_size(32, local_bsz_bounds=(1, 4), gradient_accumulation=True)`` on the loader
    ``prepare`` returned, 2 processes stopped by SIGTERM and resumed on 3.  From rank 0's record of every
    micro-batch: the batch changes during the run (scripted: the goodput model's decisions replaced by a script,
    so that the accumulation steps change whatever the machine measures); inside ``accumulate``,
    ``sync_gradients`` is true exactly on the micro-batch that ends a step and ``gradient_accumulation_steps`` is
    the step's micro-batches; each step's samples are the planned global batch; ``completed_steps`` and
    ``samples_seen`` count every step and sample once; every sample is trained once per epoch; the LR factor is
    the scaling rule's (SGD with momentum: AdaScale, the gain, 1 <= gain <= scale)."""
    out = tmp_path / "autoscale"
    log2, log3 = out / "job2.log", out / "job3.log"
    knobs = dict(ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_SAMPLES="96", WORKER_BATCH="2", WORKER_EPOCHS="2",
                 WORKER_AUTOSCALE="32,1,4", WORKER_SCRIPTED=scripted)
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER,
                       WORKER_STEP_SLEEP="0.15", **knobs)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 6, 90, "2 processes to take 6 steps")
    os.killpg(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    assert exit_codes(out, started) == [143, 143], tail(log2)
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       WORKER_STEP_SLEEP="0.01", **knobs)
    assert wait_exit(proc, 120, log3) == 0, tail(log3)

    records = read_jsonl(out / "steps.jsonl")
    steps: dict[int, list[dict]] = {}
    for record in records:
        steps.setdefault(record["step"], []).append(record)
    assert sorted(steps) == list(range(len(steps))), sorted(steps)  # each optimizer step once, none lost
    shapes, samples, factors = set(), 0, []
    for number, micro in sorted(steps.items()):
        first, last = micro[0], micro[-1]
        count = first["micro_step"][1]
        assert [record["micro_step"] for record in micro] == [[m, count] for m in range(count)], micro
        assert [record["sync"] for record in micro] == [False] * (count - 1) + [True], micro
        assert all(record["accumulation"] == count for record in micro), micro
        assert all(record["world"] == first["world"] and record["size"] == first["size"] for record in micro)
        samples += first["size"]
        assert (last["completed"], last["samples"]) == (number + 1, samples), last  # the accelerator's counters
        assert 1.0 <= last["gain"] <= first["planned"] / 4 + 1e-9 and last["rule_factor"] == pytest.approx(
            last["gain"]), last  # AdaScale: the LR factor is the measured gain
        shapes.add((first["world"], first["planned"] // (first["world"] * count), count))  # the planned local batch
        factors.append(last["rule_factor"])
    assert {shape[0] for shape in shapes} == {2, 3}
    assert len({shape[1:] for shape in shapes}) > 1, shapes  # autoscale changed the batch
    assert max(factors) > 1.0, factors
    if scripted:
        assert len({shape[2] for shape in shapes}) > 1, shapes  # the accumulation steps changed
    epochs = {record["epoch"]: record for record in read_jsonl(out / "epochs.jsonl")}
    assert [(epochs[e]["missing"], epochs[e]["extra"]) for e in (0, 1)] == [(0, 0), (0, 0)], epochs
    done = json.loads((out / "done.json").read_text())
    assert (done["completed_steps"], done["samples_seen"], done["step"], done["world"]) == (
        len(steps), 2 * 96, len(steps), 3), done
