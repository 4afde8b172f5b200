"""H3 costs: warm-call overhead of the compile gate, and stampede wall time.

1. Warm calls of a tiny compiled function (``x + 1`` on a 16-element tensor, backend ``aot_eager`` by
   default): the same function compiled once without the gate (package uninstalled) and once with it,
   in one process, alternating batches; median per-call time of each and their ratio.
2. Warm calls of the smallest compiled function (``torch.compile(lambda x: x + 1, backend="eager")``),
   where the gate and the per-thread flags are the largest share of a call: per interpreter, best of 7 x
   20,000 calls, active vs ``TTC_DISABLE=1`` (everything the package changes, not only the gate), in
   ``--pairs`` alternating interpreter pairs; the median of the pairs' ratios.
3. Stampede: 8 threads make the first call of one compiled function at the same moment; wall time of
   the stampede divided by the wall time of a single thread's first call (one compile), both active and
   unpatched.

    python bench/warm_call.py [--rounds 10] [--pairs 5] [--backend inductor]
    python bench/warm_call.py --tree . --tree ../other-checkout    # two trees of the package, one run

With ``--tree`` (repeatable) each measurement is made for every tree given, the trees taking turns within
each round, so that two commits are compared on the same machine state (each child gets the tree first on
``PYTHONPATH`` and prints which package file it activated).
"""

from __future__ import annotations

import argparse
import statistics

from _harness import ACTIVE, UNPATCHED, add_tree_option, run_child_json, tree_turns, trees_of

# Both versions of the function live in one process: `plain` is compiled while the package is
# uninstalled (no gate, upstream's wrapper), `gated` after install(). Batches alternate between them.
WARM = """
import time, statistics, json, torch
import torch_threadsafe_compile as ttc
ttc.uninstall()
plain = torch.compile(lambda x: x + 1, backend={backend!r})
ttc.install()
gated = torch.compile(lambda x: x + 1, backend={backend!r})
assert getattr(gated, "_ttc_gate", False) and not getattr(plain, "_ttc_gate", False)
x = torch.randn(16)
for _ in range(300): plain(x); gated(x)
per = {{"plain": [], "gated": []}}
for i in range(40):
    for name in (("plain", "gated") if i % 2 == 0 else ("gated", "plain")):
        f = plain if name == "plain" else gated
        t0 = time.perf_counter()
        for _ in range(2000): f(x)
        per[name].append((time.perf_counter() - t0) / 2000)
print(json.dumps([statistics.median(per["gated"]), statistics.median(per["plain"])]))
"""

SMALLEST = """
import time, json, torch
import torch_threadsafe_compile as _ttc
ORIGIN = _ttc.__file__
f = torch.compile(lambda x: x + 1, backend="eager")
x = torch.randn(16)
for _ in range(500): f(x)
best = 1e9
for _ in range(7):
    t0 = time.perf_counter()
    for _ in range(20000): f(x)
    best = min(best, (time.perf_counter() - t0) / 20000)
print(json.dumps([best, ORIGIN]))
"""

STAMPEDE = """
import time, threading, json, torch
def make():
    return torch.compile(lambda x: (x * 2).sin() + 1, backend={backend!r})
# warm up dynamo/AOT machinery once, so that "one compile" below is a compile and not first-use setup
torch.compile(lambda x: x - 1, backend={backend!r})(torch.randn(8))
# one compile, alone (a different function object of the same shape of work)
f1 = make(); x = torch.randn(64)
t0 = time.perf_counter(); f1(x); single = time.perf_counter() - t0
f = torch.compile(lambda x: (x * 3).cos() - 1, backend={backend!r})
bar = threading.Barrier({n})
def w():
    y = torch.randn(64); bar.wait(); f(y)
ts = [threading.Thread(target=w) for _ in range({n})]
t0 = time.perf_counter(); [t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps([single, time.perf_counter() - t0]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=5, help="interpreter pairs for the smallest eager-backend function")
    add_tree_option(ap)
    a = ap.parse_args()
    trees = trees_of(ap, a)
    label = {t: ("installed" if t is None else t) for t in trees}
    pairs: dict[str | None, list[tuple[float, float]]] = {t: [] for t in trees}
    origin: dict[str | None, str] = {}
    for i in range(a.pairs):
        for t in tree_turns(trees, i):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {disabled: run_child_json(SMALLEST, disabled, tree=t) for disabled in order}
            origin[t] = got[False][1]
            pairs[t].append((got[False][0], got[True][0]))
    for t in trees:
        ratios_small = sorted(on / off for on, off in pairs[t])
        print(f"[{label[t]}] package {origin[t]}")
        on, off = statistics.median(p[0] for p in pairs[t]), statistics.median(p[1] for p in pairs[t])
        print(f"[{label[t]}] warm call of the smallest eager-backend function: active {on*1e6:.2f} us, "
              f"TTC_DISABLE=1 {off*1e6:.2f} us, median ratio of {a.pairs} interpreter pairs "
              f"{statistics.median(ratios_small):.3f} (range {ratios_small[0]:.3f}..{ratios_small[-1]:.3f})")
    runs: dict[str | None, list[list[float]]] = {t: [] for t in trees}
    for i in range(a.rounds):
        for t in tree_turns(trees, i):
            runs[t].append(run_child_json(WARM.format(backend=a.backend), False, tree=t))
    for t in trees:
        gated = statistics.median(r[0] for r in runs[t])
        plain = statistics.median(r[1] for r in runs[t])
        ratios = sorted(r[0] / r[1] for r in runs[t])
        print(f"[{label[t]}] warm call ({a.backend}): gated {gated*1e6:.2f} us, upstream wrapper {plain*1e6:.2f} us, "
              f"ratio {gated / plain:.3f} (per-interpreter ratios {ratios[0]:.3f}..{ratios[-1]:.3f}; "
              f"{a.rounds} interpreters x 40 alternating batches of 2000 calls)")
    for t in trees:
        res = {}
        for disabled in (False, True):
            st = [run_child_json(STAMPEDE.format(backend=a.backend, n=a.threads), disabled, tree=t) for _ in range(3)]
            res[disabled] = (sorted(r[0] for r in st)[1], sorted(r[1] for r in st)[1])
        for disabled, mode in ((False, ACTIVE), (True, UNPATCHED)):
            single, stamp = res[disabled]
            print(f"[{label[t]}] stampede of {a.threads} threads ({a.backend}), {mode}: {stamp:.2f} s vs one compile {single:.2f} s "
                  f"-> ratio {stamp / single:.2f} (median of 3)")


if __name__ == "__main__":
    main()
