"""A Lightning training script on AdaptiveStrategy, for tests/test_lightning_integration.py.

Written as a Lightning user writes one (a LightningModule with
``training_step``, ``validation_step``, ``configure_optimizers`` with a
per-step LR scheduler, ``self.log(..., sync_dist=True)``; its data from a
LightningDataModule or from the module's own ``*_dataloader`` methods, with
a per-process ``batch_size``), with ``strategy=AdaptiveStrategy()`` as the
only change.  A tiny linear model on generated data.

Environment knobs:
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      training samples (default 96)
    WORKER_EVAL         validation samples (default 10)
    WORKER_BATCH        DataLoader batch_size, per process (default 4)
    WORKER_EPOCHS       max_epochs (default 3)
    WORKER_ACCUMULATION accumulate_grad_batches (default 1)
    WORKER_STEP_SLEEP   seconds each training step sleeps, to give tests time to act (default 0.1)
    WORKER_DTYPE        dtype of the model and data: float32 (default) or float64 (exact comparisons)
    WORKER_DATAMODULE   1 (default): the data comes from a LightningDataModule; 0: from the module's methods
    WORKER_CHECKPOINT_EVERY  a ModelCheckpoint writes ``WORKER_OUT/lightning/{epoch}-{step}.ckpt`` every that many
                        optimizer steps, keeping every file, and ``last.ckpt`` (default 0: no ModelCheckpoint)
    WORKER_CKPT_PATH    ``trainer.fit(ckpt_path=...)`` (default: none)
    WORKER_AUTOSCALE    ``AdaptiveStrategy(autoscale_batch_size=...)`` (default 0: autoscale off); with it
                        ``local_bsz_bounds=(1, WORKER_LOCAL_MAX)`` (default 8), ``gradient_accumulation=True``,
                        ``adapt_every=1`` and ``scaling_rule="linear"``
    WORKER_SCRIPTED     "3x2,2x3,...": the goodput model's decisions replaced by these (local batch x accumulation
                        steps), one per decision, so that the batch changes whatever the machine measures

Every rank rewrites ``progress.rank<R>.json`` after every micro-batch (pid,
epoch, loader step, world); rank 0 appends one record per micro-batch to
``steps.jsonl`` (Lightning's global_step and epoch, the loader's step, its
planned and actual global batch, this process's samples, whether the
optimizer steps); every rank appends the sample indices it trained to
``samples.rank<R>.jsonl`` (with Lightning's global step, its pid and the weights it
trained the batch with); at the end of each epoch rank 0 appends to
``epochs.jsonl`` the samples missed and repeated (per-sample counts summed
over the processes by an Accumulator); at the end ``done.json`` (Lightning's
counters, the scheduler's count, the final weights).  The ``steps.jsonl``
records also hold the loader's micro-step (index, count), Lightning's
``accumulate_grad_batches`` and the step's end position; with autoscale rank
0 appends one record per optimizer step to ``lrs.jsonl`` (the LR used, the
scheduler's LR and count, the step's size and end position).  Every process appends
its exit status to ``exits.rank<R>.jsonl``.
"""

import logging
import os
import time

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import ModelCheckpoint
import torch

