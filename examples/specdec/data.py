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
from typing import Any, Sequence

import numpy as np
import torch

BOS = 0


@dataclass
class Batch:
    """One batch: ``packed`` is ``[3, B, S]`` int64 (tokens, document ids, in-document positions), so it travels to
    a device as one copy; ``tokens``, ``doc`` and ``pos`` are views of it."""

    index: int
    packed: torch.Tensor

    @property
    def tokens(self) -> torch.Tensor:
        return self.packed[0]

    @property
    def doc(self) -> torch.Tensor:
        return self.packed[1]

    @property
    def pos(self) -> torch.Tensor:
        return self.packed[2]

    def to(self, device: torch.device) -> Batch:
        return Batch(self.index, self.packed.to(device))


def _stack(index: int, rows: list[tuple]) -> Batch:
    packed = np.stack([np.stack([r[j] for r in rows]) for j in range(3)]).astype(np.int64)
    return Batch(index, torch.from_numpy(packed))


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
                 min_doc: int = 16, max_doc: int | None = None, block: int = 16, pin_memory: bool = False) -> None:
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
        # The choice table [V * levels] (level j of token v at v * levels + j) followed by the identity [V] (_chain).
        choices = np.take_along_axis(succ, choice, axis=1).astype(np.int64).ravel()
        self.table = np.concatenate([choices, np.arange(vocab_size, dtype=np.int64)])
        self.block, self.cached_blocks = max(1, block), 4
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        # block key -> its batches, or the Event of the thread making it
        self._cache: OrderedDict[int, list[Batch] | threading.Event] = OrderedDict()

    def transition_logprobs(self, floor: float = 1e-3) -> torch.Tensor:
        """``[V, V]`` log transition probabilities (floored), used as the built-in target's bigram prior."""
        trans = np.full((self.vocab_size, self.vocab_size), floor)
        rows = np.repeat(np.arange(self.vocab_size), self.succ.shape[1])
        np.add.at(trans, (rows, self.succ.ravel()), self.probs.ravel())
        return torch.from_numpy(np.log(trans / trans.sum(1, keepdims=True))).float()

    def _draws(self, index: int) -> tuple:
        """Batch ``index``'s random draws, from its own seed stream: document lengths ``[B, N]``, the uniform
        tokens and the quantised successor choices ``[B, S]``."""
        rng = np.random.default_rng([self.seed, index])
        n_docs = self.seq_len // self.min_doc + 1
        lengths = rng.integers(self.min_doc, self.max_doc + 1, size=(self.batch_size, n_docs))
        return (lengths, *self._token_draws(rng, self.batch_size, self.seq_len))

    def _token_draws(self, rng: np.random.Generator, rows: int, seq_len: int) -> tuple:
        """The chain's draws ``[rows, seq_len]``, in this order: uniform tokens, quantised successor choices."""
        shape = (rows, seq_len)
        return rng.integers(1, self.vocab_size, size=shape), rng.integers(0, self.levels, size=shape)

    def _layout(self, lengths: np.ndarray, seq_len: int) -> tuple:
        """Rows of packed documents with the given lengths ``[R, N]`` (cumulative sum must reach ``seq_len``):
        document ids and in-document positions ``[R, seq_len]``."""
        rows = lengths.shape[0]
        ends = np.cumsum(lengths, axis=1)
        # Document index of every position: one searchsorted over all rows (row r's ends shifted by r * span
        # keep the concatenation sorted).
        span = int(ends[:, -1].max()) + seq_len + 1
        shift = (np.arange(rows) * span)[:, None]
        t = np.arange(seq_len)
        doc = np.searchsorted((ends + shift).ravel(), (t[None, :] + shift).ravel(), side="right").reshape(rows, seq_len)
        doc -= (np.arange(rows) * lengths.shape[1])[:, None]
        pos = t[None, :] - np.take_along_axis(ends - lengths, doc, axis=1)
        return doc, pos

    def _chain(self, pos: np.ndarray, uniform: np.ndarray, level: np.ndarray) -> np.ndarray:
        """Tokens ``[R, S]``: position 0 of a document is BOS, position 1 the uniform token, later ones follow the
        chain (``level`` picks the successor). One small numpy step per position for all rows at once (rows are
        independent, so how many are stepped together changes nothing).

        Every position is one gather, ``token = table[prev * mult + add]``: ``table`` is the choice table followed
        by the identity, and a position that does not follow the chain gets ``mult = 0`` and ``add`` pointing at
        its fixed token in the identity part. Three in-place ufunc calls per position, no temporaries."""
        vocab, levels = self.vocab_size, self.levels
        free = pos >= 2
        fixed = np.where(pos == 0, BOS, uniform)
        mult = np.ascontiguousarray(np.where(free, levels, 0).T)
        add = np.ascontiguousarray(np.where(free, level, vocab * levels + fixed).T)
        take, multiply = self.table.take, np.multiply
        out = np.empty(mult.shape, dtype=np.int64)
        idx = np.empty(mult.shape[1], dtype=np.int64)
        prev = np.zeros_like(idx)
        for i in range(mult.shape[0]):
            multiply(prev, mult[i], out=idx)
            idx += add[i]
            prev = out[i]
            take(idx, out=prev)
        rows: np.ndarray = out.T
        return rows

    def batches(self, indices: Sequence[int]) -> list[Batch]:
        """``[batch(i) for i in indices]``, generated together: each batch draws from its own seed stream exactly
        as ``batch`` does, and the layout and the chain run once over the rows of all of them (the chain's cost is
        per position, not per row: 16 batches cost little more than one). Each batch is a view of one
        ``[n, 3, B, S]`` tensor (pinned when the data was made with ``pin_memory=True``)."""
        draws = [self._draws(i) for i in indices]
        lengths, uniform, level = (np.concatenate([d[j] for d in draws]) for j in range(3))
        doc, pos = self._layout(lengths, self.seq_len)
        toks = self._chain(pos, uniform, level)
        shape = (len(draws), self.batch_size, self.seq_len)
        packed = torch.from_numpy(np.stack([a.reshape(shape) for a in (toks, doc, pos)], axis=1))
        if self.pin_memory:
            packed = packed.pin_memory()
        return [Batch(index, packed[k]) for k, index in enumerate(indices)]

    def batch(self, index: int) -> Batch:
        """Batch ``index`` (a pure function of it). Batches are made ``block`` at a time (``batches``) and kept in a
        small cache shared by the threads that ask: the trainer's threads ask for consecutive indices. A block is
        made outside the cache's lock by the first thread that needs it (others that need the same block wait for
        it, others not), and a thread that takes a batch from the second half of a block makes the next block
        first if nobody has started it: threads that ask for consecutive batches rarely wait. (Under torchrun a
        rank uses D of every WORLD x D consecutive indices, so a block also makes other ranks' batches: host work,
        never a different batch.)"""
        key, offset = divmod(index, self.block)
        if self.block > 1 and offset >= self.block // 2:
            self._block(key + 1, wait=False)
        block = self._block(key, wait=True)
        assert block is not None
        return block[offset]

    def _block(self, key: int, wait: bool) -> list[Batch] | None:
        """Block ``key`` from the cache, made here if nobody has started it; if another thread is making it: wait
        for it (``wait``) or return None."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                mine = threading.Event()
                self._put(key, mine)
        if entry is None:
            return self._make(key, mine)
        if isinstance(entry, list):
            return entry
        if not wait:
            return None
        entry.wait()
        with self._lock:  # evicted meanwhile (a thread far behind the others): make it again
            entry = self._cache.get(key)
        return entry if isinstance(entry, list) else self._make(key)

    def _make(self, key: int, event: threading.Event | None = None) -> list[Batch]:
        made = self.batches(range(key * self.block, (key + 1) * self.block))
        with self._lock:
            if event is None or self._cache.get(key) is event:
                self._put(key, made)
        if event is not None:
            event.set()
        return made

    def _put(self, key: int, entry: list[Batch] | threading.Event) -> None:
        """Under the lock: store an entry, evicting the oldest beyond ``cached_blocks``."""
        self._cache[key] = entry
        while len(self._cache) > self.cached_blocks:
            self._cache.popitem(last=False)

    def prompts(self, count: int, length: int, seed: int) -> torch.Tensor:
        """``[count, length]`` single-document prompts (held out: their own seed stream)."""
        rng = np.random.default_rng([self.seed, seed, 999])
        uniform, level = self._token_draws(rng, count, length)
        _, pos = self._layout(np.full((count, 1), length), length)
        return torch.from_numpy(np.ascontiguousarray(self._chain(pos, uniform, level)))


class ByteTokenizer:
    """Fallback tokenizer: UTF-8 bytes shifted by one so that id 0 stays BOS; vocabulary 257."""

    vocab_size = 257
    bos_token_id = BOS

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str | None) -> bool:
    """Whether a model directory ships a tokenizer (a bare checkpoint falls back to bytes)."""
    return path is not None and path != "" and any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | None) -> Any:
    """A Hugging Face tokenizer from a local path (transformers imported lazily), or the byte-level fallback."""
    if not path:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def read_documents(path: str) -> list[str]:
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    return [d.strip() for d in text.split("\n\n") if d.strip()]


class TextData:
    """Local text corpus, tokenized once, packed into a token stream with document ids, cut into windows."""

    def __init__(self, path: str, tokenizer: Any, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.batch_size, self.seq_len = batch_size, seq_len
        bos = getattr(tokenizer, "bos_token_id", None)
        bos = BOS if bos is None else int(bos)
        toks: list[int] = []
        doc: list[int] = []
        pos: list[int] = []
        docs: list[np.ndarray] = []
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


Data = MarkovData | TextData  # a batch source: ``batch(index)`` is a pure function of the index
