"""Target and drafter models.

* ``TargetLM``: a small Llama-style decoder (RMSNorm, RoPE, SwiGLU, causal attention) built in code with a seeded
  random init. A random transformer's greedy tokens are an arbitrary (but deterministic) function of the context;
  to give it some learnable, data-consistent structure, its logits get a frozen bigram prior taken from the
  synthetic Markov chain (``prior``), so its greedy continuation mostly follows likely successors while the
  transformer part decides between them from context.
* ``HFTarget``: wraps a local Hugging Face causal LM (transformers imported lazily) behind the same interface.
* ``Drafter``: EAGLE-3 style: fuse(concat(low, mid, high target hidden states)) -> concat with the token embedding
  -> one decoder layer -> LM head. Embedding and LM head are frozen copies of the target's.

All attention goes through ``attention()``, which runs ``flex_attention`` for a ``BlockMask`` (CUDA; always called
from compiled code) and ``scaled_dot_product_attention`` with a dense boolean mask otherwise (CPU fallback).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812 - torch's own convention

from . import flops, stats
from .masks import Mask


# --------------------------------------------------------------------------------------------- building blocks
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class SwiGLU(nn.Module):
    """``fused=True``: gate and up in one matmul against their concatenated weights (see ``Attention``)."""

    def __init__(self, dim: int, hidden: int, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = F.linear(x, torch.cat([self.gate.weight, self.up.weight])).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, S, D]`` at integer positions ``pos`` ``[B, S]`` (rotate-half form)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.float().unsqueeze(-1) * inv_freq  # [B, S, half]
    cos, sin = ang.cos().unsqueeze(1).to(x.dtype), ang.sin().unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, return_lse: bool = False) -> Any:
    """``[B, H, Q, D] x [B, Hkv, KV, D] -> [B, H, Q, D]`` under ``mask`` (BlockMask -> flex, tensor -> SDPA).
    ``Hkv < H``: grouped-query attention (each key/value head serves ``H / Hkv`` query heads).

    ``return_lse``: also the log-sum-exp of each query's scaled scores over the keys it attends, ``[B, H, Q]``
    float32, differentiable (flex returns it; the dense path computes the scores explicitly, since SDPA does not
    return it). Every query must attend at least one key."""
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, torch.Tensor):
        if return_lse:
            return _dense_attention_lse(q, k, v, mask)
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention.flex_attention import flex_attention

    if gqa:
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=return_lse)
    return flex_attention(q, k, v, block_mask=mask, return_lse=return_lse)


def _dense_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-2, -1)).to(acc) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype) @ v, lse


def merge_diagonal(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   diagonal: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention of ``q`` over a key set and, in addition, over one more key per query at each entry of
    ``diagonal`` (``(k_j, v_j)`` ``[B, Hkv, Q, D]``: query t also attends ``k_j[t]``), from the first set's
    output ``out`` and log-sum-exp ``lse``. Softmax over a union of key sets is the sets' outputs weighted by
    ``softmax`` of their log-sum-exps; a single key's log-sum-exp is its score. Computed in float32 (or wider)."""
    if not diagonal:
        return out
    b, h, s, d = q.shape
    hkv = diagonal[0][0].shape[1]
    g = h // hkv
    acc = torch.promote_types(out.dtype, torch.float32)
    qg = q.to(acc).view(b, hkv, g, s, d)
    scores = [lse.to(acc).view(b, hkv, g, s)]
    scores += [(qg * kj.to(acc).unsqueeze(2)).sum(-1) * d ** -0.5 for kj, _ in diagonal]
    w = torch.softmax(torch.stack(scores), dim=0).unsqueeze(-1)  # [1 + n, B, Hkv, G, Q, 1]
    merged = w[0] * out.to(acc).view(b, hkv, g, s, d)
    for j, (_, vj) in enumerate(diagonal, start=1):
        merged = merged + w[j] * vj.to(acc).unsqueeze(2)
    return merged.view(b, h, s, d).to(out.dtype)


