"""AdaptiveTrainer (adaptive.integrations.transformers): a transformers Trainer script made elastic.

In-process tests of what the trainer takes over (the loader, the model
wrapper, the schedule, a stop and a relaunch in the same process,
``resume_from_checkpoint`` with the Trainer's own checkpoints, a tiny
random-init BERT and GPT-2), then real ``adaptive-run`` jobs on 127.0.0.1
(gloo), compared step by step with an uninterrupted run: stopped by SIGTERM
on 2 processes and resumed on 3, a SIGKILLed worker, a Trainer checkpoint of
2 processes resumed on 3 in fresh folders, the ``run_clm.py`` port
(``examples/hf_trainer_clm.py``) stopped on 2 and resumed on 3, and an
``adaptive-run --live`` job that gains a node and loses it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the huggingface extra is not installed "
                                   "(pip install adaptive-elastic[huggingface])")

import adaptive  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from conftest import restart_process_state  # noqa: E402
from elastic_harness import (REPO, exit_codes, live_pids, newest_checkpoint_step, progress, read_jsonl,  # noqa: E402
                             tail, wait_exit, wait_for)
from elastic_harness import jobs  # noqa: E402,F401  (the fixture)
from workers.worker_common import TrainerRegressor as Regressor  # noqa: E402

WORKER = REPO / "tests" / "workers" / "trainer_worker.py"


def _reset_accelerate() -> None:
    """Forget Accelerate's shared state (its own tests' way to build a new Trainer in the same process)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def trainer_cls(job):
    """The AdaptiveTrainer class in a fresh single-process job."""
    from adaptive.integrations.transformers import AdaptiveTrainer

    _reset_accelerate()
    yield AdaptiveTrainer
    _reset_accelerate()


def _samples(n: int, seed: int = 1) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    return [{"x": x[i], "labels": y[i], "index": torch.tensor(i)} for i in range(n)]


def _args(tmp_path, **overrides) -> transformers.TrainingArguments:
    options = dict(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, num_train_epochs=2,
                   learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=2, save_strategy="no",
                   report_to=[], disable_tqdm=True, seed=0, logging_steps=2)
    options.update(overrides)
    return transformers.TrainingArguments(**options)


class _Steps(transformers.TrainerCallback):
    """Records (global_step, epoch, LR after the step) at every step; asks for a stop after ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.records: list[tuple[int, float, float]] = []

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.records.append((state.global_step, state.epoch, lr_scheduler.get_last_lr()[0]))
        if state.global_step == self.stop_at:
            adaptive.request_stop()  # as SIGTERM would


class _Counter(transformers.TrainerCallback, transformers.trainer_callback.ExportableState):
    """A stateful callback (ExportableState, as EarlyStoppingCallback): counts the steps it saw."""

    def __init__(self, label: str = "steps") -> None:
        self.label, self.count = label, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1

    def state(self) -> dict:
        return {"args": {"label": self.label}, "attributes": {"count": self.count}}


def _expected_lrs(args: transformers.TrainingArguments, max_steps: int) -> list[float]:
    """An uninterrupted run's LR after each step: the same schedule, stepped max_steps times."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer,
                                           num_warmup_steps=args.get_warmup_steps(max_steps),
                                           num_training_steps=max_steps)
    lrs = []
    for _ in range(max_steps):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def test_import_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when not installed
    monkeypatch.delitem(sys.modules, "adaptive.integrations.transformers", raising=False)
    with pytest.raises(ImportError, match=r"pip install adaptive-elastic\[huggingface\]"):
        importlib.import_module("adaptive.integrations.transformers")


def test_checked_transformers_version_and_the_private_method():
    """The one private Trainer method overridden (``_wrap_model``) exists on the release checked."""
    from adaptive.integrations.transformers import CHECKED_TRANSFORMERS_VERSIONS

    assert ".".join(transformers.__version__.split(".")[:2]) in CHECKED_TRANSFORMERS_VERSIONS
    assert callable(transformers.Trainer._wrap_model)


def test_trains_on_an_adaptive_loader_with_the_global_batch_and_wrapped_model(trainer_cls, tmp_path):
    """gradient_accumulation_steps sizes the global batch; the Trainer sees 1 and the schedule ends at the end."""
    args = _args(tmp_path, gradient_accumulation_steps=3, per_device_train_batch_size=2, save_strategy="steps",
                 save_steps=5)
    model = Regressor()
    steps = _Steps()
    trainer = trainer_cls(model=model, args=args, train_dataset=_samples(30), callbacks=[steps])
    assert args.gradient_accumulation_steps == 3 and trainer.args.gradient_accumulation_steps == 1
    assert trainer.args.use_cpu and trainer.args.world_size == 1
    trainer.train()
    data = trainer.get_train_dataloader()
    assert isinstance(data.loader, adaptive.AdaptiveDataLoader) and data.loader.batch_size == 6  # 2 x 1 x 3
    assert isinstance(trainer.model_wrapped, adaptive.AdaptiveDataParallel) and trainer.model_wrapped.module is model
    assert trainer.model_wrapped.lr_scheduler is trainer.lr_scheduler
    assert [len(indices) for indices in model.seen] == [6] * 10  # 30 samples, 5 steps per epoch, 2 epochs
    for epoch in range(2):
        assert sorted(i for indices in model.seen[5 * epoch:5 * epoch + 5] for i in indices) == list(range(30))
    assert trainer.state.global_step == data.loader.step == 10 and trainer.state.max_steps == 10
    assert [record[0] for record in steps.records] == list(range(1, 11))
    assert [record[1] for record in steps.records] == pytest.approx([(s + 1) / 5 for s in range(10)])
    assert [record[2] for record in steps.records] == _expected_lrs(args, 10)
    assert set(trainer.lr_scheduler.get_last_lr()) == {0.0}  # (two parameter groups: with and without decay)
    assert adaptive.finished_epochs() == 2
    # the Trainer's own checkpoints are still written where its arguments say
    assert sorted(path.name for path in (tmp_path / "trainer").glob("checkpoint-*")) == ["checkpoint-10",
                                                                                       "checkpoint-5"]


