"""A classifier trained with any of torch's LR schedulers and optimizers, as users write one.

    python lr_schedules.py --scheduler onecyclelr --optimizer adamw --amp --clip 1.0
    adaptive-run --standalone --nproc-per-node=2 lr_schedules.py --scheduler reducelronplateau

The patterns in it: DataLoader workers (persistent ones for training), a
GradScaler with autocast, gradient clipping of the unscaled gradients,
schedulers stepped per epoch, per step (OneCycleLR, CyclicLR) or on the
validation loss (ReduceLROnPlateau), accumulators created at the start of
every epoch, a validation loader iterated every epoch, and ``--max-steps``:
a ``break`` out of the training loop once the job has taken that many
optimizer steps (on the loader's step count, which continues across
restarts, so every replica breaks at the same step and a restart breaks
where the first run would have).  The data is synthetic; each item also
carries its index, and the ``probe`` calls record what the tests check.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import lr_scheduler as sched

import adaptive as adl
import corpus_probe as probe
from corpus_data import SyntheticImages

PER_STEP = {"onecyclelr", "cycliclr"}


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr / 50)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr / 50, weight_decay=1e-2)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr / 5)
    raise SystemExit(f"unknown optimizer {name}")


def make_scheduler(name: str, optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int):
    lr = optimizer.param_groups[0]["lr"]
    momentum = "momentum" in optimizer.defaults or "betas" in optimizer.defaults
    schedulers = {
        "steplr": lambda: sched.StepLR(optimizer, step_size=2, gamma=0.5),
        "multisteplr": lambda: sched.MultiStepLR(optimizer, milestones=[1, 3], gamma=0.5),
        "exponentiallr": lambda: sched.ExponentialLR(optimizer, gamma=0.8),
        "cosineannealinglr": lambda: sched.CosineAnnealingLR(optimizer, T_max=epochs),
        "cosineannealingwarmrestarts": lambda: sched.CosineAnnealingWarmRestarts(optimizer, T_0=2),
        "onecyclelr": lambda: sched.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch),
        "cycliclr": lambda: sched.CyclicLR(optimizer, base_lr=lr / 10, max_lr=lr, step_size_up=steps_per_epoch // 2,
                                           cycle_momentum=momentum),
        "reducelronplateau": lambda: sched.ReduceLROnPlateau(optimizer, factor=0.5, patience=0),
        "lambdalr": lambda: sched.LambdaLR(optimizer, lambda epoch: 0.85 ** epoch),
        "multiplicativelr": lambda: sched.MultiplicativeLR(optimizer, lambda epoch: 0.9),
        "constantlr": lambda: sched.ConstantLR(optimizer, factor=0.5, total_iters=2),
        "sequentiallr": lambda: sched.SequentialLR(
            optimizer, [sched.LinearLR(optimizer, start_factor=0.25, total_iters=2),
                        sched.ExponentialLR(optimizer, gamma=0.8)], milestones=[2]),
        "chainedscheduler": lambda: sched.ChainedScheduler(
            [sched.ConstantLR(optimizer, factor=0.5, total_iters=2), sched.ExponentialLR(optimizer, gamma=0.9)]),
        "polynomiallr": lambda: sched.PolynomialLR(optimizer, total_iters=epochs, power=2.0),
        "linearlr": lambda: sched.LinearLR(optimizer, start_factor=0.25, total_iters=3),
    }
    if name not in schedulers:
        raise SystemExit(f"unknown scheduler {name}; one of {', '.join(schedulers)}")
    return schedulers[name]()


class MLP(nn.Module):
    def __init__(self, inputs: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default="steplr")
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw", "adagrad"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--amp", action="store_true", help="autocast + GradScaler")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: off)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps in all")
    parser.add_argument("--train-size", type=int, default=1920)
    parser.add_argument("--valid-size", type=int, default=640)
    return parser.parse_args()


def train_step(model, optimizer, scheduler, scaler, args, x, y) -> torch.Tensor:
    optimizer.zero_grad()
    with torch.autocast("cpu", enabled=args.amp):
        loss = F.cross_entropy(model(x), y)
    if scaler is not None:
        scaler.scale(loss).backward()
        if args.clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
    if args.scheduler in PER_STEP:
        scheduler.step()
    return loss


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(0)
    adl.init_process_group("gloo")
    train_set = SyntheticImages(args.train_size, size=8, noise=2.0, seed=11, split=0)
    valid_set = SyntheticImages(args.valid_size, size=8, noise=2.0, seed=11, split=1)
    train_loader = adl.AdaptiveDataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                          num_workers=2, persistent_workers=True)
    valid_loader = adl.AdaptiveDataLoader(valid_set, batch_size=128, num_workers=2)

    model = MLP()
    optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
    scheduler = make_scheduler(args.scheduler, optimizer, args.epochs, len(train_loader))
    scaler = torch.amp.GradScaler("cpu", enabled=True) if args.amp else None
    model = adl.AdaptiveDataParallel(model, optimizer, scheduler, scaler)
    probe.started({"model": model})

    for epoch in adl.remaining_epochs_until(args.epochs):
        train_stats = adl.Accumulator()
        valid_stats = adl.Accumulator()
        model.train()
        for x, y, index in train_loader:
            if args.max_steps and train_loader.step >= args.max_steps:
                break  # the same step on every replica
            loss = train_step(model, optimizer, scheduler, scaler, args, x, y)
            train_stats["loss_sum"] += loss.item() * len(y)
            train_stats["n"] += len(y)
            probe.step(epoch, "train", train_loader, index)
        model.eval()
        with torch.no_grad():
            for x, y, index in valid_loader:
                logits = model(x)
                valid_stats["loss_sum"] += F.cross_entropy(logits, y, reduction="sum").item()
                valid_stats["correct"] += (logits.argmax(1) == y).sum().item()
                valid_stats["n"] += len(y)
                probe.step(epoch, "valid", valid_loader, index)
        with train_stats.synchronized(), valid_stats.synchronized():
            train_loss = train_stats["loss_sum"] / max(train_stats["n"], 1)
            valid_loss = valid_stats["loss_sum"] / valid_stats["n"]
            accuracy = valid_stats["correct"] / valid_stats["n"]
            probe.totals(epoch, "train", train_stats)
            probe.totals(epoch, "valid", valid_stats)
        if args.scheduler == "reducelronplateau":
            scheduler.step(valid_loss)
        elif args.scheduler not in PER_STEP:
            scheduler.step()
        lr = optimizer.param_groups[0]["lr"]
        if adl.env.rank() == 0:
            logging.info("epoch %d: train loss %.4f, valid loss %.4f, accuracy %.3f, lr %.6g", epoch, train_loss,
                         valid_loss, accuracy, lr)
        probe.epoch_end(epoch, lr=lr)
        probe.pause(epoch, "epoch-end")
        if args.max_steps and train_loader.step >= args.max_steps:
            adl.finish_training()  # checkpointed as finished: a relaunch trains nothing
            break
    probe.done({"train": train_loader, "valid": valid_loader}, {"model": model})


if __name__ == "__main__":
    main()
