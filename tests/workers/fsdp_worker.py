"""A sharded training script for the multi-process tests: AdaptiveFSDP, Adam, and every sample counted.

Like ``elastic_worker.py`` (same progress, epoch and exit records, so the
same harness checks apply), but the model is a stack of residual MLP blocks
in an ``nn.ModuleList`` sharded by :class:`adaptive.AdaptiveFSDP` and the
optimizer is Adam (its state is sharded too).  Losses are summed and
weighted with ``loader.loss_weight``, so a step's gradient is the mean over
its samples whatever the replicas and micro-steps.

Environment knobs (all optional):
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      dataset size (default 480)
    WORKER_BATCH        global batch size (default 24)
    WORKER_EPOCHS       epochs to train (default 2)
    WORKER_ACCUM        accumulation steps per optimizer step (default 1)
    WORKER_SHARD_SIZE   replicas per shard group: a 2-D (replicate, shard) HSDP mesh (default: 1-D mesh)
    WORKER_STEP_SLEEP   seconds each step sleeps (default 0.03)
    WORKER_META         "1": build the model on the meta device, shard it, then to_empty() and initialise it
                        (the FSDP2 example's idiom); the checkpoint is restored at the first forward

Right after building the model, optimizer and loader each process appends a
resume record (``resume.rank<R>.jsonl``: checkpoint resumed, loader step,
model step counter); rank 0 also writes the full (gathered) model and
optimizer state it starts from to ``full-state-<pid>.pt``, which the tests
compare with the checkpoint's shards.
"""

import logging
import os
import time

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import adaptive
from adaptive.checkpoint.states import resumed_checkpoint
from adaptive.parallel import sharding_mesh
from worker_common import BlockDataset, BlockStack, append_jsonl, run_main, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "480"))
BATCH = int(os.environ.get("WORKER_BATCH", "24"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "2"))
ACCUM = int(os.environ.get("WORKER_ACCUM", "1"))
SHARD_SIZE = os.environ.get("WORKER_SHARD_SIZE")
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.03"))
META = os.environ.get("WORKER_META") == "1"
WIDTH = 12

logging.basicConfig(level=logging.INFO, format=f"[rank {os.environ.get('RANK', 0)}] %(name)s: %(message)s")


def record_resume(rank, world, model, optimizer, loader):
    checkpoint = resumed_checkpoint()
    model_state, optimizer_state = get_state_dict(model.module, optimizer,
                                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state}, os.path.join(OUT, f"full-state-{os.getpid()}.pt"))
    append_jsonl(os.path.join(OUT, f"resume.rank{rank}.jsonl"), {
        "pid": os.getpid(), "time": time.time(), "rank": rank, "world": world,
        "seq": None if checkpoint is None else checkpoint.info.seq, "loader_step": loader.step,
        "model_steps": int(model.module.steps), "mesh": list(model.mesh.shape)})


def main():
    adaptive.init_process_group("gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    if META:  # nothing is allocated until to_empty(); the optimizer's parameters are swapped in place
        with torch.device("meta"):
            model = BlockStack(WIDTH)
    else:
        model = BlockStack(WIDTH)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    mesh = sharding_mesh(int(SHARD_SIZE)) if SHARD_SIZE else None
    model = adaptive.AdaptiveFSDP(model, optimizer, mesh=mesh)
    if META:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.reset_parameters()
        model.module.steps.zero_()
        with torch.no_grad():
            model(torch.zeros(0, 3))  # the first forward: AdaptiveFSDP restores the checkpoint over the init
    loader = adaptive.AdaptiveDataLoader(BlockDataset(SAMPLES), batch_size=BATCH, shuffle=True, seed=7,
                                         accumulation_steps=ACCUM)
    record_resume(rank, world, model, optimizer, loader)
    counts = adaptive.Accumulator()
    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        for x, y, index in loader:
            loss = (model(x) - y).pow(2).sum() * loader.loss_weight
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            if not loader.is_accumulation_step():
                model.module.steps += 1
                write_json(os.path.join(OUT, f"progress.rank{rank}.json"),
                           {"pid": os.getpid(), "epoch": epoch, "step": loader.step, "world": world})
            time.sleep(STEP_SLEEP)
        with counts.synchronized():
            seen = counts["seen"]
            if rank == 0:
                append_jsonl(os.path.join(OUT, "epochs.jsonl"), {
                    "epoch": epoch, "world": world, "missing": int((seen == 0).sum()),
                    "extra": int((seen - 1).clip(min=0).sum()), "step": loader.step,
                    "model_steps": int(model.module.steps)})
            counts.clear()
    if rank == 0:
        write_json(os.path.join(OUT, "done.json"), {"step": loader.step, "model_steps": int(model.module.steps),
                                                     "world": world})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", 0)))