@pytest.mark.parametrize("stop_at", [3, 5])
def test_a_stop_then_a_relaunch_carries_on_as_an_uninterrupted_run(trainer_cls, tmp_path, stop_at):
    """request_stop() after step 3 of 10 (or 5, the end of epoch 1): exit 143 with a checkpoint; the relaunch resumes
    at the next step with the TrainerState, the LR schedule, the weights and the data order of an uninterrupted
    run."""
    from adaptive.elastic import sync_points

    def run(stop_at=None, checkpoints="checkpoints"):
        os.environ["ADAPTIVE_CHECKPOINT_PATH"] = str(tmp_path / checkpoints)
        restart_process_state()
        _reset_accelerate()
        torch.manual_seed(0)
        model, steps = Regressor(), _Steps(stop_at)
        trainer = trainer_cls(model=model, args=_args(tmp_path), train_dataset=_samples(20), callbacks=[steps])
        return trainer, model, steps

    reference, reference_model, reference_steps = run(checkpoints="reference")
    reference.train()
    assert reference.state.global_step == 10

    trainer, model, steps = run(stop_at=stop_at)
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    last = steps.records[-1][0]  # the stop is agreed at a step boundary after the request: that step or soon after
    assert stop_at <= last < 10 and [record[0] for record in steps.records] == list(range(1, last + 1))

    trainer, resumed_model, resumed_steps = run()
    trainer.train()
    assert [record[0] for record in resumed_steps.records] == list(range(last + 1, 11))
    assert steps.records + resumed_steps.records == reference_steps.records  # global step, epoch, LR: all equal
    assert model.seen + resumed_model.seen == reference_model.seen  # the same samples in the same steps
    assert torch.equal(resumed_model.linear.weight, reference_model.linear.weight)  # same process count: exact
    logged = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == [2, 4, 6, 8, 10]  # the log history carried across the stop


def test_resume_from_a_trainer_checkpoint_in_a_fresh_folder_matches_an_uninterrupted_run(trainer_cls, tmp_path):
    """An uninterrupted run writes Trainer checkpoints every 3 steps (checkpoint-N/adaptive holds the library's
    state); a new job in fresh folders resumed with resume_from_checkpoint=checkpoint-6 (epoch 2, mid-epoch) trains
    steps 7-10 as the uninterrupted run did: same samples, LR, TrainerState and weights.  Stopped at step 8 and
    relaunched with the same resume_from_checkpoint, the library's later checkpoint of the same run wins.  A stateful
    (ExportableState) callback's attributes are carried."""
    from adaptive.elastic import sync_points

    def run(name, stop_at=None):
        os.environ["ADAPTIVE_CHECKPOINT_PATH"] = str(tmp_path / name / "library")
        restart_process_state()
        _reset_accelerate()
        torch.manual_seed(0)
        model, steps, counter = Regressor(), _Steps(stop_at), _Counter()
        args = _args(tmp_path, output_dir=str(tmp_path / name / "trainer"), save_strategy="steps", save_steps=3)
        trainer = trainer_cls(model=model, args=args, train_dataset=_samples(20), callbacks=[steps, counter])
        return trainer, model, steps

    reference, reference_model, reference_steps = run("reference")
    reference.train()
    saved = tmp_path / "reference" / "trainer"
    assert sorted(path.name for path in saved.glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-3", "checkpoint-6", "checkpoint-9"]
    assert (saved / "checkpoint-6" / "adaptive").is_dir()

    for start in (3, 6):
        trainer, model, steps = run(f"from{start}")
        trainer.train(resume_from_checkpoint=str(saved / f"checkpoint-{start}"))
        assert steps.records == reference_steps.records[start:]  # global step, epoch, LR after each step
        assert model.seen == reference_model.seen[start:]  # the same samples in the same steps
        assert torch.equal(model.linear.weight, reference_model.linear.weight)  # one process: exact
        assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [2, 4, 6, 8, 10]
        counter = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, _Counter))
        assert counter.count == 10  # the stateful callback's attributes carried from the checkpoint

    trainer, model, steps = run("stopped", stop_at=8)
    with pytest.raises(SystemExit) as stopped:
        trainer.train(resume_from_checkpoint=str(saved / "checkpoint-6"))
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    last = steps.records[-1][0]
    assert 8 <= last < 10
    trainer, model, steps = run("stopped")  # the same command again
    trainer.train(resume_from_checkpoint=str(saved / "checkpoint-6"))
    assert steps.records == reference_steps.records[last:]  # not rolled back to step 6
    assert torch.equal(model.linear.weight, reference_model.linear.weight)


def test_resume_from_an_epoch_end_checkpoint_and_from_true(trainer_cls, tmp_path):
    """save_strategy="epoch" writes checkpoint-5 after the epoch's pass ended; resume_from_checkpoint=True in a copy
    of output_dir (no library checkpoint) takes the newest Trainer checkpoint; both carry on as the
    uninterrupted run."""
    import shutil

    def run(name, output_dir, **options):
        os.environ["ADAPTIVE_CHECKPOINT_PATH"] = str(tmp_path / name / "library")
        restart_process_state()
        _reset_accelerate()
        torch.manual_seed(0)
        model, steps = Regressor(), _Steps()
        args = _args(tmp_path, output_dir=str(output_dir), **options)
        return trainer_cls(model=model, args=args, train_dataset=_samples(20), callbacks=[steps]), model, steps

    reference, reference_model, reference_steps = run("reference", tmp_path / "saved", save_strategy="epoch",
                                                      num_train_epochs=3)
    reference.train()
    assert sorted(p.name for p in (tmp_path / "saved").glob("checkpoint-*")) == [
        "checkpoint-10", "checkpoint-15", "checkpoint-5"]
    trainer, model, steps = run("from5", tmp_path / "from5", num_train_epochs=3)
    trainer.train(resume_from_checkpoint=str(tmp_path / "saved" / "checkpoint-5"))
    assert steps.records == reference_steps.records[5:] and model.seen == reference_model.seen[5:]
    assert torch.equal(model.linear.weight, reference_model.linear.weight)

    shutil.copytree(tmp_path / "saved", tmp_path / "copy")
    shutil.rmtree(tmp_path / "copy" / "checkpoint-15")
    trainer, model, steps = run("true", tmp_path / "copy", num_train_epochs=3)
    trainer.train(resume_from_checkpoint=True)  # the newest in output_dir: checkpoint-10
    assert steps.records == reference_steps.records[10:] and model.seen == reference_model.seen[10:]
    assert torch.equal(model.linear.weight, reference_model.linear.weight)


