"""Start-up cost of activation in processes that never import torch (issue: activation).

Measures, alternating active and TTC_DISABLE=1 runs:
* the bootstrap's own import time, from ``python -X importtime -c pass`` (cumulative µs of
  ``torch_threadsafe_compile._bootstrap`` and its parent package);
* wall time of ``python -c pass``.

    python bench/startup.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

from _harness import alternate, child_env


def bootstrap_import_us() -> float:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=child_env(False), capture_output=True, text=True)
    total = 0
    for line in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s+(.*)$", line)
        if m and m.group(3).strip() in ("torch_threadsafe_compile", "torch_threadsafe_compile._bootstrap", "torch_threadsafe_compile._env"):
            total += int(m.group(1))  # self time: the parents' cumulative would double count
    if not total:
        raise SystemExit("the bootstrap was not imported at start-up: is the package installed (pip install -e .)?")
    return float(total)


def wall_pass(disabled: bool) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=child_env(disabled), check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args()
    bootstrap_import_us()  # first run writes the .pyc files (editable installs have none yet)
    imp = [bootstrap_import_us() for _ in range(a.rounds)]
    wall = alternate(wall_pass, a.rounds)
    heavy = "import sys; print(sorted(m for m in ('torch','wrapt','packaging','logging') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", heavy], env=child_env(False), capture_output=True, text=True)
    print(f"bootstrap import at start-up: median {statistics.median(imp):.0f} us, max {max(imp):.0f} us ({a.rounds} runs)")
    print(f"python -c pass: active {wall['active_median']*1e3:.1f} ms, TTC_DISABLE=1 {wall['unpatched_median']*1e3:.1f} ms, "
          f"ratio {wall['ratio']:.3f} (median of {a.rounds} alternating runs)")
    print(f"heavy modules imported by `python -c pass` when active: {p.stdout.strip()}")


if __name__ == "__main__":
    main()
