"""Training script for bench_live.py: logs the end of every step (time, world size, generation, noise-scale interval), per process.

``BENCH_PLAIN=1`` trains the same model with plain DDP and a plain
``DataLoader`` + ``DistributedSampler`` under torchrun (the baseline).
``BENCH_SHARD_SIZE=N`` shards it with ``AdaptiveFSDP`` on an HSDP mesh of
shard groups of N (``sharding_mesh(N)``) instead of ``AdaptiveDataParallel``.
"""
import time

T_START = time.time()
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402

T_TORCH = time.time()
import torch.distributed as dist  # noqa: E402

OUT = os.environ["WORKER_OUT"]
WIDTH = int(os.environ.get("BENCH_WIDTH", "1024"))
STEPS = int(os.environ.get("BENCH_STEPS", "100000"))
#: DataLoader worker processes (persistent, as pytorch/examples' mnist has one); 0: load in the training process.
LOADER_WORKERS = int(os.environ.get("BENCH_LOADER_WORKERS", "0"))
LOADER_OPTIONS = {"num_workers": LOADER_WORKERS, "persistent_workers": True} if LOADER_WORKERS else {}


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10))
    data = torch.utils.data.TensorDataset(torch.randn(4096, WIDTH), torch.randint(0, 10, (4096,)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), data


def log_step(handle, generation, gns_interval=None, step=None, discarded=False):
    handle.write(json.dumps({"time": time.time(), "world": dist.get_world_size(), "generation": generation,
                             "gns_interval": gns_interval, "step": step, "discarded": discarded}) + "\n")
    handle.flush()


def record_copy_sizes() -> None:
    """Bytes a member keeps in memory for a lost peer: a copy of every state (what the in-memory snapshots of
    earlier versions held, model and optimizer included) against the live copies kept after each committed step
    (``State.live_copy``; with a library from before the step commit, for a before/after run, the snapshot
    itself), both as pickled bytes (``memory.<pid>.json``)."""
    import pickle

    from adaptive.checkpoint import states

    registered = states.registered_states()
    whole = sum(len(pickle.dumps(state.state_dict())) for state in registered)
    live = sum(len(pickle.dumps(getattr(state, "live_copy", state.state_dict)())) for state in registered)
    with open(os.path.join(OUT, f"memory.{os.getpid()}.json"), "w") as handle:
        json.dump({"whole state copy": whole, "live copies": live}, handle)


def plain() -> None:
    dist.init_process_group("gloo")
    model, optimizer, data = build()
    model = torch.nn.parallel.DistributedDataParallel(model)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=64 // dist.get_world_size(), sampler=sampler,
                                         **LOADER_OPTIONS)
    steps = 0
    with open(os.path.join(OUT, f"steps.{os.getpid()}.jsonl"), "a") as handle:
        for epoch in range(1000):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                log_step(handle, None)
                steps += 1
                if steps >= STEPS:
                    return


def adaptive_job() -> None:
    import adaptive
    from adaptive.runtime import membership
    from adaptive.runtime import step as step_records

    # (a library from before the step commit, for a before/after run: every step that lost a peer was discarded)
    discarded = getattr(step_records, "discarded", step_records.faulted)

    adaptive.init_process_group("gloo")
    model, optimizer, data = build()
    with open(os.path.join(OUT, f"start.{os.getpid()}.json"), "w") as handle:  # the script's own start-up is done
        json.dump({"start": T_START, "torch": T_TORCH, "built": time.time()}, handle)
    if os.environ.get("BENCH_SHARD_SIZE"):
        from adaptive.parallel import sharding_mesh

        mesh = sharding_mesh(int(os.environ["BENCH_SHARD_SIZE"]))
        model = adaptive.AdaptiveFSDP(model, optimizer, mesh=mesh, shard="root")
    else:
        model = adaptive.AdaptiveDataParallel(model, optimizer)
    loader = adaptive.AdaptiveDataLoader(data, batch_size=64, shuffle=True, **LOADER_OPTIONS)
    steps = 0
    with open(os.path.join(OUT, f"steps.{os.getpid()}.jsonl"), "a") as handle:
        for epoch in adaptive.remaining_epochs_until(1000):
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                log_step(handle, membership.generation_number(), model.gns.measure_interval, loader.step,
                         discarded())
                steps += 1
                if steps == 50:
                    record_copy_sizes()
                if steps >= STEPS:
                    adaptive.finish_training()
                    break


if __name__ == "__main__":
    plain() if os.environ.get("BENCH_PLAIN") == "1" else adaptive_job()
