"""Step time of a small transformer under AdaptiveTrainer against plain ``transformers.Trainer``.

Two gloo processes train the same small causal transformer (see
``_transformer.py``, wrapped to return ``{"loss": ...}`` as a transformers
model does) at the same global batch, once with ``transformers.Trainer``
(Accelerate's DDP and sharded DataLoader) and once with
``AdaptiveTrainer`` (AdaptiveDataParallel with the gradient-noise
measurement, AdaptiveDataLoader, the library's step commit), both with
``use_cpu=True`` on the job's gloo group, in the same processes.

``AdaptiveTrainer.train()`` runs once per process, so the two alternate
this way: the adaptive trainer trains every block of its steps in one
``train()``, and at each block boundary its callback runs a block of the
plain trainer (a ``train()`` of ``--steps`` steps) before it goes on; a
pair is a block of ours and the plain block right after it.  Launches
alternate which trainer is built first.  A step's time is the time
between two ``on_step_end`` events (data, forward, backward, optimizer,
scheduler, the Trainer's own bookkeeping); the first step of each block is
left out.  The result is the median over all block pairs of
(ours median step time / plain median step time), as in bench_overhead.py.

    python benchmarks/bench_trainer.py [--quick] [--launches N] [--json PATH]

Needs the ``huggingface`` extra (transformers, accelerate).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _front_end  # noqa: E402
import _paired  # noqa: E402
import _transformer  # noqa: E402


class _LanguageModel(torch.nn.Module):
    """The benchmark transformer with a transformers model's calling convention."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _transformer.Transformer(dim=args.dim, layers=args.layers, heads=4, max_len=args.length)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": _transformer.loss(self.inner, input_ids)}


def _arguments(out: str, name: str, args: argparse.Namespace, max_steps: int) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(Path(out, name)), per_device_train_batch_size=args.batch // 2, max_steps=max_steps,
        learning_rate=1e-4, lr_scheduler_type="constant", save_strategy="no", logging_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False, seed=0,
        ddp_find_unused_parameters=False)  # (the Trainer's default, True, costs the plain DDP a graph traversal)


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    _paired.join_worker_job(rank, port, out)
    logging.disable(logging.WARNING)  # the Trainers' per-train() info and warnings
    import transformers

    from adaptive.integrations.transformers import AdaptiveTrainer

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _transformer.VOCAB, (4096, args.length + 1), generator=generator)
    data = [{"input_ids": row} for row in ids]
    results: dict[str, list[list[float]]] = {"plain": [], "ours": []}

    class Clock(transformers.TrainerCallback):
        """Times a trainer's steps (``on_step_end`` to ``on_step_end``) into blocks of ``args.steps``."""

        def __init__(self, name: str) -> None:
            self.name, self.last, self.block = name, 0.0, []

        def start(self) -> None:
            self.last, self.block = time.perf_counter(), []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.start()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            now = time.perf_counter()
            self.block.append(now - self.last)
            self.last = now
            if len(self.block) == args.steps:
                results[self.name].append(self.block[1:])  # the block's first step is left out
                self.block = []
                if self.name == "ours":
                    run_plain_block()
                    self.start()

    plain_clock, ours_clock = Clock("plain"), Clock("ours")
    steps = args.steps * (args.blocks + 1)  # (the first block of ours is a warm-up)
    built = {}
    for name in (("ours", "plain") if args.ours_first else ("plain", "ours")):
        model = _LanguageModel(args)
        if name == "plain":
            built[name] = transformers.Trainer(model=model, args=_arguments(out, name, args, args.steps),
                                               train_dataset=data, callbacks=[plain_clock])
        else:
            built[name] = AdaptiveTrainer(model=model, args=_arguments(out, name, args, steps), train_dataset=data,
                                          callbacks=[ours_clock])
    for trainer in built.values():
        trainer.remove_callback(transformers.PrinterCallback)  # the metrics each train() prints

    def run_plain_block() -> None:
        built["plain"].train()

    built["plain"].train()  # warm-up
    results["plain"].clear()
    built["ours"].train()  # block k of ours, then block k of the plain trainer, for k = 0 .. blocks
    results["ours"], results["plain"] = results["ours"][1:], results["plain"][1:]  # (block 0: warm-up)
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(results))
    dist.barrier()


def main() -> None:
    args = _front_end.arguments(__doc__, HERE / "results" / "bench_trainer.json", blocks=16, launches=2, steps=11,
                                steps_help="steps per block (the first is not counted)")
    runs = _paired.run_launches(_worker, args)
    _front_end.report(args, runs, sum(p.numel() for p in _LanguageModel(args).parameters()),
                      {"plain": "transformers.Trainer (Accelerate DDP + sharded DataLoader)",
                       "ours": "AdaptiveTrainer (AdaptiveDataParallel + AdaptiveDataLoader)"},
                      f"{args.blocks} alternating blocks x {args.steps - 1} timed steps")

if __name__ == "__main__":
    main()
