"""A small character-level transformer language model, trained with token-budget batches.

    python examples/token_lm.py                                        # one replica, ~1-2 min on a CPU
    adaptive-run --standalone --nproc-per-node=2 examples/token_lm.py  # two replicas
    python examples/token_lm.py --steps 20 --files 40                  # a quick check
    adaptive-run --standalone --nproc-per-node=2 examples/token_lm.py --shard  # sharded (FSDP2)

The text ships with Python: the docstrings of the standard library's
modules, classes and functions (read with ``ast``, so nothing is imported or
downloaded).  Docstrings vary from a few characters to pages, so batches are
bounded by a *token budget* instead of a sample count:

* ``AdaptiveDataLoader(..., max_tokens=..., lengths=...)`` keeps every
  replica's micro-batch within ``--max-tokens`` padded tokens and groups
  docstrings of similar length, so almost no compute is spent on padding;
* the loss is summed over the real tokens and multiplied by
  ``loader.loss_weight``, so each optimizer step's gradient is the mean over
  all tokens of the step, however they are spread over replicas;
* ``--ramp`` grows the global batch along a schedule in consumed tokens
  (``"0:8K 100K:16K"``: 8K tokens per step, then 16K after 100K tokens);
* the learning rate follows each step's actual size (square-root rule, the
  family of AdamScale, the default scaling rule for Adam);
* ``--shard`` trains the same model with ``adaptive.AdaptiveFSDP`` instead of
  ``AdaptiveDataParallel``: parameters, gradients and Adam's state are
  sharded over the replicas (FSDP2 ``fully_shard`` on each transformer
  layer, then the root), checkpoints are written shard by shard through
  ``torch.distributed.checkpoint`` and resharded when the job restarts on
  another number of replicas.  Its checkpoints live in
  ``.adaptive/token_lm-sharded``.

Each epoch logs the training and validation loss per token and perplexity,
and the share of real tokens in the padded batches, summed over replicas
with an ``adaptive.Accumulator``.  Stop it at any time and run the same
command again, with any number of replicas: it resumes where it stopped (a
finished run is not retrained; delete ``.adaptive/token_lm`` to start over).
"""
import argparse
import ast
import collections
import logging
import math
import os
import pathlib
import sysconfig
import time

import numpy as np
import torch
import torch.nn.functional as F

import adaptive

log = logging.getLogger("token_lm")
PAD, BOS, UNK = 0, 1, 2


