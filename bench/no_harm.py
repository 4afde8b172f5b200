#!/usr/bin/env python
"""What the package costs where a hazard does not need it: active vs ``TTC_DISABLE=1``, alternating runs.

Rows (each a scenario of ``ttc_testing/scenarios/`` in a fresh interpreter, ``--rounds`` runs per mode):

* ``server_first_request``: an 8-worker inference server whose models are in ``eval()`` without
  ``no_grad`` (parameters require grad), compiled with inductor: when the last first answer came;
* ``aot_compile_main``: ``torch.compile(f, fullgraph=True).aot_compile(...)`` in the main thread works;
* ``trace_beside_compiles``: FX traces and exports completed in 10 s beside two threads compiling back to
  back (upstream's compiles there fail with H1 errors, which makes them cheaper: the errors are reported);
* ``failing_neighbour``: target threads' calls while a neighbour's compiles keep failing (slowest warm call).

    python bench/no_harm.py --rounds 3 [--only server_first_request,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _harness import ACTIVE, UNPATCHED, alternating, md_table, mode_label, scenario_env, spread

from ttc_testing import scenarios

# name -> (kwargs, the numbers to report: (key, label, how to summarise))
ROWS: dict[str, tuple[dict[str, Any], list[tuple[str, str]]]] = {
    "server_first_request": ({"workers": 8, "backend": "inductor"},
                             [("first_answers_s", "last first answer s"), ("wrong", "wrong outputs")]),
    "aot_compile_main": ({}, [("ok", "works"), ("error", "error")]),
    "trace_beside_compiles": ({"seconds": 10.0}, [("traces", "FX traces"), ("exports", "exports"), ("errors", "errors")]),
    "failing_neighbour": ({"seconds": 8.0},
                          [("target_calls", "target calls"), ("max_warm_call_s", "slowest warm call s"), ("errors", "errors")]),
}


def _summary(values: list[Any]) -> str:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if nums and len(nums) == len(values):
        return spread(nums)
    return ", ".join(sorted({str(v)[:60] for v in values}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {n: {ACTIVE: [], UNPATCHED: []} for n in names}
    for name in names:
        kwargs = ROWS[name][0]
        for _, disable in alternating(args.rounds):
            res = scenarios.run(name, env=scenario_env(disable), timeout=900, **kwargs)
            results[name][mode_label(disable)].append(res)
            print(f"[no_harm] {name} {'off' if disable else 'on '} {json.dumps(res)[:160]}", file=sys.stderr, flush=True)
    rows = [[name, label, *(_summary([r.get(key, r.get("rc", "no result")) for r in results[name][mode]]) for mode in (UNPATCHED, ACTIVE))]
            for name in names for key, label in ROWS[name][1]]
    print(md_table(["scenario", "measure", UNPATCHED, ACTIVE], rows))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
