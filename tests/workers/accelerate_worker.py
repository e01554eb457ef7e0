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
    WORKER_SLEEP_UNTIL  a path: the steps sleep only until that file exists (a test slows the job down while it
                        acts on it, then lets it run at full speed)
    WORKER_ACCUMULATION gradient_accumulation_steps of the AdaptiveAccelerator (default 1)
    WORKER_LOADER_WORKERS DataLoader workers of both loaders (persistent; default 0: none)
    WORKER_DTYPE        dtype of the model and data: float32 (default) or float64 (exact comparisons)
    WORKER_MAX_STEPS    stop after this many optimizer steps, counted from accelerator.completed_steps as
                        transformers' *_no_trainer scripts count --max_train_steps (default 0: no limit)
    WORKER_SAVE_EVERY   accelerator.save_state(WORKER_OUT/saved) every this many steps (default 0: never)
    WORKER_LOAD_FROM    accelerator.load_state(this folder) after prepare, as --resume_from_checkpoint does
    WORKER_AUTOSCALE    "MAX,LO,HI": train_loader.autoscale_batch_size(MAX, local_bsz_bounds=(LO, HI),
                        gradient_accumulation=True, adapt_every=2) on the prepared loader (default: off)
    WORKER_SCRIPTED     with WORKER_AUTOSCALE, "4x1,2x3,...": the goodput model's decisions replaced by these
                        (local batch x accumulation steps), one per decision (default: the model decides)

Every rank rewrites ``progress.rank<R>.json`` after every step (pid, epoch,
loader step, world); rank 0 appends each step's planned global batch and actual size to
``steps.jsonl``; at the end of each epoch it appends to ``epochs.jsonl`` the
training samples missed and repeated (per-sample counts summed over the
processes by an Accumulator) and the evaluation indices that
``gather_for_metrics`` returned; at the end ``done.json`` (loader steps, the
accelerator's step and sample counters, the scheduler's step count, world,
the final weights).  Every process appends its exit status to
``exits.rank<R>.jsonl``.
"""

import logging
import os
import time

import numpy as np
import torch

import adaptive
from adaptive.integrations.accelerate import AdaptiveAccelerator
from adaptive.runtime import membership
from worker_common import append_jsonl, regression_dataset, run_main, script_decisions, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "96"))
EVAL = int(os.environ.get("WORKER_EVAL", "10"))
BATCH = int(os.environ.get("WORKER_BATCH", "4"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.1"))
LOADER_WORKERS = int(os.environ.get("WORKER_LOADER_WORKERS", "0"))
SLEEP_UNTIL = os.environ.get("WORKER_SLEEP_UNTIL")
ACCUMULATION = int(os.environ.get("WORKER_ACCUMULATION", "1"))
DTYPE = getattr(torch, os.environ.get("WORKER_DTYPE", "float32"))
MAX_STEPS = int(os.environ.get("WORKER_MAX_STEPS", "0"))
SAVE_EVERY = int(os.environ.get("WORKER_SAVE_EVERY", "0"))
LOAD_FROM = os.environ.get("WORKER_LOAD_FROM")
AUTOSCALE = os.environ.get("WORKER_AUTOSCALE", "")
SCRIPTED = os.environ.get("WORKER_SCRIPTED", "")


def dataset(samples: int, offset: int) -> torch.utils.data.TensorDataset:
    return regression_dataset(samples, offset, DTYPE)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    accelerator = AdaptiveAccelerator(gradient_accumulation_steps=ACCUMULATION)
    model = torch.nn.Linear(4, 1).to(DTYPE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    workers = {"num_workers": LOADER_WORKERS, "persistent_workers": True} if LOADER_WORKERS else {}
    with accelerator.main_process_first():  # (transformers' scripts map their datasets here: a barrier on each side)
        train_set, eval_set = dataset(SAMPLES, 1), dataset(EVAL, 2)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH, shuffle=True, **workers)
    eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=2, **workers)
    model, optimizer, train_loader, eval_loader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, lr_scheduler)
    if AUTOSCALE:
        largest, lo, hi = (int(n) for n in AUTOSCALE.split(","))
        if SCRIPTED:
            script_decisions(SCRIPTED)
        train_loader.autoscale_batch_size(largest, local_bsz_bounds=(lo, hi), gradient_accumulation=True,
                                          adapt_every=2)
    counts = adaptive.Accumulator()
    if LOAD_FROM:
        accelerator.load_state(LOAD_FROM)
    completed_steps = accelerator.completed_steps  # was 0, or the step parsed from a checkpoint's folder name

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
            if accelerator.sync_gradients:
                if membership.is_live():  # a joiner counted nothing before it was admitted: read the job's count
                    completed_steps = accelerator.completed_steps
                else:  # as transformers' scripts count, which the accelerator's count must match
                    completed_steps += 1
                    assert completed_steps == accelerator.completed_steps, (completed_steps,
                                                                            accelerator.completed_steps)
                if SAVE_EVERY and completed_steps % SAVE_EVERY == 0:
                    accelerator.save_state(os.path.join(OUT, "saved"))
            rank, world = accelerator.process_index, accelerator.num_processes  # (a live job's change them)
            if rank == 0:
                step = train_loader.current_step
                append_jsonl(os.path.join(OUT, "steps.jsonl"), {
                    "step": train_loader.step, "world": world, "planned": step.planned_size, "size": step.size,
                    "batch_size": train_loader.batch_size, "sync": accelerator.sync_gradients, "local": len(index),
                    "accumulation": accelerator.gradient_accumulation_steps, "micro_step": train_loader.micro_step,
                    "rule_factor": model.scaling_rule.last_factor, "gain": model.scaling_rule.last_gain,
                    "lr": optimizer.param_groups[0]["lr"],
                    "completed": completed_steps, "samples": accelerator.samples_seen})
            write_json(os.path.join(OUT, f"progress.rank{rank}.json"), {
                "pid": os.getpid(), "epoch": epoch, "step": train_loader.step, "world": world,
                "generation": membership.generation_number()})
            if not (SLEEP_UNTIL and os.path.exists(SLEEP_UNTIL)):
                time.sleep(STEP_SLEEP)
            if MAX_STEPS and completed_steps >= MAX_STEPS:
                adaptive.finish_training()  # a relaunch trains nothing more
                break
        model.eval()
        gathered = []
        with torch.no_grad():
            for x, y, index in eval_loader:
                model(x)
                gathered.append(accelerator.gather_for_metrics(index))
        with counts.synchronized():
            seen = counts["seen"]
            rank, world = accelerator.process_index, accelerator.num_processes
            if rank == 0:
                append_jsonl(os.path.join(OUT, "epochs.jsonl"), {
                    "epoch": epoch, "world": world, "missing": int((seen == 0).sum()),
                    "extra": int((seen - 1).clip(min=0).sum()), "eval": torch.cat(gathered).tolist() if gathered else []})
            counts.clear()
    rank, world = accelerator.process_index, accelerator.num_processes
    if rank == 0:
        write_json(os.path.join(OUT, "done.json"), {
            "step": train_loader.step, "world": world, "scheduler_steps": lr_scheduler.scheduler.last_epoch,
            "completed_steps": accelerator.completed_steps, "samples_seen": accelerator.samples_seen,
            "weights": [value for tensor in model.module.state_dict().values() for value in tensor.flatten().tolist()]})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", "0")))
