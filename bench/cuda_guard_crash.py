#!/usr/bin/env python
"""Crash rate of upstream's dynamo thread-safety reproducer (pytorch/pytorch#118260) on torch's CUDA builds
on a machine without a GPU, unpatched (``TTC_DISABLE=1``) and with the package active.

Every run is a fresh interpreter of the venv, started from a neutral directory (so the venv's installed
package and its start-up hook are what is exercised), that runs::

    f = torch.compile(lambda x: x.sin() + 1, dynamic=False, backend="aot_eager")
    # two threads (offset 0 and 1) call f(torch.randn(2 * i + offset)), i = 0, 1, 2, ...,
    # for --seconds and at least --min-calls times each

Each call has a new shape, so one thread compiles while the other runs compiled code. On CUDA builds
without a GPU this can kill the process (``FakeTensorMode.__enter__`` calls
``torch._C._ensureCUDADeviceGuardSet()`` on every compile). Runs of the two modes alternate, so that the
machine's load hits both alike. Printed per version and mode: crashes / runs, the signals, and the most
frequent faulthandler headline (``Fatal Python error`` and the crashing thread's innermost frame).

    python bench/cuda_guard_crash.py --venv 2.11.0=/path/to/venv [--venv V=PATH ...] [--runs 20]
    python bench/cuda_guard_crash.py --venv-root DIR --versions 2.4.1 2.11.0 --modes unpatched --runs 10
    python bench/cuda_guard_crash.py --venv-root DIR            # every default version found under DIR

CPU builds of torch (``torch.version.cuda`` is None) are skipped unless ``--include-cpu-builds`` (a control:
they are not expected to crash). A venv with a visible GPU is run too, and the table says so. Standard library
only, like ``bench/compat_matrix.py``, whose process supervision it shares (``bench/compat/``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _harness import kill_children_on_stop, result_line, run_proc
from compat.scrub import SCRUB
from compat.supervise import child_env, failure_info, log
from compat.venvs import DEFAULT_VENV_ROOT, DEFAULT_VERSIONS, VENV_ROOT_ENV, venv_python

# The reproducer. Its RESULT line is printed only if the process survives.
REPRO = r"""
import json, sys, threading, time
import torch
import torch._dynamo  # before the threads: they race on compiles, not on first imports

seconds, min_calls = float(sys.argv[1]), int(sys.argv[2])
f = torch.compile(lambda x: x.sin() + 1, dynamic=False, backend="aot_eager")
calls = [0, 0]
errors = {}
t0 = time.monotonic()

def run(offset):
    i = 0
    while i < min_calls or time.monotonic() - t0 < seconds:
        try:
            f(torch.randn(i * 2 + offset))
            calls[offset] += 1
        except Exception as e:  # counted, not fatal: the question is whether the process survives
            key = type(e).__name__ + ": " + str(e)[:80]
            errors[key] = errors.get(key, 0) + 1
        i += 1

ts = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
for t in ts:
    t.start()
for t in ts:
    t.join()
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
print("RESULT " + json.dumps({"calls": sum(calls), "graphs": int(graphs), "errors": sum(errors.values()),
                              "kinds": list(errors)[:3], "secs": round(time.monotonic() - t0, 2)}))
