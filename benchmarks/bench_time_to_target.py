"""Time to a validation target: autoscale against a sweep of fixed batch sizes.

The task is a character-level language model on text that ships with
Python (a fixed list of standard-library modules, read from this
interpreter's own ``Lib/``; no downloads): predict the next character from
the previous 16 with an MLP (embedding, two hidden layers), Adam.
Training stops when the validation cross-entropy (nats per
character, on the held-out tail of the text) reaches the target.

* **Fixed sweep**: each batch size trains with plain PyTorch (DataLoader,
  ``optimizer.step()``; DistributedSampler and DistributedDataParallel with
  several replicas), its learning rate scaled from the base LR at batch
  32 by the linear and by the square-root rule; the faster of the two
  counts for that size.
* **Autoscale**: AdaptiveDataLoader + AdaptiveDataParallel (its default
  rule for Adam: square-root AdaScale) starting at batch 32 with the base LR, ``autoscale_batch_size`` free to
  choose any batch up to the largest size of the sweep, mid-epoch.

Each run is its own process with one thread, or ``--replicas N`` gloo
processes under torchrun (data parallel: with several replicas small
batches pay an all-reduce per step, as on a real cluster); wall time counts
training only (rank 0 validates while the others wait; that time is
excluded).  A run that has not reached the target after ``--max-seconds``,
or after ``CAP_FACTOR`` times the best fixed time of its repeat so far,
stops and counts as "not reached" (its time is a lower bound, and the sweep
median treats it so).  Near the target the
validation loss is on a noisy plateau, so single runs vary by 10-20%:
``--repeats N`` runs every configuration with seeds 0..N-1 (model
initialisation and data order) and compares medians.

    python benchmarks/bench_time_to_target.py                # full sweep (about 12 minutes per repeat)
    python benchmarks/bench_time_to_target.py --repeats 3    # what the docs report
    python benchmarks/bench_time_to_target.py --replicas 2 --repeats 3
    python benchmarks/bench_time_to_target.py --quick        # 3 sizes, one LR rule each
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASE_BATCH, BASE_LR = 32, 1e-3
SIZES = [32, 64, 128, 256, 512, 1024, 2048]
QUICK = {32: "linear", 256: "sqrt", 2048: "sqrt"}
CONTEXT, EMBED, HIDDEN = 16, 24, 512
#: Standard-library packages whose sources form the corpus (about 0.8 MB).
CORPUS = ("email", "json", "http", "logging")
VALIDATION_CHARS = 50_000


# ---------------------------------------------------------------------- task
def load_corpus() -> str:
    """The concatenated sources of :data:`CORPUS`, in a fixed order."""
    lib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for package in CORPUS for f in glob.glob(os.path.join(lib, package, "*.py")))
    if not files:
        raise RuntimeError(f"no standard-library sources under {lib}; this benchmark reads {CORPUS}")
    return "".join(Path(f).read_text(encoding="utf-8") for f in files)


def make_task():
    """(train dataset of (context, next char), validation tensors, vocabulary size)."""
    import torch

    text = load_corpus()
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    codes = torch.tensor([vocab[c] for c in text], dtype=torch.int32)
    train, valid = codes[:-VALIDATION_CHARS], codes[-VALIDATION_CHARS:]

    def windows(seq, stride):
        starts = torch.arange(0, len(seq) - CONTEXT - 1, stride)
        return seq[starts[:, None] + torch.arange(CONTEXT)], seq[starts + CONTEXT].long()

    return torch.utils.data.TensorDataset(*windows(train, 1)), windows(valid, 2), len(vocab)


def make_model(vocab_size: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab_size, EMBED), torch.nn.Flatten(),
        torch.nn.Linear(CONTEXT * EMBED, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, vocab_size))


def make_optimizer(model, lr: float):
    import torch

    return torch.optim.Adam(model.parameters(), lr=lr)


def validation_loss(model, valid) -> float:
    import torch

    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(valid[0]), valid[1]).item()


# ------------------------------------------------------------------ training
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _validate(model, valid, elapsed: float) -> tuple[float, float]:
    """(validation loss, training seconds), both rank 0's, on every replica.

    Rank 0 evaluates while the others wait in the broadcast, so every
    replica stops after the same step."""
    import torch
    import torch.distributed as dist

    value = validation_loss(model, valid) if _rank() == 0 else 0.0
    if _world() > 1:
        box = torch.tensor([value, elapsed], dtype=torch.float64)
        dist.broadcast(box, src=0)
        value, elapsed = box.tolist()
    return value, elapsed


def train_to_target(forward: Callable, model, optimizer, batches: Iterable, valid, target: float,
                    eval_every: int, max_seconds: float, batch_size: Callable[[], int],
                    samples_seen: Callable[[int], int]) -> dict:
    """The ordinary loop, shared by every configuration: step until the
    validation loss reaches ``target`` (checked every ``eval_every``
    samples, not timed) or ``max_seconds`` of training have passed.

    ``samples_seen(n)`` is the number of samples (over all replicas)
    trained so far, given that this replica has just trained a batch of
    ``n``."""
    import torch

    start, excluded, samples, next_eval = time.perf_counter(), 0.0, 0, eval_every
    curve, batches_seen, elapsed = [], set(), 0.0
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        samples = samples_seen(len(y))
        if samples < next_eval:
            continue
        next_eval += eval_every
        paused = time.perf_counter()
        value, elapsed = _validate(model, valid, paused - start - excluded)
        excluded += time.perf_counter() - paused
        batches_seen.add(batch_size())
        curve.append((round(elapsed, 2), samples, round(value, 4), batch_size()))
        if value <= target or elapsed >= max_seconds:
            break
    reached = bool(curve) and curve[-1][2] <= target
    return {"reached": reached, "seconds": elapsed, "samples": samples,
            "loss": curve[-1][2] if curve else math.nan, "final_batch": batch_size(),
            "batch_sizes": sorted(batches_seen), "curve": curve}


def fixed_batches(dataset, batch: int, seed: int) -> Iterator:
    """This replica's share of shuffled global batches of ``batch``, epoch after epoch."""
    import torch

    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=_world(), rank=_rank(), shuffle=True,
                                                  seed=seed, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch // _world(), sampler=sampler, drop_last=True)
    for epoch in range(10_000):
        sampler.set_epoch(epoch)
        yield from loader


