"""The training run behind examples/specdec/train.py: set-up, the worker loops of both layouts, the summary.

Entered after the command line was validated (``cli.validate``), so everything here may assume sane values.

* ``threaded`` (default): T target threads feed D drafter threads through bounded queues; each drafter trains its
  own replica on one batch per step; gradients are averaged across drafters (``runtime.Reducer``).
* ``sequential``: the usual alternative (SpecForge / EAGLE-3 style): one thread per device runs the target forward
  and then the drafter step, one batch after the other. It trains on the same D batches per step (accumulating
  gradients), with the same models, compile settings and data, so the two layouts differ only in threading.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import faulthandler
import json
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from . import checkpoint, cli, flops, graphs, masks, metrics, models, runtime
from . import data as data_mod
from .config import Config
from .runtime import Lane, PhaseTimer, Reducer, Run, StatsLog, worker


# ------------------------------------------------------------------------------------------------- devices
def check_devices(cfg: Config) -> str | None:
    """CUDA requested but not there, a GPU index that does not exist, or an SM partition the GPU cannot make: one
    line, or None."""
    spec = cfg.devices
    entries = cli.device_list(spec)
    if spec == "auto" and not torch.cuda.is_available():
        for flag, wanted in (("--step-graphs", cfg.step_graphs), ("--target-sms", cfg.target_sms)):
            if wanted:
                return f"{flag} needs CUDA, and --devices auto found none (torch {torch.__version__})"
    if spec != "auto" and any(e.startswith("cuda") for e in entries):
        preset = f" (preset {cfg.preset})" if cfg.preset else ""
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            return (f"--devices {spec}{preset} needs CUDA, but {why} (torch {torch.__version__}); "
                    f"use --devices cpu or --preset cpu-tiny")
        n = torch.cuda.device_count()
        for e in entries:
            if ":" in e and int(e.split(":")[1]) >= n:
                return f"--devices {spec}: {e} does not exist ({n} GPU(s) visible)"
    if cfg.target_sms:
        for dev in dict.fromkeys(d for d in parse_devices(spec) if d.type == "cuda"):
            problem = runtime.sm_limit_problem(dev, cfg.target_sms)
            if problem:
                return f"--target-sms {cfg.target_sms}: {problem}"
    return None


def parse_devices(spec: str) -> list[torch.device]:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        return [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return [torch.device(d) for d in cli.device_list(spec)]


# ------------------------------------------------------------------------------------------------- set-up
def build_data(cfg: Config, pin: bool = False):
    """The batch source; ``pin``: synthetic batches are made in pinned memory (for asynchronous uploads)."""
    if cfg.data:
        tok = data_mod.load_tokenizer(cfg.tokenizer or (cfg.target_hf if data_mod.has_tokenizer(cfg.target_hf) else None))
        return data_mod.TextData(cfg.data, tok, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    return data_mod.MarkovData(cfg.vocab_size, cfg.batch_size, cfg.seq_len, seed=cfg.seed, pin_memory=pin)


def build_target(cfg: Config, data, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if cfg.target_hf:
        return models.HFTarget(cfg.target_hf).to(device=device, dtype=dtype)
    use_prior = isinstance(data, data_mod.MarkovData) and cfg.prior_strength > 0
    prior = data.transition_logprobs() if use_prior else None
    vocab = cfg.vocab_size if isinstance(data, data_mod.MarkovData) else max(cfg.vocab_size, data.vocab_size)
    tcfg = models.TargetConfig(vocab_size=vocab, dim=cfg.target_dim, layers=cfg.target_layers,
                              heads=cfg.target_heads, ffn=cfg.target_ffn, seed=cfg.seed,
                              prior_strength=cfg.prior_strength if use_prior else 0.0,
                              kv_heads=cfg.target_kv_heads, rope_theta=cfg.rope_theta)
    return models.TargetLM(tcfg, prior, device=device, dtype=dtype).eval()


def replicate_target(target: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if isinstance(target, models.TargetLM):
        return target.replicate(device)
    return copy.deepcopy(target).to(device)


def target_shape(cfg: Config, target: torch.nn.Module) -> flops.Shape:
    if isinstance(target, models.HFTarget):
        return flops.Shape(target.vocab_size, target.dim, target.heads, target.kv_heads, target.ffn,
                           target.num_layers)
    tcfg = target.cfg
    return flops.Shape(tcfg.vocab_size, tcfg.dim, tcfg.heads, tcfg.kv_heads or tcfg.heads, tcfg.ffn, tcfg.layers)


def drafter_config(cfg: Config, target: torch.nn.Module) -> models.DrafterConfig:
    s = target_shape(cfg, target)
    return models.DrafterConfig(vocab_size=target.output_embedding().shape[0], dim=s.dim, heads=s.heads,
                                ffn=s.ffn, ttt_steps=cfg.ttt_steps, kv_heads=s.kv_heads,
                                rope_theta=getattr(target, "rope_theta", None) or cfg.rope_theta)


def drafter_prototype(cfg: Config, target: torch.nn.Module, dcfg: models.DrafterConfig
                      ) -> models.Drafter:
    """The drafter every replica copies: one seeded init (global RNG, on the CPU), so replicas are identical."""
    torch.manual_seed(cfg.seed + 1)
    buffer_dtype = torch.bfloat16 if cfg.autocast == "bf16" else torch.float32
    return models.Drafter(dcfg, target.input_embedding(), target.output_embedding(), buffer_dtype)


def make_replica(cfg: Config, proto: models.Drafter, lane: Lane, loss_fn: Callable) -> Replica:
    """A copy of ``proto`` on the lane's device with its AdamW (fused on CUDA unless ``--no-fused-optimizer``;
    capturable with ``--step-graphs``)."""
    model = copy.deepcopy(proto).to(lane.device)
    opt_kw: dict[str, Any] = dict(fused=True) if lane.device.type == "cuda" and cfg.fused_optimizer else {}
    if cfg.step_graphs:
        opt_kw["capturable"] = True  # step counts on the device: an update that can be replayed
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, **opt_kw)
    return Replica(model, opt, lane, cfg.ttt_steps, cfg, loss_fn)


def maybe_compile(cfg: Config, fn: Callable, mode: str = "default") -> Callable:
    if cfg.no_compile:
        return fn
    kwargs: dict[str, Any] = dict(backend=cfg.compile_backend, dynamic=False)
    if mode != "default":
        kwargs["mode"] = mode
    return torch.compile(fn, **kwargs)


def autocast(cfg: Config, device: torch.device):
    if cfg.autocast == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def mean_attended_keys(data, batches: int = 2) -> float:
    """Keys a query attends under the document-causal mask, averaged over a few batches (for the FLOP count)."""
    total, count = 0.0, 0
    for i in range(batches):
        doc = data.batch(i).doc
        b, s = doc.shape
        total += float(masks.dense_mask(masks.document_causal_mod(doc), b, s, s, torch.device("cpu")).sum())
        count += b * s
    return total / count


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
    @torch.no_grad()
    def build(cls, cfg: Config, data, target: torch.nn.Module, device: torch.device) -> EvalSet:
        """Eager and dense-masked on purpose: built once, before any worker thread starts."""
        block_fn = getattr(target, "block_fn", None)
        if block_fn is not None:  # a compiled layer would recompile for every generated length
            target.block_fn = None
        try:
            return cls._build(cfg, data, target, device)
        finally:
            if block_fn is not None:
                target.block_fn = block_fn

    @classmethod
    @torch.no_grad()
    def _build(cls, cfg: Config, data, target: torch.nn.Module, device: torch.device) -> EvalSet:
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
    """Linear warm-up then cosine decay to 10 %; a pure function of the step, so resume needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


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
    concatenation, no per-parameter copies. Layout: [gradients | loss | accuracy per TTT step | grad norm].

    With ``--step-graphs`` the forward+backward and the optimizer update are ``graphs.StepGraph``s; the learning
    rate is then a tensor on the device (a captured update reads it at every replay)."""

    def __init__(self, model: models.Drafter, opt: torch.optim.Optimizer, lane: Lane, k: int,
                 cfg: Config, loss_fn: Callable) -> None:
        self.model, self.opt, self.lane, self.k = model, opt, lane, k
        params = list(model.parameters())
        self.n_grad = sum(p.numel() for p in params)
        self.flat = torch.zeros(self.n_grad + k + 2, device=lane.device)
        offset = 0
        for p in params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
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

    def _fwd_bwd_fn(self, cfg: Config, loss_fn: Callable) -> Callable[..., None]:
        """The mask, loss, backward (into the flat buffer) and the batch's statistics, from the batch's tensors."""
        k, n_grad = self.k, self.n_grad
        mark_step = cfg.drafter_compile_mode == "reduce-overhead" and not cfg.no_compile

        def fwd_bwd(fused, vals, idx, packed) -> None:
            tokens, doc, pos = packed.unbind(0)
            if cfg.autocast == "off" and fused.dtype != torch.float32:
                fused = fused.float()
            mask = masks.target_mask(doc)  # document-causal: every TTT step's mask (models.Drafter.step)
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()  # the stats output is consumed before the next replay
            with autocast(cfg, self.lane.device):
                loss, stats = loss_fn(self.model, fused, tokens, pos, doc, vals, idx, mask, k)
            loss.backward()
            self.flat[n_grad:n_grad + 1 + k].add_(stats)

        return fwd_bwd

    def forward_backward(self, run: Run, feats: Sequence[torch.Tensor], first: bool) -> None:
        step = self.fb_graph or self.fwd_bwd

        def call() -> None:
            if first:
                self.flat.zero_()
            step(*feats)

        run.call("drafter", call)

    def update(self, run: Run, idx: int, step: int, lr: float) -> None:
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


# ------------------------------------------------------------------------------------------------ training
def run_training(cfg: Config) -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    devices = parse_devices(cfg.devices)
    cuda = devices[0].type == "cuda"
    if not cuda or cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads or 1)
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for whatever stays float32
    masks.BUILDER = cfg.mask_builder
    T, D = cfg.target_threads, cfg.drafter_threads
    if cfg.layout == "threaded":
        t_dev = [devices[j % len(devices)] for j in range(T)]
        d_dev = [devices[(T + d) % len(devices)] for d in range(D)]
    else:  # one worker per device (at most one per batch of the step), each running target and drafter
        W = min(D, len(devices))
        t_dev = d_dev = devices[:W]
    if world > 1:
        import torch.distributed as dist

        backend = "nccl" if cuda else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(d_dev[0])
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    out = Path(cfg.out) if cfg.out and rank == 0 else None
    log = metrics.MetricsLog(out / "metrics.jsonl" if out else None)
    target_dtype = torch.bfloat16 if cfg.target_dtype == "bfloat16" else torch.float32
    out_dtype = target_dtype if target_dtype != torch.float32 else None
    k = cfg.ttt_steps

    data = build_data(cfg, pin=cuda and cfg.pin_memory)
    first_dev = t_dev[0]
    target0 = build_target(cfg, data, first_dev, target_dtype)
    dcfg = drafter_config(cfg, target0)
    topk = cfg.target_topk if 0 < cfg.target_topk < dcfg.vocab_size else 0

    # One frozen target (and one compiled forward) per device, shared by the target threads on that device.
    placed: dict[torch.device, torch.nn.Module] = {first_dev: target0}

    def target_on(dev: torch.device) -> torch.nn.Module:
        if dev not in placed:
            placed[dev] = replicate_target(target0, dev)
        return placed[dev]

    target_fns: dict[torch.device, Callable] = {}
    per_layer = cfg.target_compile_scope == "layer" and isinstance(target0, models.TargetLM)
    block_fn = maybe_compile(cfg, models.call_block, cfg.target_compile_mode) if per_layer else None
    for dev in dict.fromkeys(t_dev):
        def fwd(tokens, pos, mask, tgt=target_on(dev)):
            return models.target_features(tgt, tokens, pos, mask, topk, out_dtype)

        if per_layer:  # eager around one compiled layer, shared by every layer (and device)
            target_on(dev).block_fn = block_fn
            target_fns[dev] = fwd
        else:
            target_fns[dev] = maybe_compile(cfg, fwd, cfg.target_compile_mode)

    proto = drafter_prototype(cfg, target0, dcfg)
    threaded = cfg.layout == "threaded"
    lanes = [Lane(dev, cfg.streams, threaded and cfg.stream_priority == "drafter") for dev in d_dev]
    loss_fn = maybe_compile(cfg, models.ttt_loss, cfg.drafter_compile_mode)
    replicas = [make_replica(cfg, proto, lane, loss_fn) for lane in lanes]
    del proto
    start_step = 0
    if cfg.resume:
        ckpt = checkpoint.find(Path(cfg.resume))
        for rep in replicas:
            start_step = checkpoint.load(ckpt, rep.model, rep.opt)
            rep.bind_lr()
            rep.completed = start_step
        print(f"resumed from {ckpt} at step {start_step}", flush=True)
        if start_step >= cfg.steps:
            print(f"train.py: error: --resume {cfg.resume} is at step {start_step}, not before --steps "
                  f"{cfg.steps}: nothing to train", file=sys.stderr, flush=True)
            return 2
    evalset = EvalSet.build(cfg, data, target_on(d_dev[0]), d_dev[0]) if rank == 0 else None

    run = Run(cfg, rank=rank, world=world)
    n_grad = replicas[0].n_grad

    def clip(total: torch.Tensor) -> None:
        g = total[:n_grad]
        norm = g.norm()
        total[-1] = norm
        if cfg.grad_clip > 0:
            g.mul_(torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0))

    run.reducer = Reducer(len(replicas), D, world, clip, graph=bool(cfg.step_graphs))
    tokens_per_batch = cfg.batch_size * cfg.seq_len
    summary: dict[str, Any] = {"tau_initial": None, "tau_final": None}
    leader = replicas[0]
    stats_log = StatsLog(leader.lane, cfg.pin_memory)
    timer = PhaseTimer(cuda)
    mark_after = start_step + cfg.measure_after
    prof_range = None
    if cfg.profile and rank == 0:
        a, b = (int(x) for x in (cfg.profile_steps or f"{mark_after + 1}:{mark_after + 6}").split(":"))
        prof_range = (a, b)
    profiler: list[Any] = []
    saved: dict[str, Any] = {"step": None}

    if evalset is not None:
        ev = evalset.evaluate(leader.model, cfg)
        summary["tau_initial"] = ev["tau"]
        log.write({"kind": "eval", "step": start_step, **ev})
        print(f"τ of the drafter at step {start_step} (before training): {ev['tau']:.3f}  accept={ev['accept']}",
              flush=True)
    if cuda:
        # Worker streams do not wait for the default streams, on which everything above was built.
        graphs.synchronize(devices)
    keys = mean_attended_keys(data)
    flop_counts = {"target": flops.target_flops_per_token(target_shape(cfg, target0), keys),
                   "drafter": flops.drafter_flops_per_token(
                       flops.Shape(dcfg.vocab_size, dcfg.dim, dcfg.heads, dcfg.kv_heads or dcfg.heads, dcfg.ffn),
                       k, keys)}
    progress = metrics.Progress(cfg.steps, start_step, cfg.log_every) if rank == 0 else None

    def write_records(items, taus: dict[int, float]) -> None:
        for step, vals, extra in items:
            loss, acc, gnorm = vals[0], vals[1:1 + k], vals[-1]
            summary.setdefault("loss_first", loss)
            summary["loss_last"] = loss
            log.write({"kind": "train", "step": step, "loss": round(loss, 6), "acc": [round(a, 4) for a in acc],
                       "grad_norm": round(gnorm, 4), **extra})
            info = {"loss": f"{loss:.3f}", "acc0": f"{acc[0]:.2f}"}
            if step in taus:
                info["tau"] = f"{taus[step]:.2f}"
            if progress is not None:
                progress.update(step, cfg.steps, info)

    def after_step(step: int) -> None:
        """Leader only, after optimizer step ``step`` was issued: measurement marks, logging, evaluation,
        checkpoints. Only evaluation and checkpoints wait for the GPU."""
        if step == mark_after:
            if cuda:
                graphs.synchronize(devices)
            run.throughput.mark()
        if step == cfg.steps:
            if cuda:
                graphs.synchronize(devices)
            run.throughput.close()
        if prof_range is not None:
            if step == prof_range[0] and not profiler:
                profiler.append(start_profiler(cuda))
            elif step == prof_range[1] and profiler:
                stop_profiler(profiler.pop(), Path(cfg.profile), cuda)
        if rank != 0:
            return
        stats_log.push(step, leader.flat[n_grad:], {"lr": lr_at(cfg, step - 1),
                                                     "elapsed_s": round(time.monotonic() - run.throughput.start, 2)})
        taus: dict[int, float] = {}
        eval_due = evalset is not None and ((cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps)
        save_due = out is not None and not cfg.no_checkpoint and (
            step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0))
        if eval_due:
            ev = evalset.evaluate(leader.model, cfg)
            summary["tau_final"] = ev["tau"]
            log.write({"kind": "eval", "step": step, **ev})
            taus[step] = ev["tau"]
        write_records(stats_log.drain(wait=eval_due or save_due), taus)
        if save_due:
            save_checkpoint(out, leader, step, cfg, D * world)
            saved["step"] = step

    # --host-lock: one thread at a time issues a target forward or a drafter forward/backward (never held while
    # waiting for a queue or a barrier). Without it, every torch call releases the GIL and another thread takes
    # it, so threads hand the interpreter to each other thousands of times per step; with it, the threads that
    # wait sleep on the lock and the one issuing work keeps the GIL between its calls.
    host_lock = threading.Lock() if cfg.host_lock and cfg.layout == "threaded" else contextlib.nullcontext()

    def target_loop(j: int) -> None:
        lane = t_lanes[j]
        call = TargetCall(cfg, target_fns[t_dev[j]], lane)
        with lane.context():
            n = start_step * D + (j - start_step * D) % T  # local batch numbers n ≡ j (mod T), in increasing order
            while n < cfg.steps * D:
                s, d = divmod(n, D)
                if j == 0:
                    inject_fault(cfg, "target", s)
                with host_lock:
                    feats = target_step(run, cfg, data, call, lane, (s * world + rank) * D + d, s, timer)
                    ready = lane.record()
                run.put(queues[d], (n, feats, ready))
                run.throughput.add("target", tokens_per_batch)
                n += T

    def drafter_loop(d: int) -> None:
        rep = replicas[d]
        with rep.lane.context():
            pending: dict[int, tuple] = {}
            for s in range(start_step, cfg.steps):
                n = s * D + d
                if d == 0:
                    inject_fault(cfg, "drafter", s)
                while n not in pending:
                    got_n, item, ev = run.get(queues[d])
                    pending[got_n] = (item, ev)
                item, ev = pending.pop(n)
                with host_lock:
                    feats = rep.lane.fetch(item, ev)
                    del item
                    started = timer.start(s)
                    rep.forward_backward(run, feats, first=True)
                    rep.lane.release(feats)  # referenced until this stream has read them (not record_stream)
                    del feats
                rep.update(run, d, s, lr_at(cfg, s))
                timer.stop("drafter", s + 1, started)
                run.throughput.add("drafter", tokens_per_batch)
                if d == 0:
                    after_step(s + 1)
                    run.steps_done = s + 1
                    run.last_progress = time.monotonic()

    def sequential_loop(w: int) -> None:
        rep = replicas[w]
        call = TargetCall(cfg, target_fns[d_dev[w]], rep.lane)
        mine = [d for d in range(D) if d % len(replicas) == w]
        with rep.lane.context():
            for s in range(start_step, cfg.steps):
                if w == 0:
                    inject_fault(cfg, "target", s)
                    inject_fault(cfg, "drafter", s)
                for m, d in enumerate(mine):
                    feats = target_step(run, cfg, data, call, rep.lane, (s * world + rank) * D + d, s, timer)
                    run.throughput.add("target", tokens_per_batch)
                    started = timer.start(s)  # drafter interval per batch; the last one includes the update
                    rep.forward_backward(run, feats, first=(m == 0))
                    del feats
                    if m == len(mine) - 1:
                        rep.update(run, w, s, lr_at(cfg, s))
                    timer.stop("drafter", s + 1, started)
                run.throughput.add("drafter", tokens_per_batch * len(mine))
                if w == 0:
                    after_step(s + 1)
                    run.steps_done = s + 1
                    run.last_progress = time.monotonic()

    if cfg.layout == "threaded":
        t_lanes = [Lane(dev, cfg.streams, cfg.stream_priority == "target", cfg.target_sms) for dev in t_dev]
        queues = [queue.Queue(maxsize=cfg.queue_size) for _ in range(D)]
        threads = [worker(run, f"target-{j}@{t_dev[j]}", lambda j=j: target_loop(j)) for j in range(T)]
        threads += [worker(run, f"drafter-{d}@{d_dev[d]}", lambda d=d: drafter_loop(d)) for d in range(D)]
    else:
        threads = [worker(run, f"sequential-{w}@{d_dev[w]}", lambda w=w: sequential_loop(w))
                   for w in range(len(replicas))]
    util = None
    if cuda and cfg.gpu_util == "auto":
        util = metrics.GpuUtil(sorted({d.index for d in list(t_dev) + list(d_dev)}))
    run.gpu_util = util
    if cfg.measure_after == 0:
        run.throughput.mark()
    status = supervise(run, threads)
    if progress is not None:
        progress.close()
    for p in profiler:
        stop_profiler(p, Path(cfg.profile), cuda)

    # ------------------------------------------------------------------------------------------- summary
    sync_error = None
    if cuda:
        try:
            graphs.synchronize(devices)
        except Exception as e:  # a sticky CUDA error from a dead thread
            sync_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    run.throughput.close()
    if util is not None:
        util.close()
    if rank == 0 and sync_error is None:
        write_records(stats_log.drain(wait=True), {})
    kept: tuple[str, int] | None = None
    if status == "error" and out is not None and not cfg.no_checkpoint:
        if sync_error is None:
            kept = emergency_checkpoint(out, replicas, saved.get("step"), start_step, cfg, D * world)
        elif saved.get("step") is not None:
            kept = (str(out / f"ckpt-{saved['step']:06d}"), saved["step"])
    checksum = float(sum(p.detach().double().sum().cpu() for p in leader.model.parameters())) if sync_error is None else float("nan")
    emit_line(f"PARAM_CHECKSUM rank={rank} {checksum:.10e}")
    peak = peak_reserved = None
    if cuda:  # allocated: tensors alive; reserved: what the caching allocator holds from the driver
        peak = sum(torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(devices))
        peak_reserved = sum(torch.cuda.max_memory_reserved(d) for d in dict.fromkeys(devices))
    tp = run.throughput.summary()
    gpus = len({d for d in list(t_dev) + list(d_dev) if d.type == "cuda"})
    peak_t = {kind: (cfg.peak_tflops or (flops.peak_tflops(torch.cuda.get_device_name(devices[0]), bf16) if cuda else None))
              for kind, bf16 in (("target", target_dtype == torch.bfloat16), ("drafter", cfg.autocast == "bf16"))}
    mfu = {kind: flops.mfu(flop_counts[kind], (tp.get(kind) or {}).get("steady_tokens_per_s"), peak_t[kind], gpus)
           for kind in ("target", "drafter")}
    phases = timer.summary(mark_after) if cuda and sync_error is None else {}
    for kind, ph in phases.items():  # every interval covers one batch (see the loops)
        if peak_t.get(kind):
            ph["mfu_in_interval"] = round(flop_counts[kind] * tokens_per_batch / (ph["mean_ms"] / 1e3) / 1e12
                                          / peak_t[kind], 4)
    mfu["peak_tflops_per_gpu"] = peak_t
    mfu["gpus"] = gpus
    mfu["mean_attended_keys"] = round(keys, 1)
    mfu["phases"] = phases
    gpu_util = util.mean(run.throughput.window()) if util is not None else None
    first = run.errors.first_exc
    summary.update({
        "status": status, "layout": cfg.layout, "steps_done": run.steps_done, "start_step": start_step,
        "steps": cfg.steps, "rank": rank, "world_size": world,
        "threads": {"target": T, "drafter": D} if cfg.layout == "threaded" else {"sequential": len(replicas)},
        "devices": {"target": [str(x) for x in t_dev], "drafter": [str(x) for x in d_dev]},
        "throughput": tp, "mfu": mfu, "gpu_util_pct": gpu_util,
        "gpu_util_source": (util.source or util.reason) if util is not None else None,
        "compile": metrics.compile_counts(),
        "errors": {"total": run.errors.total(), "counted": dict(run.errors.counts), "first": run.errors.first,
                   "first_line": one_line(first) if first is not None else None},
        "checkpoint_kept": kept[0] if kept else None, "hung": False, "peak_gpu_mem_bytes": peak,
        "peak_gpu_reserved_bytes": peak_reserved, "param_checksum": checksum,
        "ttc_disable_env": os.environ.get("TTC_DISABLE"), "ttc": metrics.ttc_status(),
        "torch": torch.__version__, "wall_s": round(time.monotonic() - run.throughput.start, 2),
        "config": cfg.as_dict(),
    })
    if out is not None:
        note = metrics.plot(log.records, out / "metrics.png")
        if note:
            print(note, flush=True)
            summary["plot"] = note
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log.close()
    if rank == 0:
        emit_line("SUMMARY " + json.dumps(short_summary(summary, out), default=str))
    if status == "error":
        print(f"\nFATAL: a worker thread failed; first error:\n{run.errors.first}", file=sys.stderr, flush=True)
        where = f"checkpoint of step {kept[1]} kept: {kept[0]}" if kept else "no checkpoint written"
        print(f"train.py: error: {summary['errors']['first_line']} (last completed step {run.steps_done}; {where})",
              file=sys.stderr, flush=True)
    if world > 1 and status == "ok":
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"ok": 0, "error": 1, "interrupted": 130}[status]


class TargetCall:
    """How one thread runs the target: ``packed [3, B, S] -> (fused, vals, idx)``, tensors it may hand on.

    The mask and the compiled forward, eagerly; under the compile mode's CUDA graphs (``reduce-overhead``) or, with
    ``--step-graphs``, as one ``graphs.StepGraph`` of mask and forward. Graph outputs are overwritten by the next
    replay, so those are copied before they go to a drafter."""

    def __init__(self, cfg: Config, fn: Callable, lane: Lane) -> None:
        self.fn, self.dense = fn, bool(cfg.target_hf)
        self.cudagraphs = cfg.target_compile_mode == "reduce-overhead" and not cfg.no_compile
        self.graph = graphs.StepGraph(self._forward, lane.stream) if cfg.step_graphs else None

    def _forward(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens, doc, pos = packed.unbind(0)
        mask = masks.target_mask(doc, dense=self.dense)
        with torch.no_grad():
            return self.fn(tokens, pos, mask)

    def __call__(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.graph is not None:
            return tuple(t.clone() for t in self.graph(packed))
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
            return tuple(t.clone() for t in self._forward(packed))
        return self._forward(packed)


def target_step(run: Run, cfg: Config, data, call: TargetCall, lane: Lane, index: int, step: int,
                timer: PhaseTimer) -> tuple[torch.Tensor, ...]:
    """One target forward on the lane: data (a pure function of ``index``), mask, compiled forward. Returns what
    the drafter step takes: ``(fused, vals, idx, packed)``."""
    packed = upload(data.batch(index), lane, cfg.pin_memory)
    started = timer.start(step)
    fused, vals, idx = run.call("target", lambda: call(packed))
    timer.stop("target", step + 1, started)
    return fused, vals, idx, packed


def save_checkpoint(out: Path, rep: Replica, step: int, cfg: Config, batches_per_step: int) -> str:
    path = out / f"ckpt-{step:06d}"
    checkpoint.save(path, rep.model, rep.opt, step, {"data_position": step * batches_per_step,
                                                     "config": cfg.as_dict()})
    return str(path)


def emergency_checkpoint(out: Path, replicas: list[Replica], saved_step: int | None, start_step: int,
                         cfg: Config, batches_per_step: int) -> tuple[str, int] | None:
    """After a thread died: the state of the last step the replicas completed (replicas are identical after a
    completed step; one caught inside its optimizer update is skipped), unless that step is already saved.
    Returns (path, step) of the checkpoint that holds the last completed step, or None."""
    usable = [r for r in replicas if not r.updating]
    if not usable:
        return None
    rep = max(usable, key=lambda r: r.completed)
    if saved_step is not None and saved_step >= rep.completed:
        return str(out / f"ckpt-{saved_step:06d}"), saved_step
    if rep.completed <= start_step:
        return None
    try:
        return save_checkpoint(out, rep, rep.completed, cfg, batches_per_step), rep.completed
    except Exception as e:  # the device may be unusable after the failure
        print(f"checkpoint of step {rep.completed} not written: {one_line(e)}", file=sys.stderr, flush=True)
        return None


def emit_line(line: str) -> None:
    """Print one machine-read line (SUMMARY, PARAM_CHECKSUM) in a single write. Ranks of a torchrun job share
    stdout, and print() writes the text and its newline separately: with unbuffered stdout another rank's line
    could land between the two (seen once in CI as two checksums on one line)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def start_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # every thread's ops, not only the profiling thread's (torch >= 2.7)
        from torch.profiler import _ExperimentalConfig

        prof = profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
    except (ImportError, TypeError):
        prof = profile(activities=activities)
    prof.__enter__()
    return prof


