"""The served models and their inputs.

Both take ``(batch, seq, FEATURES)`` float32 inputs and return ``(batch, CLASSES)`` logits, so that a request's
shape varies in two dimensions, as a server's does: the batch (how many items a client sends) and the sequence
length. Their weights come from a seed, so that a load generator can build the very same model and check every
answer against eager PyTorch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

FEATURES = 16
CLASSES = 8
SEQ = 8  # the sequence length of ordinary traffic (the load generator's default)


class MLP(nn.Module):
    """A position-wise MLP over the sequence, mean-pooled into logits."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x).mean(dim=1))


class Block(nn.Module):
    """One pre-norm transformer block (multi-head self-attention, then an MLP) between an input projection and a
    mean-pooled head."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.inp = nn.Linear(FEATURES, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.inp(x)
        q, k, v = self.qkv(self.norm1(h)).reshape(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = scaled_dot_product_attention(q, k, v)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        h = h + self.mlp(self.norm2(h))
        return self.head(h.mean(dim=1))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "block": Block}


def build(name: str, seed: int = 0, device: str = "cpu") -> nn.Module:
    """The model ``name`` with weights drawn from ``seed``, in eval mode, on ``device``.

    The global random generator is forked, not reseeded, so that building a model leaves the caller's random
    numbers alone.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(sorted(MODELS))}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODELS[name]()
    return model.eval().to(device)


def example_input(batch: int, seq: int, seed: int) -> torch.Tensor:
    """A deterministic input of shape ``(batch, seq, FEATURES)``: multiples of 1/64 in [-4, 4], which float32
    holds exactly and JSON writes in a few characters."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-256, 257, (batch, seq, FEATURES), generator=g).to(torch.float32) / 64