def test_resume_from_checkpoint_refusals_name_the_argument(trainer_cls, tmp_path):
    trainer = trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8))
    with pytest.raises(ValueError, match="resume_from_checkpoint=.*not a folder"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "missing"))
    trainer = trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8))
    with pytest.raises(ValueError, match="resume_from_checkpoint=True: no valid checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_max_steps_ends_training_mid_epoch_and_a_relaunch_trains_nothing(trainer_cls, tmp_path):
    """max_steps=7 with 5 steps per epoch: the schedule ends at step 7, in epoch 1, and the job is checkpointed as
    finished there; a relaunch restores the weights and TrainerState and takes no step."""
    args = _args(tmp_path, max_steps=7)
    model, steps = Regressor(), _Steps()
    trainer = trainer_cls(model=model, args=args, train_dataset=_samples(20), callbacks=[steps])
    trainer.train()
    assert [record[0] for record in steps.records] == list(range(1, 8)) and trainer.state.epoch == pytest.approx(1.4)
    assert [record[2] for record in steps.records] == _expected_lrs(args, 7)
    assert adaptive.training_finished() and trainer.get_train_dataloader().loader.step == 7
    weight = model.linear.weight.detach().clone()

    restart_process_state()
    _reset_accelerate()
    model, steps = Regressor(), _Steps()
    trainer = trainer_cls(model=model, args=_args(tmp_path, max_steps=7), train_dataset=_samples(20),
                          callbacks=[steps])
    output = trainer.train()
    assert steps.records == [] and output.global_step == 7 and trainer.state.epoch == pytest.approx(1.4)
    assert torch.equal(model.linear.weight, weight)


def test_refusals_name_the_argument(trainer_cls, tmp_path):
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        trainer_cls(model=Regressor(), args=_args(tmp_path, auto_find_batch_size=True), train_dataset=_samples(8))
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        trainer_cls(model=Regressor(), args=_args(tmp_path, train_sampling_strategy="group_by_length"),
                    train_dataset=_samples(8))
    trainer = trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8))
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path))


def test_a_tiny_random_init_bert_trains(trainer_cls, tmp_path):
    """A transformers model (2 layers, hidden 32, random init: nothing is downloaded) with its own loss."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(0, 64, (8,), generator=generator), "labels": torch.tensor(i % 2)}
               for i in range(16)]
    args = _args(tmp_path, per_device_train_batch_size=4, num_train_epochs=1, learning_rate=1e-3, warmup_steps=1,
                 eval_strategy="epoch", per_device_eval_batch_size=4)
    trainer = trainer_cls(model=model, args=args, train_dataset=samples, eval_dataset=samples[:6])
    output = trainer.train()
    assert isinstance(trainer.model_wrapped, adaptive.AdaptiveDataParallel)
    assert output.global_step == trainer.state.global_step == 4 and trainer.state.epoch == 1.0
    assert set(trainer.lr_scheduler.get_last_lr()) == {0.0}  # (two parameter groups: with and without decay)
    assert any("eval_loss" in entry for entry in trainer.state.log_history)


def test_a_tiny_causal_lm_keeps_the_trainers_token_normalised_loss(trainer_cls, tmp_path):
    """GPT-2 (random init) takes num_items_in_batch: the Trainer normalises its loss over the batch's tokens, and
    the trainer's sample weighting leaves it alone."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(12):
        ids = torch.randint(0, 64, (8,), generator=generator)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    trainer = trainer_cls(model=model, args=_args(tmp_path, num_train_epochs=1, learning_rate=1e-3),
                          train_dataset=samples)
    assert trainer.model_accepts_loss_kwargs
    shares = []
    original = trainer._sample_share

    def recorded(num_items_in_batch):
        shares.append((num_items_in_batch is not None, original(num_items_in_batch)))
        return shares[-1][1]

    trainer._sample_share = recorded
    output = trainer.train()
    assert output.global_step == 3 and shares == [(True, 1.0)] * 3
    assert all(entry["loss"] > 0 for entry in trainer.state.log_history if "loss" in entry)




def _steps_by_number(out):
    """Every process's step records merged per global step: {step: [(rank, record), ...]}.

    A step trained again after a roll-back (a crash) is taken from its last
    training: each process's later record of a step replaces its earlier one.
    """
    merged: dict[int, dict[int, dict]] = {}
    for rank_file in sorted(out.glob("steps.rank*.jsonl")):
        rank = int(rank_file.name.split(".")[1][len("rank"):])
        for record in read_jsonl(rank_file):
            merged.setdefault(record["step"], {})[rank] = record
    return {step: sorted(records.items()) for step, records in merged.items()}


# global batch 4 x 2 = 8 of 48 samples: 6 steps per epoch, 18 in all; on 3 processes 3, 3, 2 samples per step
SAMPLES, BATCH, EPOCHS, PER_EPOCH = 48, 4, 3, 6
TOTAL = EPOCHS * PER_EPOCH


def _uninterrupted_run(jobs, folder):
    """The reference: one process, the same global batch (8), no stop; its step records and done.json."""
    folder.mkdir()
    done = subprocess.run([sys.executable, str(WORKER)], env=jobs.env(folder, WORKER_BATCH=str(2 * BATCH),
                          WORKER_STEP_SLEEP="0", ADAPTIVE_CHECKPOINT_INTERVAL="0"), cwd=str(folder),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-4000:]
    expected = {step: records[0][1] for step, records in _steps_by_number(folder).items()}
    assert sorted(expected) == list(range(1, TOTAL + 1))
    return expected, json.loads((folder / "done.json").read_text())


