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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (per process: half)")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--launches", type=int, default=2, help="separate 2-process runs, built in alternating order")
    parser.add_argument("--steps", type=int, default=11, help="steps per block (the first is not counted)")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_trainer.json"))
    args = parser.parse_args()
    if args.quick:
        args.layers, args.blocks, args.steps, args.launches = 2, 4, 6, 1
    runs = _paired.run_launches(_worker, args)
    params = sum(p.numel() for p in _LanguageModel(args).parameters())
    summary = _paired.summarize(runs)
    times, medians, block_ratios = summary["times"], summary["median_s"], summary["block_ratios"]
    ratio, quartiles, launch_ratios = summary["ratio"], summary["quartiles"], summary["launch_ratios"]
    print(f"step time, 2 gloo processes, transformer {params / 1e6:.2f}M params ({args.layers} layers, dim "
          f"{args.dim}, {args.length} tokens), global batch {args.batch}, AdamW, {args.launches} launches x "
          f"{args.blocks} alternating blocks x {args.steps - 1} timed steps")
    print(f"{'set-up':<62}{'median ms':>10}{'p90 ms':>10}")
    for name, label in (("plain", "transformers.Trainer (Accelerate DDP + sharded DataLoader)"),
                        ("ours", "AdaptiveTrainer (AdaptiveDataParallel + AdaptiveDataLoader)")):
        print(f"{label:<62}{1e3 * medians[name]:>10.1f}{1e3 * _paired.p90(times[name]):>10.1f}")
    print(f"ours / plain, median of {len(block_ratios)} block-pair ratios: {ratio:.3f} (quartiles "
          f"{quartiles[0]:.3f}-{quartiles[1]:.3f}; target <= 1.03); per launch: "
          + " / ".join(f"{r:.3f}" for r in launch_ratios))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"params": params, "batch": args.batch, "layers": args.layers,
                                           "dim": args.dim, "length": args.length, "median_s": medians,
                                           "ratio": ratio, "quartiles": quartiles, "launch_ratios": launch_ratios,
                                           "block_ratios": block_ratios, "times": times}, indent=2))


if __name__ == "__main__":
    main()
