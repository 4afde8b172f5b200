#!/usr/bin/env python
"""Interpreter time of the reference trainer's per-batch host work, one part at a time.

    python bench/trainer_host_costs.py [--preset cuda-small] [--device cuda] [--batches 64]

Under the GIL every trainer thread needs the interpreter, so host time per batch is what bounds a small model on a
fast GPU. Measured here, per batch of the preset's shape:

* ``data``: synthetic batches one at a time (``block=1``) against 16 made together and cached (the default);
* ``masks``: the target's and the drafter's document-causal BlockMasks (CUDA) or dense masks (CPU), built with
  eager ops (``--mask-builder dense``) against the compiled builder (``--mask-builder compiled``, CUDA only). Host time is
  the time to *issue* the work (no synchronisation inside the timed loop), the GPU time is reported separately.

Prints one table; every number is a median over ``--rounds`` rounds of ``--batches`` batches.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
from _repo import ROOT  # noqa: F401  (makes examples.specdec importable)

from examples.specdec import config, masks
from examples.specdec import data as data_mod


def per_batch_ms(fn: Callable[[int], object], batches: int, rounds: int, start: int, sync: Callable[[], None]) -> float:
    times: list[float] = []
    for r in range(rounds):
        sync()
        t0 = time.perf_counter()
        for i in range(batches):
            fn(start + r * batches + i)
        times.append((time.perf_counter() - t0) / batches * 1e3)
    sync()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cuda-small", choices=sorted(config.PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    cfg = config.resolve({"preset": a.preset})
    device = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    B, S, V, k = cfg.batch_size, cfg.seq_len, cfg.vocab_size, cfg.ttt_steps  # noqa: N806 - batch, sequence, vocabulary
    rows = [f"### Host time per batch: preset `{a.preset}` ({B} × {S}, k = {k}), device {device}, torch "
            f"{torch.__version__}", "", "| part | variant | host ms per batch |", "|---|---|---|"]

    fresh = {b: data_mod.MarkovData(V, B, S, seed=0, block=b) for b in (1, 16)}
    for b, src in fresh.items():
        # A new index range per round: the cache must not answer from an earlier round.
        ms = per_batch_ms(src.batch, a.batches, a.rounds, start=1000, sync=lambda: None)
        rows.append(f"| data | {'one batch at a time' if b == 1 else '16 batches together, cached'} | {ms:.3f} |")

    docs = [data_mod.MarkovData(V, B, S, seed=1).batch(i).doc.to(device) for i in range(8)]
    builders = ["dense", "compiled"] if masks.use_flex(device) else ["dense"]
    for builder in builders:
        masks.BUILDER = builder

        def build(i: int) -> object:
            doc = docs[i % len(docs)]
            return masks.target_mask(doc), masks.target_mask(doc)  # target thread, drafter thread

        per_batch_ms(build, 4, 2, start=0, sync=sync)  # compile and warm up
        ms = per_batch_ms(build, a.batches, a.rounds, start=0, sync=sync)
        rows.append(f"| masks (target + drafter) | {builder} | {ms:.3f} |")
    masks.BUILDER = "dense"
    print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