def hidden_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Indices into a ``hidden_states`` tuple (entry 0 = embeddings, entry i = output of layer i) used as the
    EAGLE-3 low/mid/high features: roughly a quarter, half and all-but-one of the depth."""
    low = max(1, num_layers // 4)
    mid = max(1, num_layers // 2)
    high = num_layers - 1 if num_layers >= 3 else num_layers
    return low, mid, high


# ----------------------------------------------------------------------------------------------------- target
@dataclass(kw_only=True)
class TargetConfig:
    """The built-in target's shape and init; every value from the run's ``Config`` (``build.build_target``)."""

    vocab_size: int
    dim: int
    layers: int
    heads: int
    ffn: int
    seed: int
    prior_strength: float  # weight of the frozen bigram prior in the logits (0 disables it)
    kv_heads: int | None  # grouped-query attention (Llama 3: 8); None = heads
    rope_theta: float


class Attention(nn.Module):
    """``fused=True`` computes q, k and v with one matmul against the concatenation of their weights (the
    parameters stay separate, so checkpoints do not change). The drafter uses it: its matmuls are small (one
    batch, one layer), and one [N, in] x [in, q+2kv] product, with one input-gradient and one weight-gradient
    product in backward, is fewer and larger kernels than three of each plus the sum of three input gradients
    (measured together with ``SoftCrossEntropy``: docs/trainer.md, row 14). The frozen target keeps three
    (concatenating its weights would copy them on every forward)."""

    def __init__(self, in_dim: int, dim: int, heads: int, kv_heads: int | None, rope_theta: float,
                 fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.heads, self.head_dim = heads, dim // heads
        self.kv_heads = kv_heads or heads
        self.rope_theta = rope_theta
        self.q = nn.Linear(in_dim, dim, bias=False)
        self.k = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape

        def split(t: torch.Tensor, h: int) -> torch.Tensor:
            return t.view(b, s, h, self.head_dim).transpose(1, 2)

        if self.fused:
            kv_dim = self.kv_heads * self.head_dim
            qkv = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]))
            q, k, v = qkv.split([self.heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = split(q, self.heads), split(k, self.kv_heads), split(v, self.kv_heads)
        return rope(q, pos, self.rope_theta), rope(k, pos, self.rope_theta), v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        b, h, s, d = out.shape
        return self.o(out.transpose(1, 2).reshape(b, s, h * d))


class Block(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.dim, cfg.heads, cfg.kv_heads, cfg.rope_theta)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: Mask) -> torch.Tensor:
        q, k, v = self.attn.project(self.attn_norm(x), pos)
        x = x + self.attn.merge(attention(q, k, v, mask))
        return x + self.mlp(self.mlp_norm(x))


def call_block(block: nn.Module, x: torch.Tensor, pos: torch.Tensor, mask: Mask) -> torch.Tensor:
    """One decoder layer. Compiled on its own (``--target-compile-scope layer``) it is traced once and reused by
    every layer: dynamo treats the layer's weights as inputs (inlined nn.Modules), so a 32-layer target compiles
    one layer's graph instead of one 32-layer graph."""
    return block(x, pos, mask)


