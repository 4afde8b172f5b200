"""Training data: packed ``[B, S]`` token batches with per-token document ids and in-document positions.

Every source is a pure function ``batch(index) -> Batch``: which batch a drafter trains on at a step depends only
on the step, never on thread timing, so runs are reproducible and ``--resume`` replays the exact loss curve.

* ``MarkovData`` (default, no download): a seeded sparse first-order Markov chain over a small vocabulary.
  Documents start with BOS (id 0) and follow the chain for a random length; they are packed back to back.
* ``TextData``: a local ``.txt`` (documents separated by blank lines) or ``.jsonl`` (field ``"text"``), tokenized
  with a Hugging Face tokenizer (optional) or a byte-level fallback, concatenated and cut into windows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

BOS = 0


@dataclass
class Batch:
    index: int
    tokens: torch.Tensor  # [B, S] int64
    doc: torch.Tensor  # [B, S] int64 document id inside each row
    pos: torch.Tensor  # [B, S] int64 position inside the document

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.index, self.tokens.to(device), self.doc.to(device), self.pos.to(device))


def _pack(docs: Sequence[np.ndarray], seq_len: int) -> tuple:
    """Concatenate documents into one row of ``seq_len`` tokens (the last one truncated)."""
    toks, doc, pos = [], [], []
    for d_id, d in enumerate(docs):
        toks.append(d)
        doc.append(np.full(len(d), d_id))
        pos.append(np.arange(len(d)))
    cat = lambda xs: np.concatenate(xs)[:seq_len]  # noqa: E731
    return cat(toks), cat(doc), cat(pos)


def _stack(index: int, rows: List[tuple]) -> Batch:
    t, d, p = (torch.from_numpy(np.stack([r[j] for r in rows]).astype(np.int64)) for j in range(3))
    return Batch(index, t, d, p)


class MarkovData:
    """Seeded sparse Markov chain: each token has ``branch`` successors with Zipf-like probabilities."""

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0, branch: int = 4,
                 min_doc: int = 16, max_doc: Optional[int] = None) -> None:
        self.vocab_size, self.batch_size, self.seq_len, self.seed = vocab_size, batch_size, seq_len, seed
        self.min_doc, self.max_doc = min_doc, max_doc or seq_len
        rng = np.random.default_rng([seed, 12345])
        n = vocab_size - 1  # token 0 is BOS, never a successor
        self.succ = np.stack([rng.choice(n, size=branch, replace=False) + 1 for _ in range(vocab_size)])
        w = 1.0 / np.arange(1, branch + 1) ** 1.2
        self.probs = np.stack([rng.permutation(w) for _ in range(vocab_size)])
        self.probs /= self.probs.sum(1, keepdims=True)
        self.cum = np.cumsum(self.probs, axis=1)

    def transition_logprobs(self, floor: float = 1e-3) -> torch.Tensor:
        """``[V, V]`` log transition probabilities (floored), used as the built-in target's bigram prior."""
        T = np.full((self.vocab_size, self.vocab_size), floor)
        for v in range(self.vocab_size):
            T[v, self.succ[v]] += self.probs[v]
        return torch.from_numpy(np.log(T / T.sum(1, keepdims=True))).float()

    def document(self, rng: np.random.Generator, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        out[0] = BOS
        if length > 1:
            out[1] = rng.integers(1, self.vocab_size)
        u = rng.random(length)
        for t in range(2, length):
            prev = out[t - 1]
            out[t] = self.succ[prev, min(int(np.searchsorted(self.cum[prev], u[t])), self.succ.shape[1] - 1)]
        return out

    def batch(self, index: int) -> Batch:
        rng = np.random.default_rng([self.seed, index])
        rows = []
        for _ in range(self.batch_size):
            docs, n = [], 0
            while n < self.seq_len:
                d = self.document(rng, int(rng.integers(self.min_doc, self.max_doc + 1)))
                docs.append(d)
                n += len(d)
            rows.append(_pack(docs, self.seq_len))
        return _stack(index, rows)

    def prompts(self, count: int, length: int, seed: int) -> torch.Tensor:
        """``[count, length]`` single-document prompts (held out: their own seed stream)."""
        rng = np.random.default_rng([self.seed, seed, 999])
        return torch.from_numpy(np.stack([self.document(rng, length) for _ in range(count)]))


class ByteTokenizer:
    """Fallback tokenizer: UTF-8 bytes shifted by one so that id 0 stays BOS; vocabulary 257."""

    vocab_size = 257
    bos_token_id = BOS

    def encode(self, text: str) -> List[int]:
        return [b + 1 for b in text.encode("utf-8")]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: Optional[str]) -> bool:
    """Whether a model directory ships a tokenizer (a bare checkpoint falls back to bytes)."""
    return bool(path) and any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(path: Optional[str]):
    """A Hugging Face tokenizer from a local path (transformers imported lazily), or the byte-level fallback."""
    if not path:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def read_documents(path: str) -> List[str]:
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    return [d.strip() for d in text.split("\n\n") if d.strip()]


class TextData:
    """Local text corpus, tokenized once, packed into a token stream with document ids, cut into windows."""

    def __init__(self, path: str, tokenizer, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.batch_size, self.seq_len = batch_size, seq_len
        bos = getattr(tokenizer, "bos_token_id", None)
        bos = BOS if bos is None else int(bos)
        toks, doc, pos, docs = [], [], [], []
        for i, text in enumerate(read_documents(path)):
            ids = [bos] + list(tokenizer.encode(text))
            docs.append(np.asarray(ids, dtype=np.int64))
            toks.extend(ids)
            doc.extend([i] * len(ids))
            pos.extend(range(len(ids)))
        if len(toks) < seq_len + 1:
            raise ValueError(f"{path}: {len(toks)} tokens, fewer than one sequence of {seq_len}")
        self.tokens, self.doc, self.pos = (np.asarray(x, dtype=np.int64) for x in (toks, doc, pos))
        self.docs = docs
        self.windows = len(self.tokens) - seq_len
        self.order = np.random.default_rng(seed).permutation(self.windows)
        self.vocab_size = int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))

    def batch(self, index: int) -> Batch:
        rows = []
        for b in range(self.batch_size):
            start = int(self.order[(index * self.batch_size + b) % self.windows])
            sl = slice(start, start + self.seq_len)
            d = self.doc[sl]
            rows.append((self.tokens[sl], d - d[0], self.pos[sl] - np.where(d == d[0], self.pos[start], 0)))
        return _stack(index, rows)

    def prompts(self, count: int, length: int, seed: int) -> torch.Tensor:
        long_docs = [d for d in self.docs if len(d) >= length] or [self.tokens]
        rng = np.random.default_rng(seed)
        return torch.from_numpy(np.stack([long_docs[int(rng.integers(len(long_docs)))][:length] for _ in range(count)]))
