#!/usr/bin/env python
"""Memory of a process that compiles and drops many distinct functions, active vs ``TTC_DISABLE=1``.

A server that compiles many short-lived functions must not grow without bound because of this package:
its per-function tables (first_compile's statistics, compile results not yet in dynamo's cache,
continuation gates, flights) are keyed weakly and pruned. In each mode, one fresh interpreter compiles
``--functions`` functions with distinct code objects (``--backend eager``: dynamo's work without a
compiler's), calls each once, drops them all, collects garbage, then calls ``torch._dynamo.reset()``;
the resident set size (RSS) and the package's table sizes are read at each step.

    python bench/memory_functions.py --functions 10000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _harness import ACTIVE, UNPATCHED, child_env, md_table, result_line

CHILD = r"""
import gc, json, sys, torch, torch._dynamo
n, backend, graph_break = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"

def rss_mib():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20

def tables():
    try:
        import torch_threadsafe_compile as ttc
        from torch_threadsafe_compile.patches import first_compile
        from torch_threadsafe_compile.patches.first_compile import _calls
        from torch_threadsafe_compile import _journal
    except ImportError:
        return {}
    if not ttc.is_patched("first_compile"):
        return {}
    return dict(first_compile.tables(), thread_stacks=len(_calls.all_stacks), journal=len(_journal._journal_index))

def make(i):
    ns = {"torch": torch}
    body = "    torch._dynamo.graph_break()\n" if graph_break else ""
    exec(f"def f_{i}(x):\n    y = x * {i}\n{body}    return y + {i}\n", ns)
    return ns[f"f_{i}"]

x = torch.randn(4)
fns = [torch.compile(make(i), backend=backend) for i in range(20)]
for f in fns:
    f(x)
del fns
gc.collect()
out = {"start": {"rss_mib": rss_mib(), "tables": tables()}}
fns = []
for i in range(n):
    f = torch.compile(make(1000 + i), backend=backend)
    f(x)
    fns.append(f)
out["compiled"] = {"rss_mib": rss_mib(), "tables": tables()}
del fns, f
gc.collect()
out["dropped"] = {"rss_mib": rss_mib(), "tables": tables()}
torch._dynamo.reset()
gc.collect()
out["reset"] = {"rss_mib": rss_mib(), "tables": tables()}
print("RESULT " + json.dumps(out))
"""


def run(disable: bool, n: int, backend: str, graph_break: bool) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, str(n), backend, "1" if graph_break else "0"],
                       env=child_env(disable), capture_output=True, text=True, timeout=3600)
    res = result_line(p.stdout)
    if res is None:
        raise RuntimeError(f"child failed (rc={p.returncode}):\n{p.stderr[-3000:]}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--functions", type=int, default=10000)
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--graph-break", action="store_true", help="each function has a graph break (continuations)")
    args = ap.parse_args(argv)
    res = {label: run(disable, args.functions, args.backend, args.graph_break) for label, disable in ((UNPATCHED, True), (ACTIVE, False))}
    print(f"{args.functions} functions, backend {args.backend}{', graph break' if args.graph_break else ''}")
    steps = ["start", "compiled", "dropped", "reset"]
    rows = []
    for label, r in res.items():
        tab = " → ".join(json.dumps(r[s]["tables"], separators=(",", ":")) if r[s]["tables"] else "–" for s in steps)
        rows.append([label, *(f"{r[s]['rss_mib']:.0f}" for s in steps), f"{r['dropped']['rss_mib'] - r['start']['rss_mib']:.0f}", tab])
    print(md_table(["mode", "RSS start MiB", "after compiling", "after dropping", "after reset", "growth (dropped - start)",
                    "package tables start → compiled → dropped → reset"], rows))
    off, on = (res[k]["dropped"]["rss_mib"] - res[k]["start"]["rss_mib"] for k in (UNPATCHED, ACTIVE))
    print(f"RSS growth active / off: {on / off:.3f}" if off > 0 else "RSS growth off: none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
