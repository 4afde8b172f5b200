#!/usr/bin/env python
"""What a compile in one thread holds up in the others: issue 38's three shapes, unpatched against active.

    python bench/first_compile_waits.py                 # 3 runs of each shape per mode
    python bench/first_compile_waits.py --runs 10 --md docs/performance.md

Each run is a fresh interpreter (``ttc_testing/scenarios/``), modes alternating run by run so that the
machine's drift hits both alike:

* ``warm_beside_recompile``: 7 threads call a compiled function whose graph fits their inputs while an 8th
  recompiles it (float64, 1.5 s compile): warm calls per second during the recompile, the longest warm call;
* ``rendezvous_step``: 8 ranks, a ``threading.Barrier(8, timeout=4)`` in a ``torch.compiler.disable``d
  helper between two graphs, first compile 3 s: ranks that saw the barrier broken;
* ``blocking_io_step``: 8 threads, a 2 s sleep in a disabled helper between two graphs: the cold round and
  the graphs compiled.

The markdown table goes between ``<!-- first-compile-waits:begin -->`` and ``<!-- ...:end -->`` of ``--md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _harness import alternating, md_table, mode_label, scenario_env, spread, write_between

from ttc_testing import scenarios

MODES = [mode_label(True), mode_label(False)]  # the table's order
SHAPES = {
    "warm_beside_recompile": ("warm_per_s_during", "longest_warm_call_s", "warm_per_s_before"),
    "rendezvous_step": ("broken", "wrong", "first_step_s"),
    "blocking_io_step": ("cold_round_s", "graphs", "uncompiled_frames"),
}
BEGIN, END = "<!-- first-compile-waits:begin -->", "<!-- first-compile-waits:end -->"


def measure(runs: int, shapes: list[str]) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in MODES} for s in shapes}
    for shape in shapes:
        for k, disabled in alternating(runs):
            mode = mode_label(disabled)
            res = scenarios.run(shape, env=scenario_env(disabled), timeout=300)
            out[shape][mode].append(res)
            print(f"{shape} [{mode}] run {k + 1}: {res}", file=sys.stderr, flush=True)
    return out


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def render(out: dict[str, dict[str, list[dict]]], runs: int, command: str) -> str:
    lines = [f"`{command}` ({runs} runs per shape and mode, fresh interpreters, modes alternating; "
             f"median (min–max); {time.strftime('%Y-%m-%d')})", ""]
    for shape in out:
        keys = SHAPES[shape]
        rows = []
        for mode, results in out[shape].items():
            bad = sum(1 for r in results if r.get("errors") or "rc" in r or "timeout" in r)
            rows.append([mode, *(spread([r.get(k) for r in results], _num) for k in keys), f"{bad} of {len(results)}"])
        lines += [f"**{shape}**", "", md_table(["mode", *keys, "errors or crashes"], rows), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each shape per mode (default 3)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset (default: all three)")
    ap.add_argument("--md", type=Path, help="write the table between the markers in this markdown file")
    args = ap.parse_args(argv)
    command = "python bench/first_compile_waits.py " + " ".join(argv if argv is not None else sys.argv[1:])
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shape(s): {sorted(unknown)}")
    table = render(measure(max(1, args.runs), shapes), args.runs, command.strip())
    print(table)
    if args.md and not write_between(args.md, BEGIN, END, table):
        print(f"{args.md}: no {BEGIN} … {END} markers; table not written", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
