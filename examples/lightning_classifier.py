"""A Lightning script made elastic: an MLP classifier with a LightningDataModule, on generated digits.

Written as Lightning's own image-classifier examples are (a
``LightningDataModule`` with train/val splits, a ``LightningModule`` with
``training_step``, ``validation_step``, ``self.log(..., sync_dist=True)``,
``configure_optimizers`` with a per-step LR schedule, ``ModelCheckpoint``),
with the one line that changes marked ``# adaptive:``.  The "digits" are
8x8 images generated from 10 noisy prototypes: nothing is downloaded.

    pip install -e ".[lightning]"
    python examples/lightning_classifier.py
    adaptive-run --standalone --nproc-per-node=2 examples/lightning_classifier.py

Stop it (Ctrl-C, SIGTERM, kill a worker) and run the same command again
with any number of processes: it resumes at the exact sample, with the
global batch of its first launch, and Lightning's global_step and epoch
carry on.  ``fit(ckpt_path="last")`` is exact too: Lightning's ``last.ckpt``
carries the library's state, so the run also resumes from it alone (in a
new checkpoint folder, on another machine).  See docs/lightning.md.
"""

import argparse
import logging

import torch

try:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from adaptive.integrations.lightning import AdaptiveStrategy  # adaptive: the strategy
except ImportError as error:
    raise SystemExit(f'this example needs Lightning ({error}): pip install "adaptive-elastic[lightning]" '
                     '(in a checkout: pip install -e ".[lightning]")') from None

log = logging.getLogger("lightning_classifier")

SIDE, CLASSES = 8, 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per process, as Lightning scripts write it")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--train-samples", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--output-dir", default="lightning_classifier_out")
    return parser.parse_args()


def make_digits(samples: int, seed: int) -> torch.utils.data.TensorDataset:
    """``samples`` noisy copies of 10 fixed 8x8 prototypes (the same on every process and every launch)."""
    prototypes = (torch.rand(CLASSES, SIDE * SIDE, generator=torch.Generator().manual_seed(1234)) > 0.5).float()
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    images = prototypes[labels] + 1.5 * torch.randn(samples, SIDE * SIDE, generator=generator)
    return torch.utils.data.TensorDataset(images.view(samples, 1, SIDE, SIDE), labels)


class DigitsDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int, train_samples: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_samples = train_samples

    def setup(self, stage: str) -> None:
        self.train_set = make_digits(self.train_samples, seed=1)
        self.val_set = make_digits(1024, seed=2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val_set, batch_size=256)


class LitClassifier(L.LightningModule):
    def __init__(self, hidden: int, learning_rate: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(SIDE * SIDE, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            metrics = self.trainer.callback_metrics
            log.info("epoch %d: global step %d, val_loss %.4f, accuracy %.1f%%, %d processes", self.current_epoch,
                     self.trainer.global_step, metrics["val_loss"], 100 * metrics["val_acc"],
                     self.trainer.world_size)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=0.9)
        # optimizer steps of the whole run: under AdaptiveStrategy they are counted at the first launch's global
        # batch, which the elastic loader keeps at every world size, so the schedule follows the samples
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    L.seed_everything(0)
    data = DigitsDataModule(args.batch_size, args.train_samples)
    trainer = L.Trainer(
        max_epochs=args.max_epochs,
        accumulate_grad_batches=args.accumulate_grad_batches,
        strategy=AdaptiveStrategy(),  # adaptive: was strategy="ddp" (devices and num_nodes come from the launcher)
        accelerator="cpu",
        default_root_dir=args.output_dir,
        callbacks=[ModelCheckpoint(dirpath=args.output_dir, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LitClassifier(args.hidden, args.learning_rate)
    # last.ckpt carries the library's state (loader position, epoch, random generators): resumed exactly, unless the
    # library's own newest checkpoint of the same run is further along (a relaunch of this command), which wins
    trainer.fit(model, datamodule=data, ckpt_path="last")
    if trainer.is_global_zero:
        log.info("done: global step %d, epoch %d", trainer.global_step, trainer.current_epoch)


if __name__ == "__main__":
    main()
