"""Step time of a small transformer under AdaptiveAccelerator against plain Accelerate's Accelerator.

Two gloo processes train the same small causal transformer
(``torch.nn.TransformerEncoderLayer`` blocks, see ``_transformer.py``) at
the same global batch, written as an Accelerate script writes its loop::

    with accelerator.accumulate(model):
        loss = ...; accelerator.backward(loss)
        optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()

once with ``accelerate.Accelerator`` (DDP, Accelerate's sharded DataLoader)
and once with ``AdaptiveAccelerator`` (AdaptiveDataParallel with the
gradient-noise measurement, AdaptiveDataLoader), both in the same processes
(Accelerate's state is shared; both are built with ``cpu=True`` on the
job's gloo group).  Each process alternates blocks of steps between the two,
changing which goes first; the result is the median over all block pairs of
(ours median step time / plain median step time), as in bench_overhead.py.

    python benchmarks/bench_accelerate.py [--quick] [--launches N] [--json PATH]

Needs the ``huggingface`` extra (accelerate).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

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


def _build(accelerator: Any, data: torch.utils.data.Dataset, args: argparse.Namespace) -> tuple:
    """Model, optimizer, loader and scheduler, prepared by ``accelerator`` as a script prepares them."""
    model = _model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch // 2, shuffle=True)
    return accelerator.prepare(model, optimizer, loader, scheduler)


def _timed_steps(accelerator: Any, prepared: tuple, batches: Iterator[Any], steps: int) -> list[float]:
    model, optimizer, _, scheduler = prepared
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        (ids,) = next(batches)
        with accelerator.accumulate(model):
            loss = _transformer.loss(model, ids)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def _plain_batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _adaptive_batches(loader: Any) -> Iterator[Any]:
    """Batches of the AdaptiveDataLoader across as many epochs as the blocks need."""
    import adaptive

    for _ in adaptive.remaining_epochs_until(1_000_000):
        yield from loader


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    _paired.join_worker_job(rank, port, out)
    from accelerate import Accelerator

    from adaptive.integrations.accelerate import AdaptiveAccelerator

    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, _transformer.VOCAB, (4096, args.length + 1),
                                                        generator=generator))
    ours_accelerator = AdaptiveAccelerator(cpu=True)  # joins the gloo group (it initialises Accelerate's state)
    plain_accelerator = Accelerator(cpu=True)  # Accelerate's shared state: the same group
    order = [("plain", plain_accelerator), ("ours", ours_accelerator)]
    if args.ours_first:  # memory placement can favour whichever is built first; launches alternate
        order.reverse()
    built = {name: (accelerator, _build(accelerator, data, args)) for name, accelerator in order}
    plain = built["plain"] + (_plain_batches(built["plain"][1][2]),)
    ours = built["ours"] + (_adaptive_batches(built["ours"][1][2]),)
    for accelerator, prepared, batches in (plain, ours):
        _timed_steps(accelerator, prepared, batches, 3)  # warm-up
    results: dict[str, list[list[float]]] = {"plain": [], "ours": []}
    for block in range(args.blocks):  # alternate which set-up goes first
        runs = [("plain", plain), ("ours", ours)]
        for name, (accelerator, prepared, batches) in runs[::1 if block % 2 == 0 else -1]:
            results[name].append(_timed_steps(accelerator, prepared, batches, args.steps))
    ours[2].close()
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(results))
    dist.barrier()


def main() -> None:
    args = _front_end.arguments(__doc__, HERE / "results" / "bench_accelerate.json", blocks=16, launches=3, steps=10)
    runs = _paired.run_launches(_worker, args)
    _front_end.report(args, runs, sum(p.numel() for p in _model(args).parameters()),
                      {"plain": "accelerate.Accelerator (DDP + sharded DataLoader)",
                       "ours": "AdaptiveAccelerator (AdaptiveDataParallel + AdaptiveDataLoader)"},
                      f"{args.blocks} alternating blocks x {args.steps} steps")

if __name__ == "__main__":
    main()
