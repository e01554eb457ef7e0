"""A token-budget training script for the multi-process tests: it counts every sample and logs every step.

Environment knobs (all optional):
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      dataset size (default 400); sample lengths are seeded, 1..24 tokens
    WORKER_EPOCHS       epochs to train (default 2)
    WORKER_MAX_TOKENS   padded-token budget of a micro-batch (default 64)
    WORKER_SCHEDULE     ramp-up of the global batch in tokens (default "0:96 1500:192 4000:384")
    WORKER_STEP_SLEEP   seconds each step sleeps, to give tests time to act (default 0.02)

Each rank rewrites ``progress.rank<R>.json`` after every optimizer step
(pid, epoch, loader step, consumed tokens, world size).  Rank 0 appends one
line per step to ``steps.jsonl`` (consumed tokens before the step, its real
and padded tokens, planned size, micro-steps and budget), the epoch's
per-sample counts (summed over replicas by an Accumulator) to
``epochs.jsonl`` and, at the end, ``done.json``: the files
``tests/elastic_harness.py`` checks.  The optimizer is SGD with momentum (state
to restore); right after building it and the loader each rank appends its resumed
checkpoint and state digests to ``resume.rank<R>.jsonl``, and on exit its exit
status to ``exits.rank<R>.jsonl`` (see ``worker_common``).
"""

import logging
import os
import time

import numpy as np
import torch

import adaptive
from worker_common import StepCountingLinear, append_jsonl, record_resume, run_main, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "400"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "2"))
MAX_TOKENS = int(os.environ.get("WORKER_MAX_TOKENS", "64"))
SCHEDULE = os.environ.get("WORKER_SCHEDULE", "0:96 1500:192 4000:384")
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.02"))
LENGTHS = np.random.default_rng(0).integers(1, 25, SAMPLES)

logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK', 0)}] %(name)s: %(message)s")


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        length = int(LENGTHS[index])
        return index, torch.randn(length, 2, generator=generator), torch.randn(length, generator=generator)


def pad(batch):
    longest = max(len(y) for _, _, y in batch)
    x, y = torch.zeros(len(batch), longest, 2), torch.zeros(len(batch), longest)
    mask = torch.zeros(len(batch), longest, dtype=torch.bool)
    for row, (_, xs, ys) in enumerate(batch):
        x[row, :len(ys)], y[row, :len(ys)], mask[row, :len(ys)] = xs, ys, True
    return torch.tensor([i for i, _, _ in batch]), x, y, mask


def append(name, record):
    append_jsonl(os.path.join(OUT, name), record)


def main():
    adaptive.init_process_group("gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = StepCountingLinear(2, squeeze=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = adaptive.AdaptiveDataLoader(Tokens(), shuffle=True, seed=7, max_tokens=MAX_TOKENS, lengths=LENGTHS,
                                         window_size=128, batch_size_schedule=SCHEDULE, collate_fn=pad)
    record_resume(OUT, rank, world, model, optimizer, loader)
    counts = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        for index, x, y, mask in loader:
            loss = ((model(x) - y).pow(2) * mask).sum() * loader.loss_weight
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            if loader.is_accumulation_step():
                continue
            model.module.steps += 1
            step = loader.current_step
            if rank == 0:
                append("steps.jsonl", {"epoch": epoch, "step": loader.step, "world": world,
                                       "consumed": loader.consumed, "tokens": step.num_tokens,
                                       "padded": step.padded_tokens, "planned": step.planned_size,
                                       "micro_steps": step.num_micro_steps, "budget": step.shape.micro,
                                       "final": step.position.finished})
            write_json(os.path.join(OUT, f"progress.rank{rank}.json"),
                       {"pid": os.getpid(), "epoch": epoch, "step": loader.step, "world": world,
                        "consumed": loader.consumed})
            time.sleep(STEP_SLEEP)
        with counts.synchronized():
            seen = counts["seen"]
            if rank == 0:
                append("epochs.jsonl", {"epoch": epoch, "world": world, "missing": int((seen == 0).sum()),
                                        "extra": int((seen - 1).clip(min=0).sum()), "step": loader.step,
                                        "model_steps": int(model.module.steps)})
            counts.clear()
    if rank == 0:
        write_json(os.path.join(OUT, "done.json"), {"step": loader.step, "model_steps": int(model.module.steps),
                                                     "world": world, "consumed": loader.consumed})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", 0)))
