"""Added cost of activation to ``import torch`` (and to ``import torch._dynamo``, where the dynamo
patches apply), as a ratio active / TTC_DISABLE=1, median of alternating fresh interpreters.

    python bench/import_torch.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import alternate, run_child  # noqa: E402

CODE = """
import time, json, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
{extra}
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t1, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    mods: dict[bool, list[str]] = {}

    def m_torch(disabled: bool) -> float:
        t_torch, _, m = json.loads(run_child(CODE.format(extra=""), disabled))
        mods[disabled] = m
        return t_torch

    dyn_mods: dict[bool, list[str]] = {}

    def m_dynamo(disabled: bool) -> float:
        _, t_dyn, m = json.loads(run_child(CODE.format(extra="import torch._dynamo, torch._functorch.config"), disabled))
        dyn_mods[disabled] = m
        return t_dyn

    r1 = alternate(m_torch, a.rounds)
    r2 = alternate(m_dynamo, a.rounds)
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
