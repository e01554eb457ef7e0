"""AdaptiveStrategy (adaptive.integrations.lightning): a Lightning script made elastic.

Single-process tests of what the strategy builds (the elastic training
loader, the model wrapper, the environment), of accumulation, of a stop
resumed in a new process state, and of ``fit(ckpt_path=...)`` from
Lightning's own checkpoints (which carry the library's state); then real
``adaptive-run`` jobs on 127.0.0.1 (gloo): stopped with SIGTERM on 2
processes and resumed on 3, a SIGKILLed worker, a ``ModelCheckpoint`` file
of 2 processes resumed with ``ckpt_path=`` on 3, and an
``adaptive-run --live`` job that gains a node and loses it, each ending with
the weights of an uninterrupted run (marked slow), and the example script.
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

lightning = pytest.importorskip("lightning", reason="the lightning extra is not installed "
                                "(pip install adaptive-elastic[lightning])")

import lightning as L  # noqa: E402

import adaptive  # noqa: E402
from elastic_harness import (REPO, exit_codes, live_pids, newest_checkpoint_step, progress, read_jsonl,  # noqa: E402
                             tail, wait_exit, wait_for)
from elastic_harness import jobs  # noqa: E402,F401  (the fixture)

WORKER = REPO / "tests" / "workers" / "lightning_worker.py"


def _dataset(n=24, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=generator, dtype=dtype)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True), torch.arange(n))


class _Module(L.LightningModule):
    """A linear regression that records what it trained: (epoch, global_step, indices) per micro-batch."""

    def __init__(self, batch_size=4, stop_after=None, shuffle=True, n=24):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1).double()
        self.batch_size, self.stop_after, self.shuffle, self.n = batch_size, stop_after, shuffle, n
        self.trained: list[tuple[int, int, list[int]]] = []
        self.seen_in_fit: dict[str, object] = {}

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained.append((self.trainer.current_epoch, self.trainer.global_step, index.tolist()))
        if self.stop_after is not None and len(self.trained) == self.stop_after:
            adaptive.request_stop()
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def on_train_start(self):
        self.seen_in_fit.update(model=self.trainer.strategy.model, train=self.trainer.train_dataloader,
                                val=self.trainer.val_dataloaders)

    def configure_optimizers(self):
        first = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=2, gamma=0.5)
        return {"optimizer": first, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(_dataset(self.n), batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(_dataset(6), batch_size=3)


def _trainer(**kwargs):
    from adaptive.integrations.lightning import AdaptiveStrategy

    options = dict(max_epochs=2, strategy=AdaptiveStrategy(), accelerator="cpu", logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0)
    options.update(kwargs)
    return L.Trainer(**options)


def test_import_without_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # what `import lightning.pytorch` meets when missing
    monkeypatch.delitem(sys.modules, "adaptive.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install adaptive-elastic\[lightning\]"):
        importlib.import_module("adaptive.integrations.lightning")


def test_checked_lightning_version():
    from adaptive.integrations.lightning import CHECKED_LIGHTNING_VERSIONS

    assert ".".join(lightning.__version__.split(".")[:2]) in CHECKED_LIGHTNING_VERSIONS


def test_environment_comes_from_torchrun_variables(monkeypatch):
    from adaptive.integrations.lightning import AdaptiveEnvironment

    for name, value in dict(RANK="4", WORLD_SIZE="6", LOCAL_RANK="1", LOCAL_WORLD_SIZE="3", GROUP_RANK="1",
                            MASTER_ADDR="10.0.0.1", MASTER_PORT="29400").items():
        monkeypatch.setenv(name, value)
    environment = AdaptiveEnvironment()
    assert environment.creates_processes_externally and AdaptiveEnvironment.detect()
    assert (environment.global_rank(), environment.world_size(), environment.local_rank(),
            environment.node_rank()) == (4, 6, 1, 1)
    assert (environment.main_address, environment.main_port) == ("10.0.0.1", 29400)
    environment.set_world_size(2)  # Lightning's own count of devices x nodes does not override the job's
    environment.set_global_rank(0)
    assert (environment.global_rank(), environment.world_size()) == (4, 6)


def test_fit_trains_an_elastic_loader_and_the_library_wrapper(job):
    """The training DataLoader becomes an AdaptiveDataLoader (same dataset, collate, order; no DistributedSampler),
    the validation loader keeps Lightning's DistributedSampler, the model is an AdaptiveDataParallel holding the
    optimizer and scheduler Lightning built; each sample once per epoch; the job is checkpointed as finished."""
    module = _Module()
    trainer = _trainer()
    trainer.fit(module)
    wrapper, train, val = module.seen_in_fit["model"], module.seen_in_fit["train"], module.seen_in_fit["val"]
    assert isinstance(wrapper, adaptive.AdaptiveDataParallel) and wrapper.module is module
    assert wrapper.optimizer is trainer.optimizers[0]
    assert wrapper.lr_scheduler is trainer.lr_scheduler_configs[0].scheduler
    loader = trainer.strategy.train_loader
    assert isinstance(loader, adaptive.AdaptiveDataLoader) and loader.batch_size == 4 and loader.sampler.shuffle
    assert train.loader is loader  # what Lightning iterates: the loader's epochs
    assert isinstance(val.sampler, torch.utils.data.DistributedSampler)
    for epoch in (0, 1):
        indices = sorted(i for e, _, batch in module.trained if e == epoch for i in batch)
        assert indices == list(range(24)), (epoch, indices)
    assert [step for _, step, _ in module.trained] == list(range(12))
    assert (trainer.global_step, trainer.current_epoch, loader.step) == (12, 2, 12)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 12
    assert adaptive.finished_epochs() == 2
    (metrics,) = trainer.validate(module, verbose=False)  # the other stages run as under DDPStrategy
    assert set(metrics) == {"val_loss"}


def test_order_follows_the_dataloaders_sampler_and_seed(job, monkeypatch):
    """A SequentialSampler trains in order; a RandomSampler is shuffled by seed_everything's seed (the same order
    on every process and launch), a DataLoader's generator seeding it instead."""
    from conftest import restart_process_state

    module = _Module(shuffle=False)
    trainer = _trainer(max_epochs=1)
    trainer.fit(module)
    assert [i for _, _, batch in module.trained for i in batch] == list(range(24))
    assert not trainer.strategy.train_loader.sampler.shuffle

    runs = iter(range(100))

    def first_order(seed=None, generator=None):
        restart_process_state()
        monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / f"run{next(runs)}"))  # a new job each time
        if seed is not None:
            monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))

        class Seeded(_Module):
            def train_dataloader(self):
                return torch.utils.data.DataLoader(_dataset(), batch_size=4, shuffle=True, generator=generator)

        module = Seeded()
        _trainer(max_epochs=1).fit(module)
        return [i for _, _, batch in module.trained for i in batch]

    assert first_order(seed=3) == first_order(seed=3) != first_order(seed=4)
    assert first_order(seed=3, generator=torch.Generator().manual_seed(4)) == first_order(seed=4)


