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

import _front_end  # noqa: E402
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
    args = _front_end.arguments(__doc__, HERE / "results" / "bench_lightning.json", blocks=8, launches=3, steps=10)
    runs = _paired.run_launches(_worker, args)
    _front_end.report(args, runs, sum(p.numel() for p in _model(args).parameters()),
                      {"plain": "DDPStrategy (DDP + DistributedSampler)",
                       "ours": "AdaptiveStrategy (AdaptiveDataParallel + AdaptiveDataLoader)"},
                      f"{args.blocks} blocks x {args.steps} steps per strategy")

if __name__ == "__main__":
    main()
