"""torchrun worker for tests/test_checkpoint_sharded.py (gloo, CPU).

SHARDED_CKPT_MODE=save: train a FSDP2 model with Adam, checkpoint it SHARDED_CKPT_SAVES times (every second
save asynchronous when SHARDED_CKPT_ASYNC=alternate, all when 1), each after 2 training steps, and keep
going while a background save runs; rank 0 writes the full state at each save to ``full-<seq>.pt``.
SHARDED_CKPT_BLOCK=<rank>:<save number> makes that rank stop inside that save, right after its shards are
written (``blocked.rank<R>`` appears; the test SIGKILLs it).

SHARDED_CKPT_MODE=load: build the model from another seed, restore it from the newest checkpoint (ranks
1.. first, then rank 0, so a restore that needed the other ranks would hang: restoring is local), and
write the full state to ``loaded.pt`` and what was resumed to ``loaded.json``.

Every rank writes its pid to ``pid.rank<R>``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import adaptive  # noqa: E402
from adaptive.checkpoint import _dcp_io  # noqa: E402
from adaptive.checkpoint.states import resumed_checkpoint  # noqa: E402
from sharded_ckpt_common import FSDPState, build, full_state, train  # noqa: E402

OUT = Path(os.environ["WORKER_OUT"])


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def block_inside_save(rank: int, save_number: int) -> None:
    """Stop this rank inside save ``save_number``, once its shards are written (test hook)."""
    real = _dcp_io.write_shards
    calls = {"n": 0}

    def write_then_block(*args, **kwargs):
        calls["n"] += 1
        records = real(*args, **kwargs)
        if calls["n"] == save_number:
            (OUT / f"blocked.rank{rank}").write_text(str(os.getpid()))
            time.sleep(600)  # the test SIGKILLs this process now
        return records

    _dcp_io.write_shards = write_then_block


def save_mode(rank: int, world: int) -> None:
    model, optimizer = build(world, seed=1)
    state = FSDPState(model, optimizer)
    block = os.environ.get("SHARDED_CKPT_BLOCK")
    if block:
        blocked_rank, save_number = map(int, block.split(":"))
        if rank == blocked_rank:
            block_inside_save(rank, save_number)
    mode = os.environ.get("SHARDED_CKPT_ASYNC", "0")
    for number in range(1, int(os.environ.get("SHARDED_CKPT_SAVES", "2")) + 1):
        train(model, optimizer, 2, seed=100 * number + rank)
        state.steps += 2
        full = full_state(model, optimizer)
        asynchronous = mode == "1" or (mode == "alternate" and number % 2 == 0)
        seq = adaptive.save_all_states({"number": number}, blocking=not asynchronous)
        if rank == 0:
            torch.save(full, OUT / f"full-{seq}.pt")
        if asynchronous:  # keep training while the background thread writes: the staged copy must not move
            train(model, optimizer, 1, seed=999)
            state.steps += 1
            adaptive.wait_for_pending_save()
    (OUT / f"done.rank{rank}").write_text("ok")


def load_mode(rank: int, world: int) -> None:
    model, optimizer = build(world, seed=2)
    if rank == 0:
        for other in range(1, world):
            wait_for(OUT / f"restored.rank{other}", timeout=60)
    state = FSDPState(model, optimizer)
    (OUT / f"restored.rank{rank}").write_text("ok")
    full = full_state(model, optimizer)
    if rank == 0:
        torch.save(full, OUT / "loaded.pt")
        checkpoint = resumed_checkpoint()
        (OUT / "loaded.json").write_text(json.dumps({
            "seq": None if checkpoint is None else checkpoint.info.seq, "steps": state.steps,
            "restored": state.restored, "world": world}))


def main() -> None:
    adaptive.init_process_group("gloo")
    rank, world = adaptive.env.rank(), adaptive.env.num_replicas()
    (OUT / f"pid.rank{rank}").write_text(str(os.getpid()))
    {"save": save_mode, "load": load_mode}[os.environ["SHARDED_CKPT_MODE"]](rank, world)


if __name__ == "__main__":
    main()