def _assert_matches_uninterrupted(out, expected, reference_done, world_of_step):
    """Each optimizer step once, on every process, with the first launch's global batch, the uninterrupted run's
    samples and LR; every sample once per epoch; the same TrainerState, LR and (nearly) weights at the end."""
    steps = _steps_by_number(out)
    assert sorted(steps) == list(range(1, TOTAL + 1)), sorted(steps)  # no step lost or counted twice
    visits = {epoch: [] for epoch in range(EPOCHS)}
    for step, records in steps.items():
        world = records[0][1]["world"]
        assert [rank for rank, _ in records] == list(range(world)), (step, records)  # every process trained it
        assert world == world_of_step(step), (step, world)
        indices = [i for _, record in records for i in record["indices"]]
        assert len(indices) == 2 * BATCH, (step, records)  # the first launch's global batch, at 3 processes too
        assert sorted(indices) == sorted(expected[step]["indices"]), step  # the uninterrupted run's samples
        for _, record in records:
            assert record["lr"] == expected[step]["lr"], (step, record, expected[step])  # the same LR, exactly
            assert record["rule_factor"] == record["size_factor"] == 1.0, record  # and applied as it is
            assert record["epoch"] == pytest.approx(expected[step]["epoch"]) and record["max_steps"] == TOTAL
        visits[(step - 1) // PER_EPOCH] += indices
    for epoch, seen in visits.items():
        assert sorted(seen) == list(range(SAMPLES)), epoch  # every sample exactly once per epoch

    done = json.loads((out / "done.json").read_text())
    assert (done["global_step"], done["loader_step"], done["epoch"]) == (TOTAL, TOTAL, 3.0), done
    assert done["lr"] == reference_done["lr"] == 0.0
    assert done["logged_steps"] == reference_done["logged_steps"] == [4, 8, 12, 16]  # the log history carried
    for weights, reference_weights in zip(done["weights"], reference_done["weights"]):
        # the same samples per step, each step's gradient the mean over its 8 samples (3, 3, 2 per process
        # weighted by compute_loss); only the order of the floating-point sums differs
        assert weights == pytest.approx(reference_weights, rel=1e-4, abs=1e-5)
    return done


@pytest.mark.slow
@pytest.mark.ci_sample  # 25-70 s on 2 shared cores: three launches that import transformers
@pytest.mark.distributed
def test_sigterm_on_2_processes_resume_on_3_matches_an_uninterrupted_run(jobs, tmp_path):
    expected, reference_done = _uninterrupted_run(jobs, tmp_path / "reference")
    out = tmp_path / "trainer"
    log2, log3 = out / "job2.log", out / "job3.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_BATCH=str(BATCH), WORKER_STEP_SLEEP="0.2")
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 5, 90, "2 processes to take 5 steps")
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does to the launcher
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    codes = exit_codes(out, started)
    assert codes == [143, 143], f"{codes}\n{tail(log2)}"
    stopped = progress(out, 0)
    assert stopped["world"] == 2 and 5 <= stopped["step"] < TOTAL, f"{stopped}\n{tail(log2)}"

    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_BATCH=str(BATCH), WORKER_STEP_SLEEP="0")
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert f"AdaptiveTrainer resumes at global step {stopped['step']}," in log3.read_text(), tail(log3)
    done = _assert_matches_uninterrupted(out, expected, reference_done,
                                         lambda step: 2 if step <= stopped["step"] else 3)
    assert done["world"] == 3


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sigkilled_worker_rolls_back_to_the_last_checkpoint_and_matches_an_uninterrupted_run(jobs, tmp_path):
    """torchrun restarts both workers; they resume the newest periodic checkpoint (model, optimizer, scheduler,
    data position and TrainerState together) and retrain the steps after it exactly."""
    expected, reference_done = _uninterrupted_run(jobs, tmp_path / "reference")
    out = tmp_path / "crash"
    log = out / "job.log"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=1"], out, "job.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.3", WORKER_BATCH=str(BATCH), WORKER_STEP_SLEEP="0.2")
    victim = wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 7 and newest_checkpoint_step(out) >= 3
                      and p, 90, "rank 0 to take 7 steps after a checkpoint")
    ended = [victim["pid"], progress(out, 1)["pid"]]  # the incarnation the kill ends: both workers
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_exit(proc, 180, log) == 0, tail(log)
    assert live_pids(ended) == [], "a worker of the killed incarnation outlived it"
    text = log.read_text()
    assert "resuming from checkpoint" in text and "AdaptiveTrainer resumes at global step" in text, tail(log)
    done = _assert_matches_uninterrupted(out, expected, reference_done, lambda step: 2)
    assert done["world"] == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_a_trainer_checkpoint_of_2_processes_resumed_on_3_in_fresh_folders_matches_an_uninterrupted_run(jobs,
                                                                                                          tmp_path):
    """The Trainer's checkpoint-7 of a 2-process job (checkpoint-7/adaptive: the library's state), resumed with
    resume_from_checkpoint= by a 3-process job with a new library checkpoint folder and output_dir: steps 8-18
    train the uninterrupted run's samples with its LR, every sample once per epoch, the weights close."""
    expected, reference_done = _uninterrupted_run(jobs, tmp_path / "reference")
    out = tmp_path / "job"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_BATCH=str(BATCH), WORKER_STEP_SLEEP="0",
                       WORKER_SAVE_STEPS="7")
    assert wait_exit(proc, 120, out / "job2.log") == 0, tail(out / "job2.log")
    saved = out / "trainer" / "checkpoint-7"
    assert (saved / "adaptive").is_dir(), sorted(p.name for p in (out / "trainer").iterdir())
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_BATCH=str(BATCH), WORKER_STEP_SLEEP="0",
                       ADAPTIVE_CHECKPOINT_PATH=str(out / "fresh-checkpoints"),
                       WORKER_TRAINER_OUT=str(out / "fresh-trainer"), WORKER_RESUME_FROM=str(saved))
    log3 = out / "job3.log"
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert "resume_from_checkpoint: restoring the library's state from" in log3.read_text(), tail(log3)
    assert "AdaptiveTrainer resumes at global step 7," in log3.read_text(), tail(log3)
    done = _assert_matches_uninterrupted(out, expected, reference_done, lambda step: 2 if step <= 7 else 3)
    assert done["world"] == 3


