"""A training script for the live-membership tests: it logs every step it trains, per process.

Environment knobs (all optional but WORKER_OUT):
    WORKER_OUT          folder for the logs (required)
    WORKER_SAMPLES      dataset size (default 480)
    WORKER_BATCH        global batch size (default 24)
    WORKER_EPOCHS       epochs to train (default 3)
    WORKER_STEP_SLEEP   seconds each step sleeps, to give tests time to act (default 0.05)
    WORKER_LOADER_WORKERS  DataLoader worker processes per rank (default 0)
    WORKER_AUTOSCALE    "max_batch,lo,hi,accumulation(0/1),adapt_every" turns on autoscale
    WORKER_RAMPUP       a ramp-up of the global batch in consumed samples ("0:8 300:16 900:24"): the loader's
                        ``batch_size_schedule``
    WORKER_TOKENS       "max_tokens,accumulation_steps": a token budget per replica's micro-batch instead of a
                        global batch of samples; sample ``i`` counts ``1 + i % 5`` tokens
    WORKER_EVAL         "1": the usual extras of a script: rank 0 prepares the data while the others wait
                        in a barrier, and every epoch a validation loop counts its samples in an
                        Accumulator created in that epoch (rank 0 appends them to ``val.jsonl``)
    WORKER_TRANSFER_LOG "1": rank 0 and the joiners append to ``transfer.jsonl`` when they enter and leave
                        their part of a hand-over of the training state (role send or receive; phase start,
                        end or failed), so that a test can act while the state is being handed over
    WORKER_SLOW_JOIN    seconds a joiner's first process (not one its launcher started again) waits before it
                        receives the training state: its peers wait in the hand-over meanwhile
    WORKER_DIE_BEFORE_EPOCH  "E:R": the first process of its launcher that is rank R of 2 or more SIGKILLs
                        itself as epoch E's loader loop is about to start (its peers are then at that loop's
                        first boundary); it appends its PID and the time to ``died.jsonl`` first
    WORKER_ORDER        "loaders-first": build the loaders and the accumulator before the model wrapper (as
                        pytorch/examples' mnist builds its DataLoaders before its model); default: the wrapper first
    WORKER_DIE_WHILE_REFORMING "1": the first process of its launcher SIGKILLs itself once it re-formed after
                        a lost member (it said it lives and built the new group with the others) and before it
                        meets them on that group; "before-group": once the members that are left agreed on the
                        new generation with it, before they build its group; it appends its PID and the time
                        to ``died.jsonl`` first

Each process appends to ``steps.<pid>.jsonl`` one line per optimizer step it
trained: its rank, the world size and the live generation then, the epoch,
the loader's step, the sample indices of its micro-batches, and a digest of
the model and optimizer state *before* the step (every member of a step
must hold the same), a number it drew from torch's global generator as it
began (as a dropout mask would), written before the update, and then a line
``{"ended": true, "discarded": ...}`` once the step ended: whether it was
discarded (a member was lost before every member applied it: it is trained
again after the members re-form).  Rank 0 appends each epoch's per-sample counts (summed
over the replicas by an Accumulator) to ``epochs.jsonl``, and at the end
writes ``done.json``.  Each process appends its pid and exit status to
``exits.jsonl``.
"""

