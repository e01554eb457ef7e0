"""The summary of an A/B step-time benchmark run in alternating blocks (bench_overhead, bench_fsdp).

Each launch times blocks of steps of the plain set-up and ours back to back,
alternating which goes first; the ratio of a pair's medians cancels slow
drifts of the machine, and the median over all pairs is the result.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

import portpicker
import torch.multiprocessing as mp


def join_worker_job(rank: int, port: int, out: str) -> None:
    """Make this spawned process rank ``rank`` of a 2-process gloo job on 127.0.0.1 (one thread, no
    periodic checkpoints or metrics, checkpoints under ``out``) and initialise the process group."""
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ADAPTIVE_CHECKPOINT_INTERVAL="0",
                      ADAPTIVE_METRICS_INTERVAL="0", ADAPTIVE_CHECKPOINT_PATH=os.path.join(out, "ckpt"))
    torch.set_num_threads(1)
    import adaptive

    adaptive.init_process_group("gloo")


def run_launches(worker: Callable[..., None], args: Any) -> list[dict]:
    """``args.launches`` separate 2-process runs of ``worker(rank, port, args, out)``, built in alternating
    order (``args.ours_first``: memory placement can favour whichever set-up is built first); each
    worker's rank 0 writes ``times.json`` into ``out``."""
    runs = []
    for launch in range(args.launches):
        args.ours_first = launch % 2 == 1
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(worker, args=(portpicker.pick_unused_port(), args, out), nprocs=2, join=True)
            runs.append(json.loads(Path(out, "times.json").read_text()))
    return runs


def summarize(runs: list[dict]) -> dict:
    """``runs``: per launch, ``{"plain": [[step s, ...] per block], "ours": [...]}``.

    Returns every step time per set-up (``times``), their medians
    (``median_s``), the sorted block-pair ratios, their median (``ratio``)
    and quartiles, and each launch's ratio of medians.
    """
    times = {name: [t for run in runs for block in run[name] for t in block] for name in ("plain", "ours")}
    block_ratios = sorted(statistics.median(o) / statistics.median(p)
                          for run in runs for p, o in zip(run["plain"], run["ours"]))
    launch_ratios = [statistics.median([t for b in run["ours"] for t in b])
                     / statistics.median([t for b in run["plain"] for t in b]) for run in runs]
    return {"times": times, "median_s": {name: statistics.median(values) for name, values in times.items()},
            "block_ratios": block_ratios, "ratio": statistics.median(block_ratios),
            "quartiles": (block_ratios[len(block_ratios) // 4], block_ratios[(3 * len(block_ratios)) // 4]),
            "launch_ratios": launch_ratios}


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]
