"""One sharded optimizer step, compared with the single-process gradient of the same samples.

Builds the ``fsdp_worker`` model under :class:`adaptive.AdaptiveFSDP` and
an :class:`adaptive.AdaptiveDataLoader` (sample batches, or token budgets
with ``WORKER_MODE=tokens``), trains one optimizer step of
``WORKER_ACCUM`` micro-steps with losses weighted by ``loader.loss_weight``,
gathers the full reduced gradient, and on rank 0 computes the gradient of
the mean loss over exactly the samples every replica trained (gathered
from all ranks) on an unsharded copy of the model.  Rank 0 writes
``gradients.json``: the relative error per parameter, the samples of the
step and the micro-steps it had.

Environment: WORKER_OUT (required), WORKER_MODE (``samples``: 24 samples
per step; ``tokens``: micro-batches of at most 12 tokens), WORKER_ACCUM
(micro-steps per optimizer step, token mode; default 1), WORKER_SHARD_SIZE
(HSDP shard groups).
"""

import copy
import json
import os

import numpy as np
import torch

import adaptive
from adaptive.runtime import collectives
from adaptive.parallel import sharding_mesh
from fsdp_worker import SAMPLES as BLOCK_SAMPLES, WIDTH
from worker_common import BlockDataset, BlockStack

OUT = os.environ["WORKER_OUT"]
MODE = os.environ.get("WORKER_MODE", "samples")
ACCUM = int(os.environ.get("WORKER_ACCUM", "1"))
SHARD_SIZE = os.environ.get("WORKER_SHARD_SIZE")
SAMPLES = 96
LENGTHS = np.random.default_rng(0).integers(1, 9, SAMPLES)


class TokenDataset(torch.utils.data.Dataset):
    """Sequences of 1-8 tokens of 3 features; every token has a target."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        length = int(LENGTHS[index])
        return index, torch.randn(length, 3, generator=generator), torch.randn(length, generator=generator)


def pad(batch):
    longest = max(len(y) for _, _, y in batch)
    x, y = torch.zeros(len(batch), longest, 3), torch.zeros(len(batch), longest)
    mask = torch.zeros(len(batch), longest)
    for row, (_, xs, ys) in enumerate(batch):
        x[row, :len(ys)], y[row, :len(ys)], mask[row, :len(ys)] = xs, ys, 1.0
    return torch.tensor([i for i, _, _ in batch]), x, y, mask


def make_loader():
    if MODE == "tokens":
        return adaptive.AdaptiveDataLoader(TokenDataset(), shuffle=True, seed=3, max_tokens=12, lengths=LENGTHS,
                                           collate_fn=pad, accumulation_steps=ACCUM)
    if ACCUM != 1:
        raise ValueError("sample batches accumulate only under autoscale; use WORKER_MODE=tokens")
    return adaptive.AdaptiveDataLoader(BlockDataset(BLOCK_SAMPLES), batch_size=24, shuffle=True, seed=3)


def summed_loss(model, batch):
    """The batch's summed squared error (over real tokens) and its sample indices."""
    if MODE == "tokens":
        index, x, y, mask = batch
        return ((model(x) - y).pow(2) * mask).sum(), index
    x, y, index = batch
    return (model(x) - y).pow(2).sum(), index


def reference_gradients(reference, indices):
    """Gradient of the mean loss over ``indices`` (mean over tokens in token mode), one process."""
    if MODE == "tokens":
        dataset = TokenDataset()
        batch = pad([dataset[i] for i in indices])
        loss_sum, _ = summed_loss(reference, batch)
        loss = loss_sum / float(sum(LENGTHS[i] for i in indices))
    else:
        dataset = BlockDataset(BLOCK_SAMPLES)
        items = [dataset[i] for i in indices]
        batch = torch.stack([x for x, _, _ in items]), torch.stack([y for _, y, _ in items]), None
        loss_sum, _ = summed_loss(reference, batch)
        loss = loss_sum / len(indices)
    loss.backward()
    return {name: param.grad for name, param in reference.named_parameters()}


def main():
    adaptive.init_process_group("gloo")
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)
    model = BlockStack(WIDTH)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    mesh = sharding_mesh(int(SHARD_SIZE)) if SHARD_SIZE else None
    model = adaptive.AdaptiveFSDP(model, optimizer, mesh=mesh, gns_interval=1)
    loader = make_loader()
    seen, micro_steps = [], 0
    for batch in loader:
        loss_sum, index = summed_loss(model, batch)
        (loss_sum * loader.loss_weight).backward()
        seen += index.tolist()
        micro_steps += 1
        if not loader.is_accumulation_step():
            break
    full = {name: param.grad.full_tensor() for name, param in model.module.named_parameters()}
    everyone = collectives.allgather_object(seen)
    if rank == 0:
        indices = [i for part in everyone for i in part]
        expected = reference_gradients(reference, indices)
        errors = {name: float((full[name] - expected[name]).norm() / expected[name].norm().clamp_min(1e-12))
                  for name in expected}
        with open(os.path.join(OUT, "gradients.json"), "w") as f:
            json.dump({"errors": errors, "samples": len(indices), "unique": len(set(indices)),
                       "micro_steps": micro_steps, "width": WIDTH}, f)


if __name__ == "__main__":
    main()