def stdlib_docstrings(max_files: int) -> list[str]:
    """Docstrings of the first ``max_files`` standard-library modules, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "test", "tests"} & set(p.parts))
    docs = []
    for path in files[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 8:
                    docs.append(doc)
    return docs


class CharVocab:
    """Characters seen at least ``min_count`` times, most frequent first; others map to UNK."""

    def __init__(self, docs: list[str], min_count: int = 5) -> None:
        counts = collections.Counter(ch for doc in docs for ch in doc)
        chars = sorted((ch for ch, n in counts.items() if n >= min_count), key=lambda ch: (-counts[ch], ch))
        self.index = {ch: i + 3 for i, ch in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.index) + 3

    def encode(self, text: str) -> list[int]:
        return [BOS] + [self.index.get(ch, UNK) for ch in text]


class Sequences(torch.utils.data.Dataset):
    """Token-id sequences (BOS + characters), each at most ``max_len`` tokens."""

    def __init__(self, docs: list[str], vocab: CharVocab, max_len: int) -> None:
        self.items = []
        for doc in docs:
            ids = vocab.encode(doc)
            for start in range(0, len(ids) - 1, max_len - 1):  # pieces overlap by one token
                piece = ids[start:start + max_len]
                if len(piece) > 1:
                    self.items.append(torch.tensor(piece, dtype=torch.long))
        self.lengths = np.array([len(item) for item in self.items], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad_batch(batch: list[torch.Tensor]) -> torch.Tensor:
    """Right-pad a micro-batch to its longest sequence (PAD = 0)."""
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=PAD)


class TinyTransformer(torch.nn.Module):
    """A causal transformer: token + position embeddings, pre-norm layers, tied output."""

    def __init__(self, vocab_size: int, max_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab_size, dim)
        self.positions = torch.nn.Embedding(max_len, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        for embedding in (self.tokens, self.positions):
            torch.nn.init.normal_(embedding.weight, std=0.02)  # small logits at the start (tied output)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        # Right padding never reaches a real token through a causal mask, so no key-padding mask is needed.
        return self.norm(self.layers(x, mask=causal, is_causal=True)) @ self.tokens.weight.T


def token_loss_sum(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over the real tokens, number of those tokens)."""
    logits = model(ids[:, :-1])
    targets = ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD,
                           reduction="sum")
    return loss, int((targets != PAD).sum())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train (default 3)")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    parser.add_argument("--files", type=int, default=120, help="standard-library files to read (default 120)")
    parser.add_argument("--max-len", type=int, default=192, help="longest sequence in tokens (default 192)")
    parser.add_argument("--max-tokens", type=int, default=4096,
                        help="padded-token budget of one replica's micro-batch (default 4096)")
    parser.add_argument("--ramp", default="", help="ramp-up of the global batch in tokens, e.g. '0:4K 60K:8K' "
                        "(default: no ramp; each replica runs one micro-batch per step)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--shard", action="store_true",
                        help="shard the model over the replicas (AdaptiveFSDP, FSDP2) instead of replicating it")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.shard:  # its own checkpoints: sharded model state does not load into a replicated model
        os.environ.setdefault("ADAPTIVE_JOB_ID", "token_lm-sharded")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Everything before the epoch loop runs again after a restart: keep it deterministic.
    torch.manual_seed(0)
    started = time.monotonic()
    docs = stdlib_docstrings(args.files)
    vocab = CharVocab(docs)
    train_set = Sequences([d for i, d in enumerate(docs) if i % 20], vocab, args.max_len)
    val_set = Sequences([d for i, d in enumerate(docs) if i % 20 == 0], vocab, args.max_len)
    log.info("%d docstrings from %d files: %d training sequences (%d tokens), %d validation sequences; "
             "vocabulary of %d characters (%.1f s)", len(docs), args.files, len(train_set),
             int(train_set.lengths.sum()), len(val_set), len(vocab), time.monotonic() - started)

    adaptive.init_process_group("gloo")
    net = TinyTransformer(len(vocab), args.max_len, args.dim, args.layers, heads=4)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 30))
    if args.shard:  # each transformer layer, then the root, is a fully_shard unit
        model = adaptive.AdaptiveFSDP(net, optimizer, warmup)
    else:
        model = adaptive.AdaptiveDataParallel(net, optimizer, warmup)
    train_loader = adaptive.AdaptiveDataLoader(
        train_set, shuffle=True, max_tokens=args.max_tokens, lengths=train_set.lengths, collate_fn=pad_batch,
        window_size=4096, batch_size_schedule=args.ramp or None, name="train")
    val_loader = adaptive.AdaptiveDataLoader(val_set, max_tokens=args.max_tokens, lengths=val_set.lengths,
                                             collate_fn=pad_batch, name="validation")
    stats = adaptive.Accumulator()

    for epoch in adaptive.remaining_epochs_until(args.epochs):
        model.train()
        for ids in train_loader:
            if args.steps and train_loader.step >= args.steps:
                break  # the same step on every replica
            loss_sum, tokens = token_loss_sum(model, ids)
            optimizer.zero_grad()
            (loss_sum * train_loader.loss_weight).backward()  # the step's gradient: a mean over all its tokens
            if not train_loader.is_accumulation_step():
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            if not train_loader.is_accumulation_step():
                warmup.step()
            if not train_loader.is_padding:
                stats["train_loss"] += loss_sum.item()
                stats["train_tokens"] += tokens
                stats["padded"] += ids.numel()
                stats["real"] += int((ids != PAD).sum())
        model.eval()
        with torch.no_grad():
            for ids in val_loader:
                # Every replica runs every batch, padding ones too: a sharded model gathers its
                # parameters in the forward pass, a collective the other replicas take part in.
                loss_sum, tokens = token_loss_sum(model.module, ids)
                if not val_loader.is_padding:
                    stats["val_loss"] += loss_sum.item()
                    stats["val_tokens"] += tokens
        with stats.synchronized():
            if adaptive.env.rank() == 0:
                train = stats["train_loss"] / max(stats["train_tokens"], 1)
                val = stats["val_loss"] / max(stats["val_tokens"], 1)
                log.info("epoch %d: train loss %.3f (perplexity %.2f), validation loss %.3f (perplexity %.2f); "
                         "%d steps so far, %.1f%% real tokens in padded batches, %d replicas, %.0f s", epoch,
                         train, math.exp(min(train, 50)), val, math.exp(min(val, 50)), train_loader.step,
                         100 * stats["real"] / max(stats["padded"], 1), adaptive.env.num_replicas(),
                         time.monotonic() - started)
            stats.clear()
        if args.steps and train_loader.step >= args.steps:
            log.info("stopping after %d optimizer steps (--steps)", train_loader.step)
            adaptive.finish_training()  # checkpointed as finished: a relaunch trains nothing
            break


if __name__ == "__main__":
    main()
