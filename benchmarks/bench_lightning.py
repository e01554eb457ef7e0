"""Step time of a small transformer under Lightning's AdaptiveStrategy against Lightning's DDPStrategy.

Two gloo processes train the same small causal transformer
(``torch.nn.TransformerEncoderLayer`` blocks, see ``_transformer.py``) as a
LightningModule, at the same global batch, with ``trainer.fit``: once with
``DDPStrategy`` (DDP, Lightning's DistributedSampler) and once with
``AdaptiveStrategy`` (AdaptiveDataParallel with the gradient-noise
measurement, AdaptiveDataLoader, the agreement at step boundaries), in the
same processes: a launch runs a DDP fit, the adaptive fit, and another DDP
fit (one AdaptiveStrategy fit per process), so that each adaptive block is
paired with a DDP block from before and one from after it.  A step's time
is the wall time between two ``on_train_batch_end`` calls (data loading,
forward, backward, optimizer, Lightning's own hooks).  The result is the
median over all block pairs of (ours median step time / DDP median step
time), as in bench_accelerate.py.

    python benchmarks/bench_lightning.py [--quick] [--launches N] [--json PATH]

Needs the ``lightning`` extra.
"""
from __future__ import annotations

import argparse
import json
import os
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


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    return _transformer.Transformer(dim=args.dim, layers=args.layers, heads=4, max_len=args.length)


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    _paired.join_worker_job(rank, port, out)
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from adaptive.integrations.lightning import AdaptiveStrategy

    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, _transformer.VOCAB, (8192, args.length + 1),
                                                        generator=generator))
    steps = args.blocks * args.steps + 3  # 3 warm-up steps

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *unused: Any) -> None:
            self.ends.append(time.perf_counter())

        def blocks(self) -> list[list[float]]:
            times = [b - a for a, b in zip(self.ends[3:], self.ends[4:])]
            return [times[i:i + args.steps] for i in range(0, len(times), args.steps) if len(times[i:i + args.steps])]

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return _transformer.loss(self.model, ids)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-4)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(data, batch_size=args.batch // 2, shuffle=True)

    def fit(strategy: Any) -> list[list[float]]:
        timer = Timer()
        options: dict[str, Any] = dict(max_steps=steps + 1, accelerator="cpu", logger=False,
                                       enable_checkpointing=False, enable_progress_bar=False,
                                       enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
        if isinstance(strategy, DDPStrategy) and not isinstance(strategy, AdaptiveStrategy):
            options["devices"] = 2
        saved = dict(os.environ)  # LightningEnvironment.teardown deletes WORLD_SIZE after a DDP fit
        L.Trainer(strategy=strategy, **options).fit(Lit())
        os.environ.update(saved)
        return timer.blocks()

    before = fit(DDPStrategy(process_group_backend="gloo"))
    ours = fit(AdaptiveStrategy())
    after = fit(DDPStrategy(process_group_backend="gloo"))
    half = len(ours) // 2
    plain = before[:half] + after[half:len(ours)]  # the first half paired with blocks before, the rest after
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps({"plain": plain, "ours": ours}))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (per process: half)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--launches", type=int, default=3, help="separate 2-process runs")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_lightning.json"))
    args = parser.parse_args()
    if args.quick:
        args.layers, args.blocks, args.steps, args.launches = 2, 4, 5, 1
    runs = _paired.run_launches(_worker, args)
    params = sum(p.numel() for p in _model(args).parameters())
    summary = _paired.summarize(runs)
    times, medians, block_ratios = summary["times"], summary["median_s"], summary["block_ratios"]
    ratio, quartiles, launch_ratios = summary["ratio"], summary["quartiles"], summary["launch_ratios"]
    print(f"step time, 2 gloo processes, transformer {params / 1e6:.2f}M params ({args.layers} layers, dim "
          f"{args.dim}, {args.length} tokens), global batch {args.batch}, AdamW, {args.launches} launches x "
          f"{args.blocks} blocks x {args.steps} steps per strategy")
    print(f"{'set-up':<62}{'median ms':>10}{'p90 ms':>10}")
    for name, label in (("plain", "DDPStrategy (DDP + DistributedSampler)"),
                        ("ours", "AdaptiveStrategy (AdaptiveDataParallel + AdaptiveDataLoader)")):
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
