"""Set-up of a training run: everything built in the main thread before the worker threads start (``setup``).

In order: the devices of the threads, torch.distributed (under torchrun), the data, the frozen target (one per
device) and its compiled forward, the drafter replicas with their optimizers (resumed from a checkpoint if asked),
the held-out eval set, and the state every thread shares (``runtime.Run``: stop event, errors, throughput, the
gradient average). The result is a ``steps.Setup``, which the loops, the leader and the summary read.
"""
from __future__ import annotations

import copy
import datetime
import functools
import os
from pathlib import Path
from typing import Any, Callable

import torch

from . import checkpoint, masks, metrics, models, runtime
from . import data as data_mod
from .config import Config
from .runtime import Lane, PhaseTimer, Reducer, Run
from .steps import EvalSet, Replica, Setup, clip_gradients


# ------------------------------------------------------------------------------------------------- devices
def place_threads(cfg: Config, devices: list[torch.device]) -> tuple[list[torch.device], list[torch.device]]:
    """The devices of the target threads and of the drafter threads: round robin over ``devices``, targets first.
    The sequential layout has one worker per device (at most one per batch of the step), each running target and
    drafter: both lists are those workers' devices."""
    t_threads, d_threads = cfg.target_threads, cfg.drafter_threads
    if cfg.layout == "threaded":
        return ([devices[j % len(devices)] for j in range(t_threads)],
                [devices[(t_threads + d) % len(devices)] for d in range(d_threads)])
    workers = devices[:min(d_threads, len(devices))]
    return workers, workers


def init_distributed(cfg: Config, cuda: bool, device: torch.device) -> None:
    """One process per node under torchrun: NCCL between GPUs, gloo between CPUs."""
    import torch.distributed as dist

    backend = "nccl" if cuda else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.dist_timeout))


