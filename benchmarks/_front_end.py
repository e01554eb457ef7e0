"""What the front-end benchmarks (``bench_accelerate``, ``bench_trainer``, ``bench_lightning``) share.

Each times a small causal transformer (:mod:`_transformer`) trained by a
front-end as it comes (``plain``) and through its adaptive integration
(``ours``) on 2 gloo processes, in paired blocks (:mod:`_paired`); they
take the same options and print and write the same table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import _paired


def arguments(description: str, json_path: Path, *, blocks: int, launches: int, steps: int,
              steps_help: str = "steps per block") -> argparse.Namespace:
    """The benchmark's command line; ``--quick``: 2 layers, 4 blocks, 1 launch and fewer steps."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=64, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=32, help="global batch size (per process: half)")
    parser.add_argument("--blocks", type=int, default=blocks)
    parser.add_argument("--launches", type=int, default=launches, help="separate 2-process runs")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--json", default=str(json_path))
    args = parser.parse_args()
    if args.quick:
        args.layers, args.blocks, args.launches = 2, 4, 1
        args.steps = max(5, args.steps // 2)
    return args


def report(args: argparse.Namespace, runs: list[dict], params: int, labels: dict[str, str], timed: str) -> None:
    """Print the table (median and p90 step time of each set-up, the median block-pair ratio) and write the JSON.

    ``labels``: what ``plain`` and ``ours`` are; ``timed``: what each launch timed ("16 alternating blocks x 10
    steps").
    """
    summary = _paired.summarize(runs)
    times, medians, block_ratios = summary["times"], summary["median_s"], summary["block_ratios"]
    ratio, quartiles, launch_ratios = summary["ratio"], summary["quartiles"], summary["launch_ratios"]
    print(f"step time, 2 gloo processes, transformer {params / 1e6:.2f}M params ({args.layers} layers, dim "
          f"{args.dim}, {args.length} tokens), global batch {args.batch}, AdamW, {args.launches} launches x {timed}")
    print(f"{'set-up':<62}{'median ms':>10}{'p90 ms':>10}")
    for name in ("plain", "ours"):
        print(f"{labels[name]:<62}{1e3 * medians[name]:>10.1f}{1e3 * _paired.p90(times[name]):>10.1f}")
    print(f"ours / plain, median of {len(block_ratios)} block-pair ratios: {ratio:.3f} (quartiles "
          f"{quartiles[0]:.3f}-{quartiles[1]:.3f}; target <= 1.03); per launch: "
          + " / ".join(f"{r:.3f}" for r in launch_ratios))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"params": params, "batch": args.batch, "layers": args.layers,
                                           "dim": args.dim, "length": args.length, "median_s": medians,
                                           "ratio": ratio, "quartiles": quartiles, "launch_ratios": launch_ratios,
                                           "block_ratios": block_ratios, "times": times}, indent=2))