CLM_PORT = REPO / "tests" / "workers" / "run_clm_port.py"


def _final_eval_loss(text: str) -> tuple[float, int, int]:
    """(eval loss, global step, processes) from the example's last line."""
    line = [line for line in text.splitlines() if line.startswith("final eval loss")][-1]
    words = line.split()
    return float(words[3]), int(words[5]), int(words[8])


@pytest.mark.slow
@pytest.mark.distributed
def test_the_run_clm_port_stopped_on_2_processes_and_resumed_on_3_matches_an_uninterrupted_run(jobs, tmp_path):
    """examples/hf_trainer_clm.py (run_clm.py on AdaptiveTrainer, a tiny GPT-2 on generated text) under adaptive-run:
    SIGTERM on 2 processes (exit 143), the same command on 3; every block once per epoch, 16 blocks per step, the
    uninterrupted run's blocks and LR at every step, and its final eval loss."""
    # 36 evaluation blocks in batches of 6 split evenly on 1, 2 and 3 processes: the Trainer's distributed evaluation
    # pads an uneven last batch with repeated blocks, and the mean loss of that batch counts them
    evaluation = ["--max_eval_samples", "36", "--per_device_eval_batch_size", "6"]
    reference = tmp_path / "reference"
    reference.mkdir()
    done = subprocess.run([sys.executable, str(CLM_PORT), "--per_device_train_batch_size", "16", *evaluation,
                           "--output_dir", str(reference / "trainer")], env=jobs.env(reference, ADAPTIVE_CHECKPOINT_INTERVAL="0"),
                          cwd=str(reference), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180)
    text = done.stdout.decode(errors="replace")
    assert done.returncode == 0, text[-4000:]
    reference_loss, total, _ = _final_eval_loss(text)
    expected = {step: records[0][1] for step, records in _steps_by_number(reference).items()}
    assert sorted(expected) == list(range(1, total + 1))
    samples = len({i for record in expected.values() for i in record["indices"]})
    per_epoch = -(-samples // 16)
    assert total == 3 * per_epoch

    out = tmp_path / "job"
    out.mkdir()
    command = ["--output_dir", str(out / "trainer"), *evaluation]  # (jobs.launch passes the script no arguments)
    started = time.time()
    launch = [sys.executable, "-m", "adaptive.elastic.launcher"]
    log2 = open(out / "job2.log", "ab")
    proc = subprocess.Popen([*launch, "--standalone", "--nproc-per-node=2", str(CLM_PORT), *command],
                            env=jobs.env(out, ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_STEP_SLEEP="0.1"),
                            stdout=log2, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(out))
    jobs.procs.append(proc)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= per_epoch + 3, 120, "2 processes to pass epoch 1")
    os.killpg(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 60, out / "job2.log") == 143, tail(out / "job2.log")
    assert exit_codes(out, started) == [143, 143], tail(out / "job2.log")
    stopped = progress(out, 0)["step"]
    assert per_epoch < stopped < total

    log3 = open(out / "job3.log", "ab")
    proc = subprocess.Popen([*launch, "--standalone", "--nproc-per-node=3", str(CLM_PORT), *command],
                            env=jobs.env(out, ADAPTIVE_CHECKPOINT_INTERVAL="0"), stdout=log3,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=str(out))
    jobs.procs.append(proc)
    assert wait_exit(proc, 180, out / "job3.log") == 0, tail(out / "job3.log")
    loss, steps_done, world = _final_eval_loss((out / "job3.log").read_text())
    assert (steps_done, world) == (total, 3)

    steps = _steps_by_number(out)
    assert sorted(steps) == list(range(1, total + 1))
    visits: dict[int, list[int]] = {epoch: [] for epoch in range(3)}
    for step, records in steps.items():
        world = 2 if step <= stopped else 3
        assert [rank for rank, _ in records] == list(range(world)), (step, records)
        indices = [i for _, record in records for i in record["indices"]]
        assert sorted(indices) == sorted(expected[step]["indices"]), step  # 16 blocks (6 at an epoch's end)
        assert all(record["lr"] == expected[step]["lr"] for _, record in records), (step, records)
        visits[(step - 1) // per_epoch] += indices
    for epoch, seen in visits.items():
        assert sorted(seen) == list(range(samples)), epoch  # every block once per epoch
    assert loss == pytest.approx(reference_loss, rel=1e-4)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_live_job_of_one_node_gains_a_second_node_which_then_leaves(jobs, tmp_path):
    """adaptive-run --live: a Trainer job on one node (global batch 8) gains a second node mid-training; that node
    is stopped by SIGTERM (its launcher exits 143) and the first finishes: every step once with 8 samples, every
    sample once per epoch, the LR and weights of an uninterrupted run, an evaluation every epoch.  The script builds
    its TrainingArguments before the trainer, as Trainer scripts do."""
    portpicker = pytest.importorskip("portpicker")
    from live_harness import launch, logs

    expected, reference_done = _uninterrupted_run(jobs, tmp_path / "reference")
    out, port = tmp_path / "live", portpicker.pick_unused_port()
    settings = dict(WORKER_SAMPLES=str(SAMPLES), WORKER_BATCH=str(2 * BATCH), WORKER_STEP_SLEEP="0.7",
                    ADAPTIVE_CHECKPOINT_INTERVAL="0")
    first = launch(jobs, out, port, "first", script=WORKER, **settings)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 2, 90, "the first node to train")
    second = launch(jobs, out, port, "second", script=WORKER, **settings)
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 and p["step"] >= 3, 90, "the second node to join")
    joined = progress(out, 0)["step"]
    wait_for(lambda: progress(out, 0)["step"] >= joined + 2, 60, "two steps on two nodes")
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)

    steps = _steps_by_number(out)
    worlds = {step: records[0][1]["world"] for step, records in steps.items()}
    sequence = [worlds[step] for step in sorted(worlds)]
    assert sequence[0] == 1 and 2 in sequence and sequence[-1] == 1, sequence
    assert sum(sequence[i] != sequence[i - 1] for i in range(1, len(sequence))) == 2, sequence  # one join, one leave
    done = _assert_matches_uninterrupted(out, expected, reference_done, lambda step: worlds[step])
    assert done["world"] == 1
    # the Trainer's evaluation every epoch, sharded over the members of the moment (Accelerate's process count
    # follows the joins and leaves)
    assert [entry["step"] for entry in done["evaluations"]] == [PER_EPOCH, 2 * PER_EPOCH, TOTAL], done["evaluations"]


