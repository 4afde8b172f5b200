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
import threading
from collections import OrderedDict
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
    """Seeded sparse Markov chain: each token has ``branch`` distinct successors with Zipf-like probabilities.

    Generation is vectorised over rows: one small numpy step per position instead of one Python iteration per
    token (a 8 x 1024 batch took ~50 ms of interpreter time token by token, holding the GIL that every other
    trainer thread needs), and ``block`` consecutive batches are stepped together and cached (the loop costs per
    position, not per row), so a batch costs a fraction of a millisecond. The successor choice uses a quantised uniform variate
    (``levels`` steps), so transition probabilities are multiples of ``1 / levels``; ``probs`` holds those
    effective probabilities and ``transition_logprobs`` uses them.
    """

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0, branch: int = 4,
                 min_doc: int = 16, max_doc: Optional[int] = None, block: int = 16) -> None:
        if vocab_size <= branch:
            raise ValueError(f"vocab_size {vocab_size} must exceed the branching factor {branch}")
        self.vocab_size, self.batch_size, self.seq_len, self.seed = vocab_size, batch_size, seq_len, seed
        self.min_doc = max(2, min(min_doc, seq_len))
        self.max_doc = max(self.min_doc, max_doc or seq_len)
        rng = np.random.default_rng([seed, 12345])
        # `branch` distinct successors in 1..V-1 per token (BOS is never a successor), drawn for all tokens at
        # once; rows that drew a repeat are redrawn (rare unless the vocabulary is tiny).
        succ = rng.integers(1, vocab_size, size=(vocab_size, branch))
        while True:
            srt = np.sort(succ, axis=1)
            bad = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
            if not bad.any():
                break
            succ[bad] = rng.integers(1, vocab_size, size=(int(bad.sum()), branch))
        self.succ = succ
        w = 1.0 / np.arange(1, branch + 1) ** 1.2
        order = rng.permuted(np.tile(np.arange(branch), (vocab_size, 1)), axis=1)
        exact = w[order] / w.sum()
        # Quantised choice table: level j of token v picks successor choice[v, j]. Levels shrink for large
        # vocabularies so the table stays ~16M entries (V = 128k: 130 levels).
        self.levels = int(min(1024, max(64, (1 << 24) // vocab_size)))
        u = (np.arange(self.levels) + 0.5) / self.levels
        cum = np.cumsum(exact, axis=1)
        choice = np.minimum((cum[:, None, :] <= u[None, :, None]).sum(-1), branch - 1)  # [V, levels]
        counts = np.stack([(choice == c).sum(1) for c in range(branch)], axis=1)
        self.probs = counts / self.levels
        self.table = np.take_along_axis(succ, choice, axis=1).astype(np.int64).ravel()  # [V * levels]
        self.block, self.cached_blocks = max(1, block), 4
        self._lock = threading.Lock()
        self._cache: "OrderedDict[int, List[Batch]]" = OrderedDict()

    def transition_logprobs(self, floor: float = 1e-3) -> torch.Tensor:
        """``[V, V]`` log transition probabilities (floored), used as the built-in target's bigram prior."""
        T = np.full((self.vocab_size, self.vocab_size), floor)
        rows = np.repeat(np.arange(self.vocab_size), self.succ.shape[1])
        np.add.at(T, (rows, self.succ.ravel()), self.probs.ravel())
        return torch.from_numpy(np.log(T / T.sum(1, keepdims=True))).float()

    def _layout(self, rng: np.random.Generator, lengths: np.ndarray, seq_len: int) -> tuple:
        """Rows of packed documents with the given lengths ``[R, N]`` (cumulative sum must reach ``seq_len``):
        document ids and in-document positions ``[R, seq_len]``, and the chain's inputs, time-major ``[seq_len, R]``:
        the token where a position does not follow the chain (BOS, or a uniform token at position 1), whether it
        follows it, and the quantised choice of successor."""
        rows = lengths.shape[0]
        ends = np.cumsum(lengths, axis=1)
        # Document index of every position: one searchsorted over all rows (row r's ends shifted by r * span
        # keep the concatenation sorted).
        span = int(ends[:, -1].max()) + seq_len + 1
        shift = (np.arange(rows) * span)[:, None]
        t = np.arange(seq_len)
        doc = np.searchsorted((ends + shift).ravel(), (t[None, :] + shift).ravel(), side="right").reshape(rows, seq_len)
        doc -= (np.arange(rows) * lengths.shape[1])[:, None]
        starts = ends - lengths
        pos = t[None, :] - np.take_along_axis(starts, doc, axis=1)
        # Position 0 of a document is BOS, position 1 a uniform random token, later ones follow the chain.
        fixed = np.where(pos == 0, BOS, rng.integers(1, self.vocab_size, size=(rows, seq_len))).T
        level = rng.integers(0, self.levels, size=(rows, seq_len)).T
        return doc, pos, fixed, (pos >= 2).T, level

    def _chain(self, fixed: np.ndarray, free: np.ndarray, level: np.ndarray) -> np.ndarray:
        """Run the chain over time-major inputs ``[seq_len, R]``: one small numpy step per position for all rows
        at once (the rows are independent, so how many are stepped together changes nothing). Returns ``[R, S]``."""
        fixed, free, level = (np.ascontiguousarray(a) for a in (fixed, free, level))
        table, levels = self.table, self.levels
        out = np.empty(fixed.shape, dtype=np.int64)
        prev = np.zeros(fixed.shape[1], dtype=np.int64)
        for i in range(fixed.shape[0]):
            prev = np.where(free[i], table[prev * levels + level[i]], fixed[i])
            out[i] = prev
        return out.T

    def _generate(self, rng: np.random.Generator, lengths: np.ndarray, seq_len: int) -> tuple:
        doc, pos, fixed, free, level = self._layout(rng, lengths, seq_len)
        return self._chain(fixed, free, level), doc, pos

    def batches(self, indices: Sequence[int]) -> List[Batch]:
        """``[batch(i) for i in indices]``, generated together: each batch draws from its own seed stream exactly
        as ``batch`` does, and one chain loop steps the rows of all of them (the loop's cost is per position, not
        per row: 16 batches cost about what two did one at a time)."""
        n_docs = self.seq_len // self.min_doc + 1
        parts = []
        for index in indices:
            rng = np.random.default_rng([self.seed, index])
            lengths = rng.integers(self.min_doc, self.max_doc + 1, size=(self.batch_size, n_docs))
            parts.append(self._layout(rng, lengths, self.seq_len))
        toks = self._chain(*(np.concatenate([p[j] for p in parts], axis=1) for j in (2, 3, 4)))
        out = []
        for k, (index, (doc, pos, *_)) in enumerate(zip(indices, parts)):
            rows = toks[k * self.batch_size:(k + 1) * self.batch_size]
            out.append(Batch(index, *(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
                                      for a in (rows, doc, pos))))
        return out

    def batch(self, index: int) -> Batch:
        """Batch ``index`` (a pure function of it). Batches are made ``block`` at a time (``batches``) and kept in a
        small cache shared by the threads that ask: the trainer's threads ask for consecutive indices. (Under
        torchrun a rank uses D of every WORLD x D consecutive indices, so a block also makes other ranks' batches:
        host work, never a different batch.)"""
        key = index // self.block
        with self._lock:
            cached = self._cache.get(key)
            if cached is None:
                cached = self._cache[key] = self.batches(range(key * self.block, (key + 1) * self.block))
                while len(self._cache) > self.cached_blocks:
                    self._cache.popitem(last=False)
        return cached[index - key * self.block]

    def prompts(self, count: int, length: int, seed: int) -> torch.Tensor:
        """``[count, length]`` single-document prompts (held out: their own seed stream)."""
        rng = np.random.default_rng([self.seed, seed, 999])
        toks, _, _ = self._generate(rng, np.full((count, 1), length), length)
        return torch.from_numpy(np.ascontiguousarray(toks))


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
