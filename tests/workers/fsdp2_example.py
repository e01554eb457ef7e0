"""PyTorch's FSDP2 example (pytorch/examples, ``distributed/FSDP2/example.py`` and its ``model.py``), ported to
adaptive for the live-membership tests.

What the example does stays: a decoder-only Transformer (token and position
embeddings, blocks of attention and MLP in an ``nn.ModuleList``, a final norm and
an output layer) built on the meta device, every block sharded on its own and
then the root (``AdaptiveFSDP``'s default policy), ``to_empty`` and
``reset_parameters`` for the initialisation, Adam at lr 1e-2, ``loss.backward()``,
``optim.step()``, ``optim.zero_grad()``.  Changes, only those the docs ask
for: ``adaptive.init_process_group("gloo")`` for the NCCL group;
``AdaptiveFSDP(model, optim)`` for the ``fully_shard`` calls (the optimizer is
built on the meta model's parameters, before the wrapper); its own
``Checkpointer`` (DCP, saved at the end, loaded at the start) is the
library's checkpoint; the ten steps on ``torch.randint`` tokens are epochs of
an ``AdaptiveDataLoader`` over a seeded dataset of random token sequences
(which returns each sample's index); the loss is the next-token
cross-entropy (the example sums the logits); the model is CPU-sized.

Each process appends to ``steps.<pid>.jsonl`` one line per optimizer step (rank,
world, live generation, epoch, loader step, sample indices, whether the step
was discarded); rank 0 appends each epoch's per-sample counts to
``epochs.jsonl`` and writes ``done.json``; ``exits.jsonl`` gets each process's
exit status.  Knobs: WORKER_OUT (required), WORKER_SAMPLES (default 256),
WORKER_BATCH (default 16), WORKER_EPOCHS (default 4), WORKER_STEP_SLEEP
(default 0.02).
"""

import faulthandler
import logging
import math
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import adaptive
from adaptive.runtime import membership
from adaptive.runtime import step as step_records
from worker_common import append_jsonl, record_done, record_epoch, run_main

OUT = os.environ["WORKER_OUT"]
SAMPLES = int(os.environ.get("WORKER_SAMPLES", "256"))
BATCH = int(os.environ.get("WORKER_BATCH", "16"))
EPOCHS = int(os.environ.get("WORKER_EPOCHS", "4"))
STEP_SLEEP = float(os.environ.get("WORKER_STEP_SLEEP", "0.02"))

logging.basicConfig(level=logging.INFO, format=f"[pid {os.getpid()}] %(name)s: %(message)s")
faulthandler.register(signal.SIGUSR1)  # a test can ask for every thread's stack


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    dropout_p: float = 0.0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.dim % args.n_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
        queries = queries.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        values = values.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(queries, keys, values, None,
                                                self.dropout_p if self.training else 0, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(output))

    def reset_parameters(self):
        for linear in (self.wq, self.wk, self.wv, self.wo):
            linear.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))

    def reset_parameters(self):
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim, dropout_p=args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        _, seq_len = tokens.size()
        h = self.tok_embeddings(tokens)
        pos = torch.arange(0, seq_len, device=tokens.device)
        h = self.dropout(h + self.pos_embeddings(pos))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):
        self.tok_embeddings.reset_parameters()
        self.pos_embeddings.reset_parameters()
        self.norm.reset_parameters()
        self.output.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()


class RandomTokens(torch.utils.data.Dataset):
    """The example's ``torch.randint(0, vocab_size, (batch, seq_len))``, as a seeded dataset with indices."""

    def __init__(self, args: ModelArgs, size: int):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, args.vocab_size, (size, args.max_seq_len + 1), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index], index


def main():
    adaptive.init_process_group("gloo")  # was: init_process_group(backend="nccl", device_id=device)
    torch.manual_seed(0)
    model_args = ModelArgs()
    with torch.device("meta"):
        model = Transformer(model_args)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model = adaptive.AdaptiveFSDP(model, optim)  # was: fully_shard(layer) for each layer, then fully_shard(model)
    model.to_empty(device="cpu")
    model.module.reset_parameters()
    loader = adaptive.AdaptiveDataLoader(RandomTokens(model_args, SAMPLES), batch_size=BATCH, shuffle=True, seed=3)
    counts = adaptive.Accumulator()
    log = os.path.join(OUT, f"steps.{os.getpid()}.jsonl")
    steps = 0
    for epoch in adaptive.remaining_epochs_until(EPOCHS):
        for tokens, index in loader:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, model_args.vocab_size), tokens[:, 1:].reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad()
            steps += 1
            counts["seen"] += np.bincount(index.numpy(), minlength=SAMPLES)
            append_jsonl(log, {"pid": os.getpid(), "time": time.time(), "rank": dist.get_rank(),
                               "world": dist.get_world_size(), "generation": membership.generation_number(),
                               "epoch": epoch, "step": loader.step, "indices": index.tolist(),
                               "loss": loss.item() if math.isfinite(loss.item()) else None,
                               "discarded": step_records.discarded()})
            time.sleep(STEP_SLEEP)
        record_epoch(OUT, epoch, counts, loader, loader.step)
    record_done(OUT, loader, loader.step)


if __name__ == "__main__":
    run_main(main, OUT, 0, log_name="exits.jsonl")
