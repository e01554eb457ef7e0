"""Step time of AdaptiveFSDP (noise scale on) against plain ``fully_shard``, same model, same batches.

Two gloo processes train the ~10M-parameter transformer of ``_transformer.py``
with Adam, sharded the same way (each block, then the root).  The plain
set-up is ``fully_shard`` + ``torch.optim.Adam``; ours is
``adaptive.AdaptiveFSDP`` with the gradient noise scale measured (Adam
preconditioned) every ``--gns-interval`` steps and the AdamScale LR rule.
Both read the same fixed batches, so the ratio is the wrapper's cost, not
the data loader's (that is ``bench_overhead.py``).  Each process alternates
blocks of steps between the two, changing which goes first; the result is
the median over block pairs of (our median step time / plain median step
time), over several launches built in alternating order.

    python benchmarks/bench_fsdp.py [--quick] [--gns-interval N] [--launches N] [--json PATH]
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
import _transformer  # noqa: E402


def _timed_steps(model, optimizer, batches, steps: int, offset: int) -> list[float]:
    times = []
    for i in range(steps):
        ids = batches[(offset + i) % len(batches)]
        start = time.perf_counter()
        loss = _transformer.loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def _build_plain(args):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _transformer.Transformer(layers=args.layers)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _build_ours(args):
    import adaptive

    torch.manual_seed(0)
    net = _transformer.Transformer(layers=args.layers)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    model = adaptive.AdaptiveFSDP(net, optimizer, gns_interval=args.gns_interval)
    # What the AdaptiveDataLoader tells the model before every step; set once here (fixed batches).
    model.gns.set_batch_config(init_batch_size=2 * args.batch, local_bsz=args.batch, accum_steps=1)
    return model, optimizer


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    _paired.join_worker_job(rank, port, out)
    builders = {"plain": _build_plain, "ours": _build_ours}
    order = ["ours", "plain"] if args.ours_first else ["plain", "ours"]
    built = {name: builders[name](args) for name in order}
    batches = _transformer.batches(8, args.batch, args.length, seed=rank)
    for name in order:  # warm-up: lazy allocations, Adam state, the first noise measurements
        _timed_steps(*built[name], batches, 4, 0)
    results = {"plain": [], "ours": []}
    for block in range(args.blocks):
        for name in order[::1 if block % 2 == 0 else -1]:
            results[name].append(_timed_steps(*built[name], batches, args.steps, block * args.steps))
    measured = built["ours"][0].gns.num_updates
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps({**results, "measured": measured}))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (a smoke run)")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (12: ~10M parameters)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per replica per step")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--gns-interval", type=int, default=4, help="AdaptiveFSDP(gns_interval=...)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="steps per block")
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--json", default=str(HERE / "results" / "bench_fsdp.json"))
    args = parser.parse_args()
    if args.quick:
        args.layers, args.blocks, args.steps, args.launches = 2, 2, 3, 1
    runs = _paired.run_launches(_worker, args)
    params = _transformer.parameter_count(_transformer.Transformer(layers=args.layers))
    summary = _paired.summarize(runs)
    times, medians, block_ratios = summary["times"], summary["median_s"], summary["block_ratios"]
    ratio, quartiles = summary["ratio"], summary["quartiles"]
    print(f"step time, 2 gloo processes, transformer {params / 1e6:.1f}M params, Adam, {args.batch} x "
          f"{args.length} tokens per replica, {args.launches} launches x {args.blocks} alternating blocks x "
          f"{args.steps} steps, gns_interval={args.gns_interval}")
    print(f"{'set-up':<46}{'median ms':>10}{'p90 ms':>10}")
    for name, label in (("plain", "fully_shard + Adam"), ("ours", "AdaptiveFSDP (noise scale, AdamScale)")):
        print(f"{label:<46}{1e3 * medians[name]:>10.1f}{1e3 * _paired.p90(times[name]):>10.1f}")
    print(f"ours / plain, median of {len(block_ratios)} block-pair ratios: {ratio:.3f} (quartiles "
          f"{quartiles[0]:.3f}-{quartiles[1]:.3f}; target <= 1.05); noise measurements folded in per launch: "
          + ", ".join(str(run["measured"]) for run in runs))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"params": params, "median_s": medians, "ratio": ratio,
                                           "quartiles": quartiles, "block_ratios": block_ratios,
                                           "gns_interval": args.gns_interval, "measured": [r["measured"] for r in runs],
                                           "times": times}, indent=2))


if __name__ == "__main__":
    main()
