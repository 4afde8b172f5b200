"""H4 on a GPU: the seed layout (drafter threads training with compiled flex_attention fwd+bwd, target
threads running a compiled forward) with a cold inductor cache, repeated, unpatched and active.

A run that does not finish within ``--timeout`` seconds is a hang: its stacks (faulthandler) are kept.

    python bench/h4_drafter_flex.py --active-runs 5 --unpatched-runs 2 --timeout 90 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _harness import ACTIVE, UNPATCHED, mode_label, result_line, run_cold


def one(disabled: bool, timeout: float, out_dir: str | None, tag: str) -> dict:
    cmd = [sys.executable, "-X", "faulthandler", "-c",
           f"import faulthandler, sys, json; faulthandler.dump_traceback_later({timeout!r}, exit=True); "
           "from ttc_testing.scenarios import drafter_flex; r = drafter_flex(); "
           "faulthandler.cancel_dump_traceback_later(); print('RESULT ' + json.dumps(r), flush=True)"]
    pr = run_cold(cmd, disabled, timeout + 30, watchdog_s=None if disabled else max(10, timeout / 3))  # a cold cache
    err, rc = pr["stderr"], None if pr["timeout"] else pr["rc"]
    res = result_line(pr["stdout"])
    row = {"run": tag, "package": mode_label(disabled), "wall_s": pr["secs"]}
    if res is not None:
        row.update(completed=True, **res)
    else:
        row.update(completed=False, hung="Timeout" in err or rc is None or "Thread 0x" in err, rc=rc,
                   watchdog="H4" in err)
        if out_dir:
            with open(os.path.join(out_dir, f"stacks-{tag}.txt"), "w") as fh:
                fh.write(err[-200000:])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--active-runs", type=int, default=5)
    ap.add_argument("--unpatched-runs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    rows = []
    for i in range(a.unpatched_runs):
        rows.append(one(True, a.timeout, a.out, f"unpatched-{i}"))
        print(json.dumps(rows[-1]), flush=True)
    for i in range(a.active_runs):
        rows.append(one(False, a.timeout, a.out, f"active-{i}"))
        print(json.dumps(rows[-1]), flush=True)
    for pkg in (UNPATCHED, ACTIVE):
        sel = [r for r in rows if r["package"] == pkg]
        done = sum(r["completed"] for r in sel)
        print(f"{pkg}: {done}/{len(sel)} completed, {sum(not r['completed'] for r in sel)} hung (> {a.timeout:g} s)")
    if a.out:
        with open(os.path.join(a.out, "h4.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
