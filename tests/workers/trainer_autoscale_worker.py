"""A transformers Trainer script on AdaptiveTrainer with autoscale on, for tests/test_trainer_integration.py.

As ``trainer_worker.py`` (a tiny regression model on generated data, AdamW,
a linear schedule with warm-up), with ``AdaptiveTrainer(...,
max_batch_size=..., local_bsz_bounds=..., gradient_accumulation=True)``:
the loader chooses the micro-batch size and accumulation steps from the
goodput model while the job runs.  Each step sleeps (a fixed cost per
optimizer step, as a large model's communication is), so larger batches
and more micro-batches pay off.

Environment knobs:
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      training samples (default 96)
    WORKER_BATCH        per_device_train_batch_size (default 2)
    WORKER_EPOCHS       num_train_epochs (default 3)
    WORKER_MAX_BATCH    max_batch_size (default 32)
    WORKER_LOCAL_MAX    the upper local_bsz_bounds (default 4)
    WORKER_STEP_SLEEP   seconds each optimizer step sleeps (default 0.05)
    WORKER_SCRIPTED     "4x1,2x3,...": the goodput model's decisions replaced by these (local batch x
                        accumulation steps), one per decision, so that the batch changes whatever the machine
                        measures (default: the goodput model decides)

Every process appends one record per optimizer step to
``steps.rank<R>.jsonl`` (data for the test): the Trainer's ``global_step``,
``epoch`` and ``max_steps``, the world size, the sample indices of each
micro-batch this process trained in the step (and which of them only repeat a
sample to keep the processes in lock-step at an epoch's end), the step the loader planned
(global micro-batch size, micro-batches, fresh samples, planned size), the
scaling rule's gain and LR factor, the scheduler's LR and step count.
Rank 0 rewrites ``progress.rank0.json`` after every step and writes
``done.json`` at the end; every process appends its exit status to
``exits.rank<R>.jsonl``.
"""

import logging
import os
import time

import torch

from adaptive.integrations.transformers import AdaptiveTrainer
from transformers import TrainerCallback, TrainingArguments
from worker_common import TrainerRegressor as Regressor, append_jsonl, run_main, script_decisions, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "96"))
BATCH = int(os.environ.get("WORKER_BATCH", "2"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
MAX_BATCH = int(os.environ.get("WORKER_MAX_BATCH", "32"))
LOCAL_MAX = int(os.environ.get("WORKER_LOCAL_MAX", "4"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.05"))
SCRIPTED = os.environ.get("WORKER_SCRIPTED", "")


def dataset(samples: int) -> list:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.5 * torch.randn(samples, generator=generator)
    return [{"x": x[i], "labels": y[i], "index": torch.tensor(i)} for i in range(samples)]


class Recorder(TrainerCallback):
    """Writes every optimizer step of this process (see the module docstring)."""

    def __init__(self, trainer: AdaptiveTrainer, model: Regressor) -> None:
        self.trainer, self.model = trainer, model

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        loader = self.trainer.get_train_dataloader().loader
        step, rule = loader.current_step, self.trainer.model_wrapped.scaling_rule
        append_jsonl(os.path.join(OUT, f"steps.rank{rank}.jsonl"), {
            "step": state.global_step, "epoch": state.epoch, "max_steps": state.max_steps, "world": world,
            "micro_batches": self.model.seen, "padding": list(step.padding), "micro": step.shape.micro,
            "accum": step.num_micro_steps, "size": step.size, "planned": step.planned_size, "gain": rule.last_gain,
            "factor": rule.last_factor, "lr": lr_scheduler.get_last_lr()[0],
            "scheduler_steps": lr_scheduler.last_epoch, "loader_step": loader.step})
        self.model.seen = []
        if rank == 0:
            write_json(os.path.join(OUT, "progress.rank0.json"), {"pid": os.getpid(), "step": state.global_step,
                                                                   "world": world})
        time.sleep(STEP_SLEEP)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)
    if SCRIPTED:
        script_decisions(SCRIPTED)
    args = TrainingArguments(
        output_dir=os.path.join(OUT, "trainer"), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
        learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=3, logging_steps=4, save_strategy="no",
        report_to=[], disable_tqdm=True, seed=0)
    model = Regressor()
    trainer = AdaptiveTrainer(model=model, args=args, train_dataset=dataset(SAMPLES), max_batch_size=MAX_BATCH,
                              local_bsz_bounds=(1, LOCAL_MAX), gradient_accumulation=True, adapt_every=2)
    trainer.add_callback(Recorder(trainer, model))
    trainer.train()
    if torch.distributed.get_rank() == 0:
        write_json(os.path.join(OUT, "done.json"), {
            "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "world": torch.distributed.get_world_size(), "loader_step": trainer.get_train_dataloader().loader.step,
            "logged_steps": [entry["step"] for entry in trainer.state.log_history if "loss" in entry]})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", "0")))
