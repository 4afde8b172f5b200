#!/usr/bin/env python
"""Warm calls of one compiled model while another thread compiles it for a new shape, without HTTP: do they wait
for that compile? The in-process half of bench/serve.py's new-shape phase, where the HTTP stack, the request queue
and the recompile limit do not blur the answer.

Per mode (package active, ``TTC_DISABLE=1``, ``TTC_DISABLE=first_compile``), each run in a fresh interpreter with
a fresh inductor cache: the serving example's model is compiled for ordinary traffic (a static batch, then the
dynamic one), ``--threads`` threads call it in a loop with an already compiled shape, and after one second the main
thread calls it with a new sequence length, which compiles. Reported: that compile's time, how many warm calls
overlapped it, their median and largest latency, and the warm calls' median before it. Modes alternate per round.

    python bench/serve_new_shape.py --model mlp --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from _harness import child_env
from _repo import ROOT

MODES: dict[str, str | None] = {"active": None, "off": "1", "no-first-compile": "first_compile"}


def child(model_name: str, threads: int) -> dict[str, Any]:
    import torch

    from examples.serve import models

    model = models.build(model_name)
    compiled = torch.compile(model)
    ordinary = models.example_input(6, models.SEQ, 0)
    with torch.no_grad():
        compiled(models.example_input(4, models.SEQ, 0))  # static batch
        compiled(ordinary)  # the dynamic batch: the graph ordinary traffic hits from now on
    calls: list[tuple[float, float]] = []
    stop = threading.Event()

    def warm() -> None:
        with torch.no_grad():
            while not stop.is_set():
                t = time.perf_counter()
                compiled(ordinary)
                calls.append((t, time.perf_counter() - t))
                time.sleep(0.005)  # leave the compiling thread some of the GIL, as request handling would

    pool = [threading.Thread(target=warm) for _ in range(threads)]
    for th in pool:
        th.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(models.example_input(4, models.SEQ + 4, 0))
    t1 = time.perf_counter()
    time.sleep(0.3)
    stop.set()
    for th in pool:
        th.join()
    during = [d for s, d in calls if s < t1 and s + d > t0]
    before = [d for s, d in calls if s + d <= t0]
    return {"compile_s": t1 - t0, "overlapping": len(during),
            "overlapping_median_ms": statistics.median(during) * 1000 if during else None,
            "overlapping_max_ms": max(during) * 1000 if during else None,
            "before_median_ms": statistics.median(before) * 1000 if before else None}


def run_mode(mode: str, model: str, threads: int) -> dict[str, Any]:
    env = child_env(MODES[mode])
    with tempfile.TemporaryDirectory(prefix="serve-new-shape-") as cache:  # cold: nothing compiled before
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        p = subprocess.run([sys.executable, __file__, "--child", "--model", model, "--threads", str(threads)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise RuntimeError(f"{mode} run failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), mode=mode)


def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def main() -> int:
    ap = argparse.ArgumentParser(prog="serve_new_shape.py")
    ap.add_argument("--model", choices=["mlp", "block"], default="mlp")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="active,off,no-first-compile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.threads)))
        return 0
    modes = a.modes.split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    rows = []
    for i in range(a.rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            r = run_mode(mode, a.model, a.threads)
            print(f"[new-shape] round {i + 1} {json.dumps(r)}", file=sys.stderr, flush=True)
            rows.append(r)
    print("| mode | round | compile of the new shape, s | warm calls during it | their median, ms | their max, ms "
          "| warm median before, ms |\n| --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        for i, r in enumerate(x for x in rows if x["mode"] == mode):
            print(f"| {mode} | {i + 1} | {r['compile_s']:.2f} | {r['overlapping']} | {fmt(r['overlapping_median_ms'])} "
                  f"| {fmt(r['overlapping_max_ms'])} | {fmt(r['before_median_ms'], 2)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
