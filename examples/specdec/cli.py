"""Command line of the reference trainer: presets, flags and validation. Imports nothing heavy (no torch), so a bad
invocation is answered with one line and exit code 2 in well under a second, before anything is built or compiled.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

PRESETS: dict[str, dict[str, Any]] = {
    # 2 target + 2 drafter threads on CPU; a few minutes on a 2-core machine.
    "cpu-tiny": dict(devices="cpu", target_threads=2, drafter_threads=2, steps=300, batch_size=4, seq_len=128,
                     vocab_size=256, target_dim=128, target_layers=4, target_heads=4, target_ffn=256,
                     ttt_steps=3, lr=3e-3, eval_every=50, log_every=25),
    # several threads sharing one GPU. Both small CUDA presets capture the target forward, the drafter step and
    # the optimizer update as CUDA graphs (--step-graphs) and build masks with one compiled call: a small model is
    # bound by interpreter time otherwise (docs/trainer.md). 4 + 4 threads: faster than 3 + 2 on an H200. The target
    # threads' streams get the higher priority: the drafter step is the longer part and fills what they leave.
    "cuda-small": dict(devices="cuda:0", target_threads=4, drafter_threads=4, steps=1000, batch_size=8,
                       seq_len=512, vocab_size=2048, target_dim=256, target_layers=6, target_heads=4,
                       target_ffn=704, ttt_steps=4, lr=3e-3, prior_strength=1.0, eval_every=100, log_every=50,
                       target_dtype="bfloat16", autocast="bf16", step_graphs=True, mask_builder="compiled",
                       stream_priority="target"),
    # 5 target + 3 drafter threads spread round robin over every visible GPU.
    "multi-gpu": dict(devices="cuda", target_threads=5, drafter_threads=3, steps=2000, batch_size=8,
                      seq_len=1024, vocab_size=4096, target_dim=512, target_layers=8, target_heads=8,
                      target_ffn=1408, ttt_steps=5, lr=2e-3, prior_strength=1.0, eval_every=200, log_every=50,
                      target_dtype="bfloat16", autocast="bf16", step_graphs=True, mask_builder="compiled",
                      stream_priority="target"),
    # Llama-3.1-8B-shaped target (random bf16 weights: same compute as the real model) and an EAGLE-3 drafter
    # for it (one decoder layer of the target's width, full-vocabulary LM head) on one GPU.
    "cuda-8b": dict(devices="cuda:0", target_threads=1, drafter_threads=1, steps=50, batch_size=4, seq_len=2048,
                    vocab_size=128256, target_dim=4096, target_layers=32, target_heads=32, target_kv_heads=8,
                    target_ffn=14336, rope_theta=500000.0, ttt_steps=5, lr=1e-4, prior_strength=0.0,
                    eval_every=0, log_every=10, eval_prompts=4, eval_gen_len=8, queue_size=2,
                    target_dtype="bfloat16", autocast="bf16", target_compile_scope="layer"),
}

DEFAULTS: dict[str, Any] = dict(
    devices="auto", target_threads=1, drafter_threads=1, steps=200, batch_size=4, seq_len=128, vocab_size=256,
    target_dim=128, target_layers=4, target_heads=4, target_kv_heads=None, target_ffn=256, rope_theta=10000.0,
    ttt_steps=3, lr=3e-3, prior_strength=0.5, eval_every=50, log_every=25, eval_prompts=16, eval_gen_len=48,
    queue_size=4, target_dtype="float32", autocast="off", measure_after=None, target_compile_scope="model",
    target_compile_mode="default", drafter_compile_mode="default", mask_builder="dense", step_graphs=False,
    stream_priority="none",
)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the usage block and then the error; a bad flag here gets one line (``--help`` has the rest)."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def fail(message: str) -> NoReturn:
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="train.py", description=(
        "Reference EAGLE-3 style speculative-decoding trainer: one process per node, one thread per device "
        "(see docs/trainer.md)."))
    g = p.add_argument_group("threads and devices")
    g.add_argument("--preset", choices=sorted(PRESETS), help="defaults for everything below; explicit flags win")
    g.add_argument("--devices", help="'cpu', 'cuda' (all visible GPUs), 'auto', or a list 'cuda:0,cuda:1'; "
                                     "threads (targets first, then drafters) take devices round robin")
    g.add_argument("--layout", choices=["threaded", "sequential"], default="threaded",
                   help="threaded: target threads feed drafter threads through queues (default); sequential: one "
                        "thread per device runs the target forward and then the drafter step (the usual "
                        "SpecForge/EAGLE-3 layout; the baseline of bench/bench_trainer.py)")
    g.add_argument("--target-threads", type=int, help="threads running the frozen target (threaded layout)")
    g.add_argument("--drafter-threads", type=int,
                   help="threads training a drafter replica each; the sequential layout trains on as many batches "
                        "per step, so both layouts see the same data")
    g.add_argument("--queue-size", type=int, help="bound of each drafter's input queue (back-pressure)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default 1 when a device is the CPU: the worker threads are the "
                        "parallelism)")
    g = p.add_argument_group("models")
    g.add_argument("--target-hf", metavar="PATH", help="local Hugging Face causal-LM checkpoint (needs transformers)")
    g.add_argument("--vocab-size", type=int, help="vocabulary of the built-in target / synthetic data")
    g.add_argument("--target-dim", type=int)
    g.add_argument("--target-layers", type=int)
    g.add_argument("--target-heads", type=int)
    g.add_argument("--target-kv-heads", type=int, help="key/value heads (grouped-query attention); default: heads")
    g.add_argument("--target-ffn", type=int)
    g.add_argument("--rope-theta", type=float)
    g.add_argument("--prior-strength", type=float,
                   help="weight of the synthetic chain's bigram prior in the built-in target's logits (0: off; "
                        "larger vocabularies need more to keep the greedy target learnable in few steps)")
    g.add_argument("--target-topk", type=int, default=0,
                   help="target logits sent to drafters: top-k (0 = full vocabulary, sent as logits)")
    g.add_argument("--ttt-steps", type=int, help="k: training-time-test unroll depth = tokens drafted per round")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help=".txt (blank-line separated docs) or .jsonl (field 'text'); "
                                                  "default: embedded synthetic Markov-chain language")
    g.add_argument("--tokenizer", metavar="PATH", help="local HF tokenizer (default: --target-hf's, else bytes)")
    g.add_argument("--batch-size", type=int)
    g.add_argument("--seq-len", type=int)
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, help="drafter optimizer steps")
    g.add_argument("--lr", type=float)
    g.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager compiles fast)")
    g.add_argument("--no-compile", action="store_true", help="run eagerly (debugging; CUDA flex would be unfused)")
    g = p.add_argument_group("GPU performance (each switchable, so that a failing feature can be turned off)")
    g.add_argument("--target-dtype", choices=["float32", "bfloat16"], help="weights of the frozen target")
    g.add_argument("--autocast", choices=["off", "bf16"],
                   help="drafter forward under bf16 autocast (float32 master weights and optimizer state)")
    g.add_argument("--streams", action=argparse.BooleanOptionalAction, default=True,
                   help="one CUDA stream per thread, hand-offs ordered by events (default on)")
    g.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="batches go to the GPU from pinned memory, asynchronously (default on)")
    g.add_argument("--host-lock", action=argparse.BooleanOptionalAction, default=False,
                   help="threaded layout: a thread issues a whole target forward or drafter step while holding one "
                        "process-wide lock, so threads do not hand the GIL to each other at every torch call "
                        "(default off)")
    g.add_argument("--stream-priority", choices=["none", "drafter", "target"],
                   help="threaded layout on CUDA: give the target threads' streams (or the drafter threads') the "
                        "higher scheduling priority, so that on a shared GPU the other part's kernels take the "
                        "SMs the first part leaves idle (default: target in the cuda-small and multi-gpu presets, "
                        "none otherwise)")
    g.add_argument("--target-sms", type=int, metavar="N",
                   help="threaded layout on CUDA: the target threads' streams run their kernels on one fixed set of "
                        "N SMs of their GPU (a CUDA green context; torch built with CUDA >= 12.8), leaving the "
                        "drafters the rest at all times (default: all SMs; on multi-gpu it changed no throughput, "
                        "docs/trainer.md)")
    g.add_argument("--step-graphs", action=argparse.BooleanOptionalAction,
                   help="CUDA only: capture each target forward, each drafter forward+backward and each optimizer "
                        "update as one CUDA graph (by hand, after two eager steps) and replay it: almost no "
                        "interpreter time per batch. Compiled code inside runs in the default mode (default: on in the "
                        "cuda-small and multi-gpu presets, off otherwise)")
    g.add_argument("--fused-optimizer", action=argparse.BooleanOptionalAction, default=True,
                   help="AdamW(fused=True) on CUDA (default on)")
    g.add_argument("--target-compile-mode", choices=COMPILE_MODES,
                   help="torch.compile mode of the target forward; 'reduce-overhead' = CUDA graphs (needs CUDA "
                        "graphs to work from several threads); default 'default' (the cuda-small and multi-gpu "
                        "presets capture whole steps instead: --step-graphs)")
    g.add_argument("--mask-builder", choices=["dense", "compiled", "create_block_mask"],
                   help="how flex BlockMasks are built per batch: from one dense evaluation in eager ops "
                        "(dense, the default), the same ops compiled (compiled: fewer host calls; the cuda-small and "
                        "multi-gpu presets), or with torch's create_block_mask (slower); all give the same masks")
    g.add_argument("--target-compile-scope", choices=["model", "layer"],
                   help="compile the target's whole forward as one graph (model) or one decoder layer, reused "
                        "by every layer (layer: a fraction of the compile time of a deep target; cuda-8b)")
    g.add_argument("--drafter-compile-mode", choices=COMPILE_MODES,
                   help="torch.compile mode of the drafter loss (forward and backward); 'reduce-overhead' = CUDA "
                        "graphs, as for the target (same defaults)")
    g.add_argument("--measure-after", type=int,
                   help="steps excluded from the steady-state throughput (compile, warm-up); default: a fifth "
                        "of the steps, at least 1")
    g.add_argument("--peak-tflops", type=float,
                   help="peak dense TFLOP/s of one GPU for MFU (default: known parts, e.g. H100/H200 989 bf16)")
    g.add_argument("--gpu-util", choices=["auto", "off"], default="auto",
                   help="sample GPU utilisation (NVML or nvidia-smi) during the steady window")
    g.add_argument("--profile", metavar="DIR", help="torch.profiler trace of a few steady steps into DIR")
    g.add_argument("--profile-steps", metavar="A:B", help="steps profiled (default: the 5 after --measure-after)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-every", type=int, help="measure τ every N steps (0: only at start and end)")
    g.add_argument("--eval-prompts", type=int)
    g.add_argument("--eval-prompt-len", type=int, default=16)
    g.add_argument("--eval-gen-len", type=int, help="greedy target tokens after each eval prompt")
    g.add_argument("--log-every", type=int, help="plain progress line every N steps (when tqdm is not used)")
    g.add_argument("--out", metavar="DIR", help="metrics.jsonl, summary.json, metrics.png, checkpoints")
    g.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps; with --out a checkpoint is always written at the end")
    g.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint (benchmarks)")
    g.add_argument("--resume", metavar="DIR", help="a checkpoint dir, or an --out dir (latest checkpoint)")
    g = p.add_argument_group("robustness")
    g.add_argument("--no-ttc", action="store_true",
                   help="run without torch_threadsafe_compile (re-executes with TTC_DISABLE=1) to show hazards")
    g.add_argument("--error-policy", choices=["raise", "count"],
                   help="errors from compiled calls: stop the run (default) or count and retry (default with "
                        "--no-ttc)")
    g.add_argument("--retry-timeout", type=float, default=600.0,
                   help="'count' mode: give up on a call after failing this long (s)")
    g.add_argument("--hang-timeout", type=float, default=900.0,
                   help="no drafter step for this long (s) = hang: dump all thread stacks, exit 3")
    g.add_argument("--dist-timeout", type=float, default=1800.0, help="torch.distributed timeout (s)")
    g.add_argument("--inject-fault", metavar="KIND:THREAD:STEP",
                   help="testing aid: 'error' or 'hang' in thread kind 'target'/'drafter' (index 0) at STEP")
    g.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    preset = PRESETS.get(args.preset or "", {})
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    if args.error_policy is None:
        args.error_policy = "count" if os.environ.get("TTC_DISABLE") == "1" else "raise"
    if args.measure_after is None and isinstance(args.steps, int) and args.steps > 0:
        args.measure_after = min(args.steps - 1, max(1, args.steps // 5))
    return args


DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device_list(spec: str) -> list[str]:
    """The comma-separated entries of ``--devices`` (syntax only; availability is checked with torch)."""
    return [d.strip() for d in spec.split(",") if d.strip()]


def validate(args: argparse.Namespace) -> str | None:
    """Everything that can be checked without torch; returns the first problem as one line, or None."""
    positive = ["target_threads", "drafter_threads", "steps", "batch_size", "seq_len", "vocab_size", "target_dim",
                "target_layers", "target_heads", "target_ffn", "ttt_steps", "queue_size", "eval_prompts",
                "eval_prompt_len", "log_every"]
    for name in positive:
        value = getattr(args, name)
        if value is None or value < 1:
            return f"--{name.replace('_', '-')} must be at least 1 (got {value})"
    for name in ["eval_gen_len", "eval_every", "save_every", "warmup", "target_topk", "grad_clip", "weight_decay"]:
        value = getattr(args, name)
        if value < 0:
            return f"--{name.replace('_', '-')} must not be negative (got {value})"
    for name in ["lr", "hang_timeout", "retry_timeout", "dist_timeout", "rope_theta"]:
        value = getattr(args, name)
        if not value > 0:
            return f"--{name.replace('_', '-')} must be positive (got {value})"
    if args.torch_threads is not None and args.torch_threads < 1:
        return f"--torch-threads must be at least 1 (got {args.torch_threads})"
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        return f"--peak-tflops must be positive (got {args.peak_tflops})"
    if args.measure_after is not None and not 0 <= args.measure_after < args.steps:
        return f"--measure-after must be in [0, --steps) = [0, {args.steps}) (got {args.measure_after})"
    if not args.target_hf:
        if args.target_dim % args.target_heads:
            return f"--target-dim {args.target_dim} is not a multiple of --target-heads {args.target_heads}"
        if (args.target_dim // args.target_heads) % 2:
            return f"head dimension {args.target_dim // args.target_heads} must be even (rotary embedding)"
        kv = args.target_kv_heads
        if kv is not None and (kv < 1 or args.target_heads % kv):
            return f"--target-kv-heads {kv} must be at least 1 and divide --target-heads {args.target_heads}"
        if not args.data and args.vocab_size < 8:
            return f"--vocab-size must be at least 8 for the synthetic data (got {args.vocab_size})"
        if args.target_topk > args.vocab_size:
            return f"--target-topk {args.target_topk} exceeds --vocab-size {args.vocab_size}"
    if args.target_hf and args.target_compile_scope == "layer":
        return "--target-compile-scope layer needs the built-in target (not --target-hf)"
    if args.target_compile_scope == "layer" and args.target_compile_mode == "reduce-overhead":
        # every layer would replay one CUDA graph, overwriting the previous layer's output that is still needed
        return "--target-compile-mode reduce-overhead needs --target-compile-scope model"
    if args.step_graphs:
        for flag, mode in (("--target-compile-mode", args.target_compile_mode),
                           ("--drafter-compile-mode", args.drafter_compile_mode)):
            if mode in ("reduce-overhead", "max-autotune"):
                return (f"--step-graphs captures CUDA graphs itself: {flag} {mode} would nest them (use default, "
                        f"or --no-step-graphs)")
        if not args.streams:
            return "--step-graphs needs --streams (a CUDA graph cannot be captured on the default stream)"
    if args.target_sms is not None:
        if args.target_sms < 1:
            return f"--target-sms must be at least 1 (got {args.target_sms})"
        if args.layout != "threaded" or not args.streams:
            return "--target-sms needs the threaded layout with --streams (the SM partition is a stream's)"
        if device_list(args.devices)[:1] == ["cpu"]:  # "auto": trainer.check_devices
            return f"--target-sms needs CUDA devices (--devices {args.devices})"
    if args.seq_len < args.ttt_steps + 2:
        return f"--seq-len {args.seq_len} is too short for --ttt-steps {args.ttt_steps} (needs at least k + 2)"
    spec = args.devices
    entries = device_list(spec)
    if not entries or not all(DEVICE_RE.match(e) for e in entries) or ("auto" in entries and len(entries) > 1):
        return f"--devices {spec!r}: expected 'auto', 'cpu', 'cuda' or a list like 'cuda:0,cuda:1'"
    if len({e.split(":")[0] for e in entries}) > 1:
        return f"--devices {spec!r}: mixes CPU and CUDA devices"
    if args.step_graphs and entries[0] == "cpu":  # "auto" is checked once torch can tell (trainer.check_devices)
        return f"--step-graphs needs CUDA devices (--devices {spec}; --no-step-graphs turns it off)"
    if args.inject_fault:
        m = re.fullmatch(r"(error|hang):(target|drafter):(\d+)", args.inject_fault)
        if not m:
            return f"--inject-fault {args.inject_fault!r}: expected KIND:THREAD:STEP, e.g. error:drafter:3"
    if args.profile_steps and not re.fullmatch(r"\d+:\d+", args.profile_steps):
        return f"--profile-steps {args.profile_steps!r}: expected A:B (steps A <= s < B)"
    for flag, path in (("--data", args.data), ("--target-hf", args.target_hf), ("--tokenizer", args.tokenizer)):
        if path and not Path(path).exists():
            return f"{flag} {path}: no such file or directory"
    if args.resume:
        problem = resume_problem(Path(args.resume))
        if problem:
            return problem
        step = resume_step(Path(args.resume))
        if step is not None and step >= args.steps:
            return f"--resume {args.resume} is at step {step}, not before --steps {args.steps}: nothing to train"
    if args.out and int(os.environ.get("RANK", 0)) == 0:
        problem = writable_dir(Path(args.out))
        if problem:
            return f"--out {args.out}: {problem}"
    if args.profile:
        problem = writable_dir(Path(args.profile))
        if problem:
            return f"--profile {args.profile}: {problem}"
    return None


def resume_problem(path: Path) -> str | None:
    if not path.exists():
        return f"--resume {path}: no such file or directory"
    if (path / "checkpoint.safetensors").exists():
        return None
    if any((p / "checkpoint.safetensors").exists() for p in path.glob("ckpt-*")):
        return None
    return f"--resume {path}: no checkpoint there (expected checkpoint.safetensors or ckpt-*/ inside)"


def resume_step(path: Path) -> int | None:
    """Step of the checkpoint ``--resume`` would load (from its meta.json), if readable."""
    import json

    ckpt = path if (path / "checkpoint.safetensors").exists() else max(
        (p for p in path.glob("ckpt-*") if (p / "checkpoint.safetensors").exists()), default=None)
    try:
        return int(json.loads((ckpt / "meta.json").read_text())["step"])
    except Exception:
        return None


def writable_dir(path: Path) -> str | None:
    """Create ``path`` if needed and prove it takes files; the reason as one line, or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"cannot create or write there ({e.strerror or type(e).__name__})"
    return None


def reexec_without_ttc() -> None:
    """``--no-ttc``: torch_threadsafe_compile activates at interpreter start (a .pth file), so turning it off means
    starting a fresh interpreter with ``TTC_DISABLE=1``. ``os.execv`` keeps the pid (torchrun, signals still
    work). ``sys.orig_argv`` (Python 3.10+) keeps interpreter options and ``-m``; without it the command is
    rebuilt from the interpreter flags and ``sys.argv``."""
    if os.environ.get("TTC_DISABLE") == "1":
        return
    os.environ["TTC_DISABLE"] = "1"
    orig = getattr(sys, "orig_argv", None)
    if orig:
        argv = [sys.executable, *orig[1:]]
    else:  # pragma: no cover - Python < 3.10
        import subprocess

        argv = [sys.executable, *subprocess._args_from_interpreter_flags(), *sys.argv]
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, argv)