# ---------------------------------------------------------------- autoscale


class _Shapes(transformers.TrainerCallback):
    """Records, at every optimizer step, the step the loader planned and what the Trainer counted."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.records: list[dict] = []

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        loader = self.trainer.get_train_dataloader().loader
        step = loader.current_step
        self.records.append({"step": state.global_step, "micro": step.shape.micro, "accum": step.num_micro_steps,
                             "size": step.size, "planned": step.planned_size, "lr": lr_scheduler.get_last_lr()[0],
                             "factor": self.trainer.model_wrapped.scaling_rule.last_factor,
                             "scheduler_steps": lr_scheduler.last_epoch})


def test_autoscale_settings_are_checked_by_the_librarys_validator(trainer_cls, tmp_path):
    with pytest.raises(ValueError, match="local_bsz_bounds"):
        trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8), max_batch_size=16,
                    local_bsz_bounds=(4, 2))
    with pytest.raises(ValueError, match="hysteresis"):
        trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8), max_batch_size=16,
                    hysteresis=1.5)
    with pytest.raises(ValueError, match="gradient_accumulation.*max_batch_size"):
        trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8), gradient_accumulation=True)
    trainer = trainer_cls(model=Regressor(), args=_args(tmp_path), train_dataset=_samples(8), max_batch_size=2)
    with pytest.raises(ValueError, match="max_batch_size"):  # below the reference global batch (4)
        trainer.train()


def _scripted_decisions(monkeypatch, shapes: list[tuple[int, int]]) -> None:
    """The goodput model's choices replaced by ``shapes`` in turn, one per decision (every ``adapt_every``
    steps), so that the batch changes whatever the machine measures."""
    from adaptive.batchsize.autoscale import BatchSizeController, Decision

    choices = iter(shapes)

    def propose(self, grad_params, force):
        local, accum = next(choices, self.current())
        return None if (local, accum) == self.current() else Decision(local, accum, 2.0, 1.0, "scripted")

    monkeypatch.setattr(BatchSizeController, "_evaluation_due", lambda self: True)
    monkeypatch.setattr(BatchSizeController, "_propose", propose)


def test_autoscale_micro_batches_each_sample_once_and_steps_count_reference_batches(trainer_cls, tmp_path,
                                                                                   monkeypatch):
    """Autoscale with accumulation in one process (the batch changes as scripted): each optimizer step trains
    the micro-batches the loader planned, every sample once per epoch, global_step counts reference batches (4
    samples) and the scheduler steps with it; the LR factor is the scaling rule's at the step's planned size."""
    _scripted_decisions(monkeypatch, [(4, 1), (4, 2), (2, 3), (3, 2), (4, 3), (2, 2), (4, 2)])
    args = _args(tmp_path, num_train_epochs=3, per_device_train_batch_size=4)
    model = Regressor()
    trainer = trainer_cls(model=model, args=args, train_dataset=_samples(40), max_batch_size=24,
                          local_bsz_bounds=(2, 4), gradient_accumulation=True, adapt_every=3, scaling_rule="sqrt")
    shapes = _Shapes(trainer)
    trainer.add_callback(shapes)
    trainer.train()
    records = shapes.records
    assert trainer.state.max_steps == 30  # 10 reference steps per epoch
    assert sum(len(indices) for indices in model.seen) == 120
    position = 0
    for record in records:  # the micro-batches the Trainer trained are the loader's plan
        taken = model.seen[position:position + record["accum"]]
        position += record["accum"]
        assert sum(len(indices) for indices in taken) == record["size"]
        assert all(len(indices) <= record["micro"] for indices in taken)
        assert record["factor"] == pytest.approx((record["planned"] / 4) ** 0.5)
        assert record["scheduler_steps"] == record["step"]
    assert position == len(model.seen)
    expected = _expected_lrs(args, 30)  # the schedule of 30 reference steps, at the reference step reached
    assert [record["lr"] for record in records] == [expected[record["step"] - 1] for record in records]
    counted = [0] + [record["step"] for record in records]  # a log at every step that passed a multiple of 2
    logged = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == [after for before, after in zip(counted, counted[1:]) if after // 2 > before // 2]
    seen = [i for indices in model.seen for i in indices]
    for epoch in range(3):
        assert sorted(seen[40 * epoch:40 * epoch + 40]) == list(range(40))
    assert len({(record["micro"], record["accum"]) for record in records}) > 1, records
    assert max(record["accum"] for record in records) > 1, records
    assert trainer.state.global_step == 30 and records[-1]["step"] == 30
    assert len(records) < 30  # fewer optimizer steps than reference steps: larger batches


class _UsedLR(transformers.TrainerCallback):
    """Records the LR each optimizer step used (after the library's factors), from the optimizer itself."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        optimizer.optimizer.register_step_pre_hook(lambda opt, *_: self.lrs.append(opt.param_groups[0]["lr"]))


def test_autoscale_steps_train_the_mean_gradient_of_their_samples(trainer_cls, tmp_path, monkeypatch):
    """Under autoscale with accumulation, each optimizer step's update is SGD's on the mean gradient over the
    step's samples (its micro-batches accumulated from zero, weighted by their sizes), at the LR it used:
    replayed in plain torch from the samples each step trained, the weights are the trainer's."""
    _scripted_decisions(monkeypatch, [(4, 2), (3, 3), (2, 2), (4, 3)])
    # plain SGD without clipping: the update is proportional to the gradient (Adam's is not to its scale)
    args = _args(tmp_path, num_train_epochs=2, per_device_train_batch_size=4, optim="sgd", max_grad_norm=0.0)
    torch.manual_seed(3)
    model = Regressor()
    replay = Regressor()
    replay.load_state_dict(model.state_dict())
    data = _samples(30)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, max_batch_size=24,
                          local_bsz_bounds=(2, 4), gradient_accumulation=True, adapt_every=2)
    shapes, used = _Shapes(trainer), _UsedLR()
    trainer.add_callback(shapes)
    trainer.add_callback(used)
    trainer.train()
    assert max(record["accum"] for record in shapes.records) > 1
    assert len(used.lrs) == len(shapes.records)
    optimizer = torch.optim.SGD(replay.parameters(), lr=1.0)
    position = 0
    for record, lr in zip(shapes.records, used.lrs):
        indices = [i for micro in model.seen[position:position + record["accum"]] for i in micro]
        position += record["accum"]
        batch = [data[i] for i in indices]
        x, y = torch.stack([d["x"] for d in batch]), torch.stack([d["labels"] for d in batch])
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        replay(x, y)["loss"].backward()
        optimizer.step()
    for ours, theirs in zip(model.parameters(), replay.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)


