"""examples/hf_trainer_clm.py (the run_clm.py port) as it ships, with a recorder, for tests/test_trainer_integration.py.

Runs the example's ``main()`` with its command line (``sys.argv``), its
``AdaptiveTrainer`` replaced by a subclass that records what each
optimizer step trained:

* every process appends one line per optimizer step to
  ``steps.rank<R>.jsonl``: the global step, the epoch, the world size, the
  indices (in the example's training set) of the blocks this process
  trained in the step, and the LR after the step;
* rank 0 rewrites ``progress.rank0.json`` (pid, step) after every step;
* every process appends its exit status to ``exits.rank<R>.jsonl``.

Environment: ``WORKER_OUT`` (required), ``WORKER_STEP_SLEEP`` (seconds
each step sleeps, default 0).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_trainer_clm as clm  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from worker_common import append_jsonl, run_main, write_json  # noqa: E402

OUT = os.environ["WORKER_OUT"]
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0"))


class _Recorder(TrainerCallback):
    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        rank = args.process_index
        append_jsonl(os.path.join(OUT, f"steps.rank{rank}.jsonl"), {
            "step": state.global_step, "epoch": state.epoch, "world": args.world_size,
            "indices": self.trainer.trained, "lr": lr_scheduler.get_last_lr()[0]})
        self.trainer.trained = []
        if rank == 0:
            write_json(os.path.join(OUT, "progress.rank0.json"), {"pid": os.getpid(), "step": state.global_step,
                                                                  "world": args.world_size})
        time.sleep(STEP_SLEEP)


class RecordingTrainer(clm.AdaptiveTrainer):
    """The example's trainer; remembers which training blocks each micro-batch held."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trained: list[int] = []
        self.block_index = {tuple(sample["input_ids"]): i for i, sample in enumerate(self.train_dataset or [])}
        if len(self.block_index) != len(self.train_dataset or []):
            raise RuntimeError("the example's training blocks are not unique: they cannot name the samples")
        self.add_callback(_Recorder(self))

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.trained += [self.block_index[tuple(row)] for row in inputs["input_ids"].tolist()]
        return super().training_step(model, inputs, num_items_in_batch)


if __name__ == "__main__":
    clm.AdaptiveTrainer = RecordingTrainer
    run_main(clm.main, OUT, int(os.environ.get("RANK", "0")))
