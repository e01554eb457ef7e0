"""A training script for the multi-process tests: it counts every sample it sees.

Environment knobs (all optional):
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      dataset size (default 600)
    WORKER_BATCH        global batch size (default 24)
    WORKER_EPOCHS       epochs to train (default 3)
    WORKER_STEP_SLEEP   seconds each step sleeps, to give tests time to act (default 0.05)
    WORKER_AUTOSCALE    "max_batch,lo,hi,accumulation(0/1),adapt_every" turns on autoscale
    WORKER_LOADER_WORKERS  DataLoader worker processes per rank (default 0)
    WORKER_GATE         a path: from epoch WORKER_GATE_EPOCH (default 0) on, each step waits until it
                        exists (or a stop is requested), so a test can order two jobs' progress

Each rank rewrites ``progress.rank<R>.json`` after every step (pid, epoch,
loader step, world size) so tests know when and whom to kill.  At the end of
each epoch rank 0 appends the epoch's per-sample counts, summed over all
replicas by an Accumulator, to ``epochs.jsonl``; at the end ``done.json``.
Right after building the model (SGD with momentum, so the optimizer has state
to restore) and the loader, each rank appends to ``resume.rank<R>.jsonl`` the
checkpoint it resumed and digests of the model and optimizer state it holds;
on exit, its exit status to ``exits.rank<R>.jsonl`` (see ``worker_common``).
"""

import logging
import math
import os
import time

import numpy as np
import torch

import adaptive
from worker_common import StepCountingLinear, append_jsonl, record_resume, run_main, wait_for_gate, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "600"))
BATCH = int(os.environ.get("WORKER_BATCH", "24"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.05"))
AUTOSCALE = os.environ.get("WORKER_AUTOSCALE")
GATE = os.environ.get("WORKER_GATE")
LOADER_WORKERS = int(os.environ.get("WORKER_LOADER_WORKERS", "0"))
GATE_EPOCH = int(os.environ.get("WORKER_GATE_EPOCH", "0"))

logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK', 0)}] %(name)s: %(message)s")


class IndexDataset(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        x = index / SAMPLES
        noise = math.sin(index * 12.9898) * 43758.5453 % 1.0 - 0.5  # fixed per sample
        return torch.tensor([x]), torch.tensor([2 * x + noise]), index


def main():
    adaptive.init_process_group("gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = StepCountingLinear(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = adaptive.AdaptiveDataLoader(IndexDataset(), batch_size=BATCH, shuffle=True, seed=7,
                                         num_workers=LOADER_WORKERS, persistent_workers=LOADER_WORKERS > 0)
    record_resume(OUT, rank, world, model, optimizer, loader)
    if AUTOSCALE:
        max_batch, lo, hi, accumulation, every = (int(v) for v in AUTOSCALE.split(","))
        loader.autoscale_batch_size(max_batch, (lo, hi), gradient_accumulation=bool(accumulation),
                                    adapt_every=every)
    counts = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        for x, y, index in loader:
            if GATE and epoch >= GATE_EPOCH:
                wait_for_gate(GATE, "the gate")
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if not loader.is_accumulation_step():
                model.module.steps += 1
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            if not loader.is_accumulation_step():
                write_json(os.path.join(OUT, f"progress.rank{rank}.json"),
                           {"pid": os.getpid(), "epoch": epoch, "step": loader.step, "world": world})
                if rank == 0:
                    append_jsonl(os.path.join(OUT, "batches.jsonl"), {"epoch": epoch, "step": loader.step,
                                                                      "world": world, "batch_size": loader.batch_size})
            time.sleep(STEP_SLEEP)
        with counts.synchronized():
            seen = counts["seen"]
            if rank == 0:
                record = {"epoch": epoch, "world": world, "missing": int((seen == 0).sum()),
                          "extra": int((seen - 1).clip(min=0).sum()), "step": loader.step,
                          "model_steps": int(model.module.steps)}
                append_jsonl(os.path.join(OUT, "epochs.jsonl"), record)
            counts.clear()
    if rank == 0:
        write_json(os.path.join(OUT, "done.json"), {"step": loader.step, "model_steps": int(model.module.steps),
                                                     "world": world})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", 0)))