# ------------------------------------------------------------------------------------------------- models
def build_data(cfg: Config, pin: bool = False) -> data_mod.Data:
    """The batch source; ``pin``: synthetic batches are made in pinned memory (for asynchronous uploads)."""
    if cfg.data:
        tok = data_mod.load_tokenizer(cfg.tokenizer or (cfg.target_hf if data_mod.has_tokenizer(cfg.target_hf) else None))
        return data_mod.TextData(cfg.data, tok, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    return data_mod.MarkovData(cfg.vocab_size, cfg.batch_size, cfg.seq_len, seed=cfg.seed, pin_memory=pin)


def build_target(cfg: Config, data: data_mod.Data, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if cfg.target_hf:
        return models.HFTarget(cfg.target_hf).to(device=device, dtype=dtype)
    use_prior = isinstance(data, data_mod.MarkovData) and cfg.prior_strength > 0
    prior = data.transition_logprobs() if use_prior and isinstance(data, data_mod.MarkovData) else None
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


class Targets:
    """The frozen target, one per device (replicas of the first), shared by the threads on that device."""

    def __init__(self, first: torch.nn.Module, device: torch.device) -> None:
        self.first = first
        self.placed: dict[torch.device, torch.nn.Module] = {device: first}

    def on(self, device: torch.device) -> torch.nn.Module:
        if device not in self.placed:
            self.placed[device] = replicate_target(self.first, device)
        return self.placed[device]


def target_forwards(cfg: Config, targets: Targets, t_dev: list[torch.device], vocab_size: int
                    ) -> dict[torch.device, Callable[..., Any]]:
    """Per target device, the forward the target threads call: ``(tokens, pos, mask) -> (fused, vals, idx)``
    (``models.target_features``), compiled as a whole; or, with ``--target-compile-scope layer``, eager around one
    compiled decoder layer, shared by every layer (and device)."""
    topk = cfg.target_topk if 0 < cfg.target_topk < vocab_size else 0
    out_dtype = torch.bfloat16 if cfg.target_dtype == "bfloat16" else None
    per_layer = cfg.target_compile_scope == "layer" and isinstance(targets.first, models.TargetLM)
    block_fn = maybe_compile(cfg, models.call_block, cfg.target_compile_mode) if per_layer else None
    fns: dict[torch.device, Callable[..., Any]] = {}
    for dev in dict.fromkeys(t_dev):
        target = targets.on(dev)

        def fwd(tokens, pos, mask, tgt=target):  # type: ignore[no-untyped-def]
            return models.target_features(tgt, tokens, pos, mask, topk, out_dtype)

        if per_layer:
            target.block_fn = block_fn
            fns[dev] = fwd
        else:
            fns[dev] = maybe_compile(cfg, fwd, cfg.target_compile_mode)
    return fns


def drafter_config(cfg: Config, target: torch.nn.Module) -> models.DrafterConfig:
    s = models.target_shape(target)
    return models.DrafterConfig(vocab_size=target.output_embedding().shape[0], dim=s.dim, heads=s.heads,
                                ffn=s.ffn, ttt_steps=cfg.ttt_steps, kv_heads=s.kv_heads,
                                rope_theta=getattr(target, "rope_theta", None) or cfg.rope_theta)


def drafter_prototype(cfg: Config, target: torch.nn.Module, dcfg: models.DrafterConfig
                      ) -> models.Drafter:
    """The drafter every replica copies: one seeded init (global RNG, on the CPU), so replicas are identical."""
    torch.manual_seed(cfg.seed + 1)
    buffer_dtype = torch.bfloat16 if cfg.autocast == "bf16" else torch.float32
    return models.Drafter(dcfg, target.input_embedding(), target.output_embedding(), buffer_dtype)


def make_replica(cfg: Config, proto: models.Drafter, lane: Lane, loss_fn: Callable[..., Any]) -> Replica:
    """A copy of ``proto`` on the lane's device with its AdamW (fused on CUDA unless ``--no-fused-optimizer``;
    capturable with ``--step-graphs``)."""
    model = copy.deepcopy(proto).to(lane.device)
    opt_kw: dict[str, Any] = {"fused": True} if lane.device.type == "cuda" and cfg.fused_optimizer else {}
    if cfg.step_graphs:
        opt_kw["capturable"] = True  # step counts on the device: an update that can be replayed
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, **opt_kw)
    return Replica(model, opt, lane, cfg.ttt_steps, cfg, loss_fn)


def drafter_replicas(cfg: Config, target: torch.nn.Module, dcfg: models.DrafterConfig, d_dev: list[torch.device]
                     ) -> list[Replica]:
    """One identical replica per drafter thread (sequential layout: per worker), each on its own lane, sharing one
    compiled loss."""
    proto = drafter_prototype(cfg, target, dcfg)
    threaded = cfg.layout == "threaded"
    lanes = [Lane(dev, cfg.streams, threaded and cfg.stream_priority == "drafter") for dev in d_dev]
    loss_fn = maybe_compile(cfg, models.ttt_loss, cfg.drafter_compile_mode)
    return [make_replica(cfg, proto, lane, loss_fn) for lane in lanes]


def resume(path: Path, replicas: list[Replica]) -> int:
    """Load the checkpoint ``--resume`` points at into every replica; returns its step."""
    ckpt = checkpoint.find(path)
    start_step = 0
    for rep in replicas:
        start_step = checkpoint.load(ckpt, rep.model, rep.opt)
        rep.bind_lr()
        rep.completed = start_step
    print(f"resumed from {ckpt} at step {start_step}", flush=True)
    return start_step


def maybe_compile(cfg: Config, fn: Callable[..., Any], mode: str = "default") -> Callable[..., Any]:
    if cfg.no_compile:
        return fn
    kwargs: dict[str, Any] = {"backend": cfg.compile_backend, "dynamic": False}
    if mode != "default":
        kwargs["mode"] = mode
    compiled: Callable[..., Any] = torch.compile(fn, **kwargs)
    return compiled


# ------------------------------------------------------------------------------------------------- the set-up
def setup(cfg: Config) -> Setup:
    """Build the run (see the module's docstring). Without an eval set when a resumed run has nothing left to train
    (the caller stops there)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    devices = runtime.parse_devices(cfg.devices)
    cuda = devices[0].type == "cuda"
    threads = cfg.torch_threads_for(cuda)
    if threads:
        torch.set_num_threads(threads)
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for whatever stays float32
    masks.BUILDER = cfg.mask_builder
    t_dev, d_dev = place_threads(cfg, devices)
    if world > 1:
        init_distributed(cfg, cuda, d_dev[0])
    out = Path(cfg.out) if cfg.out and rank == 0 else None
    log = metrics.MetricsLog(out / "metrics.jsonl" if out else None)
    target_dtype = torch.bfloat16 if cfg.target_dtype == "bfloat16" else torch.float32

    data = build_data(cfg, pin=cuda and cfg.pin_memory)
    targets = Targets(build_target(cfg, data, t_dev[0], target_dtype), t_dev[0])
    dcfg = drafter_config(cfg, targets.first)
    target_fns = target_forwards(cfg, targets, t_dev, dcfg.vocab_size)
    replicas = drafter_replicas(cfg, targets.first, dcfg, d_dev)
    start_step = resume(Path(cfg.resume), replicas) if cfg.resume else 0
    evalset = None
    if rank == 0 and start_step < cfg.steps:
        evalset = EvalSet.build(cfg, data, targets.on(d_dev[0]), d_dev[0])

    run = Run(cfg, rank=rank, world=world)
    clip = functools.partial(clip_gradients, layout=replicas[0].layout, max_norm=cfg.grad_clip)
    run.reducer = Reducer(len(replicas), cfg.drafter_threads, world, clip, graph=bool(cfg.step_graphs))
    return Setup(cfg=cfg, rank=rank, world=world, devices=devices, t_dev=t_dev, d_dev=d_dev, out=out, log=log,
                 data=data, target=targets.first, target_fns=target_fns, dcfg=dcfg, replicas=replicas,
                 start_step=start_step, evalset=evalset, run=run,
                 timer=PhaseTimer(cuda, cfg.phase_timer_every))
