"""Benchmark the token-budget planner: padding efficiency, steps per epoch, planning speed.

Data: the Python standard library's own source, the same text the token-budget
example trains on. Each ``.py`` file is cut into documents at ``def``/``class``
lines (one document per function or class with its docstring, plus module
headers), tokenised with a simple regex (words and single punctuation marks),
and documents longer than ``--max-seq-len`` are split into pieces of at most
that length, as a language-model data pipeline would.

Compared in the same run:

* ``random``: the naive token batcher: fill each micro-batch with the next
  samples of the shuffled stream while the padded size fits the budget;
* ``grouped``: :class:`adaptive.data.tokens.planner.TokenBudgetPlanner` (sort
  within windows of the shuffled stream, shuffle the micro-batches), for
  several window sizes.

Reported: padding efficiency (real tokens / padded tokens), steps per epoch
for 1, 2 and 4 replicas, per-step balance across replicas (max replica
padded tokens / mean), and planner throughput for 10**6 samples (lengths
resampled from the corpus) against the naive batcher's own speed.

    python benchmarks/bench_token_batching.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import re
import sys
import sysconfig
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from adaptive.data.sampler import GlobalPermutation  # noqa: E402
from adaptive.data.tokens.planner import TokenBudgetPlanner  # noqa: E402

TOKEN = re.compile(r"\w+|[^\w\s]")
DEFINITION = re.compile(r"^[ \t]*(?:async[ \t]+def|def|class)[ \t]", re.MULTILINE)
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results" / "bench_token_batching.json"


# --------------------------------------------------------------------------- corpus


def stdlib_files(limit: int | None) -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    return files[:limit] if limit else files


def document_lengths(files: list[pathlib.Path], max_seq_len: int) -> np.ndarray:
    """Token counts of the corpus's documents, long documents split into max_seq_len pieces."""
    lengths: list[int] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        cuts = [0] + [m.start() for m in DEFINITION.finditer(text)] + [len(text)]
        for lo, hi in zip(cuts, cuts[1:]):
            count = len(TOKEN.findall(text, lo, hi))
            while count > 0:
                lengths.append(min(count, max_seq_len))
                count -= max_seq_len
    return np.asarray(lengths, dtype=np.int64)


# --------------------------------------------------------------------------- batchers


def random_batching(lengths_in_order: np.ndarray, max_tokens: int) -> tuple[int, int]:
    """Naive token batcher on the shuffled stream: returns (micro_batches, padded_tokens)."""
    batches = padded = count = longest = 0
    for length in lengths_in_order.tolist():
        if count and (count + 1) * max(longest, length) > max_tokens:
            batches, padded = batches + 1, padded + count * longest
            count = longest = 0
        count, longest = count + 1, max(longest, length)
    return batches + (count > 0), padded + count * longest


def grouped_batching(
    lengths: np.ndarray, stream, max_tokens: int, replicas: int, window: int
) -> dict[str, float]:
    planner = TokenBudgetPlanner(lengths, max_tokens, replicas, window_size=window, seed=1)
    steps = real = padded = 0
    imbalance = []
    for step in planner.plan_epoch(stream):
        steps += 1
        real += step.num_tokens
        per_replica = step.padded().sum(axis=1)
        padded += int(per_replica.sum())
        if not step.final:
            imbalance.append(float(per_replica.max() / per_replica.mean()))
    return {
        "steps": steps,
        "efficiency": real / padded,
        "imbalance_mean": float(np.mean(imbalance)) if imbalance else 1.0,
        "imbalance_p95": float(np.percentile(imbalance, 95)) if imbalance else 1.0,
    }


def padding_table(
    lengths: np.ndarray, max_tokens: int, windows: list[int], replica_counts: list[int]
) -> list[dict]:
    permutation = GlobalPermutation(lengths.size, seed=0, epoch=0)
    stream = permutation.take(0, lengths.size)
    rows = []
    mbs, padded = random_batching(lengths[stream], max_tokens)
    random_eff = int(lengths.sum()) / padded
    for replicas in replica_counts:
        random_steps = math.ceil(mbs / replicas)
        rows.append(
            {
                "batcher": "random",
                "window": 0,
                "replicas": replicas,
                "steps": random_steps,
                "efficiency": random_eff,
                "imbalance_mean": float("nan"),
                "imbalance_p95": float("nan"),
                "efficiency_vs_random": 1.0,
                "steps_vs_random": 1.0,
            }
        )
        for window in windows:
            row = grouped_batching(lengths, permutation, max_tokens, replicas, window)
            row.update(
                batcher="grouped",
                window=window,
                replicas=replicas,
                efficiency_vs_random=row["efficiency"] / random_eff,
                steps_vs_random=row["steps"] / random_steps,
            )
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- throughput


def time_planner(
    lengths: np.ndarray, max_tokens: int, replicas: int, accum: int
) -> dict[str, float]:
    permutation = GlobalPermutation(lengths.size, seed=0, epoch=0)
    planner = TokenBudgetPlanner(lengths, max_tokens, replicas, accum)
    start = time.perf_counter()
    steps = micro = 0
    for step in planner.plan_epoch(permutation):
        steps += 1
        micro += step.num_replicas * step.num_micro_steps
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "steps": steps,
        "micro_batches": micro,
        "micro_batches_per_s": micro / seconds,
        "steps_per_s": steps / seconds,
        "samples_per_s": lengths.size / seconds,
    }


