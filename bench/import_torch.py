"""Added cost of activation to ``import torch`` (and to ``import torch._dynamo``, where the dynamo
patches apply), as a ratio active / TTC_DISABLE=1, median of alternating fresh interpreters.

    python bench/import_torch.py [--rounds 20] [--tree . --tree ../other-checkout]

With ``--tree`` (repeatable) every measurement is made for each tree in turn within each round, so that two
commits are compared in one run (each child gets its tree first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from _harness import add_tree_option, alternate, run_child_json, tree_turns, trees_of

CODE = """
import time, json, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
{extra}
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t1, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))]))
"""


# In one active process: the time spent in our code during `import torch` (the import hook's lookups and
# everything the registry does when torch modules finish importing), against the whole import.
INPROC = """
import time, json, sys
from torch_threadsafe_compile import _bootstrap as b
spent = [0.0]
def timed(fn):
    def inner(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t
    return inner
b._on_import = timed(b._on_import)
b._finder.find_spec = timed(b._finder.find_spec)
t0 = time.perf_counter()
import torch
total = time.perf_counter() - t0
print(json.dumps([spent[0], total]))
"""


def measure(rounds: int, tree: str | None) -> dict[str, Any]:
    """One tree's rounds: the in-process share, and both imports alternating active / TTC_DISABLE=1."""
    mods: dict[bool, list[str]] = {}
    dyn_mods: dict[bool, list[str]] = {}

    def m_torch(disabled: bool) -> float:
        t_torch, _, m = run_child_json(CODE.format(extra=""), disabled, tree=tree)
        mods[disabled] = m
        return t_torch

    def m_dynamo(disabled: bool) -> float:
        _, t_dyn, m = run_child_json(CODE.format(extra="import torch._dynamo, torch._functorch.config"), disabled, tree=tree)
        dyn_mods[disabled] = m
        return t_dyn

    inproc = [run_child_json(INPROC, False, tree=tree) for _ in range(rounds)]
    return {"inproc": inproc, "torch": alternate(m_torch, rounds), "dynamo": alternate(m_dynamo, rounds),
            "mods": mods, "dyn_mods": dyn_mods}


def report(a: argparse.Namespace, res: dict[str, Any]) -> None:
    inproc, r1, r2 = res["inproc"], res["torch"], res["dynamo"]
    fractions = sorted(x / t for x, t in inproc)
    print(f"in-process: our code during import torch {statistics.median(x for x, _ in inproc)*1e3:.1f} ms of "
          f"{statistics.median(t for _, t in inproc)*1e3:.0f} ms = {statistics.median(fractions)*100:.2f} % "
          f"(median of {len(inproc)} interpreters; range {fractions[0]*100:.2f}..{fractions[-1]*100:.2f} %)")
    print(f"import torch: active {r1['active_median']*1e3:.0f} ms, TTC_DISABLE=1 {r1['unpatched_median']*1e3:.0f} ms, "
          f"ratio {r1['ratio']:.3f} ({r1['rounds']} alternating runs each)")
    print(f"then import torch._dynamo: active {r2['active_median']*1e3:.0f} ms, TTC_DISABLE=1 {r2['unpatched_median']*1e3:.0f} ms, "
          f"ratio {r2['ratio']:.3f}")
    for key, what in (("mods", "import torch"), ("dyn_mods", "import torch._dynamo")):
        extra = sorted(set(res[key][False]) - set(res[key][True]))
        print(f"torch modules imported only when active, after {what}: {extra or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    add_tree_option(ap)
    a = ap.parse_args()
    trees = trees_of(ap, a)
    # Rounds of 2 per tree, the trees taking turns, so that both see the same machine drift.
    parts: dict[str | None, list[dict[str, Any]]] = {t: [] for t in trees}
    for i in range(max(1, a.rounds // 2)):
        for t in tree_turns(trees, i):
            parts[t].append(measure(2, t))
    for t in trees:
        if len(trees) > 1:
            print(f"== tree {t}")
        report(a, _merge(parts[t]))


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one tree as one result (medians over every round's runs)."""
    out: dict[str, Any] = {"inproc": [x for p in parts for x in p["inproc"]], "mods": parts[-1]["mods"],
                           "dyn_mods": parts[-1]["dyn_mods"]}
    for key in ("torch", "dynamo"):
        on = [p[key]["active_median"] for p in parts]
        off = [p[key]["unpatched_median"] for p in parts]
        m_on, m_off = statistics.median(on), statistics.median(off)
        out[key] = {"active_median": m_on, "unpatched_median": m_off, "ratio": m_on / m_off, "rounds": 2 * len(parts)}
    return out


if __name__ == "__main__":
    main()
