#!/usr/bin/env python
"""Scaling of the reference trainer over 1, 2, 4 and 8 GPUs (one thread per GPU), with and without the package.

For each GPU count N that this machine has, the ``multi-gpu`` preset runs with ``CUDA_VISIBLE_DEVICES``
limited to N devices and its 5 target + 3 drafter threads scaled to N (at least one of each, the 5:3 ratio
kept), once active and once with ``--no-ttc``. The table records time to first step, tokens/s per thread
kind, compile counts (expect one compile per device per graph with the package, not one per thread), peak
GPU memory, and whether the run hung or fell back to uncompiled code.

    python bench/scaling.py [--gpus 1 2 4 8] [--steps 200] [--md docs/results/scaling.md]

GPU counts this machine does not have are listed as "not run" rather than guessed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _harness import child_environ
from bench_trainer import run_one, table


def threads_for(n: int) -> tuple[int, int]:
    """5 target : 3 drafter threads on 8 GPUs, the same ratio (at least one each) on fewer."""
    drafters = max(1, round(n * 3 / 8))
    return max(1, n - drafters), drafters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--hang-timeout", type=float, default=300)
    ap.add_argument("--md", help="write the markdown here too")
    a = ap.parse_args()
    import torch

    have = torch.cuda.device_count()
    out = ["# Trainer scaling (preset `multi-gpu`, one thread per GPU)", ""]
    work = Path(tempfile.mkdtemp(prefix="ttc-scaling-"))
    for n in a.gpus:
        if n > have:
            out += [f"## {n} GPU(s): not run (this machine has {have})", ""]
            continue
        targets, drafters = threads_for(n)
        env = dict(child_environ(), CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(n)))
        args = ["--preset", "multi-gpu", "--steps", str(a.steps), "--target-threads", str(targets),
                "--drafter-threads", str(drafters), "--hang-timeout", str(a.hang_timeout)]
        results = []
        for label, extra in (("with TTC", []), ("without TTC", ["--no-ttc"])):
            tag = f"{n}-{label.split()[0]}"
            # A fresh inductor/Triton cache per run: otherwise the second run reuses the first one's kernels.
            run_env = dict(env, TORCHINDUCTOR_CACHE_DIR=str(work / f"{tag}-inductor"), TRITON_CACHE_DIR=str(work / f"{tag}-triton"))
            results.append(run_one(f"{n} GPU, {label}", args + extra, run_env, work / tag, a.timeout))
        out += [f"## {n} GPU(s): {targets} target + {drafters} drafter threads", "", table(results), ""]
    text = "\n".join(out)
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