def test_autoscale_max_steps_counts_reference_batches_and_a_relaunch_trains_nothing(trainer_cls, tmp_path,
                                                                                     monkeypatch):
    """max_steps=7 reference steps (28 samples) with steps of 12 samples (3 reference steps) after the first:
    training stops at the first step that reaches 7, and the job is finished there; save_steps=3 saves at the
    steps that pass a multiple of 3 (and at the end), each Trainer checkpoint with the library's state."""
    _scripted_decisions(monkeypatch, [(4, 3)])
    args = _args(tmp_path, max_steps=7, per_device_train_batch_size=4, save_strategy="steps", save_steps=3)
    model = Regressor()
    trainer = trainer_cls(model=model, args=args, train_dataset=_samples(40), max_batch_size=12,
                          local_bsz_bounds=(2, 4), gradient_accumulation=True, adapt_every=1)
    shapes = _Shapes(trainer)
    trainer.add_callback(shapes)
    trainer.train()
    assert [(record["step"], record["size"]) for record in shapes.records] == [(1, 4), (4, 12), (7, 12)]
    assert sum(len(indices) for indices in model.seen) == 28 and adaptive.training_finished()
    assert [record["scheduler_steps"] for record in shapes.records] == [1, 4, 7]
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0  # the linear decay ended where training ended
    saved = sorted(path.name for path in (tmp_path / "trainer").glob("checkpoint-*"))
    assert saved == ["checkpoint-4", "checkpoint-7"], saved
    assert all((tmp_path / "trainer" / name / "adaptive").is_dir() for name in saved)

    restart_process_state()
    _reset_accelerate()
    model = Regressor()
    trainer = trainer_cls(model=model, args=_args(tmp_path, max_steps=7, per_device_train_batch_size=4),
                          train_dataset=_samples(40), max_batch_size=12, local_bsz_bounds=(2, 4),
                          gradient_accumulation=True, adapt_every=1)
    output = trainer.train()
    assert model.seen == [] and output.global_step == 7


