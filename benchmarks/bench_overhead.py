"""Overhead of AdaptiveDataParallel (GNS on) + AdaptiveDataLoader against plain DDP + DataLoader.

Two gloo processes train the same ~8.4M-parameter MLP at the same batch size.
Each process alternates blocks of steps between the two set-ups (so machine
noise hits both alike) and the median step time of each is compared.

    python benchmarks/bench_overhead.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import portpicker
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


def _timed_steps(model, optimizer, batches, steps: int) -> list[float]:
    times = []
    iterator = iter(batches)
    for _ in range(steps):
        start = time.perf_counter()
        try:
            x, y = next(iterator)
        except StopIteration:
            iterator = iter(batches)
            x, y = next(iterator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ADAPTIVE_CHECKPOINT_INTERVAL="0",
                      ADAPTIVE_METRICS_INTERVAL="0", ADAPTIVE_CHECKPOINT_PATH=os.path.join(out, "ckpt"))
    torch.set_num_threads(1)
    import adaptive

    adaptive.init_process_group("gloo")
    data = torch.utils.data.TensorDataset(torch.randn(8192, 1024), torch.randint(0, 10, (8192,)))
    plain_model = _model(args.width)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    plain = torch.nn.parallel.DistributedDataParallel(plain_model)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    plain_loader = torch.utils.data.DataLoader(data, batch_size=args.batch // 2, sampler=sampler)
    ours_model = _model(args.width)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.01)
    ours = adaptive.AdaptiveDataParallel(ours_model, ours_opt, gns_interval=args.gns_interval)
    ours_loader = adaptive.AdaptiveDataLoader(data, batch_size=args.batch, shuffle=True)
    results = {"plain": [], "ours": []}
    _timed_steps(plain, plain_opt, plain_loader, 3)  # warm-up
    ours_iter = _adaptive_batches(adaptive, ours_loader)
    for _ in range(3):  # warm-up
        x, y = next(ours_iter)
        loss = torch.nn.functional.cross_entropy(ours(x), y)
        ours_opt.zero_grad()
        loss.backward()
        ours_opt.step()
    for _ in range(args.blocks):
        results["plain"] += _timed_steps(plain, plain_opt, plain_loader, args.steps)
        results["ours"] += _timed_steps(ours, ours_opt, _Forever(ours_iter), args.steps)
    ours_iter.close()
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(results))
    dist.barrier()


def _adaptive_batches(adaptive, loader):
    """Batches of ``loader`` across as many epochs as the blocks need."""
    for _ in adaptive.remaining_epochs_until(1_000_000):
        yield from loader


class _Forever:
    """Makes a generator look like the re-iterable loader _timed_steps expects."""

    def __init__(self, iterator):
        self.iterator = iterator

    def __iter__(self):
        return self.iterator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--gns-interval", type=int, default=1, help="AdaptiveDataParallel(gns_interval=...)")
    parser.add_argument("--steps", type=int, default=15, help="steps per block")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_overhead.json"))
    args = parser.parse_args()
    if args.quick:
        args.width, args.blocks, args.steps = 512, 3, 5
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(portpicker.pick_unused_port(), args, out), nprocs=2, join=True)
        times = json.loads(Path(out, "times.json").read_text())
    params = sum(p.numel() for p in _model(args.width).parameters())
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["ours"] / medians["plain"]
    print(f"step time, 2 gloo processes, MLP {params / 1e6:.1f}M params, global batch {args.batch}, "
          f"{args.blocks} alternating blocks x {args.steps} steps")
    print(f"{'set-up':<44}{'median ms':>10}{'p90 ms':>10}")
    for name, label in (("plain", "DDP + DataLoader(DistributedSampler)"),
                        ("ours", "AdaptiveDataParallel (GNS) + AdaptiveDataLoader")):
        values = sorted(times[name])
        print(f"{label:<44}{1e3 * medians[name]:>10.1f}{1e3 * values[int(0.9 * (len(values) - 1))]:>10.1f}")
    print(f"median ratio ours / plain: {ratio:.3f} (target <= 1.03)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"params": params, "batch": args.batch, "median_s": medians,
                                           "ratio": ratio, "times": times}, indent=2))


if __name__ == "__main__":
    main()
