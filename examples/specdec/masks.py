"""Attention masks shared by the target and the drafter.

Every mask is written once as a flex-attention ``mask_mod(b, h, q_idx, kv_idx) -> bool``. The same function is used
two ways:

* on CUDA it is handed to ``create_block_mask`` and the resulting ``BlockMask`` drives compiled ``flex_attention``;
* on CPU (where flex_attention has no backward on torch 2.13) it is evaluated densely by broadcasting index tensors,
  giving a boolean ``[B, 1, Q, KV]`` mask for ``F.scaled_dot_product_attention``.

Because both paths evaluate the very same ``mask_mod``, the CPU fallback trains exactly the attention pattern that
the CUDA path trains.

The drafter's attention pattern at training-time-test (TTT) step ``i`` (``ttt_mod``, the reference definition),
over the keys/values of steps ``0..i`` laid out along one axis, ``kv_idx = step * S + position``:

* step-0 keys were computed from the *target's* fused hidden states: ordinary document-causal attention
  (``kv_pos <= q`` and same document);
* keys of steps ``1..i`` were computed from the drafter's *own* earlier outputs at the same position: only the
  diagonal (``kv_pos == q``) is visible. At inference those are the drafter's earlier speculated tokens for the
  position being extended, and no other position has such keys.

The drafter does not build that mask: it attends the step-0 keys under the document-causal mask (the target's)
and adds the diagonal terms outside the attention kernel (``models.Drafter.step``); tests check that both give
the same attention.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Mask = Union[torch.Tensor, "torch.nn.attention.flex_attention.BlockMask"]


def document_causal_mod(doc: torch.Tensor) -> MaskMod:
    """Causal attention restricted to the query's own packed document (``doc`` is ``[B, S]`` document ids)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return mask_mod