def test_a_stop_resumes_at_the_exact_sample_with_lightnings_counters_and_the_uninterrupted_weights(job, monkeypatch):
    """request_stop() (as SIGTERM) in epoch 0: every process would stop after the same step, checkpoint and exit
    143; a new process state resumes: global_step and current_epoch carry on, each sample once per epoch, and
    the final weights are those of an uninterrupted run, with accumulate_grad_batches=2 (loss scaled back)."""
    from conftest import restart_process_state
    from adaptive.elastic import sync_points

    def run(stop_after=None):
        module = _Module(batch_size=2, stop_after=stop_after)
        trainer = _trainer(max_epochs=3, accumulate_grad_batches=2)
        trainer.fit(module)
        return module, trainer

    reference, trainer = run()
    final = reference.net.weight.detach().clone()
    assert trainer.global_step == 18 and trainer.current_epoch == 3  # 24 samples / (2 x 2) = 6 steps per epoch
    restart_process_state()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / "interrupted"))
    with pytest.raises(SystemExit) as stopped:
        run(stop_after=15)  # in epoch 1
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    first = interrupted = None
    restart_process_state()
    resumed, trainer = run()
    first = resumed.trained[0]
    assert first[0] == 1 and 7 <= first[1] <= 9, first  # epoch 1, after the steps trained before the stop
    interrupted = [record for record in reference.trained if (record[0], record[1]) < (first[0], first[1])]
    assert resumed.trained == reference.trained[len(interrupted):]  # same samples, steps and epochs from there
    assert (trainer.global_step, trainer.current_epoch) == (18, 3)
    torch.testing.assert_close(resumed.net.weight.detach(), final, rtol=0, atol=1e-12)


def test_max_steps_ends_training_mid_epoch_and_a_relaunch_trains_nothing(job):
    """``max_steps`` reached inside an epoch: the step is committed and the job checkpointed as finished."""
    from conftest import restart_process_state

    module = _Module()
    trainer = _trainer(max_epochs=-1, max_steps=8)
    trainer.fit(module)
    assert trainer.global_step == 8 and trainer.strategy.train_loader.step == 8 and adaptive.training_finished()
    ended_in = trainer.current_epoch  # (Lightning counts the epoch that max_steps ended as processed)
    restart_process_state()
    again, trainer = _Module(), _trainer(max_epochs=-1, max_steps=8)
    trainer.fit(again)
    assert again.trained == [] and (trainer.global_step, trainer.current_epoch) == (8, ended_in)
    torch.testing.assert_close(again.net.weight, module.net.weight, rtol=0, atol=0)


def test_refusals_name_what_to_do(job):
    from conftest import restart_process_state

    class Manual(_Module):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic optimization only"):
        _trainer().fit(Manual())
    restart_process_state()

    class Custom(_Module):
        def train_dataloader(self):
            sampler = torch.utils.data.SubsetRandomSampler(range(5))
            return torch.utils.data.DataLoader(_dataset(), batch_size=2, sampler=sampler)

    with pytest.raises(ValueError, match="sampler SubsetRandomSampler cannot be honoured"):
        _trainer().fit(Custom())
    from adaptive.integrations.lightning import AdaptiveStrategy

    with pytest.raises(ValueError, match="cluster_environment"):
        AdaptiveStrategy(cluster_environment=object())