import faulthandler
import logging
import math
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import adaptive
from adaptive.runtime import membership
from adaptive.runtime import step as step_records
from worker_common import StepCountingLinear, append_jsonl, record_done, record_epoch, state_digest, validate

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "480"))
BATCH = int(os.environ.get("WORKER_BATCH", "24"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.05"))
LOADER_WORKERS = int(os.environ.get("WORKER_LOADER_WORKERS", "0"))
AUTOSCALE = os.environ.get("WORKER_AUTOSCALE")
RAMPUP = os.environ.get("WORKER_RAMPUP")
TOKENS = os.environ.get("WORKER_TOKENS")
EVAL = os.environ.get("WORKER_EVAL") == "1"
TRANSFER_LOG = os.environ.get("WORKER_TRANSFER_LOG") == "1"
SLOW_JOIN = float(os.environ.get("WORKER_SLOW_JOIN", "0"))
DIE_BEFORE_EPOCH = os.environ.get("WORKER_DIE_BEFORE_EPOCH")
DIE_WHILE_REFORMING = os.environ.get("WORKER_DIE_WHILE_REFORMING", "")
LOADERS_FIRST = os.environ.get("WORKER_ORDER", "model-first") == "loaders-first"

logging.basicConfig(level=logging.INFO, format=f"[pid {os.getpid()}] %(name)s: %(message)s")
faulthandler.enable()  # a crash (say, at interpreter teardown) leaves every thread's Python stack in the log
faulthandler.register(signal.SIGUSR1)  # a test (or a person) can ask for every thread's stack
logging.getLogger("adaptive.runtime.peer_failure").setLevel(logging.DEBUG)


class IndexDataset(torch.utils.data.Dataset):
    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        x = index / SAMPLES
        noise = math.sin(index * 12.9898) * 43758.5453 % 1.0 - 0.5
        return torch.tensor([x, x * x]), torch.tensor([2 * x + noise]), index


def log_transfers():
    """Wrap the library's hand-over of the state to joiners (``peer_state._transfer``) to log it (and slow a
    joiner's first process down, WORKER_SLOW_JOIN)."""
    from adaptive.checkpoint import peer_state

    transfer = peer_state._transfer
    path = os.path.join(OUT, "transfer.jsonl")

    def logged(tensor):
        role = "send" if tensor is not None else "receive"
        record = {"pid": os.getpid(), "role": role, "generation": membership.generation_number()}
        append_jsonl(path, dict(record, phase="start", time=time.time()))
        if role == "receive" and SLOW_JOIN and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            time.sleep(SLOW_JOIN)
        try:
            out = transfer(tensor)
        except BaseException:
            append_jsonl(path, dict(record, phase="failed", time=time.time()))
            raise
        append_jsonl(path, dict(record, phase="end", time=time.time()))
        return out

    peer_state._transfer = logged


def die_before_loop(epoch):
    """WORKER_DIE_BEFORE_EPOCH: this process dies (SIGKILL) as the epoch's loader loop is about to start."""
    if not DIE_BEFORE_EPOCH or os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        return
    at_epoch, rank = (int(v) for v in DIE_BEFORE_EPOCH.split(":"))
    if epoch == at_epoch and dist.get_rank() == rank and dist.get_world_size() > 1:
        append_jsonl(os.path.join(OUT, "died.jsonl"), {"pid": os.getpid(), "time": time.time(), "epoch": epoch})
        os.kill(os.getpid(), signal.SIGKILL)


def die_while_reforming():
    """WORKER_DIE_WHILE_REFORMING: this process dies (SIGKILL) right after its first re-forming's new group
    ("1"), or right after the members that are left agreed on it, before its group is built ("before-group")."""
    from adaptive.runtime import collectives, reforming

    def die(following):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            append_jsonl(os.path.join(OUT, "died.jsonl"), {"pid": os.getpid(), "time": time.time(),
                                                           "generation": following.number})
            os.kill(os.getpid(), signal.SIGKILL)

    if DIE_WHILE_REFORMING == "before-group":
        reform_after_loss = reforming.reform_after_loss

        def agreeing(*args, **kwargs):
            following = reform_after_loss(*args, **kwargs)
            if following is not None:
                die(following)
            return following

        reforming.reform_after_loss = agreeing
        return
    regroup = collectives.regroup

    def dying(following, *, broken=False):
        regroup(following, broken=broken)
        if broken:
            die(following)

    collectives.regroup = dying


def build_model():
    model = StepCountingLinear(2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    return adaptive.AdaptiveDataParallel(model, optimizer, scheduler), optimizer, scheduler


def build_loaders():
    if TOKENS:
        max_tokens, accumulation = (int(v) for v in TOKENS.split(","))
        sizing = {"max_tokens": max_tokens, "accumulation_steps": accumulation,
                  "lengths": [1 + i % 5 for i in range(SAMPLES)]}
    else:
        sizing = {"batch_size": None if RAMPUP else BATCH, "batch_size_schedule": RAMPUP}
    loader = adaptive.AdaptiveDataLoader(IndexDataset(), shuffle=True, seed=7, num_workers=LOADER_WORKERS,
                                         persistent_workers=LOADER_WORKERS > 0, **sizing)
    if AUTOSCALE:
        max_batch, lo, hi, accumulation, every = (int(v) for v in AUTOSCALE.split(","))
        loader.autoscale_batch_size(max_batch, (lo, hi), gradient_accumulation=bool(accumulation),
                                    adapt_every=every)
    val_loader = adaptive.AdaptiveDataLoader(IndexDataset(), batch_size=BATCH, name="val") if EVAL else None
    return loader, val_loader, adaptive.Accumulator()


def main():
    if TRANSFER_LOG or SLOW_JOIN:
        log_transfers()
    if DIE_WHILE_REFORMING:
        die_while_reforming()
    adaptive.init_process_group("gloo")
    if EVAL and dist.get_rank() != 0:
        dist.barrier()  # rank 0 prepares the data first
    if EVAL and dist.get_rank() == 0:
        dist.barrier()
    if LOADERS_FIRST:
        loader, val_loader, counts = build_loaders()
        model, optimizer, scheduler = build_model()
    else:
        model, optimizer, scheduler = build_model()
        loader, val_loader, counts = build_loaders()
    log = os.path.join(OUT, f"steps.{os.getpid()}.jsonl")
    indices, digest, draw = [], None, None
    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        die_before_loop(epoch)
        for x, y, index in loader:
            if digest is None:  # the state this step starts from (before its first micro-batch)
                digest = state_digest({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                       "scheduler": scheduler.state_dict()})
                draw = torch.rand(()).item()  # a number the step draws (a dropout mask, say), from the global RNG
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            indices.extend(index.tolist())
            ends_step = not loader.is_accumulation_step()
            if ends_step:  # recorded before the update: a worker killed right after it still tells what it trained
                append_jsonl(log, {"pid": os.getpid(), "time": time.time(), "rank": dist.get_rank(),
                                   "world": dist.get_world_size(), "generation": membership.generation_number(),
                                   "epoch": epoch, "step": loader.step, "indices": indices, "digest": digest,
                                   "draw": draw})
            optimizer.step()
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            if ends_step:
                discarded = step_records.discarded()
                if not discarded:  # a discarded step is trained again: counted then (the buffer is not rolled back)
                    model.module.steps += 1
                scheduler.step()
                append_jsonl(log, {"pid": os.getpid(), "ended": True, "discarded": discarded})
                indices, digest, draw = [], None, None
            time.sleep(STEP_SLEEP)
        if val_loader is not None:
            validate(OUT, val_loader, epoch, SAMPLES)
        record_epoch(OUT, epoch, counts, loader, int(model.module.steps))
    record_done(OUT, loader, int(model.module.steps))


if __name__ == "__main__":
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise
    except BaseException:
        code = 1
        raise
    finally:
        append_jsonl(os.path.join(OUT, "exits.jsonl"), {"pid": os.getpid(), "time": time.time(), "code": code})
        sys.stdout.flush()
