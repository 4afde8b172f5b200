"""Start-up cost of activation in processes that never import torch (issue: activation).

Measures, alternating active and TTC_DISABLE=1 runs:
* the bootstrap's own import time, from ``python -X importtime -c pass`` (cumulative µs of
  ``torch_threadsafe_compile._bootstrap`` and its parent package);
* wall time of ``python -c pass``.

    python bench/startup.py [--rounds 40] [--tree . --tree ../other-checkout]

With ``--tree`` (repeatable) every measurement is made for each tree, the trees taking turns within each
round, so that two commits are compared in one run (each child gets its tree first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

from _harness import add_tree_option, alternate, child_env, tree_turns, trees_of


def bootstrap_import_us(tree: str | None = None) -> float:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=child_env(False, tree), capture_output=True, text=True)
    total = 0
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s+(.*)$", line)
        if m and m.group(3).strip() in ("torch_threadsafe_compile", "torch_threadsafe_compile._bootstrap", "torch_threadsafe_compile._env"):
            total += int(m.group(1))  # self time: the parents' cumulative would double count
    if not total:
        raise SystemExit("the bootstrap was not imported at start-up: is the package installed (pip install -e .)?")
    return float(total)


def wall_pass(disabled: bool, tree: str | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=child_env(disabled, tree), check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    add_tree_option(ap)
    a = ap.parse_args()
    trees = trees_of(ap, a)
    imp: dict[str | None, list[float]] = {t: [] for t in trees}
    walls: dict[str | None, list[tuple[float, float]]] = {t: [] for t in trees}
    for t in trees:
        bootstrap_import_us(t)  # first run writes the .pyc files (editable installs have none yet)
    for i in range(a.rounds):
        for t in tree_turns(trees, i):
            imp[t].append(bootstrap_import_us(t))
            wall = alternate(lambda disabled, t=t: wall_pass(disabled, t), 2)
            walls[t].append((wall["active_median"], wall["unpatched_median"]))
    heavy = "import sys; print(sorted(m for m in ('torch','wrapt','packaging','logging') if m in sys.modules))"
    for t in trees:
        p = subprocess.run([sys.executable, "-c", heavy], env=child_env(False, t), capture_output=True, text=True)
        on, off = statistics.median(x for x, _ in walls[t]), statistics.median(y for _, y in walls[t])
        if len(trees) > 1:
            print(f"== tree {t}")
        print(f"bootstrap import at start-up: median {statistics.median(imp[t]):.0f} us, max {max(imp[t]):.0f} us ({a.rounds} runs)")
        print(f"python -c pass: active {on*1e3:.1f} ms, TTC_DISABLE=1 {off*1e3:.1f} ms, "
              f"ratio {on / off:.3f} (median of {a.rounds} rounds of 2 alternating runs per mode)")
        print(f"heavy modules imported by `python -c pass` when active: {p.stdout.strip()}")


if __name__ == "__main__":
    main()