def _checkpointing_trainer(folder, **kwargs):
    """A trainer whose ModelCheckpoints write every 4 optimizer steps (on_train_batch_end) and at each epoch's
    validation (on_validation_end), keeping every file, and last.ckpt."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    every_steps = ModelCheckpoint(dirpath=str(folder), filename="{epoch}-{step}", every_n_train_steps=4,
                                  save_top_k=-1, save_last=True)
    every_epoch = ModelCheckpoint(dirpath=str(folder), filename="end-{epoch}-{step}", save_top_k=-1)
    return _trainer(enable_checkpointing=True, callbacks=[every_steps, every_epoch], **kwargs)


def _step_of(path):
    return int(path.stem.split("step=")[1])


def test_ckpt_path_resumes_a_lightning_checkpoint_exactly_in_a_fresh_folder(job, monkeypatch):
    """ModelCheckpoint files (mid-epoch after an optimizer step, and at an epoch's validation end), each resumed with
    fit(ckpt_path=...) by a new job with an empty library checkpoint folder: the same samples in the same steps and
    epochs as the uninterrupted run from there, Lightning's counters going on, the same float64 weights, with
    accumulate_grad_batches=2.  A file written by another strategy (no library state) is refused, naming it."""
    from conftest import restart_process_state

    saved = job / "lightning"
    reference = _Module(batch_size=2)
    trainer = _checkpointing_trainer(saved, max_epochs=3, accumulate_grad_batches=2)
    trainer.fit(reference)
    assert trainer.global_step == 18
    files = sorted(saved.glob("*step=*.ckpt"), key=_step_of)
    steps = [_step_of(path) for path in files]
    assert {4, 6, 8, 12}.issubset(steps), steps  # mid-epoch (4, 8) and epoch ends (6, 12)
    for path in files:
        start = _step_of(path)
        if start >= 18:
            continue
        restart_process_state()
        monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / f"fresh-{path.stem}"))
        resumed = _Module(batch_size=2)
        trainer = _trainer(max_epochs=3, accumulate_grad_batches=2)
        trainer.fit(resumed, ckpt_path=str(path))
        expected = [record for record in reference.trained if record[1] >= start]
        assert resumed.trained == expected, (path.name, resumed.trained[:3], expected[:3])
        assert (trainer.global_step, trainer.current_epoch) == (18, 3), path.name
        assert trainer.fit_loop.epoch_loop._batches_that_stepped == 18, path.name  # the loggers' step
        torch.testing.assert_close(resumed.net.weight.detach(), reference.net.weight.detach(), rtol=0, atol=1e-12)

    restart_process_state()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / "foreign"))
    plain = job / "plain.ckpt"
    checkpoint = torch.load(files[0], weights_only=True)
    checkpoint.pop("adaptive")
    torch.save(checkpoint, plain)
    with pytest.raises(ValueError, match=r"ckpt_path=.*plain.ckpt.* holds no library state"):
        _trainer(max_epochs=3, accumulate_grad_batches=2).fit(_Module(batch_size=2), ckpt_path=str(plain))


def test_a_checkpoint_written_inside_an_accumulated_step_resumes_at_the_steps_start(job, monkeypatch):
    """trainer.save_checkpoint from on_train_batch_end of a step's first micro-batch (accumulate_grad_batches=2):
    the step is resumed from its start (its first micro-batch trained again), the rest as the uninterrupted run,
    with the same weights.  One written inside a batch (before the optimizer step) holds no library state and is
    refused."""
    from conftest import restart_process_state

    class Saver(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 8 and trainer.current_epoch == 0:  # the first micro-batch of global step 4
                trainer.save_checkpoint(job / "inside-step.ckpt")

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step == 2:
                trainer.save_checkpoint(job / "inside-batch.ckpt")

    reference = _Module(batch_size=2)
    _trainer(max_epochs=3, accumulate_grad_batches=2, callbacks=[Saver()]).fit(reference)
    restart_process_state()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / "fresh"))
    resumed = _Module(batch_size=2)
    trainer = _trainer(max_epochs=3, accumulate_grad_batches=2)
    trainer.fit(resumed, ckpt_path=str(job / "inside-step.ckpt"))
    assert resumed.trained == [record for record in reference.trained if record[1] >= 4]
    assert (trainer.global_step, trainer.current_epoch) == (18, 3)
    torch.testing.assert_close(resumed.net.weight.detach(), reference.net.weight.detach(), rtol=0, atol=1e-12)
    restart_process_state()
    monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / "fresh2"))
    with pytest.raises(ValueError, match="holds no library state"):
        _trainer(max_epochs=3, accumulate_grad_batches=2).fit(_Module(batch_size=2),
                                                              ckpt_path=str(job / "inside-batch.ckpt"))


def test_ckpt_path_last_on_every_launch_never_rolls_back(job, monkeypatch):
    """fit(ckpt_path="last") on every launch, as Lightning scripts write it: the first launch finds no last.ckpt;
    stopped after last.ckpt was written, the same command resumes from the library's own newer checkpoint of the
    same run (not from last.ckpt); with the library's folder gone, from last.ckpt; each time exactly."""
    from conftest import restart_process_state
    from adaptive.elastic import sync_points

    saved = job / "lightning"
    reference = _Module(batch_size=2)
    _checkpointing_trainer(job / "reference", max_epochs=3, accumulate_grad_batches=2).fit(reference)

    def launch(stop_after=None, folder="library"):
        restart_process_state()
        monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / folder))
        module = _Module(batch_size=2, stop_after=stop_after)
        trainer = _checkpointing_trainer(saved, max_epochs=3, accumulate_grad_batches=2)
        trainer.fit(module, ckpt_path="last")
        return module, trainer

    with pytest.raises(SystemExit) as stopped:
        launch(stop_after=11)  # 11 micro-batches: stopped in global step 5, after last.ckpt at step 4
    assert stopped.value.code == sync_points.GRACEFUL_EXIT_CODE
    last_written = torch.load(saved / "last.ckpt", weights_only=True)["global_step"]
    module, trainer = launch()
    first = module.trained[0][1]
    assert first > last_written, (first, last_written)  # the library's own checkpoint won
    assert module.trained == [r for r in reference.trained if r[1] >= first]
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 18  # the loggers' step
    torch.testing.assert_close(module.net.weight.detach(), reference.net.weight.detach(), rtol=0, atol=1e-12)

    # the library's folder lost: last.ckpt (step 16) is resumed exactly
    last_written = torch.load(saved / "last.ckpt", weights_only=True)["global_step"]
    assert last_written == 16
    module, trainer = launch(folder="lost")
    assert module.trained == [r for r in reference.trained if r[1] >= 16]
    assert (trainer.global_step, trainer.current_epoch) == (18, 3)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == 18  # the loggers' step
    torch.testing.assert_close(module.net.weight.detach(), reference.net.weight.detach(), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- autoscale


def _script_decisions(monkeypatch, shapes, every=1):
    """The goodput model's choices replaced by ``shapes`` ((local batch, accumulation steps)): after the loader's
    step ``n`` it chooses ``shapes[n // every % len(shapes)]``, batch-size changes the test chooses instead of
    timings.  (A resume makes no decision at its first step boundary, as the library does: a resume at a
    multiple of ``every`` keeps the shape it restored.)"""
    from adaptive.batchsize.autoscale import BatchSizeController, Decision
    from adaptive.data.dataloader import current_dataloader

    def propose(self, grad_params, force):
        local, accum = shapes[current_dataloader().step // every % len(shapes)]
        return None if (local, accum) == self.current() else Decision(local, accum, 2.0, 1.0, "scripted")

    monkeypatch.setattr(BatchSizeController, "_evaluation_due", lambda self: True)
    monkeypatch.setattr(BatchSizeController, "_propose", propose)


class _AutoscaleModule(_Module):
    """Records, per micro-batch, the loader's plan and Lightning's view of it, and per optimizer step the LR used."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.micro: list[dict] = []
        self.lrs: list[dict] = []
        self.validated: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        loader = self.trainer.strategy.train_loader
        step = loader.current_step
        self.micro.append(dict(epoch=self.trainer.current_epoch, global_step=self.trainer.global_step,
                               micro=loader.micro_step, accumulate=self.trainer.accumulate_grad_batches,
                               size=step.size, planned=step.planned_size, position=step.position,
                               indices=batch[2].tolist(), batches=self.trainer.num_training_batches,
                               batch_idx=batch_idx,
                               weights=[p.detach().flatten().tolist() for p in self.net.parameters()]))
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        scheduler = self.trainer.lr_scheduler_configs[0].scheduler
        wrapper = self.trainer.strategy.model
        self.lrs.append(dict(global_step=self.trainer.global_step, used=optimizer.param_groups[0]["lr"],
                             scheduled=scheduler.get_last_lr()[0], last_epoch=scheduler.last_epoch,
                             factor=wrapper.scaling_rule.last_factor))

    def on_validation_epoch_end(self):
        self.validated.append((self.trainer.current_epoch, self.trainer.global_step))

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches  # (sets up the training data)
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _autoscale_strategy(**kwargs):
    from adaptive.integrations.lightning import AdaptiveStrategy

    options = dict(autoscale_batch_size=24, local_bsz_bounds=(1, 8), gradient_accumulation=True,
                   scaling_rule="linear", adapt_every=1)
    options.update(kwargs)
    return AdaptiveStrategy(**options)


def test_autoscale_arguments_are_checked_by_the_librarys_validator_naming_the_argument():
    from adaptive.integrations.lightning import AdaptiveStrategy

    with pytest.raises(ValueError, match="autoscale_batch_size must be an integer"):
        AdaptiveStrategy(autoscale_batch_size=0)
    with pytest.raises(ValueError, match=r"local_bsz_bounds\[1\] must be an integer"):
        AdaptiveStrategy(autoscale_batch_size=16, local_bsz_bounds=(4, 2))
    with pytest.raises(ValueError, match="hysteresis"):
        AdaptiveStrategy(autoscale_batch_size=16, hysteresis=1.5)
    with pytest.raises(ValueError, match="adapt_every"):
        AdaptiveStrategy(autoscale_batch_size=16, adapt_every=0)
    with pytest.raises(ValueError, match="gradient_accumulation only apply with autoscale"):
        AdaptiveStrategy(gradient_accumulation=True)


def test_autoscale_below_the_reference_batch_is_refused_naming_it(job):
    with pytest.raises(ValueError, match="autoscale_batch_size must be an integer >= 8"):
        _trainer(strategy=_autoscale_strategy(autoscale_batch_size=6)).fit(_Module(batch_size=8))


def test_autoscale_accumulation_follows_the_loaders_plan_and_the_schedule_follows_samples(job, monkeypatch):
    """Scripted decisions change the micro-batch and accumulation steps during epochs (one process, reference
    batch 4): Lightning steps the optimizer on the last micro-batch of every planned step only (its
    accumulate_grad_batches is the step's micro-batches), global_step counts optimizer steps, each step trains the
    loader's planned samples, every sample once per epoch, the epoch's validation runs once at its end, the LR
    scheduler counts reference steps (samples / 4) and the LR used is the schedule's times the linear rule's
    factor (step size / 4); each step is SGD on the mean gradient of its samples."""
    shapes = [(2, 1), (4, 2), (3, 3), (8, 1), (2, 2), (5, 1), (6, 2)]
    _script_decisions(monkeypatch, shapes)
    module = _AutoscaleModule(batch_size=4, n=30)
    trainer = _trainer(max_epochs=2, strategy=_autoscale_strategy())
    trainer.fit(module)
    records = module.micro
    steps: list[list[dict]] = []
    for record in records:
        index, count = record["micro"]
        assert record["accumulate"] == count, record  # Lightning's accumulation is the loader's plan
        if index == 0:
            steps.append([])
        steps[-1].append(record)
    assert all(len(group) == group[0]["micro"][1] for group in steps), steps
    assert len({group[0]["micro"][1] for group in steps}) >= 3, steps  # the accumulation changed during the run
    assert len({len(group[0]["indices"]) for group in steps}) >= 3, steps  # and so did the local batch
    assert [group[0]["global_step"] for group in steps] == list(range(len(steps)))  # optimizer steps
    assert all(len({r["global_step"] for r in group}) == 1 for group in steps), steps
    for group in steps:  # the step's samples are the loader's plan
        assert sum(len(r["indices"]) for r in group) == group[0]["size"], group
        if group[0]["position"] < 30:
            assert group[0]["size"] == group[0]["planned"], group
    assert trainer.global_step == len(steps) == len(module.lrs)
    for epoch in (0, 1):
        indices = sorted(i for r in records if r["epoch"] == epoch for i in r["indices"])
        assert indices == list(range(30)), (epoch, indices)
        in_epoch = [r for r in records if r["epoch"] == epoch]
        assert in_epoch[-1]["batches"] == len(in_epoch), in_epoch  # Lightning's count of the epoch's batches
    assert [epoch for epoch, _ in module.validated] == [0, 1], module.validated  # once, at each epoch's end
    reference = 0
    for group, lr in zip(steps, module.lrs):
        assert lr["last_epoch"] == reference, (group[0], lr)  # the scheduler counted reference steps so far
        assert lr["scheduled"] == pytest.approx(0.1 / (1 + reference))
        assert lr["used"] == pytest.approx(lr["scheduled"] * group[0]["size"] / 4), (group[0], lr)
        epoch, end = group[0]["epoch"], group[0]["position"]
        # reference steps (a step smaller than the reference batch still counts one)
        reference = max(reference + 1, (epoch + 1) * 8 if end >= 30 else epoch * 8 + end // 4)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == reference >= 16
    assert module.estimated == 16  # estimated_stepping_batches: reference steps (8 per epoch of 30 samples / 4)
    data = _dataset(30)
    for group, after, lr in zip(steps, steps[1:], module.lrs):  # SGD on the mean gradient of each step's samples
        net = torch.nn.Linear(3, 1).double()
        with torch.no_grad():
            for parameter, value in zip(net.parameters(), group[0]["weights"]):
                parameter.copy_(torch.tensor(value, dtype=torch.float64).view_as(parameter))
        indices = [i for r in group for i in r["indices"]]
        torch.nn.functional.mse_loss(net(data.tensors[0][indices]), data.tensors[1][indices]).backward()
        for parameter, value in zip(net.parameters(), after[0]["weights"]):
            expected = parameter.detach() - lr["used"] * parameter.grad
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64).view_as(parameter), expected,
                                       rtol=0, atol=1e-12)


def test_autoscale_ckpt_path_resumes_every_model_checkpoint_exactly(job, monkeypatch):
    """Autoscale on (the shape changes every 3 steps), ModelCheckpoint files written every 2 optimizer steps and at
    each epoch's validation end, each resumed with fit(ckpt_path=...) in a fresh library folder: the optimizer
    steps go on from the file's, every sample once per epoch, the LR schedule counts reference steps and the LR
    follows the linear rule; where the resume does not fall on a shape change, the same micro-batches (samples,
    micro-steps) and optimizer steps as the uninterrupted run from there, and its float64 weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from conftest import restart_process_state

    _script_decisions(monkeypatch, [(2, 1), (4, 2), (3, 3), (8, 1), (2, 2)], every=3)
    saved = job / "lightning"
    callbacks = [ModelCheckpoint(dirpath=str(saved), filename="{epoch}-{step}", every_n_train_steps=2, save_top_k=-1),
                 ModelCheckpoint(dirpath=str(saved), filename="end-{epoch}-{step}", save_top_k=-1)]
    reference = _AutoscaleModule(batch_size=4, n=30)
    trainer = _trainer(max_epochs=2, strategy=_autoscale_strategy(), enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(reference)
    final = (trainer.global_step, trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    files = sorted(saved.glob("*step=*.ckpt"), key=_step_of)
    assert len({_step_of(path) for path in files}) >= 4, files

    def trained(module, start):
        return [(r["epoch"], r["global_step"], r["micro"], r["indices"]) for r in module.micro
                if r["global_step"] >= start]

    exact = 0
    for path in files:
        start = _step_of(path)
        if start >= final[0]:
            continue
        restart_process_state()
        monkeypatch.setenv("ADAPTIVE_CHECKPOINT_PATH", str(job / f"fresh-{path.stem}"))
        resumed = _AutoscaleModule(batch_size=4, n=30)
        trainer = _trainer(max_epochs=2, strategy=_autoscale_strategy())
        trainer.fit(resumed, ckpt_path=str(path))
        assert resumed.micro[0]["global_step"] == start and all(r["accumulate"] == r["micro"][1]
                                                                for r in resumed.micro), path.name
        for epoch in (0, 1):  # the reference run's steps before the file's, the resumed run's from it
            indices = sorted(i for module, kept in ((reference, lambda step: step < start), (resumed, bool))
                             for r in module.micro if r["epoch"] == epoch and (kept(r["global_step"]) or
                                                                               module is resumed) for i in r["indices"])
            assert indices == list(range(30)), (path.name, epoch, indices)
        steps = [r for r in resumed.micro if r["micro"][0] == r["micro"][1] - 1]
        assert trainer.global_step == start + len(steps) == start + len(resumed.lrs), path.name
        assert [lr["global_step"] for lr in resumed.lrs] == list(range(start, trainer.global_step)), path.name
        counted = reference.lrs[start]["last_epoch"] if start < len(reference.lrs) else final[1]
        for lr, step in zip(resumed.lrs, steps):
            assert lr["last_epoch"] == counted, (path.name, lr, counted)
            assert lr["used"] == pytest.approx(lr["scheduled"] * step["size"] / 4), (path.name, lr)
            end = step["position"]
            counted = max(counted + 1, (step["epoch"] + 1) * 8 if end >= 30 else step["epoch"] * 8 + end // 4)
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == counted and trainer.current_epoch == 2
        if start % 3:  # not on a shape change: the uninterrupted run from the file's step, exactly
            assert trained(resumed, start) == trained(reference, start), path.name
            assert (trainer.global_step, counted) == final, path.name
            weights = [(r["global_step"], r["weights"]) for r in resumed.micro]
            assert weights == [(r["global_step"], r["weights"]) for r in reference.micro if r["global_step"] >= start]
            torch.testing.assert_close(resumed.net.weight.detach(), reference.net.weight.detach(), rtol=0,
                                       atol=1e-12)
            exact += 1
    assert exact >= 2, files


# ---------------------------------------------------------------------- real jobs




#: The distributed tests' job: 96 samples, 3 epochs, float64; 3 samples per process x 2 processes x 2 accumulated
#: batches on the first launch: a global batch of 12 (8 optimizer steps per epoch), which 3 processes split evenly.
_JOB = dict(WORKER_SAMPLES="96", WORKER_BATCH="3", WORKER_ACCUMULATION="2", WORKER_EPOCHS="3", WORKER_DTYPE="float64")


def _uninterrupted(job, monkeypatch, global_batch):
    """``done.json`` of the same script run without interruption, here, on one process, with a fixed batch of
    ``global_batch`` and no accumulation (the same mean gradient per step as the first launch's micro-batches
    on its processes, up to rounding)."""
    import runpy

    out = job / f"uninterrupted{global_batch}"
    out.mkdir()
    for key, value in dict(_JOB, WORKER_BATCH=str(global_batch), WORKER_ACCUMULATION="1", WORKER_OUT=str(out),
                           WORKER_STEP_SLEEP="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.syspath_prepend(str(WORKER.parent))  # worker_common, as for the script run by a launcher
    runpy.run_path(str(WORKER), run_name="uninterrupted")["main"]()
    done = json.loads((out / "done.json").read_text())
    steps = 3 * 96 // global_batch
    assert (done["global_step"], done["current_epoch"], done["scheduler_steps"]) == (steps, 3, steps), done
    return done


@pytest.fixture
def uninterrupted(job, monkeypatch):
    return _uninterrupted(job, monkeypatch, 12)


def _assert_exact(out, done, steps=24):
    """``steps`` optimizer steps (24 of 12 samples), every sample once in each of the 3 epochs, Lightning's
    counters."""
    assert (done["global_step"], done["current_epoch"], done["scheduler_steps"]) == (steps, 3, steps), done
    epochs = {record["epoch"]: record for record in read_jsonl(out / "epochs.jsonl")}  # the last record of each
    assert sorted(epochs) == [0, 1, 2], epochs
    assert all((epochs[e]["missing"], epochs[e]["extra"]) == (0, 0) for e in epochs), epochs


def _assert_weights(done, reference):
    torch.testing.assert_close(torch.tensor(done["weights"], dtype=torch.float64),
                               torch.tensor(reference["weights"], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("batch, accumulation", [pytest.param(3, 2, id="accumulated", marks=pytest.mark.ci_sample),
                                                 pytest.param(4, 1, id="uneven-shares")])
def test_sigterm_on_2_processes_resume_on_3_keeps_the_global_batch_counters_and_uninterrupted_weights(
        jobs, tmp_path, job, monkeypatch, batch, accumulation):
    """About 20-40 s on 2 shared cores each (two launches).  ``accumulated``: 3 per process x 2 processes x 2
    accumulated batches, a global batch of 12 in 2 micro-batches of 6 (3 + 3, then 2 + 2 + 2); ``uneven-shares``:
    4 x 2 x 1, a global batch of 8, split 3 + 3 + 2 on 3 processes (the losses weighted by their shares)."""
    global_batch, micro = batch * 2 * accumulation, batch * 2
    steps = 3 * 96 // global_batch
    reference = _uninterrupted(job, monkeypatch, global_batch)
    out = tmp_path / "lightning"
    log2, log3 = out / "job2.log", out / "job3.log"
    started = time.time()
    run = dict(_JOB, WORKER_BATCH=str(batch), WORKER_ACCUMULATION=str(accumulation))
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", **run)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 5, 90, "2 processes to take 5 steps")
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler does to the launcher
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    codes = exit_codes(out, started)
    assert codes == [143, 143], f"{codes}\n{tail(log2)}"
    stopped = progress(out, 0)
    assert stopped["world"] == 2 and stopped["step"] < steps, f"{stopped}\n{tail(log2)}"

    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_STEP_SLEEP="0", WORKER_DATAMODULE="0", **run)
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert "resuming from checkpoint" in log3.read_text(), tail(log3)
    assert "Lightning resumes at epoch" in log3.read_text(), tail(log3)
    records = read_jsonl(out / "steps.jsonl")  # rank 0, one record per micro-batch
    worlds = [record["world"] for record in records]
    assert worlds[0] == 2 and worlds[-1] == 3 and worlds == sorted(worlds), worlds
    # the first launch's global batch at both sizes, in micro-batches of ``micro`` samples split over the processes
    assert {(r["planned"], r["size"]) for r in records} == {(global_batch, global_batch)}, records
    assert {(r["world"], r["local"]) for r in records} == {(2, micro // 2), (3, -(-micro // 3))}, records
    assert [r["sync"] for r in records] == ([False] * (accumulation - 1) + [True]) * steps, records
    synced = [r for r in records if r["sync"]]
    assert [r["step"] for r in synced] == list(range(steps)), synced  # no step twice, none lost
    assert [r["global_step"] for r in synced] == list(range(steps)), synced  # Lightning's count carries on
    assert [r["epoch"] for r in synced] == [e for e in range(3) for _ in range(steps // 3)], synced
    # per-sample accounting from every process's own records: each sample once per epoch over both launches
    for epoch in range(3):
        indices = sorted(i for rank in range(3) if (out / f"samples.rank{rank}.jsonl").exists()
                         for r in read_jsonl(out / f"samples.rank{rank}.jsonl") if r["epoch"] == epoch
                         for i in r["indices"])
        assert indices == list(range(96)), (epoch, len(indices))
    done = json.loads((out / "done.json").read_text())
    assert done["world"] == 3
    _assert_exact(out, done, steps)
    _assert_weights(done, reference)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 15-35 s on 2 shared cores: a start, a kill, a restart round
def test_a_sigkilled_worker_rolls_back_to_the_checkpoint_and_ends_with_the_uninterrupted_weights(
        jobs, tmp_path, uninterrupted):
    out = tmp_path / "killed"
    log = out / "job.log"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2", "--max-restarts=2"], out, "job.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0.3", ADAPTIVE_CHECKPOINT_KEEP="1000", WORKER_DATAMODULE="0",
                       **_JOB)
    victim = wait_for(lambda: (p := progress(out, 1)) and p["step"] >= 10 and newest_checkpoint_step(out) >= 4
                      and p, 90, "rank 1 to reach epoch 1 with a checkpoint taken")
    ended = [victim["pid"], progress(out, 0)["pid"]]  # the incarnation the kill ends: both workers
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_exit(proc, 120, log) == 0, tail(log)
    assert live_pids(ended) == [], "a worker of the killed incarnation outlived it"
    assert "resuming from checkpoint" in log.read_text(), tail(log)
    steps = [r for r in read_jsonl(out / "steps.jsonl") if r["sync"]]
    assert sorted({r["step"] for r in steps}) == list(range(24)), steps  # the steps after the checkpoint again
    assert all(r["global_step"] == r["step"] for r in steps), steps  # Lightning's count rolled back with them
    done = json.loads((out / "done.json").read_text())
    _assert_exact(out, done)
    _assert_weights(done, uninterrupted)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 18-30 s on 2 shared cores (three Lightning start-ups)
def test_the_lightning_example_trains_on_2_processes_under_adaptive_run_and_a_relaunch_trains_nothing(tmp_path):
    """``examples/lightning_classifier.py`` as its docstring runs it (shortened by its own options): Lightning's
    own checkpoints are still written, and a relaunch on one process trains nothing more."""
    import subprocess

    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                       ADAPTIVE_CHECKPOINT_PATH=str(tmp_path / "checkpoints"), ADAPTIVE_SHARE_PATH=str(tmp_path / "share"),
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    script = [str(REPO / "examples" / "lightning_classifier.py"), "--train-samples", "2048", "--max-epochs", "2",
              "--output-dir", str(tmp_path / "out")]

    def run(*launcher):
        result = subprocess.run([sys.executable, *launcher, *script], env=environment, cwd=str(tmp_path),
                                capture_output=True, text=True, timeout=120)
        log = result.stdout + result.stderr
        assert result.returncode == 0, log[-4000:]
        return log

    log = run("-m", "adaptive.elastic.launcher", "--standalone", "--nproc-per-node=2")
    epochs = [line for line in log.splitlines() if "accuracy" in line]
    assert len(epochs) == 2 and all("2 processes" in line for line in epochs), log[-4000:]
    assert float(epochs[-1].split("accuracy ")[1].split("%")[0]) > 50.0  # 10 classes: chance is 10%
    assert "done: global step 64, epoch 2" in log  # 2048 samples / (32 x 2 processes) = 32 steps per epoch
    assert (tmp_path / "out" / "last.ckpt").is_file()  # ModelCheckpoint(save_last=True) still writes
    log = run()  # relaunched, on one process: finished, nothing is trained again
    assert "accuracy" not in log and "done: global step 64, epoch 2" in log, log[-4000:]
    # the library's folder lost: fit(ckpt_path="last") resumes from last.ckpt (written at epoch 1's validation end,
    # with the library's state in it); the epoch's end is replayed, no step is trained again
    environment["ADAPTIVE_CHECKPOINT_PATH"] = str(tmp_path / "lost")
    log = run()
    assert "ckpt_path: restoring the library's state from" in log, log[-4000:]
    assert "done: global step 64, epoch 2" in log, log[-4000:]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 20-40 s on 2 shared cores (two launches)
def test_a_model_checkpoint_of_2_processes_resumed_with_ckpt_path_on_3_in_fresh_folders_is_exact(
        jobs, tmp_path, uninterrupted):
    """ModelCheckpoint files written by a 2-process job (global batch 12 in 2 micro-batches of 3 + 3), the one of
    step 10 (epoch 1, mid-epoch) resumed with fit(ckpt_path=...) by a 3-process job with a new library checkpoint
    folder: steps 10-23 with the first launch's global batch (2 + 2 + 2 per micro-batch), Lightning's counters from
    step 10, every sample once per epoch over both jobs, and the float64 weights of an uninterrupted run."""
    first, second = tmp_path / "first", tmp_path / "second"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], first, "job2.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_STEP_SLEEP="0", WORKER_CHECKPOINT_EVERY="5", **_JOB)
    assert wait_exit(proc, 120, first / "job2.log") == 0, tail(first / "job2.log")
    saved = first / "lightning" / "epoch=1-step=10.ckpt"
    assert saved.is_file(), sorted(p.name for p in (first / "lightning").iterdir())
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], second, "job3.log", script=WORKER,
                       ADAPTIVE_CHECKPOINT_INTERVAL="0", WORKER_STEP_SLEEP="0", WORKER_DATAMODULE="0",
                       WORKER_CKPT_PATH=str(saved), **_JOB)
    log3 = second / "job3.log"
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert "ckpt_path: restoring the library's state from" in log3.read_text(), tail(log3)
    records = read_jsonl(second / "steps.jsonl")
    assert {(r["world"], r["local"], r["size"]) for r in records} == {(3, 2, 12)}, records
    synced = [r for r in records if r["sync"]]
    assert [r["step"] for r in synced] == list(range(10, 24)), synced  # from the checkpoint's step on, none twice
    assert [r["global_step"] for r in synced] == list(range(10, 24)), synced
    assert [r["epoch"] for r in synced] == [1] * 6 + [2] * 8, synced
    for epoch in (1, 2):  # each sample once per epoch: the first job's steps before 10, the second's from 10
        indices = sorted(i for out, kept in ((first, lambda step: step < 10), (second, lambda step: True))
                         for rank in range(3) for r in read_jsonl(out / f"samples.rank{rank}.jsonl")
                         if r["epoch"] == epoch and kept(r["step"]) for i in r["indices"])
        assert indices == list(range(96)), (epoch, len(indices))
    done = json.loads((second / "done.json").read_text())
    assert (done["global_step"], done["current_epoch"], done["world"]) == (24, 3, 3), done
    _assert_weights(done, uninterrupted)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("per_node", [pytest.param(1, id="1-per-node"), pytest.param(2, id="2-per-node")])
def test_a_live_job_of_one_node_gains_a_second_node_which_then_leaves(jobs, tmp_path, job, monkeypatch, per_node):
    """adaptive-run --live: a Lightning job on one node (global batch 8, validation every epoch) gains a second node
    mid-training, which is then stopped by SIGTERM (its launcher exits 143) while the first finishes: every step
    once with 8 samples and Lightning's global step, one join and one leave, every sample once per epoch, the
    members training each shared step from the same float64 weights, and the weights of an uninterrupted run.
    About 30 s (1 per node) and 45-60 s (2 per node: 4 processes) on 2 shared cores."""
    portpicker = pytest.importorskip("portpicker")
    from live_harness import launch, logs

    reference = _uninterrupted(job, monkeypatch, 8)
    out, port = tmp_path / "live", portpicker.pick_unused_port()
    settings = dict(_JOB, WORKER_BATCH=str(8 // per_node), WORKER_ACCUMULATION="1", WORKER_STEP_SLEEP="0.5",
                    ADAPTIVE_CHECKPOINT_INTERVAL="0")
    first = launch(jobs, out, port, "first", per_node=per_node, script=WORKER, **settings)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 2, 120, "the first node to train")
    second = launch(jobs, out, port, "second", per_node=per_node, script=WORKER, **settings)
    wait_for(lambda: (p := progress(out, 0)) and p["world"] == 2 * per_node and p["step"] >= 3, 150,
             "the second node to join")
    joined = progress(out, 0)
    # two steps on two nodes, and across an epoch's end (its validation and Accumulator on both) unless the join
    # came in the last epoch
    wait_for(lambda: (p := progress(out, 0))["step"] >= joined["step"] + 2
             and (p["epoch"] > joined["epoch"] or joined["epoch"] == 2), 60, "two steps on two nodes")
    second.send_signal(signal.SIGTERM)
    assert wait_exit(second, 60, out / "second.log") == 143, logs(out)
    assert wait_exit(first, 120, out / "first.log") == 0, logs(out)

    records = read_jsonl(out / "steps.jsonl")  # rank 0 (on the first node throughout), one record per step
    assert [r["step"] for r in records] == list(range(36)), records  # no step lost or trained twice
    assert all(r["global_step"] == r["step"] and r["size"] == 8 for r in records), records
    assert all(r["local"] == 8 // r["world"] for r in records), records
    worlds = [r["world"] for r in records]
    assert worlds[0] == per_node and 2 * per_node in worlds and worlds[-1] == per_node, worlds
    assert sum(worlds[i] != worlds[i - 1] for i in range(1, len(worlds))) == 2, worlds  # one join, one leave
    samples = [r for rank in range(2 * per_node) for r in read_jsonl(out / f"samples.rank{rank}.jsonl")]
    for epoch in range(3):
        indices = sorted(i for r in samples if r["epoch"] == epoch for i in r["indices"])
        assert indices == list(range(96)), (epoch, len(indices))  # every sample once per epoch
    by_step: dict[int, list[dict]] = {}
    for record in samples:
        by_step.setdefault(record["step"], []).append(record)
    shared = [step for step, group in by_step.items() if len(group) == 2 * per_node]
    assert len(shared) >= 2, sorted(by_step)
    for step in shared:  # the joiners took the members' state: all train each shared step from the same weights
        group = by_step[step]
        assert len({r["pid"] for r in group}) == len(group), group
        assert all((r["weights"], r["global_step"]) == (group[0]["weights"], group[0]["global_step"])
                   for r in group), group
    epochs = {r["epoch"]: r for r in read_jsonl(out / "epochs.jsonl")}
    assert sorted(epochs) == [0, 1, 2] and all(r["missing"] == r["extra"] == 0 for r in epochs.values()), epochs
    done = json.loads((out / "done.json").read_text())
    assert (done["global_step"], done["current_epoch"], done["world"]) == (36, 3, per_node), done
    _assert_weights(done, reference)


#: The autoscale job: the distributed tests' job (reference global batch 12) with autoscale up to 48 samples, the
#: linear LR rule, and the goodput model's decisions scripted (local batch x accumulation steps, per process).
_AUTOSCALE = dict(_JOB, WORKER_AUTOSCALE="48", WORKER_LOCAL_MAX="8", WORKER_SCRIPTED="3x2,2x3,4x1,5x2,2x2,6x1",
                  ADAPTIVE_CHECKPOINT_INTERVAL="0")


def _reference_steps(epoch, position, samples=96, reference=12):
    """The LR schedule's count after a step ending at ``position`` of ``epoch`` (steps of the reference batch)."""
    per_epoch = samples // reference
    return (epoch + 1) * per_epoch if position >= samples else epoch * per_epoch + position // reference


def _assert_autoscaled_steps(out, worlds, first=0, counted=0):
    """Rank 0's records: Lightning's accumulation is the loader's plan at every micro-batch, each optimizer step
    trains its planned global batch (``size`` samples over the processes, in its planned micro-batches), the
    local batch and the accumulation change, global_step counts optimizer steps once each, the LR scheduler
    counts reference steps and the LR used is the schedule's times the linear rule's factor.  ``first``: the
    global step the records start at, ``counted``: the scheduler's count there.  Returns the optimizer steps
    (lists of micro-batch records)."""
    records = read_jsonl(out / "steps.jsonl")
    assert {r["world"] for r in records} == set(worlds), records
    steps: list[list[dict]] = []
    for record in records:
        index, count = record["micro"]
        assert record["accumulate"] == count and record["sync"] == (index == count - 1), record
        if index == 0:
            steps.append([])
        steps[-1].append(record)
    trained: dict[int, int] = {}  # samples each optimizer step trained, over every process's records
    for rank in range(max(worlds)):
        for record in read_jsonl(out / f"samples.rank{rank}.jsonl"):
            trained[record["step"]] = trained.get(record["step"], 0) + len(record["indices"])
    for group in steps:
        assert [r["micro"][0] for r in group] == list(range(group[0]["micro"][1])), group
        size, planned, last = group[0]["size"], group[0]["planned"], group[0]["position"] >= 96
        assert size == planned or (last and size < planned), group  # (the epoch's last step may be shorter)
        assert trained[group[0]["step"]] == size or (last and trained[group[0]["step"]] > size), group
    assert len({group[0]["micro"][1] for group in steps}) >= 2, steps  # the accumulation steps changed
    assert len({(r["world"], r["local"]) for r in records}) >= 3, records  # and the local batch
    expected = list(range(first, first + len(steps)))
    assert [group[-1]["global_step"] for group in steps] == expected, steps  # once each
    assert [group[-1]["step"] for group in steps] == expected, steps  # the loader's steps
    lrs = read_jsonl(out / "lrs.jsonl")
    assert [lr["global_step"] for lr in lrs] == expected, lrs
    for lr, group in zip(lrs, steps):
        assert (lr["size"], lr["position"]) == (group[0]["size"], group[0]["position"]), (lr, group)
        assert lr["last_epoch"] == counted, (lr, counted)  # reference steps so far (at least one per step)
        assert lr["scheduled"] == pytest.approx(0.05 / (1.0 + 0.01 * counted))
        assert lr["used"] == pytest.approx(lr["scheduled"] * lr["size"] / 12), lr  # linear rule: size / 12
        counted = max(counted + 1, _reference_steps(lr["epoch"], lr["position"]))
    return steps


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.ci_sample  # about 25-45 s on 2 shared cores (two launches)
def test_autoscale_sigterm_on_2_processes_resumed_on_3_keeps_counters_samples_and_the_plan(jobs, tmp_path):
    """Autoscale on (scripted decisions change the local batch and the accumulation steps every step): stopped by
    SIGTERM on 2 processes and resumed on 3, every micro-batch is accumulated or stepped as the loader planned,
    each optimizer step trains the planned global batch, global_step and the loader's step go on with no step
    lost or trained twice, every sample is trained once per epoch over both launches, and the LR follows the
    schedule in reference steps times the linear rule."""
    out = tmp_path / "autoscale"
    log2, log3 = out / "job2.log", out / "job3.log"
    started = time.time()
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], out, "job2.log", script=WORKER, **_AUTOSCALE)
    wait_for(lambda: (p := progress(out, 0)) and p["step"] >= 6, 90, "2 processes to take 6 steps")
    os.killpg(proc.pid, signal.SIGTERM)
    assert wait_exit(proc, 60, log2) == 143, tail(log2)
    assert exit_codes(out, started) == [143, 143], tail(log2)
    stopped = progress(out, 0)
    assert stopped["world"] == 2 and stopped["epoch"] < 2, f"{stopped}\n{tail(log2)}"
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], out, "job3.log", script=WORKER,
                       WORKER_STEP_SLEEP="0", WORKER_DATAMODULE="0", **_AUTOSCALE)
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert "Lightning resumes at epoch" in log3.read_text(), tail(log3)
    steps = _assert_autoscaled_steps(out, (2, 3))
    worlds = [group[0]["world"] for group in steps]
    assert worlds[0] == 2 and worlds[-1] == 3 and worlds == sorted(worlds), worlds
    for epoch in range(3):  # every sample once per epoch, from every process's own records
        indices = sorted(i for rank in range(3) if (out / f"samples.rank{rank}.jsonl").exists()
                         for r in read_jsonl(out / f"samples.rank{rank}.jsonl") if r["epoch"] == epoch
                         for i in r["indices"])
        assert indices == list(range(96)), (epoch, len(indices))
    epochs = {record["epoch"]: record for record in read_jsonl(out / "epochs.jsonl")}
    assert sorted(epochs) == [0, 1, 2] and all(r["missing"] == r["extra"] == 0 for r in epochs.values()), epochs
    done = json.loads((out / "done.json").read_text())
    assert (done["global_step"], done["current_epoch"], done["world"]) == (len(steps), 3, 3), done


@pytest.mark.distributed
@pytest.mark.slow
def test_autoscale_model_checkpoint_of_2_processes_resumed_with_ckpt_path_on_3_in_fresh_folders(jobs, tmp_path):
    """Autoscale on: a ModelCheckpoint file written by a 2-process job after its optimizer step 6 (epoch 0, inside
    the epoch), resumed with fit(ckpt_path=...) by a 3-process job with a new library checkpoint folder: global
    steps and the loader's steps from 6 on, none twice, the LR schedule's count going on from the file's, every
    micro-batch accumulated or stepped as the loader planned, and every sample once per epoch over both jobs."""
    first, second = tmp_path / "first", tmp_path / "second"
    proc = jobs.launch(["--standalone", "--nproc-per-node=2"], first, "job2.log", script=WORKER,
                       WORKER_STEP_SLEEP="0", WORKER_CHECKPOINT_EVERY="3", **_AUTOSCALE)
    assert wait_exit(proc, 120, first / "job2.log") == 0, tail(first / "job2.log")
    saved = first / "lightning" / "epoch=0-step=6.ckpt"
    assert saved.is_file(), sorted(p.name for p in (first / "lightning").iterdir())
    counted = next(lr["last_epoch"] for lr in read_jsonl(first / "lrs.jsonl") if lr["global_step"] == 6)
    proc = jobs.launch(["--standalone", "--nproc-per-node=3"], second, "job3.log", script=WORKER,
                       WORKER_STEP_SLEEP="0", WORKER_DATAMODULE="0", WORKER_CKPT_PATH=str(saved), **_AUTOSCALE)
    log3 = second / "job3.log"
    assert wait_exit(proc, 120, log3) == 0, tail(log3)
    assert "ckpt_path: restoring the library's state from" in log3.read_text(), tail(log3)
    steps = _assert_autoscaled_steps(second, (3,), first=6, counted=counted)
    for epoch in range(3):  # each sample once per epoch: the first job's steps before 6, the second's from 6
        indices = sorted(i for out, kept in ((first, lambda step: step < 6), (second, lambda step: True))
                         for rank in range(3) if (out / f"samples.rank{rank}.jsonl").exists()
                         for r in read_jsonl(out / f"samples.rank{rank}.jsonl")
                         if r["epoch"] == epoch and kept(r["step"]) for i in r["indices"])
        assert indices == list(range(96)), (epoch, len(indices))
    done = json.loads((second / "done.json").read_text())
    assert (done["global_step"], done["current_epoch"], done["world"]) == (6 + len(steps), 3, 3), done
