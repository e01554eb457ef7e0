"""A transformers Trainer script on AdaptiveTrainer, for tests/test_trainer_integration.py.

Written as a Trainer user writes one (TrainingArguments with a per-device
batch, a linear LR schedule with warm-up, an evaluation set evaluated every
epoch, ``trainer.train()``), with ``AdaptiveTrainer`` for ``Trainer``.  A
tiny regression model returning ``{"loss": ...}`` on generated data.

Environment knobs:
    WORKER_OUT          folder for progress and result files (required)
    WORKER_SAMPLES      training samples (default 48)
    WORKER_BATCH        per_device_train_batch_size (default 3)
    WORKER_ACCUM        gradient_accumulation_steps (default 1)
    WORKER_EPOCHS       num_train_epochs (default 3)
    WORKER_MAX_STEPS    max_steps (default -1: by epochs)
    WORKER_STEP_SLEEP   seconds each step sleeps, to give tests time to act (default 0.1)
    WORKER_SAVE_STEPS   the Trainer's save_steps (default 0: save_strategy="no")
    WORKER_TRAINER_OUT  the Trainer's output_dir (default WORKER_OUT/trainer)
    WORKER_RESUME_FROM  train(resume_from_checkpoint=...) (default: none)
    WORKER_EVAL         1: evaluate every epoch (default), 0: never
    WORKER_INIT_FIRST   1: adaptive.init_process_group() before TrainingArguments (default 0)

Every process appends one line per optimizer step to ``steps.rank<R>.jsonl``:
the Trainer's ``global_step`` and ``epoch``, the world size, the sample
indices this process trained in the step, the scheduler's LR after the step
and the LR the optimizer used.  Every rank rewrites ``progress.rank<R>.json``
after every step, and at the end writes ``done.json`` (global step, epoch,
loader step, world, the model's weights, the evaluations run).  Every
process appends its exit status to ``exits.rank<R>.jsonl``.
"""

import logging
import os
import time

import torch

from adaptive.integrations.transformers import AdaptiveTrainer
from transformers import TrainerCallback, TrainingArguments
from worker_common import append_jsonl, run_main, write_json

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "48"))
BATCH = int(os.environ.get("WORKER_BATCH", "3"))
ACCUM = int(os.environ.get("WORKER_ACCUM", "1"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "3"))
MAX_STEPS = int(os.environ.get("WORKER_MAX_STEPS", "-1"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.1"))
SAVE_STEPS = int(os.environ.get("WORKER_SAVE_STEPS", "0"))
TRAINER_OUT = os.environ.get("WORKER_TRAINER_OUT") or os.path.join(OUT, "trainer")
RESUME_FROM = os.environ.get("WORKER_RESUME_FROM") or None
EVAL = os.environ.get("WORKER_EVAL", "1") == "1"


class Regressor(torch.nn.Module):
    """A linear model with the Trainer's calling convention; remembers the sample indices of its last forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def forward(self, x, labels=None, index=None):
        prediction = self.linear(x).squeeze(-1)
        if torch.is_grad_enabled() and index is not None:
            self.seen = index.tolist()
        loss = torch.nn.functional.mse_loss(prediction, labels)
        return {"loss": loss, "logits": prediction}


def dataset(samples: int, offset: int) -> list:
    """``samples`` dict samples (x, labels, index), the same on every process."""
    generator = torch.Generator().manual_seed(offset)
    x = torch.randn(samples, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(samples, generator=generator)
    return [{"x": x[i], "labels": y[i], "index": torch.tensor(i)} for i in range(samples)]


class Recorder(TrainerCallback):
    """Logs every optimizer step of this process (see the module docstring)."""

    def __init__(self, trainer: AdaptiveTrainer) -> None:
        self.trainer = trainer
        self.rank = trainer.args.process_index
        self.evaluations: list[dict] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        # the processes and this one's rank now (they change under adaptive-run --live)
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        wrapper, loader = self.trainer.model_wrapped, self.trainer.get_train_dataloader().loader
        append_jsonl(os.path.join(OUT, f"steps.rank{self.rank}.jsonl"), {
            "step": state.global_step, "epoch": state.epoch, "world": self.world, "indices": model.seen,
            "lr": lr_scheduler.get_last_lr()[0], "max_steps": state.max_steps,
            # what the library multiplied the scheduler's LR by in this step: its scaling rule, and the step's
            # actual over planned size
            "rule_factor": wrapper.scaling_rule.last_factor, "size_factor": loader.lr_factor})
        write_json(os.path.join(OUT, f"progress.rank{self.rank}.json"), {
            "pid": os.getpid(), "step": state.global_step, "world": self.world})
        time.sleep(STEP_SLEEP)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append({"step": state.global_step, "epoch": state.epoch,
                                 "eval_loss": (metrics or {}).get("eval_loss")})


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if os.environ.get("WORKER_INIT_FIRST") == "1":
        import adaptive

        adaptive.init_process_group("gloo")
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=TRAINER_OUT, per_device_train_batch_size=BATCH, per_device_eval_batch_size=4,
        gradient_accumulation_steps=ACCUM, num_train_epochs=EPOCHS, max_steps=MAX_STEPS, learning_rate=0.05,
        lr_scheduler_type="linear", warmup_steps=3, logging_steps=4, eval_strategy="epoch" if EVAL else "no",
        save_strategy="steps" if SAVE_STEPS else "no", save_steps=SAVE_STEPS or 500,
        report_to=[], disable_tqdm=True, seed=0)
    trainer = AdaptiveTrainer(model=Regressor(), args=args, train_dataset=dataset(SAMPLES, 1),
                              eval_dataset=dataset(10, 2))
    recorder = Recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train(resume_from_checkpoint=RESUME_FROM)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()  # (live: they changed)
    if rank == 0:
        write_json(os.path.join(OUT, "done.json"), {
            "global_step": trainer.state.global_step, "epoch": trainer.state.epoch, "world": world,
            "loader_step": trainer.get_train_dataloader().loader.step, "lr": trainer.lr_scheduler.get_last_lr()[0],
            "weights": [p.detach().reshape(-1).tolist() for p in trainer.model.parameters()],
            "evaluations": recorder.evaluations,
            "logged_steps": [entry["step"] for entry in trainer.state.log_history if "loss" in entry]})


if __name__ == "__main__":
    run_main(main, OUT, int(os.environ.get("RANK", "0")))
