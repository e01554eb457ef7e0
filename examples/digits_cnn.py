"""Handwritten digits with a small CNN: elastic, with the batch size chosen while training.

    pip install -e ".[examples,report]"       # scikit-learn ships the images; matplotlib draws the report
    python examples/digits_cnn.py                                        # one replica, ~1-2 min on a CPU
    adaptive-run --standalone --nproc-per-node=2 examples/digits_cnn.py  # two replicas
    adaptive report .adaptive/digits_cnn                                 # summary + report.png

The 1,797 8x8 greyscale digits come with scikit-learn (``load_digits``), so
nothing is downloaded.  ``loader.autoscale_batch_size`` lets the loader pick
the local batch size and gradient-accumulation steps that maximise goodput,
also in the middle of an epoch; the learning rate follows by AdaScale (the
default for SGD).  Each epoch logs the training loss and the validation
accuracy, summed over replicas by an ``adaptive.Accumulator``.  With
``tensorboard`` installed, rank 0 writes the batch-size, noise-scale, gain,
LR-factor and throughput scalars with ``loader.to_tensorboard(writer)``
(``tensorboard --logdir .adaptive/digits_cnn/share/tensorboard``).

Stop it at any time (Ctrl-C, SIGTERM, killing a worker) and run the same
command again, with any number of replicas: it resumes where it stopped.
A finished run is not retrained; delete ``.adaptive/digits_cnn`` (or set
``ADAPTIVE_JOB_ID``) to start over.
"""
import argparse
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

import adaptive

log = logging.getLogger("digits_cnn")


def load_digits() -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """(train, validation) datasets of 8x8 images scaled to [0, 1]; the same split on every replica."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise SystemExit('digits_cnn.py needs scikit-learn, which ships the digits images: pip install '
                         '"adaptive-elastic[examples]" (in a source checkout: pip install -e ".[examples]")') from None
    data = sklearn_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, val = order[:1500], order[1500:]
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            torch.utils.data.TensorDataset(images[val], labels[val]))


class SmallCNN(torch.nn.Module):
    """Two 3x3 convolutions, one pooling, two linear layers: ~40k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def tensorboard_writer(logdir: str | None) -> Any:
    """A SummaryWriter on rank 0 when tensorboard is installed, else None."""
    if adaptive.env.rank() != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info("tensorboard is not installed; no TensorBoard scalars (pip install tensorboard)")
        return None
    return SummaryWriter(logdir or os.path.join(adaptive.env.share_path(), "tensorboard"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15, help="epochs to train (default 15)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="stop after this many optimizer steps in total (0: no limit; for quick checks)")
    parser.add_argument("--batch-size", type=int, default=32, help="initial global batch size (default 32)")
    parser.add_argument("--max-batch-size", type=int, default=512, help="largest global batch autoscale may use")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate at the initial batch size")
    parser.add_argument("--tensorboard", metavar="DIR", help="TensorBoard log folder "
                        "(default <ADAPTIVE_SHARE_PATH>/tensorboard)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Everything before the epoch loop runs again after a restart: keep it idempotent.
    torch.manual_seed(0)
    train_set, val_set = load_digits()
    adaptive.init_process_group("gloo")
    net = SmallCNN()
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    model = adaptive.AdaptiveDataParallel(net, optimizer, lr_scheduler)
    train_loader = adaptive.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    train_loader.autoscale_batch_size(args.max_batch_size, local_bsz_bounds=(8, 128), gradient_accumulation=True)
    val_loader = adaptive.AdaptiveDataLoader(val_set, batch_size=128)
    stats = adaptive.Accumulator()
    writer = tensorboard_writer(args.tensorboard)

    for epoch in adaptive.remaining_epochs_until(args.epochs):
        model.train()
        for images, labels in train_loader:
            if args.max_steps and train_loader.step >= args.max_steps:
                break  # the same step on every replica
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            if not train_loader.is_accumulation_step():  # gradients are complete only on the last micro-step
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            optimizer.step()
            stats["loss_sum"] += loss.item() * len(labels)
            stats["train_n"] += len(labels)
            if writer is not None and not train_loader.is_accumulation_step() and train_loader.step % 5 == 0:
                train_loader.to_tensorboard(writer)
        model.eval()
        with torch.no_grad():
            for images, labels in val_loader:
                stats["correct"] += (model(images).argmax(dim=1) == labels).sum().item()
                stats["val_n"] += len(labels)
        with stats.synchronized():
            loss, accuracy = stats["loss_sum"] / max(stats["train_n"], 1), stats["correct"] / stats["val_n"]
            if adaptive.env.rank() == 0:
                log.info("epoch %d: train loss %.4f, validation accuracy %.2f%% (%d replicas, batch size %d = "
                         "local %d x %d accumulation steps x %d replicas)", epoch, loss, 100 * accuracy,
                         adaptive.env.num_replicas(), train_loader.batch_size, train_loader.current_local_bsz,
                         train_loader.accumulation_steps, adaptive.env.num_replicas())
            if writer is not None:
                writer.add_scalar("train/loss", loss, epoch)
                writer.add_scalar("validation/accuracy", accuracy, epoch)
            stats.clear()
        lr_scheduler.step()  # after the epoch's last loader loop, so that a replayed epoch does not step it twice
        if args.max_steps and train_loader.step >= args.max_steps:
            log.info("stopping after %d optimizer steps (--max-steps)", train_loader.step)
            adaptive.finish_training()  # checkpointed as finished: a relaunch trains nothing
            break
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