def stop_profiler(prof, directory: Path, cuda: bool) -> None:
    prof.__exit__(None, None, None)
    directory.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(directory / "trace.json"))
    avg = prof.key_averages()
    parts = []
    for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:
            parts.append(f"sorted by {key}\n" + avg.table(sort_by=key, row_limit=30))
        except Exception as e:  # older names (self_cuda_time_total)
            parts.append(f"sorted by {key}: {e}")
    (directory / "ops.txt").write_text("\n\n".join(parts))


def short_summary(s: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """The one-line ``SUMMARY`` (stdout); everything else, the full TTC status included, is in summary.json."""
    tp = {kind: {"tokens": v.get("tokens"), "steady_tokens_per_s": v.get("steady_tokens_per_s"),
                 "time_to_first_step_s": v.get("time_to_first_step_s")}
          for kind, v in s["throughput"].items() if kind in ("target", "drafter")}
    ttc = s.get("ttc") or {}
    return {
        "status": s["status"], "layout": s["layout"], "steps_done": s["steps_done"], "start_step": s["start_step"],
        "world_size": s["world_size"], "threads": s["threads"], "tau_initial": s.get("tau_initial"),
        "tau_final": s.get("tau_final"), "loss_first": s.get("loss_first"), "loss_last": s.get("loss_last"),
        "throughput": tp, "mfu": {k: (s["mfu"].get(k) or {}).get("mfu") for k in ("target", "drafter")},
        "gpu_util_pct": s.get("gpu_util_pct"),
        "peak_gpu_mem_mib": round(s["peak_gpu_mem_bytes"] / 2**20) if s.get("peak_gpu_mem_bytes") else None,
        "compile": {k: s["compile"].get(k) for k in ("unique_graphs", "recompiles")},
        "errors": {"total": s["errors"]["total"], "first": s["errors"]["first_line"]},
        "ttc": "disabled" if s.get("ttc_disable_env") == "1" else ("active" if ttc.get("importable") else "absent"),
        "summary_json": str(out / "summary.json") if out is not None else None,
    }


def supervise(run: Run, threads: list[threading.Thread]) -> str:
    """Main thread: start workers, watch for hangs, handle Ctrl-C. Returns 'ok', 'error' or 'interrupted'
    (a hang exits the process from here: hung threads cannot be joined)."""
    timeout = run.cfg.hang_timeout
    run.last_progress = time.monotonic()
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            # Backstop if this thread itself stops running: faulthandler's own thread dumps stacks and exits.
            faulthandler.dump_traceback_later(timeout * 1.5 + 60, exit=True)
            for t in threads:
                t.join(timeout=0.2)
            idle = time.monotonic() - run.last_progress
            if idle > timeout and not run.stop.is_set():
                hang_exit(run, idle)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping worker threads ...", file=sys.stderr, flush=True)
        run.halt()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        faulthandler.cancel_dump_traceback_later()
        return "interrupted"
    faulthandler.cancel_dump_traceback_later()
    return "error" if run.errors.first is not None else "ok"


def hang_exit(run: Run, idle: float) -> None:
    print(f"\nHANG DETECTED: no drafter step completed in {idle:.0f} s (--hang-timeout {run.cfg.hang_timeout:g}); "
          f"last completed step {run.steps_done}. Stacks of all threads follow.", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    summary = {"status": "hung", "hung": True, "steps_done": run.steps_done, "idle_s": round(idle, 1),
               "errors": {"total": run.errors.total(), "counted": dict(run.errors.counts)},
               "ttc_disable_env": os.environ.get("TTC_DISABLE")}
    if getattr(run, "gpu_util", None) is not None:
        run.gpu_util.close()
    if run.cfg.out and run.rank == 0:
        Path(run.cfg.out, "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    emit_line("SUMMARY " + json.dumps(summary, default=str))
    print(f"train.py: error: hang: no drafter step completed in {idle:.0f} s (last completed step {run.steps_done})",
          file=sys.stderr, flush=True)
    sys.stderr.flush()
    os._exit(3)
