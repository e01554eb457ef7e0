"""Benchmark sharded and asynchronous checkpoints (torch.distributed.checkpoint) against the alternatives.

A transformer of ~10M parameters (``--quick``: ~2.5M) under ``fully_shard`` with Adam, on 2 gloo processes
(torchrun, CPU), checkpointed through a ShardedState (model and optimizer from ``get_state_dict``). Each
repetition, in alternating order, times on the training loop's side:

* ``sync``: ``save_all_states()`` (every rank writes its shards; rank 0 publishes);
* ``async blocked``: how long ``save_all_states(blocking=False)`` blocks the loop (agreement + CPU staging);
  the background write is then waited for (``async total``: until published);
* ``sync felt``, ``async felt``: what the user feels, the extra time a window of ``--window`` training
  steps takes when a checkpoint starts at its first step, against the same window without one;
* ``torch.save full``: gather the full state to rank 0 (``full_state_dict=True, cpu_offload=True``) and
  ``torch.save`` + fsync it there: the usual unsharded way.

Loads (restore into a fresh model: verify, read, ``set_state_dict``): on 2 ranks (same size), then in new
jobs on 1 rank (2 -> 1) and 3 ranks (2 -> 3), from the same checkpoint.

DDP-sized state (a full replica on every rank, rank 0 writes it): the current store (one ``torch.save``
file per state, rank 0) against DCP with the replica as a ShardedState of plain tensors (DCP spreads the
writes of replicated tensors over the ranks), saves and loads.

Prints a table and writes benchmarks/results/bench_checkpoint_sharded[_quick].json.
Usage: python benchmarks/bench_checkpoint_sharded.py [--quick] [--reps N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))


# --------------------------------------------------------------- worker side


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import adaptive
    from adaptive.checkpoint import states
    from adaptive.runtime.job import current_job, reset_job

    adaptive.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.workdir)
    width, layers = (128, 6) if args.quick else (256, 12)
    vocab, seq_len, batch = 2048, 64, 8

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
                for _ in range(layers))
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    def build(seed: int):
        torch.manual_seed(seed)
        model = Model()
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(model, optimizer) -> None:
        x = torch.randint(0, vocab, (batch, seq_len))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    class Sharded(states.ShardedState):
        def __init__(self, model, optimizer, name="bench.fsdp"):
            super().__init__(name)
            self.model, self.optimizer = model, optimizer
            states.load_state(self)

        def state_dict(self):
            return {"steps": 1}

        def load_state_dict(self, state):
            pass

        def sharded_state_dict(self):
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            return {"model": model_state, "optim": optim_state}

        def load_sharded_state_dict(self, read):
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            loaded = read({"model": model_state, "optim": optim_state})
            set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])

    class Replica(states.State):  # DDP-sized: the full state on every rank, through the current store
        def __init__(self, content, name="bench.ddp"):
            super().__init__(name)
            self.content = content
            states.load_state(self)

        def state_dict(self):
            return self.content

        def load_state_dict(self, state):
            self.content = state

    class ReplicaDCP(states.ShardedState):  # the same replica through DCP
        def __init__(self, content, name="bench.ddp"):
            super().__init__(name)
            self.content = content
            states.load_state(self)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def sharded_state_dict(self):
            return self.content

        def load_sharded_state_dict(self, read):
            self.content = read(self.content)

    def use_root(path: Path) -> None:
        os.environ["ADAPTIVE_CHECKPOINT_PATH"] = str(path)

    def restart() -> None:
        states.wait_for_pending_save()
        groups = current_job().groups
        reset_job().groups = groups

    def timed(action: Callable[[], Any]) -> float:
        dist.barrier()
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        action()
        dist.barrier()
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {}

    def record(key: str, seconds: float) -> None:
        samples.setdefault(key, []).append(seconds)

    def full_torch_save(model, optimizer, path: Path) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        if rank == 0:
            with open(path, "wb") as file:
                torch.save({"model": model_state, "optim": optim_state}, file)
                file.flush()
                os.fsync(file.fileno())

    if args.phase == "load":  # a new job of another size: restore from the 2-rank checkpoint
        use_root(out / "sharded")
        model, optimizer = build(seed=7)
        for _ in range(args.reps):
            restart()
            record(f"load 2->{world}", timed(lambda: Sharded(model, optimizer)))
        params = sum(p.numel() for p in model.parameters())
    else:
        use_root(out / "sharded")
        model, optimizer = build(seed=1)
        Sharded(model, optimizer)
        step(model, optimizer)
        params = sum(p.numel() for p in model.parameters())
        step_seconds = timed(lambda: step(model, optimizer))

        def async_save() -> None:
            blocked = timed(lambda: states.save_all_states(blocking=False))
            record("async blocked", blocked)
            start = time.perf_counter()
            step(model, optimizer)  # training goes on while the background thread writes
            states.wait_for_pending_save()
            dist.barrier()
            record("async total", blocked + time.perf_counter() - start)

        saves = {
            "sync": lambda: record("sync", timed(lambda: states.save_all_states())),
            "async": async_save,
            "torch.save full": lambda: record("torch.save full", timed(
                lambda: full_torch_save(model, optimizer, out / "full.pt"))),
        }
        for rep in range(-1, args.reps):
            for key in (list(saves) if rep % 2 == 0 else list(reversed(saves))):
                saves[key]()
            if rep < 0:
                samples.clear()
        # What the user feels: a window of training steps with a checkpoint started at its first step,
        # against the same window without one (the difference is the training time the checkpoint cost,
        # whatever it blocked).
        def window(kind: str | None, steps: int = args.window) -> float:
            def run() -> None:
                if kind == "sync":
                    states.save_all_states()
                elif kind is not None:
                    states.save_all_states(blocking=False)
                for _ in range(steps):
                    step(model, optimizer)
                states.wait_for_pending_save()
            return timed(run)

        for rep in range(-1, args.reps):
            for kind in (("sync", "async") if rep % 2 == 0 else ("async", "sync")):
                base = window(None)
                felt = window(kind) - base
                if rep >= 0:
                    record(f"{kind} felt", felt)
                    record("window without checkpoint", base)
        for _ in range(args.reps):
            restart()
            model2, optimizer2 = build(seed=9)
            record("load 2->2", timed(lambda: Sharded(model2, optimizer2)))
        state_bytes = sum(f.stat().st_size for f in (out / "sharded").rglob("*") if f.is_file()) / 2  # keep=2

        # DDP-sized state: the full replica (model + Adam moments) on every rank.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        replica = {"model": {k: v.clone() for k, v in model_state.items()},
                   "optim": {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in optim_state["state"].items()},
                             "param_groups": optim_state["param_groups"]}}
        for kind, cls in (("store", Replica), ("dcp", ReplicaDCP)):
            restart()
            use_root(out / f"ddp-{kind}")
            cls(replica)
            for rep in range(-1, args.reps):
                seconds = timed(lambda: states.save_all_states())
                blocked = timed(lambda: states.save_all_states(blocking=False))
                states.wait_for_pending_save()
                if rep >= 0:
                    record(f"ddp {kind} save", seconds)
                    record(f"ddp {kind} async blocked", blocked)
            for _ in range(args.reps):
                restart()
                record(f"ddp {kind} load", timed(lambda: cls(replica)))
        samples["step"] = [step_seconds]
        if rank == 0:
            (out / "meta.json").write_text(json.dumps({"state_bytes": state_bytes}))
    if rank == 0:
        (out / f"samples-{args.phase}-{world}.json").write_text(json.dumps({"params": params, "samples": samples}))


# ----------------------------------------------------------------- driver side


def launch(script_args: list[str], nproc: int, env: dict[str, str], timeout: float) -> None:
    import portpicker

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{portpicker.pick_unused_port()}",
           "--max-restarts", "0", str(Path(__file__).resolve()), *script_args]
    subprocess.run(cmd, env=env, check=True, timeout=timeout)


RATIOS = (("async felt", "sync felt"), ("async felt", "async blocked"),
          ("async blocked", "sync"), ("sync", "torch.save full"), ("async blocked", "torch.save full"),
          ("async total", "sync"), ("load 2->1", "load 2->2"), ("load 2->3", "load 2->2"),
          ("ddp dcp save", "ddp store save"), ("ddp dcp async blocked", "ddp store async blocked"),
          ("ddp dcp load", "ddp store load"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~2.5M parameters instead of ~10M")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (default 3)")
    parser.add_argument("--window", type=int, default=8,
                        help="training steps in each window of the felt-cost measurement (default 8)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return worker(args)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    directory = Path(tempfile.mkdtemp(prefix="bench-sharded-", dir=args.dir))
    env = dict(os.environ, OMP_NUM_THREADS="1", ADAPTIVE_CHECKPOINT_INTERVAL="0", ADAPTIVE_CHECKPOINT_KEEP="2",
               ADAPTIVE_SHARE_PATH=str(directory / "share"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    common = (["--reps", str(args.reps), "--window", str(args.window), "--workdir", str(directory)]
              + (["--quick"] if args.quick else []))
    try:
        launch(["--phase", "save", *common], 2, env, timeout=1800)
        for world in (1, 3):
            launch(["--phase", "load", *common], world, env, timeout=900)
        samples: dict[str, list[float]] = {}
        params = 0
        for path in sorted(directory.glob("samples-*.json")):
            data = json.loads(path.read_text())
            params = max(params, data["params"])
            samples.update(data["samples"])
        state_bytes = json.loads((directory / "meta.json").read_text())["state_bytes"]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    medians = {key: statistics.median(values) for key, values in samples.items()}
    ratios = {f"{a} / {b}": medians[a] / medians[b] for a, b in RATIOS if a in medians and b in medians}
    result = {"params": params, "state_bytes": state_bytes, "reps": args.reps, "processes": 2,
              "median_s": medians, "samples_s": samples, "ratios": ratios, "quick": args.quick,
              "torch": __import__("torch").__version__, "python": platform.python_version(),
              "cpus": os.cpu_count()}
    print(f"state: {params / 1e6:.1f}M params under fully_shard + Adam, {state_bytes / 1e6:.0f} MB per "
          f"checkpoint, 2 gloo processes, {args.reps} reps (medians)")
    print(f"{'operation':<28}{'s':>9}")
    for key in sorted(medians):
        print(f"{key:<28}{medians[key]:>9.3f}")
    print(f"{'ratio':<48}{'':>4}")
    for name, value in ratios.items():
        print(f"{name:<48}{value:>6.2f}x")
    target = ratios.get("async blocked / sync")
    if target is not None:
        print(f"target: async blocked <= 0.25 x sync: {'met' if target <= 0.25 else 'NOT met'} ({target:.2f}x)")
    RESULTS.mkdir(exist_ok=True)
    path = args.out or RESULTS / ("bench_checkpoint_sharded_quick.json" if args.quick else
                                  "bench_checkpoint_sharded.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
