"""Command line of the reference trainer: the flags (made from ``config.Config``) and their validation. Imports
nothing heavy (no torch), so a bad invocation is answered with one line and exit code 2 in well under a second,
before anything is built or compiled.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, NoReturn

from . import checkpoint_files, config, package_state
from .config import Config


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the usage block and then the error; a bad flag here gets one line (``--help`` has the rest)."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def fail(message: str) -> NoReturn:
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """One flag per ``Config`` field (``--target-dim`` for ``target_dim``), in field order, with the field's help,
    choices and group. Flags that are not given leave no value (``argparse.SUPPRESS``): ``config.resolve`` tells the
    flags given from the defaults and the preset's values that way."""
    p = OneLineParser(prog="train.py", argument_default=argparse.SUPPRESS, description=(
        "Reference EAGLE-3 style speculative-decoding trainer: one process per node, one thread per device "
        "(see docs/trainer.md)."))
    hints = typing.get_type_hints(Config)
    group: Any = p
    for f in dataclasses.fields(Config):
        meta = dict(f.metadata)
        if "group" in meta:
            group = p.add_argument_group(meta.pop("group"))
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(flag, action=meta.pop("action", argparse.BooleanOptionalAction), **meta)
        else:
            scalar = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
            group.add_argument(flag, type=None if scalar is str else scalar, **meta)
    return p


def parse(argv: list[str] | None = None) -> Config:
    """The run's configuration from a command line (``sys.argv[1:]`` by default); not yet validated."""
    return config.resolve(vars(build_parser().parse_args(argv)), ttc_active=package_state.active())


DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def validate(cfg: Config) -> str | None:
    """Everything that can be checked without torch; returns the first problem as one line, or None."""
    positive = ["target_threads", "drafter_threads", "steps", "batch_size", "seq_len", "vocab_size", "target_dim",
                "target_layers", "target_heads", "target_ffn", "ttt_steps", "queue_size", "eval_prompts",
                "eval_prompt_len", "log_every"]
    for name in positive:
        value = getattr(cfg, name)
        if value is None or value < 1:
            return f"--{name.replace('_', '-')} must be at least 1 (got {value})"
    for name in ["eval_gen_len", "eval_every", "save_every", "warmup", "target_topk", "grad_clip", "weight_decay"]:
        value = getattr(cfg, name)
        if value < 0:
            return f"--{name.replace('_', '-')} must not be negative (got {value})"
    for name in ["lr", "hang_timeout", "retry_timeout", "dist_timeout", "rope_theta", "step_decay"]:
        value = getattr(cfg, name)
        if not value > 0:
            return f"--{name.replace('_', '-')} must be positive (got {value})"
    if not 0 <= cfg.min_lr_ratio <= 1:
        return f"--min-lr-ratio must be in [0, 1] (got {cfg.min_lr_ratio})"
    if cfg.torch_threads is not None and cfg.torch_threads < 1:
        return f"--torch-threads must be at least 1 (got {cfg.torch_threads})"
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        return f"--peak-tflops must be positive (got {cfg.peak_tflops})"
    if cfg.measure_after is not None and not 0 <= cfg.measure_after < cfg.steps:
        return f"--measure-after must be in [0, --steps) = [0, {cfg.steps}) (got {cfg.measure_after})"
    if not cfg.target_hf:
        if cfg.target_dim % cfg.target_heads:
            return f"--target-dim {cfg.target_dim} is not a multiple of --target-heads {cfg.target_heads}"
        if (cfg.target_dim // cfg.target_heads) % 2:
            return f"head dimension {cfg.target_dim // cfg.target_heads} must be even (rotary embedding)"
        kv = cfg.target_kv_heads
        if kv is not None and (kv < 1 or cfg.target_heads % kv):
            return f"--target-kv-heads {kv} must be at least 1 and divide --target-heads {cfg.target_heads}"
        if not cfg.data and cfg.vocab_size < 8:
            return f"--vocab-size must be at least 8 for the synthetic data (got {cfg.vocab_size})"
        if cfg.target_topk > cfg.vocab_size:
            return f"--target-topk {cfg.target_topk} exceeds --vocab-size {cfg.vocab_size}"
    if cfg.target_hf and cfg.target_compile_scope == "layer":
        return "--target-compile-scope layer needs the built-in target (not --target-hf)"
    if cfg.target_compile_scope == "layer" and cfg.target_compile_mode == "reduce-overhead":
        # every layer would replay one CUDA graph, overwriting the previous layer's output that is still needed
        return "--target-compile-mode reduce-overhead needs --target-compile-scope model"
    if cfg.step_graphs:
        for flag, mode in (("--target-compile-mode", cfg.target_compile_mode),
                           ("--drafter-compile-mode", cfg.drafter_compile_mode)):
            if mode in ("reduce-overhead", "max-autotune"):
                return (f"--step-graphs captures CUDA graphs itself: {flag} {mode} would nest them (use default, "
                        f"or --no-step-graphs)")
        if not cfg.streams:
            return "--step-graphs needs --streams (a CUDA graph cannot be captured on the default stream)"
    if cfg.target_sms is not None:
        if cfg.target_sms < 1:
            return f"--target-sms must be at least 1 (got {cfg.target_sms})"
        if cfg.layout != "threaded" or not cfg.streams:
            return "--target-sms needs the threaded layout with --streams (the SM partition is a stream's)"
        if config.device_list(cfg.devices)[:1] == ["cpu"]:  # "auto": runtime.check_devices
            return f"--target-sms needs CUDA devices (--devices {cfg.devices})"
    if cfg.seq_len < cfg.ttt_steps + 2:
        return f"--seq-len {cfg.seq_len} is too short for --ttt-steps {cfg.ttt_steps} (needs at least k + 2)"
    spec = cfg.devices
    entries = config.device_list(spec)
    if not entries or not all(DEVICE_RE.match(e) for e in entries) or ("auto" in entries and len(entries) > 1):
        return f"--devices {spec!r}: expected 'auto', 'cpu', 'cuda' or a list like 'cuda:0,cuda:1'"
    if len({e.split(":")[0] for e in entries}) > 1:
        return f"--devices {spec!r}: mixes CPU and CUDA devices"
    if cfg.step_graphs and entries[0] == "cpu":  # "auto" is checked once torch can tell (runtime.check_devices)
        return f"--step-graphs needs CUDA devices (--devices {spec}; --no-step-graphs turns it off)"
    if cfg.inject_fault:
        m = re.fullmatch(r"(error|hang):(target|drafter):(\d+)", cfg.inject_fault)
        if not m:
            return f"--inject-fault {cfg.inject_fault!r}: expected KIND:THREAD:STEP, e.g. error:drafter:3"
    if cfg.profile_steps and not re.fullmatch(r"\d+:\d+", cfg.profile_steps):
        return f"--profile-steps {cfg.profile_steps!r}: expected A:B (steps A <= s < B)"
    for flag, path in (("--data", cfg.data), ("--target-hf", cfg.target_hf), ("--tokenizer", cfg.tokenizer)):
        if path and not Path(path).exists():
            return f"{flag} {path}: no such file or directory"
    if cfg.resume:
        problem = resume_problem(cfg)
        if problem:
            return problem
    if cfg.out and int(os.environ.get("RANK", 0)) == 0:
        problem = writable_dir(Path(cfg.out))
        if problem:
            return f"--out {cfg.out}: {problem}"
    if cfg.profile:
        problem = writable_dir(Path(cfg.profile))
        if problem:
            return f"--profile {cfg.profile}: {problem}"
    return None


def resume_problem(cfg: Config) -> str | None:
    """``--resume``: the checkpoint exists, its files are whole (``checkpoint_files.read``), it is before
    ``--steps``, and it was made for the model and data of this run (or ``--allow-config-change``)."""
    path = Path(str(cfg.resume))
    if not path.exists():
        return f"--resume {path}: no such file or directory"
    ckpt = checkpoint_files.locate(path)
    if ckpt is None:
        return f"--resume {path}: no checkpoint there (expected checkpoint.safetensors or ckpt-*/ inside)"
    try:
        info = checkpoint_files.read(ckpt)
    except checkpoint_files.CheckpointError as e:
        return f"--resume {path}: {e}"
    if info.step >= cfg.steps:
        return f"--resume {path} is at step {info.step}, not before --steps {cfg.steps}: nothing to train"
    differ = checkpoint_files.config_differences(info.config, cfg.as_dict())
    if differ and not cfg.allow_config_change:
        return (f"--resume {path}: {ckpt.name} was made for another model or data ({'; '.join(differ)}); "
                f"--allow-config-change resumes it anyway")
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
    rebuilt from the interpreter flags and ``sys.argv``. Nothing to do where the package says it is not active
    (disabled already, in the re-executed interpreter too; not activated; not installed)."""
    if not package_state.active():
        return
    os.environ["TTC_DISABLE"] = "1"  # the variable is the package's to read; the trainer only sets it for the child
    orig = getattr(sys, "orig_argv", None)
    if orig:
        argv = [sys.executable, *orig[1:]]
    else:  # pragma: no cover - Python < 3.10
        import subprocess

        argv = [sys.executable, *subprocess._args_from_interpreter_flags(), *sys.argv]  # type: ignore[attr-defined]
    sys.stdout.flush(), sys.stderr.flush()
    os.execv(sys.executable, argv)
