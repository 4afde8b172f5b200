#!/usr/bin/env python
"""Warm compiled calls per second on a free-threaded CPython: 1 and 2 threads, GIL on and off, package on and off.

Each measurement is a fresh interpreter running ``ttc_testing.freethreaded warm_calls`` (one tiny compiled
function, ``x * 2 + 1`` on 16 elements, ``aot_eager``, compiled before the threads start; every call is warm)
for ``--seconds``; rounds alternate over all configurations so that the machine's load hits each alike. The GIL
is switched with ``PYTHON_GIL`` (one interpreter, one torch, both ways); the package with ``TTC_DISABLE=1``.
With the package active, ``eval_frame_shim`` is applied (forced by the scenario where it is not registered
yet): without it two threads can crash the process with the GIL off, with or without the rest of the package.
A run that dies or hangs is counted as such, never as a number.

    python bench/freethreaded.py                     # run with the free-threaded interpreter
    python bench/freethreaded.py --rounds 5 --seconds 8 --threads 1 2 4 --md out.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _harness import md_table, scenario_env

from ttc_testing import freethreaded


def configs(threads: list[int]) -> list[dict[str, Any]]:
    return [{"gil": gil, "ttc": ttc, "threads": n} for gil in ("on", "off") for ttc in ("off", "on") for n in threads]


def measure(cfg: dict[str, Any], seconds: float, timeout: float) -> dict[str, Any]:
    env = {"PYTHON_GIL": "1" if cfg["gil"] == "on" else "0", **scenario_env(cfg["ttc"] == "off")}
    res = freethreaded.run("warm_calls", env=env, timeout=timeout, threads=cfg["threads"], seconds=seconds,
                           force=1 if cfg["ttc"] == "on" else 0)
    return {**cfg, **res}


def key(cfg: dict[str, Any]) -> tuple[str, str, int]:
    return cfg["gil"], cfg["ttc"], cfg["threads"]


def table(rows: dict[tuple[str, str, int], list[dict[str, Any]]], threads: list[int]) -> str:
    out: list[list[Any]] = []
    for gil in ("on", "off"):
        for ttc in ("off", "on"):
            base = None
            for n in threads:
                runs = rows.get((gil, ttc, n), [])
                ok = [r["calls_per_s"] for r in runs if "calls_per_s" in r]
                died = sum(1 for r in runs if "rc" in r)
                hung = sum(1 for r in runs if r.get("timeout"))
                errors = sum(r.get("errors", 0) + r.get("wrong", 0) for r in runs)
                if not ok:
                    out.append([gil, ttc, n, "-", "-", "-", f"{died} / {hung} of {len(runs)}", errors])
                    continue
                med = statistics.median(ok)
                base = med if n == threads[0] else base
                scale = f"{med / base:.2f}x" if base and n != threads[0] else ""
                out.append([gil, ttc, n, f"**{med:,.0f}** ({min(ok):,}-{max(ok):,})", f"{med / n:,.0f}", scale,
                            f"{died} / {hung} of {len(runs)}", errors])
    return md_table(["GIL", "TTC", "threads", "warm calls/s, median (min-max)", "per thread", "vs 1 thread",
                     "runs died / hung", "errors"], out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--md", help="write the table here too")
    ap.add_argument("--jsonl", help="append every run's result here")
    a = ap.parse_args()
    state = freethreaded.gil_state()
    if not state["free_threaded_build"]:
        print(f"{sys.executable} is not a free-threaded build (python3.13t or later); nothing to measure", file=sys.stderr)
        return 2
    rows: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in range(a.rounds):
        for cfg in configs(a.threads):
            res = measure(cfg, a.seconds, a.timeout)
            rows.setdefault(key(cfg), []).append(res)
            print(json.dumps({"round": r, **res}), flush=True)
            if a.jsonl:
                with open(a.jsonl, "a") as fh:
                    fh.write(json.dumps({"round": r, **res}) + "\n")
    import torch  # only for the header: the measured interpreters import it themselves

    head = (f"Python {state['python']} (free-threaded build), torch {torch.__version__}, {a.rounds} rounds of "
            f"{a.seconds:g} s per configuration")
    text = head + "\n\n" + table(rows, a.threads)
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