def throughput_table(corpus: np.ndarray, samples: int, max_tokens: int) -> list[dict]:
    rng = np.random.default_rng(0)
    resampled = rng.choice(corpus, size=samples)
    stream = GlobalPermutation(samples, seed=0, epoch=0).take(0, samples)
    start = time.perf_counter()
    random_mbs, _ = random_batching(resampled[stream], max_tokens)
    naive_seconds = time.perf_counter() - start
    rows = [
        {
            "case": "naive sequential batcher (baseline)",
            "replicas": 1,
            "accum": 1,
            "seconds": naive_seconds,
            "steps": random_mbs,
            "micro_batches": random_mbs,
            "micro_batches_per_s": random_mbs / naive_seconds,
            "steps_per_s": random_mbs / naive_seconds,
            "samples_per_s": samples / naive_seconds,
        }
    ]
    for replicas, accum in [(1, 1), (8, 1), (4, 4)]:
        row = time_planner(resampled, max_tokens, replicas, accum)
        row.update(
            case="planner, stdlib lengths",
            replicas=replicas,
            accum=accum,
            seconds_vs_naive=row["seconds"] / naive_seconds,
        )
        rows.append(row)
    worst = rng.integers(
        max_tokens // 2 + 1, max_tokens + 1, size=samples
    )  # one sample per micro-batch
    row = time_planner(worst, max_tokens, 1, 1)
    row.update(
        case="planner, worst case (1 sample per step)",
        replicas=1,
        accum=1,
        seconds_vs_naive=row["seconds"] / naive_seconds,
    )
    rows.append(row)
    return rows


# --------------------------------------------------------------------------- report


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    header = "  ".join(
        f"{title:<{len(title)}}" if fmt == "s" else f"{title:>12}" for _, title, fmt in columns
    )
    print(header)
    for row in rows:
        cells = []
        for key, title, fmt in columns:
            value = row.get(key, "")
            width = len(title) if fmt == "s" else 12
            align = "<" if fmt == "s" else ">"
            cells.append(f"{value:{align}{width}{fmt}}" if value != "" else " " * width)
        print("  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer files and samples (about 1 minute)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="padded-token budget per micro-batch"
    )
    parser.add_argument("--max-seq-len", type=int, default=2048, help="longer documents are split")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="JSON results path")
    args = parser.parse_args()

    files = stdlib_files(300 if args.quick else None)
    start = time.perf_counter()
    corpus = document_lengths(files, args.max_seq_len)
    tokenise_seconds = time.perf_counter() - start
    stats = {
        "files": len(files),
        "documents": int(corpus.size),
        "tokens": int(corpus.sum()),
        "mean": float(corpus.mean()),
        "median": float(np.median(corpus)),
        "p90": float(np.percentile(corpus, 90)),
        "max": int(corpus.max()),
        "tokenise_seconds": tokenise_seconds,
    }
    print(
        f"corpus: {stats['files']} stdlib files -> {stats['documents']} documents, "
        f"{stats['tokens']} tokens; length mean {stats['mean']:.0f}, median {stats['median']:.0f}, "
        f"p90 {stats['p90']:.0f}, max {stats['max']}  ({tokenise_seconds:.1f} s)"
    )

    windows = [1024, 4096, 16384, int(corpus.size)]
    padding = padding_table(corpus, args.max_tokens, windows, [1, 2, 4])
    print(f"\npadding efficiency and steps per epoch, max_tokens={args.max_tokens}")
    print_table(
        padding,
        [
            ("batcher", "batcher", "s"),
            ("window", "window", "d"),
            ("replicas", "replicas", "d"),
            ("steps", "steps", "d"),
            ("efficiency", "real/padded", ".3f"),
            ("efficiency_vs_random", "eff x random", ".2f"),
            ("steps_vs_random", "steps x random", ".2f"),
            ("imbalance_mean", "imbalance", ".3f"),
            ("imbalance_p95", "imbal. p95", ".3f"),
        ],
    )

    samples = 200_000 if args.quick else 1_000_000
    throughput = throughput_table(corpus, samples, args.max_tokens)
    print(f"\nplanning one epoch of {samples} samples")
    print_table(
        throughput,
        [
            ("case", "case" + " " * 36, "s"),
            ("replicas", "replicas", "d"),
            ("accum", "accum", "d"),
            ("seconds", "seconds", ".2f"),
            ("steps", "steps", "d"),
            ("micro_batches_per_s", "micro-b/s", ".0f"),
            ("samples_per_s", "samples/s", ".0f"),
            ("seconds_vs_naive", "time x naive", ".2f"),
        ],
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "token_batching",
        "quick": args.quick,
        "max_tokens": args.max_tokens,
        "max_seq_len": args.max_seq_len,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "corpus": stats,
        "padding": padding,
        "throughput_samples": samples,
        "throughput": throughput,
    }
    args.out.write_text(json.dumps(result, indent=2, allow_nan=True))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
