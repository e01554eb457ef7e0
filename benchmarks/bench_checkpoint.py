"""Benchmark CheckpointStore against raw torch.save / torch.load.

The state mimics a model of ~25M float32 parameters with its Adam optimizer
state (~300 MB in total; ``--quick``: ~2M parameters, ~25 MB). Each
repetition, in alternating order, times:

* ``store.save``: CheckpointStore.save (hash while writing, fsync, rename);
* ``torch.save``: one torch.save of the same dict to a new file in the
  same directory, keeping the newest two (no fsync: the usual, non-durable
  baseline);
* ``torch.save+fsync``: the same followed by fsync, the durable baseline;
* ``store.load``: latest() (hash-verifies every file) plus load() of every
  state (reads, re-hashes, weights-only deserialises);
* ``torch.load``: torch.load(path, weights_only=True, map_location="cpu").

One unrecorded warm-up round comes first. Every measurement starts with
os.sync() (untimed), so no operation pays for another's dirty pages. Loads read files that were just written, so they come
from the page cache.
Usage: python benchmarks/bench_checkpoint.py [--quick] [--reps N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaptive.checkpoint.store import CheckpointStore  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def make_states(layers: int, width: int) -> dict[str, Any]:
    """A model state dict plus an Adam-style optimizer state dict."""
    generator = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    for index in range(layers):
        model[f"layers.{index}.weight"] = torch.randn(width, width, generator=generator)
        model[f"layers.{index}.bias"] = torch.randn(width, generator=generator)
    optimizer = {
        "state": {
            index: {
                "step": torch.tensor(100.0),
                "exp_avg": torch.randn_like(tensor),
                "exp_avg_sq": torch.rand_like(tensor),
            }
            for index, tensor in enumerate(model.values())
        },
        "param_groups": [{
            "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
            "amsgrad": False, "params": list(range(len(model))),
        }],
    }
    return {"model": model, "optimizer": optimizer, "loader": {"epoch": 3, "index": 12345}}


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def measure(action: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads, user+sys)."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def raw_save(states: dict[str, Any], path: Path, fsync: bool) -> None:
    with open(path, "wb") as file:
        torch.save(states, file)
        if fsync:
            file.flush()
            os.fsync(file.fileno())


def store_load(store: CheckpointStore) -> dict[str, Any]:
    checkpoint = store.latest()
    assert checkpoint is not None
    return {name: checkpoint.load(name) for name in checkpoint.names()}


OPERATIONS = ("store.save", "torch.save", "torch.save+fsync",
              "store.latest", "store.load", "torch.load")
RATIOS = (("store.save", "torch.save"), ("store.save", "torch.save+fsync"),
          ("store.load", "torch.load"), ("store.latest", "torch.load"))


def run(layers: int, width: int, reps: int, directory: Path) -> dict[str, Any]:
    states = make_states(layers, width)
    (directory / "store").mkdir()
    store = CheckpointStore(directory / "store", keep=2)
    raw_files: list[Path] = []
    samples: dict[str, dict[str, list[float]]] = {
        key: {"wall": [], "cpu": []} for key in OPERATIONS}

    def record(key: str, action: Callable[[], Any], keep: bool) -> None:
        # Flush dirty pages first (untimed): otherwise the non-fsynced
        # torch.save leaves data that the next fsync (e.g. the store's)
        # must write out, as ext4 journal commits flush it too.
        os.sync()
        wall, cpu = measure(action)
        if keep:
            samples[key]["wall"].append(wall)
            samples[key]["cpu"].append(cpu)

    def raw(fsync: bool) -> None:
        # A new file in the store's directory each time (the store ignores
        # it), keeping the newest two like keep=2: both sides then write
        # fresh page-cache pages rather than recycling one file's.
        raw_files.append(directory / "store" / f"raw-{len(raw_files)}.pt")
        raw_save(states, raw_files[-1], fsync=fsync)
        if len(raw_files) > 2:
            raw_files[-3].unlink()

    saves = {
        "store.save": lambda: store.save(states),
        "torch.save": lambda: raw(fsync=False),
        "torch.save+fsync": lambda: raw(fsync=True),
    }
    for rep in range(-1, reps):  # rep -1 is an unrecorded warm-up
        for key in (list(saves) if rep % 2 == 0 else list(reversed(saves))):
            record(key, saves[key], keep=rep >= 0)
        raw_path = raw_files[-1]
        loads = {
            "store.latest": store.latest,
            "store.load": lambda: store_load(store),
            "torch.load": lambda: torch.load(raw_path, weights_only=True, map_location="cpu"),
        }
        for key in (list(loads) if rep % 2 == 0 else list(reversed(loads))):
            record(key, loads[key], keep=rep >= 0)
    loaded = store_load(store)
    assert torch.equal(loaded["model"]["layers.0.weight"], states["model"]["layers.0.weight"])
    medians = {kind: {key: statistics.median(samples[key][kind]) for key in OPERATIONS}
               for kind in ("wall", "cpu")}
    return {
        "params": sum(t.numel() for t in states["model"].values()),
        "state_bytes": tensor_bytes(states),
        "reps": reps,
        "median_wall_s": medians["wall"],
        "median_cpu_s": medians["cpu"],
        "samples_s": samples,
        "ratios_wall": {f"{a} / {b}": medians["wall"][a] / medians["wall"][b] for a, b in RATIOS},
        "ratios_cpu": {f"{a} / {b}": medians["cpu"][a] / medians["cpu"][b] for a, b in RATIOS},
    }


def print_table(result: dict[str, Any]) -> None:
    size_mb = result["state_bytes"] / 1e6
    print(f"state: {result['params'] / 1e6:.1f}M params, {size_mb:.0f} MB of tensors, "
          f"{result['reps']} reps (medians)")
    print(f"{'operation':<20}{'wall s':>9}{'cpu s':>9}{'MB/s':>8}")
    for key in OPERATIONS:
        wall, cpu = result["median_wall_s"][key], result["median_cpu_s"][key]
        print(f"{key:<20}{wall:>9.3f}{cpu:>9.3f}{size_mb / wall:>8.0f}")
    print("store.load = latest() (verifies) + load() of every state (re-verifies)")
    print(f"{'ratio':<34}{'wall':>7}{'cpu':>7}")
    for name, wall in result["ratios_wall"].items():
        print(f"{name:<34}{wall:>6.2f}x{result['ratios_cpu'][name]:>6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~2M parameters instead of ~25M")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions (default 5 quick, 3 full)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    args = parser.parse_args()
    layers, width = (8, 512) if args.quick else (24, 1024)
    reps = args.reps or (5 if args.quick else 3)
    if reps < 1:
        parser.error("--reps must be >= 1")
    directory = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        result = run(layers, width, reps, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    result.update(quick=args.quick, torch=torch.__version__, python=platform.python_version(),
                  cpus=os.cpu_count(), directory=str(args.dir or tempfile.gettempdir()))
    print_table(result)
    name = "bench_checkpoint_quick.json" if args.quick else "bench_checkpoint.json"
    out = args.out or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
