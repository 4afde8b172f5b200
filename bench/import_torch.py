"""Added cost of activation to ``import torch`` (and to ``import torch._dynamo``, where the dynamo
patches apply), as a ratio active / TTC_DISABLE=1, median of alternating fresh interpreters.

    python bench/import_torch.py [--rounds 20]
"""

from __future__ import annotations

import argparse

from _harness import alternate, run_child_json

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    mods: dict[bool, list[str]] = {}

    def m_torch(disabled: bool) -> float:
        t_torch, _, m = run_child_json(CODE.format(extra=""), disabled)
        mods[disabled] = m
        return t_torch

    dyn_mods: dict[bool, list[str]] = {}

    def m_dynamo(disabled: bool) -> float:
        _, t_dyn, m = run_child_json(CODE.format(extra="import torch._dynamo, torch._functorch.config"), disabled)
        dyn_mods[disabled] = m
        return t_dyn

    import statistics

    inproc = [run_child_json(INPROC, False) for _ in range(a.rounds)]
    fractions = sorted(x / t for x, t in inproc)
    r1 = alternate(m_torch, a.rounds)
    r2 = alternate(m_dynamo, a.rounds)
    print(f"in-process: our code during import torch {statistics.median(x for x, _ in inproc)*1e3:.1f} ms of "
          f"{statistics.median(t for _, t in inproc)*1e3:.0f} ms = {statistics.median(fractions)*100:.2f} % "
          f"(median of {a.rounds} interpreters; range {fractions[0]*100:.2f}..{fractions[-1]*100:.2f} %)")
    print(f"import torch: active {r1['active_median']*1e3:.0f} ms, TTC_DISABLE=1 {r1['unpatched_median']*1e3:.0f} ms, "
          f"ratio {r1['ratio']:.3f} ({a.rounds} alternating runs each)")
    print(f"then import torch._dynamo: active {r2['active_median']*1e3:.0f} ms, TTC_DISABLE=1 {r2['unpatched_median']*1e3:.0f} ms, "
          f"ratio {r2['ratio']:.3f}")
    extra = sorted(set(mods[False]) - set(mods[True]))
    print(f"torch modules imported only when active, after import torch: {extra or 'none'}")
    extra = sorted(set(dyn_mods[False]) - set(dyn_mods[True]))
    print(f"torch modules imported only when active, after import torch._dynamo: {extra or 'none'}")


if __name__ == "__main__":
    main()
