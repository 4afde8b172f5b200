"""Model FLOPs per token of the target forward and of the drafter step, computed from the shapes, and MFU.

Conventions (docs/trainer.md, "Throughput and MFU"): a matmul of an ``m x n`` weight costs ``2·m·n`` FLOPs per token
forward and ``4·m·n`` backward (input and weight gradients); a frozen weight that needs only the input gradient
(the drafter's LM head), or a weight whose input needs none (the drafter's fuse layer), costs ``2·m·n`` backward.
Attention costs ``4·d·K`` per query forward (``QKᵀ`` and ``PV``, ``d`` = heads × head_dim, ``K`` = keys the query
attends under its mask, measured on the data) and twice that backward. Only useful work counts: masked-out keys,
recomputation, norms, RoPE, softmax and the loss are not FLOPs here, so MFU is conservative.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Shape:
    vocab: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int = 1

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.dim // self.heads)


def layer_matmul_params(s: Shape, in_dim: int) -> int:
    """Weights of one decoder layer whose attention reads ``in_dim`` features: q, k, v, o and SwiGLU."""
    return in_dim * s.dim + 2 * in_dim * s.kv_dim + s.dim * s.dim + 3 * s.dim * s.ffn


def target_flops_per_token(s: Shape, keys: float) -> float:
    """Forward of the target: every layer, attention over ``keys`` keys on average, the LM head."""
    return s.layers * (2 * layer_matmul_params(s, s.dim) + 4 * s.dim * keys) + 2 * s.dim * s.vocab


def drafter_flops_per_token(s: Shape, ttt_steps: int, keys: float) -> float:
    """Forward + backward of the drafter's TTT unroll. The fuse layer once, forward and weight gradient only (its
    input, the target's features, needs no gradient); per step i one decoder layer whose attention reads
    [embedding; hidden] (2H) and attends ``keys + i`` keys (causal target keys plus its own i earlier steps on the
    diagonal), and the frozen LM head (forward and input gradient)."""
    return drafter_flops_per_token_keys(s, [keys + i for i in range(ttt_steps)])


def drafter_flops_per_token_keys(s: Shape, keys_per_step: list[float]) -> float:
    total: float = 4 * 3 * s.dim * s.dim
    for keys in keys_per_step:
        total += 6 * layer_matmul_params(s, 2 * s.dim) + 12 * s.dim * keys + 4 * s.dim * s.vocab
    return total


# Dense (no sparsity) peak TFLOP/s per GPU, bf16 / tf32, from the vendors' data sheets.
PEAKS = {"H200": (989.4, 494.7), "H100 SXM": (989.4, 494.7), "H100 NVL": (835.0, 417.5), "H100 PCIe": (756.0, 378.0),
         "H100": (989.4, 494.7), "A100": (312.0, 156.0), "L40S": (362.1, 181.0), "A10G": (70.0, 35.0),
         "L4": (121.0, 60.0)}


def peak_tflops(device_name: str, bf16: bool) -> float | None:
    """Known parts by name (longest match first); None when unknown (then MFU needs --peak-tflops)."""
    for key in sorted(PEAKS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAKS[key][0 if bf16 else 1]
    return None


def mfu(flops_per_token: float, tokens_per_s: float | None, peak: float | None, gpus: int
        ) -> dict[str, float | None]:
    """Achieved TFLOP/s and its fraction of ``gpus`` × ``peak``."""
    if not tokens_per_s:
        return {"flops_per_token": flops_per_token, "tflops": None, "mfu": None}
    achieved = flops_per_token * tokens_per_s / 1e12
    return {"flops_per_token": flops_per_token, "tflops": round(achieved, 2),
            "mfu": round(achieved / (peak * gpus), 4) if peak else None}
