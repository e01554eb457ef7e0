"""The ~10M-parameter causal transformer the sharding benchmarks and the GPU check train.

Blocks are ``torch.nn.TransformerEncoderLayer`` in an ``nn.ModuleList``, so
``fully_shard`` and :class:`adaptive.AdaptiveFSDP`'s default policy shard
each block, then the root (embeddings, final norm, tied output).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 2048


class Transformer(torch.nn.Module):
    """Token + position embeddings, pre-norm encoder blocks with a causal mask, tied output."""

    def __init__(self, dim: int = 256, layers: int = 12, heads: int = 4, max_len: int = 128) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, dim)
        self.positions = torch.nn.Embedding(max_len, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        for layer in self.layers:
            x = layer(x, src_mask=causal, is_causal=True)
        return self.norm(x) @ self.tokens.weight.T


def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def batches(count: int, batch: int, length: int, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """``count`` fixed batches of random token ids (the same on every call with the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length + 1), generator=generator).to(device) for _ in range(count)]


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
