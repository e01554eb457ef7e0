"""Elastic sampler vs torch DistributedSampler: time to first batch, index rate, memory.

For each dataset size the script starts a fresh worker process per sampler
and measures, for replica 0 of 2 with a global batch of 1024:

* ``first batch``: from constructing the sampler (and ``set_epoch``) to
  holding rank 0's first local batch (512 indices);
* ``index rate``: rank-0 indices per second for the next 10**6 indices
  (``min(10**6, n // 2)`` for small ``n``), produced step by step;
* ``bulk rate`` (ours only): ``GlobalPermutation.take`` over 10**6 positions;
* ``peak extra memory``: peak RSS of the worker minus its RSS after imports.

``torch.utils.data.DistributedSampler`` materialises ``torch.randperm(n)`` and
a Python list of ``n`` ints, about 48 bytes per sample at its peak (we budget
56). Sizes whose estimate exceeds the memory budget (default 6 GB, and never
more than half the currently available memory) are reported as skipped.

Usage: ``python benchmarks/bench_sampler.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent

GLOBAL_BATCH = 1024
REPLICAS = 2
RANK = 0
STREAM_INDICES = 10**6
BASELINE_BYTES_PER_SAMPLE = 56  # randperm int64 (8) + list slot (8) + int object (32) + margin


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _worker_ours(n: int) -> dict:
    import numpy as np

    from adaptive.data.sampler import ElasticSampler, GlobalPermutation

    count = min(STREAM_INDICES, n // REPLICAS)
    base = _rss_bytes()
    t0 = time.perf_counter()
    sampler = ElasticSampler(n, shuffle=True, seed=0)
    sampler.set_epoch(0)
    first = sampler.local_indices(0, GLOBAL_BATCH, REPLICAS, RANK)
    t1 = time.perf_counter()
    produced, start = len(first), sampler.step_size(0, GLOBAL_BATCH)
    while produced < count:
        produced += len(sampler.local_indices(start, GLOBAL_BATCH, REPLICAS, RANK))
        start += sampler.step_size(start, GLOBAL_BATCH)
    t2 = time.perf_counter()
    bulk = min(STREAM_INDICES, n)
    values = GlobalPermutation(n, seed=0, epoch=1).take(0, bulk)
    t3 = time.perf_counter()
    assert values.dtype == np.int64 and len(values) == bulk
    return {
        "first_batch_s": t1 - t0,
        "stream_indices": produced - len(first),
        "stream_s": t2 - t1,
        "bulk_indices": bulk,
        "bulk_s": t3 - t2,
        "peak_extra_bytes": max(0, _peak_rss_bytes() - base),
    }


def _worker_torch(n: int) -> dict:
    import itertools

    import torch.utils.data

    class _Sized(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, index: int) -> int:
            return index

    count = min(STREAM_INDICES, n // REPLICAS)
    local = GLOBAL_BATCH // REPLICAS
    base = _rss_bytes()
    t0 = time.perf_counter()
    sampler = torch.utils.data.DistributedSampler(
        _Sized(), num_replicas=REPLICAS, rank=RANK, shuffle=True, seed=0
    )
    sampler.set_epoch(0)
    iterator = iter(sampler)
    first = list(itertools.islice(iterator, local))
    t1 = time.perf_counter()
    rest = list(itertools.islice(iterator, max(0, count - len(first))))
    t2 = time.perf_counter()
    return {
        "first_batch_s": t1 - t0,
        "stream_indices": len(rest),
        "stream_s": t2 - t1,
        "peak_extra_bytes": max(0, _peak_rss_bytes() - base),
    }


def run_worker(impl: str, n: int, timeout_s: float) -> dict:
    """Measure one (sampler, size) in a fresh interpreter so RSS peaks do not mix."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, str(n)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {impl} n={n} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_budget_bytes(budget_gb: float) -> float:
    import psutil

    return min(budget_gb * 1e9, 0.5 * psutil.virtual_memory().available)


def _rate(result: dict | None, key: str = "stream") -> float | None:
    if not result or not result.get(f"{key}_s"):
        return None
    return result[f"{key}_indices"] / result[f"{key}_s"]


def _fmt(value: float | None, unit: str, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f} {unit}"


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'n':>12} {'sampler':<20} {'first batch':>12} {'index rate':>14} "
        f"{'bulk take':>14} {'peak extra mem':>15}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        for impl in ("ours", "torch"):
            result = row[impl]
            label = "ElasticSampler" if impl == "ours" else "DistributedSampler"
            if result is None:
                print(f"{row['n']:>12} {label:<20} {row['torch_skipped']}")
                continue
            print(
                f"{row['n']:>12} {label:<20} "
                f"{_fmt(result['first_batch_s'], 'ms', 1e-3):>12} "
                f"{_fmt(_rate(result), 'M/s', 1e6):>14} "
                f"{_fmt(_rate(result, 'bulk'), 'M/s', 1e6):>14} "
                f"{_fmt(result['peak_extra_bytes'], 'MB', 1e6, 1):>15}"
            )
        ratio = row.get("first_batch_speedup")
        if ratio is not None:
            print(f"{'':>12} {'ratio torch/ours':<20} {ratio:>10.0f} x {row['rate_ratio']:>12.1f} x"
                  f" {'':>14} {row['memory_ratio']:>13.0f} x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes 1e6 and 1e7 instead of 1e6, 1e8, 1e9")
    parser.add_argument("--budget-gb", type=float, default=6.0,
                        help="largest estimated DistributedSampler footprint to run (default 6)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        sys.path.insert(0, str(ROOT))
        impl, n = args.worker[0], int(args.worker[1])
        result = _worker_ours(n) if impl == "ours" else _worker_torch(n)
        print(json.dumps(result))
        return

    sizes = [10**6, 10**7] if args.quick else [10**6, 10**8, 10**9]
    budget = torch_budget_bytes(args.budget_gb)
    rows = []
    for n in sizes:
        row: dict = {"n": n, "ours": run_worker("ours", n, timeout_s=300)}
        estimate = BASELINE_BYTES_PER_SAMPLE * n
        row["torch_estimate_bytes"] = estimate
        if estimate > budget:
            row["torch"] = None
            row["torch_skipped"] = (
                f"skipped (needs ~{estimate / 1e9:.1f} GB, budget {budget / 1e9:.1f} GB)"
            )
        else:
            row["torch"] = run_worker("torch", n, timeout_s=600)
            ours, theirs = row["ours"], row["torch"]
            row["first_batch_speedup"] = theirs["first_batch_s"] / ours["first_batch_s"]
            row["rate_ratio"] = _rate(ours) / _rate(theirs)
            row["memory_ratio"] = theirs["peak_extra_bytes"] / max(ours["peak_extra_bytes"], 1)
            row["torch_estimate_accuracy"] = theirs["peak_extra_bytes"] / estimate
        rows.append(row)

    print_table(rows)
    out = args.out or RESULTS / ("bench_sampler_quick.json" if args.quick else "bench_sampler.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "global_batch": GLOBAL_BATCH,
        "replicas": REPLICAS,
        "rank": RANK,
        "stream_indices": STREAM_INDICES,
        "torch_budget_bytes": budget,
        "ratios": "torch / ours for time and memory, ours / torch for index rate",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
