"""A sharded training script for the live-membership tests: AdaptiveFSDP under ``adaptive-run --live``.

Environment knobs (all optional but WORKER_OUT):
    WORKER_OUT          folder for the logs (required)
    WORKER_SAMPLES      dataset size (default 480)
    WORKER_BATCH        global batch size (default 24)
    WORKER_EPOCHS       epochs to train (default 2)
    WORKER_SHARD_SIZE   replicas per shard group: a 2-D (replicate, shard) HSDP mesh (default: 1-D mesh)
    WORKER_STEP_SLEEP   seconds each step sleeps, to give tests time to act (default 0.05)
    WORKER_LOADER_WORKERS  DataLoader worker processes per rank, persistent (default 0)
    WORKER_EVAL         "1": rank 0 prepares the data first behind a barrier, and a validation loop with an
                        Accumulator created in the epoch runs after each epoch's training (rank 0 appends
                        its per-sample counts to ``val.jsonl``)
    WORKER_ORDER        "loaders-first": build the loaders and the accumulator before the sharded model
                        (default: the model first)

Each process appends to ``steps.<pid>.jsonl`` one line per optimizer step:
its rank, the world size, the mesh shape and the live generation then, the
epoch, the loader's step, its sample indices, digests of the whole
(gathered) model and optimizer state before and after the step, a number
drawn from torch's global generator as the step began, and whether
the step was discarded (a member was lost during it).  A
membership change that keeps the state exact shows as a step whose
"before" digest equals the "after" digest of the step before it, across
generations.  Rank 0 appends each epoch's per-sample counts to
``epochs.jsonl`` and writes ``done.json`` at the end; each process appends
its pid and exit status to ``exits.jsonl``.
"""

import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

import adaptive
from adaptive.parallel import sharding_mesh
from adaptive.runtime import membership
from adaptive.runtime import step as step_records
from worker_common import (BlockDataset, BlockStack, append_jsonl, record_done, record_epoch, run_main, state_digest,
                           validate)

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "480"))
BATCH = int(os.environ.get("WORKER_BATCH", "24"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "2"))
SHARD_SIZE = os.environ.get("WORKER_SHARD_SIZE")
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.05"))
LOADER_WORKERS = int(os.environ.get("WORKER_LOADER_WORKERS", "0"))
EVAL = os.environ.get("WORKER_EVAL") == "1"
WIDTH = 13  # not a multiple of the replica counts: the shards are uneven

logging.basicConfig(level=logging.INFO, format=f"[pid {os.getpid()}] %(name)s: %(message)s")


def full_digest(model, optimizer, scheduler):
    """A digest of the whole model, optimizer and LR scheduler state (collective: the shards are gathered)."""
    options = StateDictOptions(full_state_dict=True)
    if optimizer.state:
        model_state, optimizer_state = get_state_dict(model.module, optimizer, options=options)
    else:  # before the first step (get_state_dict would create the optimizer's state)
        model_state, optimizer_state = get_model_state_dict(model.module, options=options), {}
    return state_digest({"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict()})


def build_model():
    torch.manual_seed(0)
    model = BlockStack(WIDTH)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    mesh = sharding_mesh(int(SHARD_SIZE)) if SHARD_SIZE else None
    return adaptive.AdaptiveFSDP(model, optimizer, scheduler, mesh=mesh), optimizer, scheduler


def build_loaders():
    loader = adaptive.AdaptiveDataLoader(BlockDataset(SAMPLES), batch_size=BATCH, shuffle=True, seed=7,
                                         num_workers=LOADER_WORKERS, persistent_workers=LOADER_WORKERS > 0)
    val_loader = adaptive.AdaptiveDataLoader(BlockDataset(SAMPLES), batch_size=BATCH, name="val") if EVAL else None
    return loader, val_loader, adaptive.Accumulator()


def main():
    adaptive.init_process_group("gloo")
    if EVAL and dist.get_rank() != 0:
        dist.barrier()  # rank 0 prepares the data first
    if EVAL and dist.get_rank() == 0:
        dist.barrier()
    if os.environ.get("WORKER_ORDER") == "loaders-first":
        loader, val_loader, counts = build_loaders()
        model, optimizer, scheduler = build_model()
    else:
        model, optimizer, scheduler = build_model()
        loader, val_loader, counts = build_loaders()
    log = os.path.join(OUT, f"steps.{os.getpid()}.jsonl")
    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        for x, y, index in loader:
            before = full_digest(model, optimizer, scheduler)
            draw = torch.rand(()).item()  # a number the step draws (a dropout mask, say), from the global RNG
            loss = (model(x) - y).pow(2).sum() * loader.loss_weight
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if not step_records.discarded():  # a discarded step is trained again: counted then (a buffer of
                model.module.steps += 1        # the model, which a loss does not roll back)
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            after = full_digest(model, optimizer, scheduler)  # (a gather: a member lost in it leaves it partial)
            append_jsonl(log, {"pid": os.getpid(), "time": time.time(), "rank": dist.get_rank(),
                               "world": dist.get_world_size(), "mesh": list(model.mesh.shape),
                               "generation": membership.generation_number(), "epoch": epoch, "step": loader.step,
                               "indices": index.tolist(), "before": before,
                               "after": None if step_records.faulted() else after,
                               "discarded": step_records.discarded(), "draw": draw})
            time.sleep(STEP_SLEEP)
        if val_loader is not None:
            validate(OUT, val_loader, epoch, SAMPLES, model)
        record_epoch(OUT, epoch, counts, loader, int(model.module.steps))
    record_done(OUT, loader, int(model.module.steps))


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", 0)), log_name="exits.jsonl")  # ranks change in live mode