"""

BUILD_PROBE = (
    "import json, torch\n"
    "print('BUILD ' + json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
    "'gpu': torch.cuda.is_available()}))\n"
)
MODES = {"unpatched": True, "active": False}  # mode -> TTC_DISABLE


def build_info(py: Path, cwd: str) -> dict[str, Any]:
    pr = run_proc([str(py), "-c", BUILD_PROBE], child_env(disable=True), 300, cwd=cwd)
    info = result_line(pr["stdout"], "BUILD ")
    return info if info is not None else {"error": failure_info(pr, 300)["short"]}


def one_run(py: Path, mode: str, seconds: float, min_calls: int, timeout: float, cwd: str) -> dict[str, Any]:
    """``outcome``: ok, crash (killed by a signal or a fatal error), timeout, or error (exited without a result)."""
    cmd = [str(py), "-X", "faulthandler", "-c", REPRO, str(seconds), str(min_calls)]
    pr = run_proc(cmd, child_env(MODES[mode]), timeout, cwd=cwd)
    res = result_line(pr["stdout"])
    if res is not None and pr["rc"] == 0:
        return dict(res, outcome="ok", wall_s=pr["secs"])
    info = failure_info(pr, timeout)
    if info["timeout"]:
        info["outcome"] = "timeout"
    elif info["signal"] or info["fatal"]:
        info["outcome"] = "crash"
    else:
        info["outcome"] = "error"
    return info


def headline(run: dict[str, Any]) -> str:
    """What a crash is known by: faulthandler's headline and the crashing thread's innermost frame."""
    fatal = run.get("fatal", "").replace("Fatal Python error: ", "")
    site = run.get("crash_site", "")
    return " in ".join(x for x in (fatal, site) if x) or run.get("last_line", "") or "no output"


@dataclass(frozen=True)
class Plan:
    modes: list[str]
    runs: int  # per mode
    seconds: float
    min_calls: int
    timeout: float
    include_cpu: bool


def run_version(label: str, venv: Path, plan: Plan) -> dict[str, Any]:
    py = venv_python(venv)
    out: dict[str, Any] = {"label": label, "runs": {m: [] for m in plan.modes}}
    with tempfile.TemporaryDirectory(prefix="ttc-cuda-guard-") as cwd:
        if not py.exists():
            out["skipped"] = "no venv"
            return out
        out["build"] = build_info(py, cwd)
        if "error" in out["build"] or (out["build"]["cuda"] is None and not plan.include_cpu):
            out["skipped"] = out["build"].get("error") or "CPU build"
            return out
        for i in range(plan.runs):
            # ABBA order: drifts of the machine's load hit both modes alike.
            for mode in (plan.modes if i % 2 == 0 else list(reversed(plan.modes))):
                r = one_run(py, mode, plan.seconds, plan.min_calls, plan.timeout, cwd)
                out["runs"][mode].append(r)
                done = f"{r['calls']} calls, {r['graphs']} graphs" if r["outcome"] == "ok" else r.get("short")
                log(f"{label} {mode:<9} run {i + 1}/{plan.runs}: {r['outcome']} ({done})", tag="crash")
    return out


def summary(res: dict[str, Any], mode: str) -> dict[str, Any]:
    rs = res["runs"][mode]
    crashes = [r for r in rs if r["outcome"] == "crash"]
    return {
        "runs": len(rs),
        "crashes": len(crashes),
        "timeouts": sum(r["outcome"] == "timeout" for r in rs),
        "errors": sum(r["outcome"] == "error" for r in rs),
        "signals": dict(collections.Counter(r["signal"] or f"rc={r['rc']}" for r in crashes)),
        "headlines": collections.Counter(headline(r) for r in crashes).most_common(),
    }


def table(results: list[dict[str, Any]], modes: list[str]) -> str:
    lines = ["| torch | CUDA | GPU visible | mode | crashed / runs | signals | most frequent headline | other |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        b = res.get("build", {})
        if "skipped" in res:
            lines.append(f"| {b.get('torch', res['label'])} | {b.get('cuda') or '–'} | {b.get('gpu', '–')} | – | "
                         f"skipped: {res['skipped']} | | | |")
            continue
        for mode in modes:
            s = summary(res, mode)
            sig = ", ".join(f"{k} ×{v}" for k, v in s["signals"].items()) or "–"
            head = f"{s['headlines'][0][0]} (×{s['headlines'][0][1]})" if s["headlines"] else "–"
            other = ", ".join(f"{s[k]} {k}" for k in ("timeouts", "errors") if s[k]) or "–"
            lines.append(f"| {b['torch']} | {b['cuda'] or 'CPU build'} | {'yes' if b['gpu'] else 'no'} | {mode} | "
                         f"{s['crashes']} / {s['runs']} | {sig} | {head.replace('|', '/')} | {other} |")
    return "\n".join(lines)


def _targets(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[tuple[str, Path]]:
    if args.venv:
        out = []
        for item in args.venv:
            ver, sep, path = item.partition("=")
            if not sep or not ver or not path:
                ap.error(f"--venv wants V=PATH, got {item!r}")
            out.append((ver, Path(path).expanduser().absolute()))
        return out
    root = Path(args.venv_root).expanduser().absolute()
    return [(v, root / f"torch-{v}") for v in args.versions]


def main(argv: list[str] | None = None) -> int:
    kill_children_on_stop()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", action="append", default=[], metavar="V=PATH", help="a venv to run (repeatable)")
    ap.add_argument("--venv-root", default=os.environ.get(VENV_ROOT_ENV) or str(DEFAULT_VENV_ROOT),
                    help=f"without --venv: torch-<V> venvs under this root (default ${VENV_ROOT_ENV}, else .venvs/)")
    ap.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS, metavar="V", help="with --venv-root")
    ap.add_argument("--runs", type=int, default=20, help="runs per version and mode (default 20)")
    ap.add_argument("--seconds", type=float, default=2.0, help="how long the two threads call (default 2)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="default: both")
    ap.add_argument("--min-calls", type=int, default=20, help="calls per thread at least (default 20)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run before it counts as a hang")
    ap.add_argument("--include-cpu-builds", action="store_true", help="also run CPU builds of torch (a control)")
    ap.add_argument("--json", metavar="PATH", help="also write every run (paths scrubbed) as JSON")
    args = ap.parse_args(argv)
    plan = Plan(list(dict.fromkeys(args.modes)), args.runs, args.seconds, args.min_calls, args.timeout,
                args.include_cpu_builds)
    results = []
    for label, venv in _targets(args, ap):
        SCRUB.add(str(venv), "<venv>")
        results.append(run_version(label, venv, plan))
    print(table(results, args.modes))
    if args.json:
        Path(args.json).write_text(SCRUB(json.dumps({"argv": argv or sys.argv[1:], "results": results}, indent=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
