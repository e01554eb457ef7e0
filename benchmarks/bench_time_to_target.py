"""Time to a validation target: autoscale against a sweep of fixed batch sizes.

The task is generated deterministically (no downloads): 20-class Gaussian
clusters in 64 dimensions with overlapping classes, an MLP, SGD with
momentum.  Each fixed batch size in the sweep is trained with plain PyTorch
(DataLoader, its own LR rule: linear or square-root scaling from the base LR
at batch 32; the better of the two counts), and autoscale starts at batch
32 with AdaptiveDataLoader + AdaptiveDataParallel (AdaScale) and may grow to
1024.  Every run stops when validation accuracy reaches the target; wall time
counts training only (validation is timed separately and excluded).

    python benchmarks/bench_time_to_target.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASE_BATCH, BASE_LR = 32, 0.02
SIZES = [32, 64, 128, 256, 512, 1024]


def make_data():
    import torch

    generator = torch.Generator().manual_seed(1234)
    means = torch.randn(20, 64, generator=generator) * 1.0
    def draw(n):
        labels = torch.randint(0, 20, (n,), generator=generator)
        return means[labels] + torch.randn(n, 64, generator=generator) * 3.0, labels
    return draw(40_000), draw(4_000)


def make_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 20))


def accuracy(model, data) -> float:
    import torch

    with torch.no_grad():
        x, y = data
        return (model(x).argmax(1) == y).float().mean().item()


class Clock:
    """Training wall time, with validation excluded."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.excluded = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.excluded


def run_fixed(batch: int, rule: str, target: float, max_samples: int, eval_every: int) -> dict:
    import torch

    (x, y), valid = make_data()
    model = make_model()
    scale = batch / BASE_BATCH
    lr = BASE_LR * (scale if rule == "linear" else math.sqrt(scale))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    clock, samples, next_eval = Clock(), 0, eval_every
    while samples < max_samples:
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(xb)
            if samples >= next_eval:
                next_eval += eval_every
                paused = time.perf_counter()
                acc = accuracy(model, valid)
                clock.excluded += time.perf_counter() - paused
                if acc >= target:
                    return {"reached": True, "seconds": clock.elapsed(), "samples": samples, "accuracy": acc}
    return {"reached": False, "seconds": clock.elapsed(), "samples": samples}


def run_autoscale(target: float, max_samples: int, eval_every: int, out: str) -> dict:
    import torch

    os.environ.update(ADAPTIVE_CHECKPOINT_PATH=os.path.join(out, "ckpt"), ADAPTIVE_SHARE_PATH=out,
                      ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_METRICS_INTERVAL="5")
    import adaptive

    (x, y), valid = make_data()
    adaptive.init_process_group("gloo")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)
    ddp = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = adaptive.AdaptiveDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BASE_BATCH,
                                         shuffle=True)
    loader.autoscale_batch_size(1024, (BASE_BATCH, 1024), adapt_every=10)
    clock, samples, next_eval = Clock(), 0, eval_every
    for _ in adaptive.remaining_epochs_until(10_000):
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            samples += len(xb)
            if samples >= next_eval:
                next_eval += eval_every
                paused = time.perf_counter()
                acc = accuracy(model, valid)
                clock.excluded += time.perf_counter() - paused
                if acc >= target:
                    return {"reached": True, "seconds": clock.elapsed(), "samples": samples, "accuracy": acc,
                            "final_batch": loader.batch_size}
        if samples >= max_samples:
            break
    return {"reached": False, "seconds": clock.elapsed(), "samples": samples, "final_batch": loader.batch_size}


def _subprocess(args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"run {args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batch sizes")
    parser.add_argument("--target", type=float, default=0.655)
    parser.add_argument("--json", default=str(HERE / "results" / "bench_time_to_target.json"))
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rule", help=argparse.SUPPRESS)
    args = parser.parse_args()
    max_samples, eval_every = 20 * 40_000, 2_048
    if args.run == "fixed":
        print(json.dumps(run_fixed(args.batch, args.rule, args.target, max_samples, eval_every)))
        return
    if args.run == "autoscale":
        with tempfile.TemporaryDirectory() as out:
            print(json.dumps(run_autoscale(args.target, max_samples, eval_every, out)))
        return
    sizes = [32, 128, 512] if args.quick else SIZES
    fixed = {}
    for batch in sizes:
        runs = {rule: _subprocess(["--run", "fixed", "--batch", str(batch), "--rule", rule,
                                   "--target", str(args.target)]) for rule in ("linear", "sqrt")}
        reached = {rule: r for rule, r in runs.items() if r["reached"]}
        best = min(reached, key=lambda rule: reached[rule]["seconds"]) if reached else "linear"
        fixed[batch] = dict(runs[best], rule=best, all=runs)
    auto = _subprocess(["--run", "autoscale", "--target", str(args.target)])
    print(f"time to {args.target:.0%} validation accuracy (1 process; training time only)")
    print(f"{'configuration':<28}{'seconds':>9}{'samples':>10}  note")
    for batch, r in fixed.items():
        note = f"LR rule {r['rule']}" + ("" if r["reached"] else ", target not reached")
        print(f"{'fixed batch ' + str(batch):<28}{r['seconds']:>9.1f}{r['samples']:>10d}  {note}")
    print(f"{'autoscale (32 -> <=1024)':<28}{auto['seconds']:>9.1f}{auto['samples']:>10d}  final batch "
          f"{auto.get('final_batch')}" + ("" if auto["reached"] else ", target not reached"))
    reached = [r["seconds"] for r in fixed.values() if r["reached"]]
    best, median = (min(reached), statistics.median(reached)) if reached else (math.nan, math.nan)
    print(f"autoscale / best fixed: {auto['seconds'] / best:.2f}   median fixed / autoscale: "
          f"{median / auto['seconds']:.2f} (targets: <= 1.0 and >= 1.5)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"target": args.target, "fixed": fixed, "autoscale": auto,
                                           "autoscale_over_best": auto["seconds"] / best,
                                           "median_over_autoscale": median / auto["seconds"]}, indent=2))


if __name__ == "__main__":
    main()