class TargetLM(nn.Module):
    """Frozen Llama-style target. ``forward`` returns logits and the full ``hidden_states`` list (HF convention).

    Built on the meta device and materialised directly on ``device`` in ``dtype`` (an 8B model never exists in
    float32 or on the CPU), then initialised from its own generator on that device: the weights are a function of
    (seed, device type), independent of the global RNG. On the CPU they are the same as when the model was built
    there in float32 and filled parameter by parameter, which is what earlier versions did.
    """

    def __init__(self, cfg: TargetConfig, prior: torch.Tensor | None = None,
                 device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                 init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        device = torch.device(device or "cpu")
        with torch.device("meta"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.norm = RMSNorm(cfg.dim)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.to(dtype)
        self.to_empty(device=device)
        if init:
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if p.dim() == 2:
                        std = 1.0 if name.startswith("embed") else 1.0 / math.sqrt(p.shape[1])
                        p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
                    else:  # RMSNorm gains
                        p.fill_(1.0)
        # (a [V, V] prior is out of the question for large vocabularies: 128k is 64 GB)
        prior = prior.to(device=device, dtype=torch.float32) * cfg.prior_strength \
            if prior is not None and cfg.prior_strength else None
        self.register_buffer("prior", prior, persistent=False)
        self.requires_grad_(False)

    def replicate(self, device: torch.device) -> TargetLM:
        """An identical copy on another device (weights copied, not re-drawn)."""
        dtype = self.embed.weight.dtype
        other = TargetLM(self.cfg, None, device=device, dtype=dtype, init=False)
        other.load_state_dict(self.state_dict())
        if self.prior is not None:
            other.prior = self.prior.to(device)
        other.eval()
        return other

    @property
    def num_layers(self) -> int:
        return self.cfg.layers

    def input_embedding(self) -> torch.Tensor:
        return self.embed.weight

    def output_embedding(self) -> torch.Tensor:
        return self.lm_head.weight

    block_fn = None  # optional callable(block, x, pos, mask), e.g. one compiled function shared by all layers

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, mask: Mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed(tokens)
        hidden = [x]
        call = self.block_fn or call_block
        for blk in self.blocks:
            x = call(blk, x, pos, mask)
            hidden.append(x)
        logits = self.lm_head(self.norm(x))
        if self.prior is not None:
            logits = logits.float() + self.prior[tokens]
        return logits, hidden


class HFTarget(nn.Module):
    """A local Hugging Face causal LM behind the ``TargetLM`` interface (transformers imported lazily).

    Packed documents are kept apart by passing the dense document-causal mask as a 4D boolean ``attention_mask``
    (SDPA attention) and per-document ``position_ids``.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:  # optional extra
            raise SystemExit("--target-hf needs the optional dependency 'transformers' (pip install transformers)") from e
        # Any to the checker: transformers' model classes are partly typed on top of an untyped torch
        self.model: Any = cast(Any, AutoModelForCausalLM).from_pretrained(path, dtype=torch.float32,
                                                                            attn_implementation="sdpa")
        self.model.eval().requires_grad_(False)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.dim = int(cfg.hidden_size)
        self.heads = int(cfg.num_attention_heads)
        self.ffn = int(getattr(cfg, "intermediate_size", 4 * self.dim))
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.rope_theta = float(getattr(cfg, "rope_theta", 10000.0))

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def input_embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def output_embedding(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, mask: Mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if not isinstance(mask, torch.Tensor):
            raise TypeError("HFTarget takes a dense boolean mask (build it with masks.dense_mask)")
        out = self.model(input_ids=tokens, position_ids=pos, attention_mask=mask, output_hidden_states=True)
        return out.logits, list(out.hidden_states)


def target_features(target: nn.Module, tokens: torch.Tensor, pos: torch.Tensor, mask: Mask, topk: int,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a target thread sends to the drafters: fused low/mid/high hidden states ``[B, S, 3H]`` and the
    next-token distribution, either

    * ``topk < vocab``: top-k logits ``[B, S, k]`` and their token ids ``[B, S, k]`` (``ids[..., 0]`` greedy), or
    * ``topk >= vocab`` (or 0): the full logits ``[B, S, V]`` and the greedy token ``[B, S]``. No sort: a
      full-vocabulary top-k sorts every row and ships int64 ids as large as the logits.

    ``out_dtype`` (e.g. bfloat16) is the dtype of what is sent (features and logits)."""
    logits, hidden = target(tokens, pos, mask)
    lo, mid, hi = hidden_layer_ids(target.num_layers)
    fused = torch.cat([hidden[lo], hidden[mid], hidden[hi]], dim=-1)
    vocab = logits.shape[-1]
    if 0 < topk < vocab:
        vals, idx = torch.topk(logits, topk, dim=-1)
        vals = vals.float()
    else:
        vals, idx = logits, logits.argmax(dim=-1)
    if out_dtype is not None:
        fused, vals = fused.to(out_dtype), vals.to(out_dtype)
    return fused, vals, idx


def target_shape(target: nn.Module) -> flops.Shape:
    """The shape of a target (built-in or Hugging Face), for the drafter built on it and the FLOP count."""
    if isinstance(target, HFTarget):
        return flops.Shape(target.vocab_size, target.dim, target.heads, target.kv_heads, target.ffn,
                           target.num_layers)
    tcfg = target.cfg
    return flops.Shape(tcfg.vocab_size, tcfg.dim, tcfg.heads, tcfg.kv_heads or tcfg.heads, tcfg.ffn, tcfg.layers)


# ---------------------------------------------------------------------------------------------------- drafter
@dataclass(kw_only=True)
class DrafterConfig:
    """The drafter's shape: the target's, with the run's TTT depth (``build.drafter_config``)."""

    vocab_size: int
    dim: int
    heads: int
    ffn: int
    ttt_steps: int
    kv_heads: int | None
    rope_theta: float


class Drafter(nn.Module):
    """EAGLE-3 drafter: one decoder layer on top of [token embedding ; fused target features].

    The embedding and LM head are frozen copies of the target's (buffers, so they are neither trained, reduced nor
    checkpointed). ``step`` is one TTT step: it appends its keys/values to ``cache`` so later steps can see them on
    the diagonal (see masks.ttt_mod).
    """

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 buffer_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        # Frozen copies; under bf16 autocast they are kept in bf16 (autocast would otherwise cast the LM head,
        # V x H, on every TTT step).
        self.register_buffer("embed", embed.detach().to(dtype=buffer_dtype, copy=True), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().to(dtype=buffer_dtype, copy=True), persistent=False)
        self.fuse = nn.Linear(3 * cfg.dim, cfg.dim, bias=False)
        self.emb_norm = RMSNorm(cfg.dim)
        self.hid_norm = RMSNorm(cfg.dim)
        self.attn = Attention(2 * cfg.dim, cfg.dim, cfg.heads, cfg.kv_heads, cfg.rope_theta, fused=True)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn, fused=True)
        self.final_norm = RMSNorm(cfg.dim)

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, mask: Mask,
             cache: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[B, S, H]`` (fused target features at step 0, own outputs later), tokens ``[B, S]`` (the token
        after each position at this step) -> (new hidden, logits).

        ``mask`` is the document-causal mask over the ``S`` keys of step 0, the same at every step. Step ``i > 0``
        also attends, at its own position only, the keys of steps ``1..i`` (masks.ttt_mod): ``i`` keys per
        query. Concatenated to the step-0 keys they would cost a whole key block per query block each in the
        attention kernel (forward and backward), so step ``i`` attends the step-0 keys alone and merges the
        diagonal terms through the log-sum-exp (``merge_diagonal``): the same attention, with a key length of
        ``S`` at every step. ``cache`` collects each step's keys and values."""
        x = torch.cat([self.emb_norm(F.embedding(tokens, self.embed)), self.hid_norm(hidden)], dim=-1)
        q, k, v = self.attn.project(x, pos)
        cache.append((k, v))
        if len(cache) == 1:
            out = attention(q, k, v, mask)
        else:
            k0, v0 = cache[0]
            out0, lse0 = attention(q, k0, v0, mask, return_lse=True)
            out = merge_diagonal(q, out0, lse0, cache[1:])
        h = hidden + self.attn.merge(out)
        h = h + self.mlp(self.mlp_norm(h))
        logits = F.linear(self.final_norm(h), self.lm_head)
        return h, logits


def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``x[:, t + n]`` at position t (padded with ``fill`` past the end); static shapes for compile."""
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_valid(doc: torch.Tensor, i: int) -> torch.Tensor:
    """Positions t whose TTT-step-i label (target prediction at t + 1 + i) exists and lies in t's document."""
    nxt = shift_left(doc, 1 + i, fill=-1)
    return nxt == doc


class SoftCrossEntropy(torch.autograd.Function):
    """Row-wise cross-entropy of ``softmax(z)`` against the distribution ``softmax(v)``, in float32:
    ``logsumexp(z) - sum(softmax(v) * z)``, which is ``-(softmax(v) * log_softmax(z)).sum(-1)``.

    Why a Function of its own: written with ``log_softmax`` the loss keeps the ``[N, V]`` float32 log-probabilities
    for backward and its backward is a row reduction (``log_softmax``'s backward sums the incoming gradient over
    the row). Since ``softmax(v)`` sums to one, the gradient is simply ``(softmax(z) - softmax(v)) * grad``: here
    forward keeps only the two row log-sum-exps, and backward is one pointwise pass over ``z`` and ``v``. On an
    H200 the log_softmax form was the drafter's largest fused kernel (8-10 % of a batch's GPU time,
    docs/results/trainer-h200-drafter-kernels.md). ``v`` gets no gradient (the target's logits are data)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        z32, v32 = z.float(), v.float()
        lse_z, lse_v = torch.logsumexp(z32, dim=-1), torch.logsumexp(v32, dim=-1)
        ctx.save_for_backward(z, v, lse_z, lse_v)
        return lse_z - (torch.exp(v32 - lse_v.unsqueeze(-1)) * z32).sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        z, v, lse_z, lse_v = ctx.saved_tensors
        q = torch.exp(z.float() - lse_z.unsqueeze(-1))
        p = torch.exp(v.float() - lse_v.unsqueeze(-1))
        return (grad.unsqueeze(-1) * (q - p)).to(z.dtype), None


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against the target's full distribution ``softmax(target_logits)`` per row
    (float32, shape ``logits.shape[:-1]``); gradients flow to ``logits`` only."""
    return SoftCrossEntropy.apply(logits, target_logits.detach())


def ttt_loss(drafter: Drafter, fused: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor,
             tgt_vals: torch.Tensor, tgt_idx: torch.Tensor, mask: Mask, steps: int, step_decay: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-time-test loss, unrolled over ``steps`` steps (teacher-forced tokens, own hidden states);
    ``mask``: the batch's document-causal mask (``Drafter.step``).

    Step i at position t reads token ``x[t+1+i]`` and predicts the target's next-token distribution at position
    ``t+1+i``: soft cross-entropy against the target's top-k (renormalised) or, when the target sent its full
    logits (``tgt_idx`` is the greedy token ``[B, S]``), against its whole distribution. Step losses are weighted
    ``step_decay**i`` (``--step-decay``). Returns (loss, the batch's measured statistics packed by ``stats.pack``: the loss and the
    accuracy of steps 0 .. k-1, argmax against the target's greedy token), the statistics detached, for logging
    without a host synchronisation.
    """
    full = tgt_idx.dim() == tokens.dim()
    hidden = drafter.fuse(fused)
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = hidden.new_zeros((), dtype=torch.float32)
    weights = 0.0
    accs = []
    for i in range(steps):
        hidden, logits = drafter.step(hidden, shift_left(tokens, 1 + i), pos + i, mask, cache)
        vals, idx = shift_left(tgt_vals, 1 + i), shift_left(tgt_idx, 1 + i)
        valid = ttt_valid(doc, i).float()
        count = valid.sum().clamp_min(1.0)
        if full:
            greedy = idx
            ce = soft_cross_entropy(logits, vals)
        else:
            greedy = idx[..., 0]
            logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, idx)
            ce = -(torch.softmax(vals.float(), dim=-1) * logq).sum(-1)
        w = step_decay ** i
        total = total + w * (ce * valid).sum() / count
        weights += w
        accs.append(((logits.argmax(-1) == greedy).float() * valid).sum() / count)
    loss = total / weights
    return loss, stats.pack(loss=loss, acc=torch.stack(accs))


def draft_greedy(drafter: Drafter, fused: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
                 mask: Mask, steps: int) -> torch.Tensor:
    """Autoregressive drafting at every position at once: step 0 reads the real next token, step i>0 reads the
    drafter's own step-(i-1) proposal. Returns proposals ``[k, B, S]``; proposal i at t is for position t+2+i."""
    with torch.no_grad():
        hidden = drafter.fuse(fused)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        tok = shift_left(tokens, 1)
        out = []
        for i in range(steps):
            hidden, logits = drafter.step(hidden, tok, pos + i, mask, cache)
            tok = logits.argmax(-1)
            out.append(tok)
        return torch.stack(out)
