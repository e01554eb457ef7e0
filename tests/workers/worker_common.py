"""Pieces shared by the multi-process test workers (imported next to them)."""

import hashlib
import json
import math
import os
import time

import torch


class StepCountingLinear(torch.nn.Module):
    """A linear model that also carries, in its checkpointed state, how many
    optimizer steps it has taken: tests compare it with the loader's step."""

    def __init__(self, in_features: int, squeeze: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(in_features, 1)
        self.squeeze = squeeze
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        out = self.linear(x)
        return out.squeeze(-1) if self.squeeze else out


class Block(torch.nn.Module):
    """A residual MLP block (each one its own FSDP unit in the sharded workers)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class BlockStack(torch.nn.Module):
    """Input projection, residual blocks in a ModuleList, head; ``steps`` counts optimizer steps (a checkpointed
    buffer)."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = torch.nn.Linear(3, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(3))
        self.head = torch.nn.Linear(width, 1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum(-1)  # (not squeeze: FSDP2 warns about views returned from a forward)


class BlockDataset(torch.utils.data.Dataset):
    """``samples`` regression samples ``(x, y, index)`` for :class:`BlockStack`, the same on every process."""

    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self):
        return self.samples

    def __getitem__(self, index):
        t = index / self.samples
        x = torch.tensor([t, math.sin(7 * t), math.cos(5 * t)])
        noise = math.sin(index * 12.9898) * 43758.5453 % 1.0 - 0.5
        return x, torch.tensor(2 * t - x[1].item() + 0.1 * noise), index


def regression_dataset(samples: int, seed: int, dtype: torch.dtype) -> torch.utils.data.TensorDataset:
    """``samples`` regression samples ``(x, y, index)`` of a noisy linear map of 4 features, the same on every
    process (drawn from ``seed``), in ``dtype`` (float64 for exact comparisons of weights)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator, dtype=dtype)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=dtype) + 0.1 * torch.randn(samples, generator=generator,
                                                                                 dtype=dtype)
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1), torch.arange(samples))


def record_epoch(out, epoch, counts, loader, model_steps) -> None:
    """End of an epoch: rank 0 appends to ``epochs.jsonl`` how many samples the epoch missed and trained more
    than once (``counts["seen"]``, an Accumulator summed over the replicas); the counts start again."""
    import torch.distributed as dist

    with counts.synchronized():
        seen = counts["seen"]
        if dist.get_rank() == 0:
            append_jsonl(os.path.join(out, "epochs.jsonl"), {
                "epoch": epoch, "world": dist.get_world_size(), "missing": int((seen == 0).sum()),
                "extra": int((seen - 1).clip(min=0).sum()), "step": loader.step, "model_steps": model_steps})
        counts.clear()


def validate(out, val_loader, epoch, samples, model=None) -> None:
    """A validation loop over ``val_loader`` (through ``model`` under no_grad, when given) with an Accumulator
    created in the epoch; rank 0 appends to ``val.jsonl`` how many samples it missed and saw more than once."""
    import adaptive
    import numpy as np
    import torch.distributed as dist

    val_counts = adaptive.Accumulator()  # created in the epoch: named by it, found again by a replay
    with torch.no_grad():
        for x, _, index in val_loader:
            if model is not None:
                model(x)
            val_counts["seen"] += np.bincount(index.numpy(), minlength=samples)
    with val_counts.synchronized():
        seen = val_counts["seen"]
        if dist.get_rank() == 0:
            append_jsonl(os.path.join(out, "val.jsonl"), {
                "epoch": epoch, "world": dist.get_world_size(), "missing": int((seen == 0).sum()),
                "extra": int((seen - 1).clip(min=0).sum())})


def record_done(out, loader, model_steps) -> None:
    """The end of training: rank 0 writes ``done.json`` (the loader's step, the model's step count, the world)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        write_json(os.path.join(out, "done.json"), {"step": loader.step, "model_steps": model_steps,
                                                    "world": dist.get_world_size()})


def write_json(path, payload):
    """Replace ``path`` atomically (tests poll these files while workers run)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def append_jsonl(path, record):
    """Append one JSON line to ``path``."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def state_digest(value) -> str:
    """SHA-256 of a nested state dict: container structure, keys, dtypes, shapes and exact tensor bytes.

    The tests compute it from a checkpoint's file and the workers from their
    live model and optimizer, so equal digests mean the state was applied exactly.
    """
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest, value) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode() + b":")
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def record_resume(out, rank, world, model, optimizer, loader) -> None:
    """Append what this process starts from, right after building its model, optimizer and loader:
    the checkpoint it resumed (None on a fresh start), digests of the model's and the optimizer's
    state as applied, and the loader's step.  ``resume.rank<R>.jsonl`` has one line per process."""
    from adaptive.checkpoint.states import resumed_checkpoint

    checkpoint = resumed_checkpoint()
    append_jsonl(os.path.join(out, f"resume.rank{rank}.jsonl"), {
        "pid": os.getpid(), "time": time.time(), "rank": rank, "world": world,
        "seq": None if checkpoint is None else checkpoint.info.seq,
        "model": state_digest(model.module.state_dict()), "optimizer": state_digest(optimizer.state_dict()),
        "optimizer_state": len(optimizer.state_dict()["state"]), "loader_step": loader.step,
        "model_steps": int(model.module.steps)})


def wait_for_gate(path, what, timeout=240.0) -> None:
    """Block until ``path`` exists (another job's progress, for tests that order two jobs), or
    until this process was asked to stop: then the next step boundary acts on the stop."""
    from adaptive.elastic.sync_points import stop_requested

    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and not stop_requested():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up after {timeout:.0f} s waiting for {what} ({path})")
        time.sleep(0.05)


def run_main(main, out, rank, log_name=None) -> None:
    """Run ``main()``; append how this process exits (its exit status) to ``log_name`` (default
    ``exits.rank<R>.jsonl``)."""
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        raise
    except BaseException:
        code = 1
        raise
    finally:
        append_jsonl(os.path.join(out, log_name or f"exits.rank{rank}.jsonl"), {"pid": os.getpid(), "code": code,
                                                                                "time": time.time()})


def script_decisions(shapes: str) -> None:
    """Replace the goodput model's choices by ``shapes`` in turn ("LOCALxACCUM,..."; then it keeps the last),
    evaluated at every chance: batch-size changes the tests choose instead of timings."""
    from adaptive.batchsize.autoscale import BatchSizeController, Decision

    choices = iter([tuple(int(n) for n in shape.split("x")) for shape in shapes.split(",")])

    def propose(self, grad_params, force):
        local, accum = next(choices, self.current())
        return None if (local, accum) == self.current() else Decision(local, accum, 2.0, 1.0, "scripted")

    BatchSizeController._evaluation_due = lambda self: True
    BatchSizeController._propose = propose


class TrainerRegressor(torch.nn.Module):
    """A linear model with the Hugging Face Trainer's calling convention (a dict with the loss); ``seen`` logs
    the sample indices of each training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def forward(self, x, labels=None, index=None):
        prediction = self.linear(x).squeeze(-1)
        if torch.is_grad_enabled() and index is not None:
            self.seen.append(index.tolist())
        return {"loss": torch.nn.functional.mse_loss(prediction, labels), "logits": prediction}