def test_autoscale_with_a_causal_lm_counts_the_items_and_tokens_of_every_micro_batch(trainer_cls, tmp_path,
                                                                                     monkeypatch):
    """GPT-2 (random init, takes num_items_in_batch) under autoscale with accumulation: each micro-batch's loss is
    normalised by its own label count, and the Trainer's token and FLO counters see every micro-batch."""
    _scripted_decisions(monkeypatch, [(2, 3), (4, 2)])
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": (ids := torch.randint(0, 64, (8,), generator=generator)), "labels": ids.clone()}
               for _ in range(24)]
    items = []
    original = transformers.Trainer.compute_loss

    def recorded(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        items.append((int(num_items_in_batch), inputs["labels"].numel()))  # (the Trainer counts every label)
        return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    monkeypatch.setattr(transformers.Trainer, "compute_loss", recorded)
    trainer = trainer_cls(model=model, args=_args(tmp_path, num_train_epochs=2, learning_rate=1e-3,
                                                  include_num_input_tokens_seen="all"),
                          train_dataset=samples, max_batch_size=16, local_bsz_bounds=(2, 4),
                          gradient_accumulation=True, adapt_every=2)
    shapes = _Shapes(trainer)
    trainer.add_callback(shapes)
    trainer.train()
    assert max(record["accum"] for record in shapes.records) > 1
    assert sum(record["accum"] for record in shapes.records) == len(items)  # every micro-batch's loss
    assert all(found == labels for found, labels in items), items  # its own items (one process)
    assert trainer.state.num_input_tokens_seen == 2 * 24 * 8  # every micro-batch's tokens, each sample twice
    assert trainer.state.total_flos == pytest.approx(2 * 24 * 8 * 6 * model.num_parameters(exclude_embeddings=True))
    assert all(entry["loss"] > 0 for entry in trainer.state.log_history if "loss" in entry)


AUTOSCALE_WORKER = REPO / "tests" / "workers" / "trainer_autoscale_worker.py"
# per_device 2 x 2 processes: reference batch 4; 192 samples, 2 epochs: 48 reference steps per epoch, 96 in all
AS_SAMPLES, AS_BATCH, AS_EPOCHS, AS_REFERENCE = 192, 2, 2, 4
AS_TOTAL = AS_EPOCHS * AS_SAMPLES // AS_REFERENCE


def _autoscale_steps(out) -> list[list[dict]]:
    """The step records of every launch, in order: one list per optimizer step, of every process's record."""
    by_step: dict[int, dict[int, dict]] = {}
    for rank_file in sorted(out.glob("steps.rank*.jsonl")):
        rank = int(rank_file.name.split(".")[1][len("rank"):])
        for record in read_jsonl(rank_file):
            assert rank not in by_step.setdefault(record["step"], {}), ("a step counted twice", record)
            by_step[record["step"]][rank] = record
    return [[records[rank] for rank in sorted(records)] for _, records in sorted(by_step.items())]


@pytest.mark.distributed
@pytest.mark.parametrize("scripted", [
    # real jobs of 15-45 s each: CI's slow sample (the default suite has the in-process autoscale tests)
    pytest.param("", id="goodput-model", marks=[pytest.mark.slow, pytest.mark.ci_sample]),
    pytest.param("2x2,4x2,2x3,4x4,3x2,4x3", id="scripted", marks=[pytest.mark.slow, pytest.mark.ci_sample])])
def test_autoscale_sigterm_on_2_processes_resume_on_3_keeps_the_counters_exact(jobs, tmp_path, scripted):
    """AdaptiveTrainer(max_batch_size=32, local_bsz_bounds=(1, 4), gradient_accumulation=True) on 2 processes,
    stopped by SIGTERM and resumed on 3.  From the processes' step records: the goodput model changes the local
    batch and accumulation steps during the run; each optimizer step trains the micro-batches the loader planned
    (its global batch over all processes, micro-batch by micro-batch); every sample once per epoch; global_step
    counts reference batches of samples (floor(samples / 4)), the LR schedule steps with it to where training
    ends, and the LR factor is the scaling rule's (AdamW: the square root of the measured gain).  "scripted":
    the goodput model's decisions replaced by a script of local batches and accumulation steps (every
    ``adapt_every`` steps), so that the accumulation steps change whatever the machine measures."""
    out = tmp_path / "autoscale"
    log2, log3 = out / "job2.log", out / "job3.log"
    started = time.time()
    knobs = dict(ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_SAMPLES=str(AS_SAMPLES), WORKER_BATCH=str(AS_BATCH),
                 WORKER_EPOCHS=str(AS_EPOCHS), WORKER_LOCAL_MAX="4", WORKER_SCRIPTED=scripted)
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=AUTOSCALE_WORKER,
                       WORKER_STEP_SLEEP="0.3", **knobs)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 20, 90, "2 processes to take 20 reference steps")
    os.killpg(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    assert exit_codes(out, started) == [143, 143], tail(log2)
    stopped = progress(out, 0)
    assert 20 <= stopped["step"] < AS_TOTAL, stopped

    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=AUTOSCALE_WORKER,
                       WORKER_STEP_SLEEP="0.02", **knobs)
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert f"AdaptiveTrainer resumes at global step {stopped['step']}," in log3.read_text(), tail(log3)

    steps = _autoscale_steps(out)
    expected_lrs = _expected_lrs(transformers.TrainingArguments(
        output_dir=str(tmp_path / "unused"), learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=3),
        AS_TOTAL)
    samples, shapes, factors = [], set(), []
    for records in steps:
        first = records[0]
        world = first["world"]
        assert len(records) == world == (2 if first["step"] <= stopped["step"] else 3), records
        assert all(record["step"] == first["step"] and record["accum"] == first["accum"]
                   and record["size"] == first["size"] for record in records), records
        # the step the loader planned, micro-batch by micro-batch, on every process
        local = first["micro"] // world
        for record in records:
            assert len(record["micro_batches"]) == first["accum"], record
            assert all(len(micro) <= local for micro in record["micro_batches"]), record
        fresh = [i for record in records for micro, padding in zip(record["micro_batches"], record["padding"])
                 if not padding for i in micro]  # (a micro-batch that repeats a sample at an epoch's end: not)
        assert len(fresh) == first["size"] and first["planned"] == first["micro"] * first["accum"], records
        samples += fresh
        shapes.add((world, local, first["accum"]))
        # the Trainer counts reference batches: the steps follow the samples (192 is a multiple of 4)
        assert first["step"] == len(samples) // AS_REFERENCE, (first, len(samples))
        assert first["epoch"] == pytest.approx(len(samples) / AS_SAMPLES)
        assert first["max_steps"] == AS_TOTAL
        for record in records:
            assert record["scheduler_steps"] == record["step"], record  # the schedule in reference steps
            assert record["lr"] == expected_lrs[record["step"] - 1], record
            # the LR factor of the step is the scaling rule's (AdamW: adamscale, sqrt(gain)), 1 <= gain <= scale
            assert record["factor"] == pytest.approx(record["gain"] ** 0.5), record
            assert 1.0 <= record["gain"] <= first["planned"] / AS_REFERENCE + 1e-9, record
        factors.append(first["factor"])
    for epoch in range(AS_EPOCHS):
        assert sorted(samples[epoch * AS_SAMPLES:(epoch + 1) * AS_SAMPLES]) == list(range(AS_SAMPLES)), epoch
    assert len(samples) == AS_EPOCHS * AS_SAMPLES
    # the goodput model changed the local batch or the accumulation steps (both, with a scripted model, in
    # test_autoscale_micro_batches_each_sample_once_and_steps_count_reference_batches), and the LR with them
    assert len({shape[1:] for shape in shapes}) > 1, shapes
    assert max(factors) > 1.0, (shapes, factors)
    if scripted:
        assert len({shape[2] for shape in shapes}) > 1 and len({shape[1] for shape in shapes}) > 1, shapes
    assert {shape[0] for shape in shapes} == {2, 3}
    done = json.loads((out / "done.json").read_text())
    assert (done["global_step"], done["epoch"], done["world"]) == (AS_TOTAL, 2.0, 3), done
    assert done["loader_step"] == len(steps) < AS_TOTAL  # fewer optimizer steps than reference steps