import adaptive
from adaptive.integrations.lightning import AdaptiveStrategy
from worker_common import append_jsonl, regression_dataset, run_main, script_decisions, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "96"))
EVAL = int(os.environ.get("WORKER_EVAL", "10"))
BATCH = int(os.environ.get("WORKER_BATCH", "4"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
ACCUMULATION = int(os.environ.get("WORKER_ACCUMULATION", "1"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.1"))
DTYPE = getattr(torch, os.environ.get("WORKER_DTYPE", "float32"))
DATAMODULE = os.environ.get("WORKER_DATAMODULE", "1") == "1"
CHECKPOINT_EVERY = int(os.environ.get("WORKER_CHECKPOINT_EVERY", "0"))
CKPT_PATH = os.environ.get("WORKER_CKPT_PATH") or None
AUTOSCALE = int(os.environ.get("WORKER_AUTOSCALE", "0"))
LOCAL_MAX = int(os.environ.get("WORKER_LOCAL_MAX", "8"))
SCRIPTED = os.environ.get("WORKER_SCRIPTED", "")


def dataset(samples: int, offset: int) -> torch.utils.data.TensorDataset:
    return regression_dataset(samples, offset, DTYPE)


def train_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(SAMPLES, 1), batch_size=BATCH, shuffle=True)


def val_loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(EVAL, 2), batch_size=2)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        return train_loader()

    def val_dataloader(self):
        return val_loader()


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1).to(DTYPE)
        self.counts = adaptive.Accumulator()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        trainer = self.trainer
        loader = trainer.strategy.train_loader  # the elastic loader, for the records
        rank, world = trainer.global_rank, trainer.world_size
        self.counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
        sync = not loader.is_accumulation_step()
        append_jsonl(os.path.join(OUT, f"samples.rank{rank}.jsonl"), {
            "epoch": trainer.current_epoch, "step": loader.step, "world": world, "indices": index.tolist(),
            "global_step": trainer.global_step, "pid": os.getpid(),
            "weights": [value for tensor in self.net.state_dict().values() for value in tensor.flatten().tolist()]})
        if rank == 0:
            step = loader.current_step
            append_jsonl(os.path.join(OUT, "steps.jsonl"), {
                "global_step": trainer.global_step, "epoch": trainer.current_epoch, "step": loader.step,
                "world": world, "planned": step.planned_size, "size": step.size, "local": len(index),
                "sync": sync, "batch_idx": batch_idx, "micro": list(loader.micro_step),
                "accumulate": trainer.accumulate_grad_batches, "position": step.position})
        write_json(os.path.join(OUT, f"progress.rank{rank}.json"), {
            "pid": os.getpid(), "epoch": trainer.current_epoch, "step": loader.step, "world": world})
        time.sleep(STEP_SLEEP)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        trainer = self.trainer
        if AUTOSCALE and trainer.global_rank == 0:
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            step = trainer.strategy.train_loader.current_step
            append_jsonl(os.path.join(OUT, "lrs.jsonl"), {
                "global_step": trainer.global_step, "epoch": trainer.current_epoch, "world": trainer.world_size,
                "used": optimizer.param_groups[0]["lr"], "scheduled": scheduler.get_last_lr()[0],
                "last_epoch": scheduler.last_epoch, "size": step.size, "planned": step.planned_size,
                "position": step.position})

    def validation_step(self, batch, batch_idx):
        x, y, index = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        with self.counts.synchronized():
            seen = self.counts["seen"]
            if self.trainer.global_rank == 0:
                append_jsonl(os.path.join(OUT, "epochs.jsonl"), {
                    "epoch": self.trainer.current_epoch, "world": self.trainer.world_size,
                    "missing": int((seen == 0).sum()), "extra": int((seen - 1).clip(min=0).sum())})
            self.counts.clear()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.01 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OwnLoaders(Regression):
    """The same module, returning its own loaders (no DataModule)."""

    def train_dataloader(self):
        return train_loader()

    def val_dataloader(self):
        return val_loader()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    model = Regression() if DATAMODULE else OwnLoaders()
    callbacks = []
    if CHECKPOINT_EVERY:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(OUT, "lightning"), filename="{epoch}-{step}",
                                         every_n_train_steps=CHECKPOINT_EVERY, save_top_k=-1, save_last=True))
    strategy = AdaptiveStrategy()
    if AUTOSCALE:
        if SCRIPTED:
            script_decisions(SCRIPTED)
        strategy = AdaptiveStrategy(autoscale_batch_size=AUTOSCALE, local_bsz_bounds=(1, LOCAL_MAX),
                                    gradient_accumulation=True, adapt_every=1, scaling_rule="linear")
    trainer = L.Trainer(max_epochs=EPOCHS, accumulate_grad_batches=ACCUMULATION, strategy=strategy,
                        accelerator="cpu", logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=Data() if DATAMODULE else None, ckpt_path=CKPT_PATH)
    if trainer.global_rank == 0:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        write_json(os.path.join(OUT, "done.json"), {
            "global_step": trainer.global_step, "current_epoch": trainer.current_epoch, "world": trainer.world_size,
            "scheduler_steps": scheduler.last_epoch,
            "weights": [value for tensor in model.net.state_dict().values() for value in tensor.flatten().tolist()]})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", "0")))
