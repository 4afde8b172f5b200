"""One batch's work, as the worker loops (``loops.py``) call it.

* the target side: ``upload`` (a batch to the thread's device), ``TargetCall`` (mask + compiled forward, or its CUDA
  graph), ``target_step`` (both, timed);
* the drafter side: ``Replica`` (one drafter replica with its optimizer: forward + backward into a flat gradient
  buffer, the gradient average, the update) and the learning rate of a step (``lr_at``);
* the gradient clipping that follows the average (``clip_gradients``) and a replica's checkpoint
  (``save_checkpoint``);
* the held-out evaluation (``EvalSet``: τ, the mean accepted length) and the ``--inject-fault`` testing aid;
* ``Setup``: the parts of a run as ``build.setup`` made them, which the loops, the leader and the report read.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import checkpoint, checkpoint_files, graphs, masks, metrics, models, stats
from . import data as data_mod
from .config import Config
from .runtime import Lane, PhaseTimer, Run


def autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``--autocast bf16``: the drafter's forward under bf16 autocast."""
    ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if cfg.autocast == "bf16":
        ctx = torch.autocast(device.type, dtype=torch.bfloat16)
    return ctx


@dataclass
class EvalSet:
    """Held-out prompts plus the target's greedy continuation, with the target features, on one device."""

    tokens: torch.Tensor
    pos: torch.Tensor
    fused: torch.Tensor
    mask: torch.Tensor
    steps: int
    first: int
    last: int

    @classmethod
    def build(cls, cfg: Config, data: data_mod.Data, target: torch.nn.Module, device: torch.device) -> EvalSet:
        """Eager and dense-masked on purpose: built once, before any worker thread starts."""
        block_fn = getattr(target, "block_fn", None)
        if block_fn is not None:  # a compiled layer would recompile for every generated length
            target.block_fn = None
        try:
            with torch.no_grad():
                return cls._build(cfg, data, target, device)
        finally:
            if block_fn is not None:
                target.block_fn = block_fn

    @classmethod
    def _build(cls, cfg: Config, data: data_mod.Data, target: torch.nn.Module, device: torch.device) -> EvalSet:
        k = cfg.ttt_steps
        toks = data.prompts(cfg.eval_prompts, cfg.eval_prompt_len, seed=cfg.seed + 1).to(device)
        for _ in range(cfg.eval_gen_len + k + 1):
            b, s = toks.shape
            pos = torch.arange(s, device=device).expand(b, s)
            mask = masks.dense_mask(masks.document_causal_mod(torch.zeros_like(toks)), b, s, s, device)
            logits, _ = target(toks, pos, mask)
            toks = torch.cat([toks, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        b, s = toks.shape
        doc = torch.zeros_like(toks)
        pos = torch.arange(s, device=device).expand(b, s).contiguous()
        mask = masks.dense_mask(masks.document_causal_mod(doc), b, s, s, device)
        fused, _, _ = models.target_features(target, toks, pos, mask, 1)
        if cfg.autocast == "off":
            fused = fused.float()
        return cls(toks, pos, fused, mask, k, first=cfg.eval_prompt_len - 1, last=s - k - 2)

    def evaluate(self, drafter: models.Drafter, cfg: Config) -> dict[str, object]:
        with autocast(cfg, self.tokens.device):
            proposals = models.draft_greedy(drafter, self.fused, self.tokens, self.pos, self.mask, self.steps)
        return metrics.acceptance(proposals, self.tokens, self.first, self.last)


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up then cosine decay to ``--min-lr-ratio`` of ``--lr``; a pure function of the step, so resume
    needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def inject_fault(cfg: Config, thread: str, step: int) -> None:
    """``--inject-fault``: fail or hang on purpose, to exercise shutdown and the hang watchdog."""
    if not cfg.inject_fault:
        return
    kind, where, at = cfg.inject_fault.split(":")
    if where == thread and int(at) == step:
        if kind == "error":
            raise RuntimeError(f"injected fault in {thread} thread at step {step}")
        while True:  # a hang that ignores the stop event, like a real deadlock would
            time.sleep(1.0)


def upload(batch: data_mod.Batch, lane: Lane, pin: bool) -> torch.Tensor:
    """The batch's ``[3, B, S]`` (tokens, doc, pos) on the lane's device: one copy, from pinned memory and
    asynchronous on the lane's stream (a pageable copy would make the thread wait for the GPU). Synthetic data
    comes pinned already (a block of batches is pinned at once); other sources are pinned here."""
    host = batch.packed
    if not lane.cuda:
        return host
    if pin and not host.is_pinned():
        host = host.pin_memory()
    return host.to(lane.device, non_blocking=pin)


class Replica:
    """One drafter replica with its optimizer, on its lane. Gradients live in one persistent flat buffer
    (``p.grad`` are views into it, so backward accumulates straight into what gets reduced): no per-step
    concatenation, no per-parameter copies. The step's statistics ride behind the gradients (``stats.Layout``).

    With ``--step-graphs`` the forward+backward and the optimizer update are ``graphs.StepGraph``s; the learning
    rate is then a tensor on the device (a captured update reads it at every replay)."""

    def __init__(self, model: models.Drafter, opt: torch.optim.Optimizer, lane: Lane, k: int,
                 cfg: Config, loss_fn: Callable[..., Any]) -> None:
        self.model, self.opt, self.lane, self.k = model, opt, lane, k
        params = list(model.parameters())
        self.layout = stats.Layout(sum(p.numel() for p in params), k)
        self.flat = torch.zeros(self.layout.size, device=lane.device)
        grads, offset = self.layout.grads(self.flat), 0
        for p in params:
            p.grad = grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.completed = 0  # last step whose optimizer update finished
        self.updating = False
        self.fwd_bwd = self._fwd_bwd_fn(cfg, loss_fn)
        self.fb_graph: graphs.StepGraph | None = None
        self.update_graph: graphs.StepGraph | None = None
        self.lr: torch.Tensor | None = None
        if cfg.step_graphs:
            self.lr = torch.full((), float(opt.param_groups[0]["lr"]), device=lane.device)
            self.bind_lr()
            self.fb_graph = graphs.StepGraph(self.fwd_bwd, lane.stream)
            self.update_graph = graphs.StepGraph(self.opt.step, lane.stream)

    def bind_lr(self) -> None:
        """Point every param group at the device learning rate (again after a checkpoint load wrote floats)."""
        if self.lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = self.lr

    def _fwd_bwd_fn(self, cfg: Config, loss_fn: Callable[..., Any]) -> Callable[..., None]:
        """The mask, loss, backward (into the flat buffer) and the batch's statistics, from the batch's tensors."""
        k, measured, decay = self.k, self.layout.measured, cfg.step_decay
        mark_step = cfg.drafter_compile_mode == "reduce-overhead" and not cfg.no_compile

        def fwd_bwd(fused: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor, packed: torch.Tensor) -> None:
            tokens, doc, pos = packed.unbind(0)
            if cfg.autocast == "off" and fused.dtype != torch.float32:
                fused = fused.float()
            mask = masks.target_mask(doc)  # document-causal: every TTT step's mask (models.Drafter.step)
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()  # the stats output is consumed before the next replay
            with autocast(cfg, self.lane.device):
                loss, batch_stats = loss_fn(self.model, fused, tokens, pos, doc, vals, idx, mask, k, decay)
            loss.backward()
            self.flat[measured].add_(batch_stats)

        return fwd_bwd

    def forward_backward(self, run: Run, feats: Sequence[torch.Tensor], first: bool) -> None:
        step = self.fb_graph or self.fwd_bwd

        def call() -> None:
            if first:
                self.flat.zero_()
            step(*feats)

        run.call("drafter", call)

    def update(self, run: Run, idx: int, step: int, lr: float) -> None:
        assert run.reducer is not None  # build.setup makes it
        run.reducer(idx, self.flat, self.lane)
        self.updating = True
        if self.update_graph is not None:
            self.lr.fill_(lr)  # type: ignore[union-attr]
            self.update_graph()
        else:
            for group in self.opt.param_groups:
                group["lr"] = lr
            self.opt.step()
        self.updating = False
        self.completed = step + 1


class TargetCall:
    """How one thread runs the target: ``packed [3, B, S] -> (fused, vals, idx)``, tensors it may hand on.

    The mask and the compiled forward, eagerly; under the compile mode's CUDA graphs (``reduce-overhead``) or, with
    ``--step-graphs``, as one ``graphs.StepGraph`` of mask and forward. Graph outputs are overwritten by the next
    replay, so those are copied before they go to a drafter."""

    def __init__(self, cfg: Config, fn: Callable[..., Any], lane: Lane) -> None:
        self.fn, self.dense = fn, bool(cfg.target_hf)
        self.cudagraphs = cfg.target_compile_mode == "reduce-overhead" and not cfg.no_compile
        self.graph = graphs.StepGraph(self._forward, lane.stream) if cfg.step_graphs else None

    def _forward(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens, doc, pos = packed.unbind(0)
        mask = masks.target_mask(doc, dense=self.dense)
        with torch.no_grad():
            out: tuple[torch.Tensor, ...] = self.fn(tokens, pos, mask)
            return out

    def __call__(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.graph is not None:
            return tuple(t.clone() for t in self.graph(packed))
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
            return tuple(t.clone() for t in self._forward(packed))
        return self._forward(packed)


def target_step(run: Run, cfg: Config, data: data_mod.Data, call: TargetCall, lane: Lane, index: int, step: int,
                timer: PhaseTimer) -> tuple[torch.Tensor, ...]:
    """One target forward on the lane: data (a pure function of ``index``), mask, compiled forward. Returns what
    the drafter step takes: ``(fused, vals, idx, packed)``."""
    packed = upload(data.batch(index), lane, cfg.pin_memory)
    started = timer.start(step)
    fused, vals, idx = run.call("target", lambda: call(packed))
    timer.stop("target", step + 1, started)
    return fused, vals, idx, packed


def clip_gradients(total: torch.Tensor, layout: stats.Layout, max_norm: float) -> None:
    """After the gradient average (``runtime.Reducer``), on its result: the norm of the gradients is the step's
    ``grad_norm``, and the gradients are scaled down to ``max_norm`` (``--grad-clip``; 0: not clipped)."""
    g = layout.grads(total)
    norm = g.norm()
    layout.field(total, "grad_norm").copy_(norm)
    if max_norm > 0:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def save_checkpoint(out: Path, rep: Replica, step: int, cfg: Config, batches_per_step: int) -> str:
    """``rep`` after ``step`` steps, into ``out``'s checkpoint directory of that step; returns its path."""
    path = checkpoint_files.step_dir(out, step)
    checkpoint.save(path, rep.model, rep.opt, step, {"data_position": step * batches_per_step,
                                                     "config": cfg.as_dict()})
    return str(path)


@dataclass
class Setup:
    """What ``build.setup`` built; the worker threads read it and never rebind it."""

    cfg: Config
    rank: int
    world: int
    devices: list[torch.device]
    t_dev: list[torch.device]  # device of each target thread (sequential layout: of each worker)
    d_dev: list[torch.device]  # device of each drafter thread (sequential layout: of each worker)
    out: Path | None  # --out, on rank 0 only
    log: metrics.MetricsLog
    data: data_mod.Data
    target: torch.nn.Module  # the first device's; the others are copies (``build.Targets``)
    target_fns: dict[torch.device, Callable[..., Any]]
    dcfg: models.DrafterConfig
    replicas: list[Replica]
    start_step: int
    evalset: EvalSet | None  # rank 0 only
    run: Run
    timer: PhaseTimer

    @property
    def cuda(self) -> bool:
        return bool(self.devices[0].type == "cuda")

    @property
    def tokens_per_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    @property
    def batches_per_step(self) -> int:
        """Batches behind one optimizer step, over every process (a checkpoint's data position)."""
        return self.cfg.drafter_threads * self.world

    @property
    def mark_after(self) -> int:
        """The last step excluded from the steady-state throughput."""
        return self.start_step + (self.cfg.measure_after or 0)  # set by config.resolve
