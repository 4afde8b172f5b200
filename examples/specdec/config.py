"""The trainer's configuration: one typed object (``Config``), the one place its defaults live.

A run's configuration is built in three layers, later ones winning: the defaults written on ``Config``'s fields, the
values of a preset (``PRESETS``, chosen with ``--preset``), and the flags given on the command line. The command
line itself is generated from ``Config`` (``cli.build_parser``): a field ``target_dim`` is the flag ``--target-dim``;
its help text, choices and group are the field's metadata. Imports nothing (no torch, nothing of this package):
whether torch_threadsafe_compile is active, which one default depends on, is the caller's to say
(``package_state.active``, the one place that decides it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

PRESETS: dict[str, dict[str, Any]] = {
    # 2 target + 2 drafter threads on CPU; a few minutes on a 2-core machine.
    "cpu-tiny": {"devices": "cpu", "target_threads": 2, "drafter_threads": 2, "steps": 300, "batch_size": 4,
                 "seq_len": 128, "vocab_size": 256, "target_dim": 128, "target_layers": 4, "target_heads": 4,
                 "target_ffn": 256, "ttt_steps": 3, "lr": 3e-3, "eval_every": 50, "log_every": 25},
    # several threads sharing one GPU. Both small CUDA presets capture the target forward, the drafter step and
    # the optimizer update as CUDA graphs (--step-graphs) and build masks with one compiled call: a small model is
    # bound by interpreter time otherwise (docs/trainer.md). 4 + 4 threads: faster than 3 + 2 on an H200. The target
    # threads' streams get the higher priority: the drafter step is the longer part and fills what they leave.
    "cuda-small": {"devices": "cuda:0", "target_threads": 4, "drafter_threads": 4, "steps": 1000, "batch_size": 8,
                   "seq_len": 512, "vocab_size": 2048, "target_dim": 256, "target_layers": 6, "target_heads": 4,
                   "target_ffn": 704, "ttt_steps": 4, "lr": 3e-3, "prior_strength": 1.0, "eval_every": 100,
                   "log_every": 50, "target_dtype": "bfloat16", "autocast": "bf16", "step_graphs": True,
                   "mask_builder": "compiled", "stream_priority": "target"},
    # 5 target + 3 drafter threads spread round robin over every visible GPU.
    "multi-gpu": {"devices": "cuda", "target_threads": 5, "drafter_threads": 3, "steps": 2000, "batch_size": 8,
                  "seq_len": 1024, "vocab_size": 4096, "target_dim": 512, "target_layers": 8, "target_heads": 8,
                  "target_ffn": 1408, "ttt_steps": 5, "lr": 2e-3, "prior_strength": 1.0, "eval_every": 200,
                  "log_every": 50, "target_dtype": "bfloat16", "autocast": "bf16", "step_graphs": True,
                  "mask_builder": "compiled", "stream_priority": "target"},
    # Llama-3.1-8B-shaped target (random bf16 weights: same compute as the real model) and an EAGLE-3 drafter
    # for it (one decoder layer of the target's width, full-vocabulary LM head) on one GPU.
    "cuda-8b": {"devices": "cuda:0", "target_threads": 1, "drafter_threads": 1, "steps": 50, "batch_size": 4,
                "seq_len": 2048, "vocab_size": 128256, "target_dim": 4096, "target_layers": 32, "target_heads": 32,
                "target_kv_heads": 8, "target_ffn": 14336, "rope_theta": 500000.0, "ttt_steps": 5, "lr": 1e-4,
                "prior_strength": 0.0, "eval_every": 0, "log_every": 10, "eval_prompts": 4, "eval_gen_len": 8,
                "queue_size": 2, "target_dtype": "bfloat16", "autocast": "bf16", "target_compile_scope": "layer"},
}


def option(default: Any, help: str | None = None, *, group: str | None = None, choices: Any = None,
           metavar: str | None = None, action: str | None = None) -> Any:
    """A field of ``Config`` and how its flag looks: ``group`` opens a new group of flags in ``--help`` (the fields
    after it belong to it); ``action="store_true"`` makes a bool a plain switch (other bools get ``--x/--no-x``)."""
    meta = {"help": help, "group": group, "choices": choices, "metavar": metavar, "action": action}
    return field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything a run is told; fields in the order of ``--help`` (and of the ``config`` record of summary.json)."""

    preset: str | None = option(None, "defaults for everything below; explicit flags win", group="threads and devices",
                                choices=sorted(PRESETS))
    devices: str = option("auto", "'cpu', 'cuda' (all visible GPUs), 'auto', or a list 'cuda:0,cuda:1'; threads "
                                  "(targets first, then drafters) take devices round robin")
    layout: str = option("threaded", "threaded: target threads feed drafter threads through queues (default); "
                                     "sequential: one thread per device runs the target forward and then the drafter "
                                     "step (the usual SpecForge/EAGLE-3 layout; the baseline of bench/bench_trainer.py)",
                         choices=["threaded", "sequential"])
    target_threads: int = option(1, "threads running the frozen target (threaded layout)")
    drafter_threads: int = option(1, "threads training a drafter replica each; the sequential layout trains on as many "
                                     "batches per step, so both layouts see the same data")
    queue_size: int = option(4, "bound of each drafter's input queue (back-pressure)")
    torch_threads: int | None = option(None, "torch intra-op threads (default 1 when a device is the CPU: the worker "
                                             "threads are the parallelism)")

    target_hf: str | None = option(None, "local Hugging Face causal-LM checkpoint (needs transformers)", group="models",
                                   metavar="PATH")
    vocab_size: int = option(256, "vocabulary of the built-in target / synthetic data")
    target_dim: int = option(128)
    target_layers: int = option(4)
    target_heads: int = option(4)
    target_kv_heads: int | None = option(None, "key/value heads (grouped-query attention); default: heads")
    target_ffn: int = option(256)
    rope_theta: float = option(10000.0)
    prior_strength: float = option(0.5, "weight of the synthetic chain's bigram prior in the built-in target's logits "
                                        "(0: off; larger vocabularies need more to keep the greedy target learnable in "
                                        "few steps)")
    target_topk: int = option(0, "target logits sent to drafters: top-k (0 = full vocabulary, sent as logits)")
    ttt_steps: int = option(3, "k: training-time-test unroll depth = tokens drafted per round")
    step_decay: float = option(0.8, "weight of TTT step i in the drafter's loss: step_decay**i")
    seed: int = option(0)

    data: str | None = option(None, ".txt (blank-line separated docs) or .jsonl (field 'text'); default: embedded "
                                    "synthetic Markov-chain language", group="data", metavar="PATH")
    tokenizer: str | None = option(None, "local HF tokenizer (default: --target-hf's, else bytes)", metavar="PATH")
    batch_size: int = option(4)
    seq_len: int = option(128)

    steps: int = option(200, "drafter optimizer steps", group="optimisation")
    lr: float = option(3e-3)
    warmup: int = option(20, "linear warm-up steps")
    min_lr_ratio: float = option(0.1, "after the warm-up the learning rate decays (cosine) to this fraction of --lr")
    weight_decay: float = option(0.0)
    grad_clip: float = option(1.0)
    compile_backend: str = option("inductor", "torch.compile backend (aot_eager compiles fast)")
    no_compile: bool = option(False, "run eagerly (debugging; CUDA flex would be unfused)", action="store_true")

    target_dtype: str = option("float32", "weights of the frozen target",
                               group="GPU performance (each switchable, so that a failing feature can be turned off)",
                               choices=["float32", "bfloat16"])
    autocast: str = option("off", "drafter forward under bf16 autocast (float32 master weights and optimizer state)",
                           choices=["off", "bf16"])
    streams: bool = option(True, "one CUDA stream per thread, hand-offs ordered by events (default on)")
    pin_memory: bool = option(True, "batches go to the GPU from pinned memory, asynchronously (default on)")
    host_lock: bool = option(False, "threaded layout: a thread issues a whole target forward or drafter step while "
                                    "holding one process-wide lock, so threads do not hand the GIL to each other at "
                                    "every torch call (default off)")
    stream_priority: str = option("none", "threaded layout on CUDA: give the target threads' streams (or the drafter "
                                          "threads') the higher scheduling priority, so that on a shared GPU the other "
                                          "part's kernels take the SMs the first part leaves idle (default: target in "
                                          "the cuda-small and multi-gpu presets, none otherwise)",
                                  choices=["none", "drafter", "target"])
    target_sms: int | None = option(None, "threaded layout on CUDA: the target threads' streams run their kernels on "
                                          "one fixed set of N SMs of their GPU (a CUDA green context; torch built with "
                                          "CUDA >= 12.8), leaving the drafters the rest at all times (default: all "
                                          "SMs; on multi-gpu it changed no throughput, docs/trainer.md)", metavar="N")
    step_graphs: bool = option(False, "CUDA only: capture each target forward, each drafter forward+backward and each "
                                      "optimizer update as one CUDA graph (by hand, after two eager steps) and replay "
                                      "it: almost no interpreter time per batch. Compiled code inside runs in the "
                                      "default mode (default: on in the cuda-small and multi-gpu presets, off "
                                      "otherwise)")
    fused_optimizer: bool = option(True, "AdamW(fused=True) on CUDA (default on)")
    target_compile_mode: str = option("default", "torch.compile mode of the target forward; 'reduce-overhead' = CUDA "
                                                 "graphs (needs CUDA graphs to work from several threads); default "
                                                 "'default' (the cuda-small and multi-gpu presets capture whole steps "
                                                 "instead: --step-graphs)", choices=COMPILE_MODES)
    mask_builder: str = option("dense", "how flex BlockMasks are built per batch: from one dense evaluation in eager "
                                        "ops (dense, the default), the same ops compiled (compiled: fewer host calls; "
                                        "the cuda-small and multi-gpu presets), or with torch's create_block_mask "
                                        "(slower); all give the same masks",
                               choices=["dense", "compiled", "create_block_mask"])
    target_compile_scope: str = option("model", "compile the target's whole forward as one graph (model) or one "
                                                "decoder layer, reused by every layer (layer: a fraction of the "
                                                "compile time of a deep target; cuda-8b)", choices=["model", "layer"])
    drafter_compile_mode: str = option("default", "torch.compile mode of the drafter loss (forward and backward); "
                                                  "'reduce-overhead' = CUDA graphs, as for the target (same defaults)",
                                       choices=COMPILE_MODES)
    measure_after: int | None = option(None, "steps excluded from the steady-state throughput (compile, warm-up); "
                                             "default: a fifth of the steps, at least 1")
    peak_tflops: float | None = option(None, "peak dense TFLOP/s of one GPU for MFU (default: known parts, e.g. "
                                             "H100/H200 989 bf16)")
    gpu_util: str = option("auto", "sample GPU utilisation (NVML or nvidia-smi) during the steady window",
                           choices=["auto", "off"])
    profile: str | None = option(None, "torch.profiler trace of a few steady steps into DIR", metavar="DIR")
    profile_steps: str | None = option(None, "steps profiled (default: the 5 after --measure-after)", metavar="A:B")

    eval_every: int = option(50, "measure τ every N steps (0: only at start and end)", group="evaluation and output")
    eval_prompts: int = option(16)
    eval_prompt_len: int = option(16)
    eval_gen_len: int = option(48, "greedy target tokens after each eval prompt")
    log_every: int = option(25, "plain progress line every N steps (when tqdm is not used)")
    out: str | None = option(None, "metrics.jsonl, summary.json, metrics.png, checkpoints", metavar="DIR")
    save_every: int = option(0, "checkpoint every N steps; with --out a checkpoint is always written at the end")
    no_checkpoint: bool = option(False, "write no checkpoint (benchmarks)", action="store_true")
    resume: str | None = option(None, "a checkpoint dir, or an --out dir (latest checkpoint)", metavar="DIR")
    allow_config_change: bool = option(False, "--resume a checkpoint made for another model or data (vocabulary, "
                                              "target sizes, seed, data, tokenizer); without it such a resume is "
                                              "refused, naming the settings that differ", action="store_true")

    no_ttc: bool = option(False, "run without torch_threadsafe_compile (re-executes with TTC_DISABLE=1) to show "
                                 "hazards", group="robustness", action="store_true")
    error_policy: str | None = option(None, "errors from compiled calls: stop the run (default while the package is "
                                            "active) or count and retry (default otherwise: --no-ttc, TTC_DISABLE, "
                                            "not installed)", choices=["raise", "count"])
    retry_timeout: float = option(600.0, "'count' mode: give up on a call after failing this long (s)")
    hang_timeout: float = option(900.0, "no drafter step for this long (s) = hang: dump all thread stacks, exit 3")
    dist_timeout: float = option(1800.0, "torch.distributed timeout (s)")
    inject_fault: str | None = option(None, "testing aid: 'error' or 'hang' in thread kind 'target'/'drafter' (index "
                                            "0) at STEP", metavar="KIND:THREAD:STEP")
    dry_run: bool = option(False, "print the resolved configuration and exit", action="store_true")

    # Fixed choices of the trainer, not flags (ClassVar: no field, so no flag and no entry in ``as_dict``).
    flop_batches: ClassVar[int] = 2  # batches whose masks give the mean attended keys of the FLOP count (MFU)
    phase_timer_every: ClassVar[int] = 4  # GPU time per phase is sampled at every N-th step (two events each)
    profile_len: ClassVar[int] = 5  # steps profiled without --profile-steps

    def torch_threads_for(self, cuda: bool) -> int | None:
        """torch's intra-op threads: ``--torch-threads``, else 1 where the devices are CPUs (the worker threads are
        the parallelism), else None (torch's own choice)."""
        return self.torch_threads or (None if cuda else 1)

    def profile_window(self, mark_after: int) -> tuple[int, int]:
        """``--profile``'s steps ``(a, b)``, from the start of step a to the start of step b: ``--profile-steps``,
        else the ``profile_len`` steps after the last step excluded from the steady window (``mark_after``)."""
        a, b = (int(x) for x in (self.profile_steps or f"{mark_after + 1}:{mark_after + 1 + self.profile_len}").split(":"))
        return a, b

    def as_dict(self) -> dict[str, Any]:
        """Field name -> value, in field order (summary.json's and the checkpoints' ``config``)."""
        return dataclasses.asdict(self)


def device_list(spec: str) -> list[str]:
    """The comma-separated entries of ``--devices`` (syntax only: ``cli.validate``; what torch finds:
    ``runtime.check_devices``)."""
    return [d.strip() for d in spec.split(",") if d.strip()]


def resolve(given: dict[str, Any], ttc_active: bool | None = None) -> Config:
    """The run's configuration from the flags given (field name -> value): ``Config``'s defaults, overridden by the
    preset's values, overridden by ``given``; then the two defaults that depend on others: ``error_policy`` (stop the
    run while torch_threadsafe_compile is active, count and retry otherwise) and ``measure_after`` (a fifth of the
    steps, at least 1). ``ttc_active`` is ``package_state.active()`` (``cli.parse``); None leaves ``error_policy``
    unset, for readers that only want the shapes of a preset (the benches)."""
    cfg = Config(**{**PRESETS.get(given.get("preset") or "", {}), **given})
    if cfg.error_policy is None and ttc_active is not None:
        cfg = dataclasses.replace(cfg, error_policy="raise" if ttc_active else "count")
    if cfg.measure_after is None and cfg.steps > 0:
        cfg = dataclasses.replace(cfg, measure_after=min(cfg.steps - 1, max(1, cfg.steps // 5)))
    return cfg
