#!/usr/bin/env python
"""GPU time per kernel and per kind of kernel in a torch.profiler trace, per profiled step.

    python examples/specdec/train.py --preset cuda-small --layout sequential --drafter-threads 1 --steps 50 \\
        --no-step-graphs --eval-every 0 --profile prof --profile-steps 40:44
    python bench/trace_kernels.py prof/trace.json --steps 4

The trainer's ``--profile`` writes ``trace.json`` (Chrome trace format). Replayed CUDA graphs hide their kernels
from the profiler on some versions, hence ``--no-step-graphs`` above: kernel for kernel the work is the same.
``--steps`` is the number of profiled steps (with ``--drafter-threads 1`` in the sequential layout, one step is
one batch: one target forward and one drafter step). Kernels are grouped by kind (matmul, flex-attention forward
and backward, the drafter's loss, RoPE, the rest) from their names, which are inductor's and cuBLAS's and may
change between releases: read the per-name table too.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

# (kind, pattern on the kernel name); the first match wins.
KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("matmul", re.compile(r"nvjet|gemm|splitK|xmma|cutlass", re.I)),
    ("flex attention backward", re.compile(r"flex_attention_backward")),
    ("flex attention forward", re.compile(r"flex_attention")),
    ("loss backward", re.compile(r"log_softmax_backward")),
    ("loss forward", re.compile(r"log_softmax|logsumexp")),
    ("rope", re.compile(r"cos.*sin|sin.*cos")),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def kernels(path: Path) -> list[tuple[str, float]]:
    """(name, duration in µs) of every kernel, memcpy and memset on the GPU timeline."""
    events = json.loads(path.read_text())["traceEvents"]
    return [(e["name"], float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="trace.json from the trainer's --profile")
    p.add_argument("--steps", type=float, default=1.0, help="profiled steps (times are divided by it)")
    p.add_argument("--top", type=int, default=30, help="kernel names listed")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error("--steps must be positive")
    ks = kernels(args.trace)
    if not ks:
        print(f"{args.trace}: no GPU kernels in the trace (a CPU run, or kernels hidden inside CUDA graphs)")
        return 1
    total = sum(d for _, d in ks)
    by_kind: dict[str, float] = collections.Counter()
    by_name: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for name, dur in ks:
        by_kind[kind_of(name)] += dur
        by_name[name] += dur
        calls[name] += 1
    per = 1000.0 * args.steps
    print(f"{len(ks) / args.steps:.0f} kernels and {total / per:.3f} ms of GPU time per step\n")
    print("| kind | ms per step | share |\n|---|---|---|")
    for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {dur / per:.3f} | {100 * dur / total:.1f} % |")
    print("\n| kernel | kind | ms per step | share | calls per step |\n|---|---|---|---|---|")
    for name, dur in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| `{name[:80]}` | {kind_of(name)} | {dur / per:.3f} | {100 * dur / total:.1f} % | "
              f"{calls[name] / args.steps:g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