def run_fixed(batch: int, rule: str, target: float, eval_every: int, max_seconds: float, seed: int) -> dict:
    """Plain PyTorch: a DataLoader and, with several replicas, DistributedDataParallel."""
    import torch

    dataset, valid, vocab = make_task()
    model = make_model(vocab, seed)
    forward = model
    if _world() > 1:
        torch.distributed.init_process_group("gloo")
        forward = torch.nn.parallel.DistributedDataParallel(model)
    scale = batch / BASE_BATCH
    lr = BASE_LR * (scale if rule == "linear" else math.sqrt(scale))
    optimizer = make_optimizer(model, lr)
    seen = [0]

    def samples_seen(n: int) -> int:
        seen[0] += n * _world()
        return seen[0]

    result = train_to_target(forward, model, optimizer, fixed_batches(dataset, batch, seed), valid, target,
                             eval_every, max_seconds, lambda: batch, samples_seen)
    return dict(result, lr=lr, rule=rule)


def run_autoscale(target: float, eval_every: int, max_seconds: float, seed: int, max_batch: int, out: str) -> dict:
    os.environ.update(ADAPTIVE_CHECKPOINT_PATH=os.path.join(out, "ckpt"), ADAPTIVE_SHARE_PATH=out,
                      ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_PROGRESS_INTERVAL="0")
    import adaptive

    dataset, valid, vocab = make_task()
    adaptive.init_process_group("gloo")
    model = make_model(vocab, seed)
    optimizer = make_optimizer(model, BASE_LR)
    ddp = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = adaptive.AdaptiveDataLoader(dataset, batch_size=BASE_BATCH, shuffle=True, drop_last=True, seed=seed)
    loader.autoscale_batch_size(max_batch, (max(1, BASE_BATCH // _world()), max_batch))

    def batches() -> Iterator:
        for _ in adaptive.remaining_epochs_until(10_000):
            yield from loader

    def samples_seen(n: int) -> int:  # the loader commits a step when the next one starts
        return loader.consumed + (0 if loader.is_accumulation_step() else loader.current_step.size)

    result = train_to_target(ddp, model, optimizer, batches(), valid, target, eval_every, max_seconds,
                             lambda: loader.batch_size, samples_seen)
    return dict(result, rule="sqrt AdaScale")


# ------------------------------------------------------------------- driver
def _subprocess(args: list[str], timeout: float, replicas: int) -> dict:
    """One run in its own process, or under torchrun with several replicas; rank 0's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ADAPTIVE_JOB_ID="bench-time-to-target",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    launcher = [] if replicas == 1 else ["-m", "torch.distributed.run", "--standalone",
                                         f"--nproc-per-node={replicas}"]
    result = subprocess.run([sys.executable, *launcher, __file__, *args], env=env, capture_output=True,
                            text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"run {args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


#: A fixed run is stopped once it takes this many times the best fixed time of its
#: repeat so far: it can be neither the best nor faster than the median's bound.
CAP_FACTOR = 1.6
#: Sweep order: sizes near the usual optimum first, so the cap tightens early.
SWEEP_ORDER = (256, 512, 1024, 128, 2048, 64, 32)


def _rank_key(run: dict) -> tuple[bool, float]:
    """Runs that did not reach the target count as slower than any that did."""
    return (not run["reached"], run["seconds"])


def _median_run(runs: list[dict]) -> dict:
    """The median of repeated runs of one configuration (the lower middle one)."""
    return sorted(runs, key=_rank_key)[(len(runs) - 1) // 2]


def _censored_median(runs: list[dict]) -> tuple[float, bool]:
    """Median wall time over the sweep's sizes, with unfinished runs counted as
    slower than any finished one (their time is a lower bound).
    Returns (median, whether it is only a lower bound)."""
    ordered = sorted(runs, key=_rank_key)
    middle = ordered[(len(ordered) - 1) // 2: len(ordered) // 2 + 1]
    return statistics.mean(r["seconds"] for r in middle), not all(r["reached"] for r in middle)


def _row(name: str, r: dict, note: str) -> str:
    seen = "->".join(str(b) for b in r["batch_sizes"]) if len(r["batch_sizes"]) > 1 else str(r["final_batch"])
    status = "" if r["reached"] else "  NOT reached"
    times = "/".join(f"{t:.0f}" if ok else f">{t:.0f}" for t, ok in r.get("repeats", []))
    return (f"{name:<24}{r['seconds']:>9.1f}{r['samples']:>11d}{r['loss']:>8.3f}  {note}, batch {seen}"
            f"{status}{f'  (repeats: {times} s)' if len(r.get('repeats', [])) > 1 else ''}")


def _fixed_size(batch: int, quick: bool, seed: int, flags: list[str], cap: float, timeout: float,
                replicas: int) -> dict:
    """One fixed size with its better LR rule (the second rule only runs while it could win)."""
    runs: dict[str, dict] = {}
    rules = [QUICK[batch]] if quick or batch == BASE_BATCH else ["sqrt", "linear"]
    for rule in rules:  # (both rules give the base LR at the base batch)
        limit = min([cap] + [r["seconds"] for r in runs.values() if r["reached"]])
        runs[rule] = _subprocess(["--configuration", "fixed", "--batch", str(batch), "--rule", rule, "--seed", str(seed),
                                  *flags, "--max-seconds", str(limit)], timeout, replicas)
    best = min(runs, key=lambda rule: _rank_key(runs[rule]))
    return dict(runs[best], others={k: v for k, v in runs.items() if k != best})


def _summarise(runs: list[dict]) -> dict:
    median = _median_run(runs)
    return dict(median, repeats=[(r["seconds"], r["reached"]) for r in runs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 sizes with one LR rule each")
    parser.add_argument("--target", type=float, default=1.55, help="validation loss, nats per character")
    parser.add_argument("--max-seconds", type=float, default=150.0, help="give up a run after this")
    parser.add_argument("--eval-every", type=int, default=25_000, help="samples between validations")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every configuration, seeds 0..N-1 (model init and data order); "
                             "each configuration reports its median")
    parser.add_argument("--replicas", type=int, default=1,
                        help="data-parallel processes per run (gloo, one thread each; torchrun when > 1)")
    parser.add_argument("--json", help="where to write the results (default: results/bench_time_to_target"
                                       "[_<N>replicas].json)")
    parser.add_argument("--configuration", choices=("fixed", "autoscale"), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rule", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    common = (args.target, args.eval_every, args.max_seconds, args.seed)
    if args.configuration is not None:
        result = (run_fixed(args.batch, args.rule, *common) if args.configuration == "fixed"
                  else run_autoscale(*common, max_batch=args.batch, out=args.out))
        if _rank() == 0:
            print(json.dumps(result))
        return
    sizes = sorted(QUICK) if args.quick else SIZES
    if args.replicas < 1 or any(batch % args.replicas for batch in sizes):
        parser.error(f"--replicas must divide every batch size of the sweep {sizes}, got {args.replicas}")
    if args.json is None:
        suffix = "" if args.replicas == 1 else f"_{args.replicas}replicas"
        args.json = str(HERE / "results" / f"bench_time_to_target{suffix}.json")
    timeout = 3 * args.max_seconds + 300
    flags = ["--target", str(args.target), "--eval-every", str(args.eval_every)]
    autos, fixed_runs = [], {batch: [] for batch in sizes}
    for seed in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:
            autos.append(_subprocess(["--configuration", "autoscale", "--batch", str(max(sizes)), "--seed", str(seed),
                                      "--out", out, *flags, "--max-seconds", str(args.max_seconds)],
                                     timeout, args.replicas))
        print(f"seed {seed}: autoscale {autos[-1]['seconds']:.1f} s, reached={autos[-1]['reached']}", flush=True)
        best = math.inf
        for batch in sorted(sizes, key=lambda b: SWEEP_ORDER.index(b) if b in SWEEP_ORDER else len(SWEEP_ORDER)):
            cap = min(args.max_seconds, CAP_FACTOR * best)
            run = _fixed_size(batch, args.quick, seed, flags, cap, timeout, args.replicas)
            fixed_runs[batch].append(run)
            if run["reached"]:
                best = min(best, run["seconds"])
            print(f"seed {seed}: fixed {batch}: {run['seconds']:.1f} s ({run['rule']}), reached={run['reached']}",
                  flush=True)
    auto = _summarise(autos)
    fixed = {batch: _summarise(runs) for batch, runs in fixed_runs.items()}

    print(f"\ntime to validation loss {args.target} nats/char ({args.replicas} process(es), 1 thread each; "
          f"training time only; median of {args.repeats} seed(s))")
    print(f"{'configuration':<24}{'seconds':>9}{'samples':>11}{'loss':>8}  note")
    for batch, r in fixed.items():
        print(_row(f"fixed batch {batch}", r, f"LR {r['rule']} {r['lr']:.3g}"))
    print(_row(f"autoscale ({min(sizes)}..{max(sizes)})", auto, "LR sqrt AdaScale"))
    reached = [r for r in fixed.values() if r["reached"]]
    best = min((r["seconds"] for r in reached), default=math.nan)
    median, median_is_bound = _censored_median(list(fixed.values()))
    over_best = auto["seconds"] / best if auto["reached"] else math.nan
    median_over = median / auto["seconds"] if auto["reached"] else math.nan
    print(f"autoscale / best fixed: {over_best:.2f} (target <= 1.0)   sweep median / autoscale: "
          f"{'>= ' if median_is_bound else ''}{median_over:.2f} (target >= 1.5)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "task": {"corpus": CORPUS, "context": CONTEXT, "hidden": HIDDEN, "base_batch": BASE_BATCH,
                 "base_lr": BASE_LR, "target_loss": args.target, "max_seconds": args.max_seconds,
                 "repeats": args.repeats, "cap_factor": CAP_FACTOR, "replicas": args.replicas},
        "fixed": fixed, "fixed_runs": fixed_runs, "autoscale": auto, "autoscale_runs": autos,
        "autoscale_over_best": over_best, "median_over_autoscale": median_over,
        "median_is_lower_bound": median_is_bound}, indent=1))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