def ttt_mod(doc: torch.Tensor, seq_len: int) -> MaskMod:
    """Mask of TTT step ``i`` over the concatenated keys of steps ``0..i`` (see module docstring)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        step = kv_idx // seq_len
        pos = kv_idx % seq_len
        same_doc = doc[b, q_idx] == doc[b, pos]
        causal_on_target = (step == 0) & (pos <= q_idx)
        own_diagonal = (step > 0) & (pos == q_idx)
        return same_doc & (causal_on_target | own_diagonal)

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate ``mask_mod`` for every (b, q, kv) by broadcasting: ``[B, 1, Q, KV]`` bool, True = attend."""
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    q = torch.arange(q_len, device=device).view(1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    h = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(b, h, q, kv).unsqueeze(1)


def mean_attended_keys(docs: Sequence[torch.Tensor]) -> float:
    """Keys a query attends under the document-causal mask, averaged over the batches' document ids ``docs``
    (``[B, S]`` each; for the FLOP count)."""
    total, count = 0.0, 0
    for doc in docs:
        b, s = doc.shape
        total += float(dense_mask(document_causal_mod(doc), b, s, s, torch.device("cpu")).sum())
        count += b * s
    return total / count


def use_flex(device: torch.device) -> bool:
    """flex_attention is used where it can train (CUDA); elsewhere the dense SDPA fallback."""
    return bool(torch.device(device).type == "cuda")


BLOCK_SIZE = 128  # flex_attention's default sparse block size


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block occupancy ``[..., rows, cols]`` (bool) -> (count per row, column indices with the occupied ones
    first, in increasing order), int32: the layout ``BlockMask`` stores (what ``create_block_mask`` computes)."""
    dense = blocks.to(torch.int32)
    count = dense.sum(dim=-1).to(torch.int32)
    order = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count.contiguous(), order.contiguous()


def block_tensors(dense: torch.Tensor, block: int = BLOCK_SIZE) -> tuple[torch.Tensor, ...]:
    """The eight index tensors of a ``BlockMask`` from a dense ``[B, H, Q, KV]`` boolean mask: block sums, full
    and partial blocks, each ordered per row (``_ordered``) and per column."""
    b, h, q_len, kv_len = dense.shape
    pad_q, pad_kv = (-q_len) % block, (-kv_len) % block
    if pad_q or pad_kv:
        dense = torch.nn.functional.pad(dense, (0, pad_kv, 0, pad_q))
    q_blocks, kv_blocks = (q_len + pad_q) // block, (kv_len + pad_kv) // block
    sums = dense.reshape(b, h, q_blocks, block, kv_blocks, block).sum(dim=(3, 5))
    full = sums == block * block
    partial = (sums > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_kv_num, full_kv_idx = _ordered(full)
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full.transpose(-2, -1))
    return kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx


def _block_mask(tensors: Sequence[torch.Tensor], q_len: int, kv_len: int, mask_mod: MaskMod,
                block: int = BLOCK_SIZE) -> torch.nn.attention.flex_attention.BlockMask:
    from torch.nn.attention.flex_attention import BlockMask

    # Positional arguments: the constructor's first eleven parameters are the same from torch 2.5 to 2.13.
    return BlockMask((q_len, kv_len), *tensors, (block, block), mask_mod)


def block_mask_from_dense(dense: torch.Tensor, mask_mod: MaskMod, block: int = BLOCK_SIZE) -> torch.nn.attention.flex_attention.BlockMask:
    """``BlockMask`` from a dense ``[B, H, Q, KV]`` boolean mask and the ``mask_mod`` that produced it.

    Same result as ``create_block_mask(mask_mod, ...)`` (tested), but built from a handful of tensor ops:
    ``create_block_mask`` evaluates the mask_mod under ``vmap`` and derives the query-side indices through
    another ``vmap``, tens of milliseconds of interpreter time per mask, and the drafter needs one per TTT step
    for every batch. Nothing here synchronises with the device.
    """
    return _block_mask(block_tensors(dense, block), dense.shape[2], dense.shape[3], mask_mod, block)


def _target_tensors(doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    batch, seq = doc.shape
    return block_tensors(dense_mask(document_causal_mod(doc), batch, seq, seq, doc.device))


class _Compiled:
    """``--mask-builder compiled``: the dense evaluation and the block tensors of ``block_mask_from_dense`` as one
    compiled function per mask kind (a few fused kernels and one Python call instead of ~25 eager ops per mask:
    the eager ops are interpreter time that every trainer thread needs the GIL for). Compiled on first use, default
    mode (no CUDA graphs: the tensors outlive the call), shapes static."""

    def __init__(self) -> None:
        self.fns: dict = {}

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        compiled = self.fns.get(name)
        if compiled is None:
            compiled = self.fns.setdefault(name, torch.compile(fn, dynamic=False))
        return compiled(*args)


_COMPILED = _Compiled()

# How BlockMasks are built: "dense" (block_mask_from_dense, eager), "compiled" (the same ops compiled) or
# "create_block_mask" (torch's own, slower; kept as a switch, --mask-builder, in case a fast path misbehaves on
# some torch version). Set once before threads start, from the run's configuration (build.setup); no default of
# its own: the default is Config's.
BUILDER: str | None = None


def _builder() -> str:
    """``BUILDER``, which only the BlockMask (CUDA) path reads."""
    if BUILDER is None:
        raise RuntimeError("masks.BUILDER is not set: it is the run's --mask-builder, set before any BlockMask is built")
    return BUILDER


def build_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> Mask:
    """A ``BlockMask`` on CUDA, a dense boolean mask elsewhere; built eagerly, outside compiled code."""
    if use_flex(device) and _builder() == "create_block_mask":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=str(device))
    dense = dense_mask(mask_mod, batch, q_len, kv_len, torch.device(device))
    return block_mask_from_dense(dense, mask_mod) if use_flex(device) else dense


def target_mask(doc: torch.Tensor, dense: bool = False) -> Mask:
    """Document-causal mask over a packed ``[B, S]`` batch: the target's, and the drafter's at every TTT step
    (``dense``: always a bool tensor, for targets that cannot take a BlockMask, e.g. Hugging Face models)."""
    batch, seq = doc.shape
    if dense:
        return dense_mask(document_causal_mod(doc), batch, seq, seq, doc.device)
    if use_flex(doc.device) and _builder() == "compiled":
        return _block_mask(_COMPILED("target", _target_tensors, doc), seq, seq, document_causal_mod(doc))
    return build_mask(document_causal_mod(doc), batch, seq, seq, doc.device)
