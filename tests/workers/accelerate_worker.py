"""An Accelerate training script on AdaptiveAccelerator, for tests/test_accelerate_integration.py.

Written as an Accelerate user writes one (a per-process ``batch_size`` in
the DataLoaders, ``prepare``, ``accumulate``, ``backward``, an LR scheduler
stepped every step, ``gather_for_metrics`` in the evaluation loop), with
``adaptive.remaining_epochs_until`` as the epoch loop.  A tiny linear model
on generated data.

Environment knobs:
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      training samples (default 96)
    WORKER_EVAL         evaluation samples (default 10)
    WORKER_BATCH        DataLoader batch_size, per process (default 4)
    WORKER_EPOCHS       epochs (default 3)
    WORKER_STEP_SLEEP   seconds each step sleeps, to give tests time to act (default 0.1)

Rank 0 rewrites ``progress.rank0.json`` after every step (pid, epoch, loader
step, world) and appends each step's planned global batch and actual size to
``steps.jsonl``; at the end of each epoch it appends to ``epochs.jsonl`` the
training samples missed and repeated (per-sample counts summed over the
processes by an Accumulator) and the evaluation indices that
``gather_for_metrics`` returned; at the end ``done.json`` (loader steps, the
scheduler's step count, world).  Every process appends its exit status to
``exits.rank<R>.jsonl``.
"""

import logging
import os
import time

import numpy as np
import torch

import adaptive
from adaptive.integrations.accelerate import AdaptiveAccelerator
from worker_common import append_jsonl, run_main, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "96"))
EVAL = int(os.environ.get("WORKER_EVAL", "10"))
BATCH = int(os.environ.get("WORKER_BATCH", "4"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.1"))


def dataset(samples: int, offset: int) -> torch.utils.data.TensorDataset:
    """``samples`` regression samples ``(x, y, index)``, the same on every process."""
    generator = torch.Generator().manual_seed(offset)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(samples, generator=generator)
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1), torch.arange(samples))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    accelerator = AdaptiveAccelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    train_loader = torch.utils.data.DataLoader(dataset(SAMPLES, 1), batch_size=BATCH, shuffle=True)
    eval_loader = torch.utils.data.DataLoader(dataset(EVAL, 2), batch_size=2)
    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler)
    counts = adaptive.Accumulator()

    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        model.train()
        for x, y, index in train_loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            if rank == 0:
                step = train_loader.current_step
                append_jsonl(os.path.join(OUT, "steps.jsonl"), {
                    "step": train_loader.step, "world": world, "planned": step.planned_size, "size": step.size,
                    "batch_size": train_loader.batch_size, "sync": accelerator.sync_gradients})
                write_json(os.path.join(OUT, "progress.rank0.json"), {
                    "pid": os.getpid(), "epoch": epoch, "step": train_loader.step, "world": world})
            time.sleep(STEP_SLEEP)
        model.eval()
        gathered = []
        with torch.no_grad():
            for x, y, index in eval_loader:
                model(x)
                gathered.append(accelerator.gather_for_metrics(index))
        with counts.synchronized():
            seen = counts["seen"]
            if rank == 0:
                append_jsonl(os.path.join(OUT, "epochs.jsonl"), {
                    "epoch": epoch, "world": world, "missing": int((seen == 0).sum()),
                    "extra": int((seen - 1).clip(min=0).sum()), "eval": torch.cat(gathered).tolist()})
            counts.clear()
    if rank == 0:
        write_json(os.path.join(OUT, "done.json"), {"step": train_loader.step, "world": world,
                                                    "scheduler_steps": lr_scheduler.scheduler.last_epoch})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", "0")))
