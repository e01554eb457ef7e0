"""Overhead of AdaptiveDataParallel (GNS on) + AdaptiveDataLoader against plain DDP + DataLoader.

Two gloo processes train the same ~8.4M-parameter MLP at the same batch size.
Each process alternates blocks of steps between the two set-ups, changing
which goes first (so machine noise hits both alike); the result is the
median over all block pairs of (our median step time / plain median step
time).  Several launches build the two set-ups in alternating order, since
memory placement can favour whichever is built first.

    python benchmarks/bench_overhead.py [--quick] [--optimizer adam] [--gns-interval N] [--launches N] [--json PATH]

With ``--optimizer adam`` the noise scale is preconditioned by Adam's second
moments (as in training with Adam), which costs a little more than with SGD.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _paired  # noqa: E402


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
    _paired.join_worker_job(rank, port, out)
    import adaptive
    data = torch.utils.data.TensorDataset(torch.randn(8192, 1024), torch.randint(0, 10, (8192,)))
    builders = [_build_plain, _build_ours]
    if args.ours_first:  # memory placement can favour whichever is built first; launches alternate
        builders.reverse()
    built = dict(build(adaptive, data, args) for build in builders)
    plain, plain_opt, plain_loader = built["plain"]
    ours, ours_opt, ours_loader = built["ours"]
    results = {"plain": [], "ours": []}
    _timed_steps(plain, plain_opt, plain_loader, 3)  # warm-up
    ours_iter = _adaptive_batches(adaptive, ours_loader)
    for _ in range(3):  # warm-up
        x, y = next(ours_iter)
        loss = torch.nn.functional.cross_entropy(ours(x), y)
        ours_opt.zero_grad()
        loss.backward()
        ours_opt.step()
    for block in range(args.blocks):  # alternate which set-up goes first
        runs = [("plain", plain, plain_opt, plain_loader), ("ours", ours, ours_opt, _Forever(ours_iter))]
        for name, model, optimizer, batches in runs[::1 if block % 2 == 0 else -1]:
            results[name].append(_timed_steps(model, optimizer, batches, args.steps))
    ours_iter.close()
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(results))
    dist.barrier()


def _optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01)


def _build_plain(adaptive, data, args):
    model = _model(args.width)
    optimizer = _optimizer(model, args.optimizer)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch // 2, sampler=sampler)
    return "plain", (torch.nn.parallel.DistributedDataParallel(model), optimizer, loader)


def _build_ours(adaptive, data, args):
    model = _model(args.width)
    optimizer = _optimizer(model, args.optimizer)
    options = {} if args.gns_interval is None else {"gns_interval": args.gns_interval}
    wrapped = adaptive.AdaptiveDataParallel(model, optimizer, **options)
    return "ours", (wrapped, optimizer, adaptive.AdaptiveDataLoader(data, batch_size=args.batch, shuffle=True))


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
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--gns-interval", type=int, default=None,
                        help="AdaptiveDataParallel(gns_interval=...); default: the library's default")
    parser.add_argument("--launches", type=int, default=3, help="separate 2-process runs, built in alternating order")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--json", default=str(HERE / "results" / "bench_overhead.json"))
    args = parser.parse_args()
    if args.quick:
        args.width, args.blocks, args.steps, args.launches = 512, 3, 5, 1
    runs = _paired.run_launches(_worker, args)
    params = sum(p.numel() for p in _model(args.width).parameters())
    summary = _paired.summarize(runs)
    times, medians, block_ratios = summary["times"], summary["median_s"], summary["block_ratios"]
    ratio, quartiles, launch_ratios = summary["ratio"], summary["quartiles"], summary["launch_ratios"]
    print(f"step time, 2 gloo processes, MLP {params / 1e6:.1f}M params, global batch {args.batch}, "
          f"{args.launches} launches x {args.blocks} alternating blocks x {args.steps} steps, "
          f"{args.optimizer}, gns_interval={'default' if args.gns_interval is None else args.gns_interval}")
    print(f"{'set-up':<44}{'median ms':>10}{'p90 ms':>10}")
    for name, label in (("plain", "DDP + DataLoader(DistributedSampler)"),
                        ("ours", "AdaptiveDataParallel (GNS) + AdaptiveDataLoader")):
        print(f"{label:<44}{1e3 * medians[name]:>10.1f}{1e3 * _paired.p90(times[name]):>10.1f}")
    print(f"ours / plain, median of {len(block_ratios)} block-pair ratios: {ratio:.3f} (quartiles "
          f"{quartiles[0]:.3f}-{quartiles[1]:.3f}; target <= 1.03); per launch: "
          + " / ".join(f"{r:.3f}" for r in launch_ratios))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"params": params, "batch": args.batch, "median_s": medians,
                                           "ratio": ratio, "quartiles": quartiles,
                                           "launch_ratios": launch_ratios, "block_ratios": block_ratios,
                                           "gns_interval": args.gns_interval, "optimizer": args.optimizer,
                                           "times": times}, indent=2))


if __name__ == "__main__":
    main()
