#!/usr/bin/env python
"""Run the reference trainer (examples/specdec/train.py) with and without torch_threadsafe_compile and write a
markdown comparison table.

Each run is a subprocess with a timeout; "without" uses the trainer's ``--no-ttc`` (re-exec with TTC_DISABLE=1),
which also makes errors from compiled calls counted instead of fatal. A run killed by the timeout, or stopped by
the trainer's own hang watchdog (exit 3), is reported as hung.

    python bench/bench_trainer.py --preset cpu-tiny --steps 40 --md bench-trainer.md
    python bench/bench_trainer.py --preset cuda-small --extra "--steps 300"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "specdec" / "train.py"


def run_one(label: str, args: List[str], env: Dict[str, str], out: Path, timeout: float) -> Dict[str, object]:
    cmd = [sys.executable, str(TRAIN), *args, "--out", str(out)]
    print(f"[bench] {label}: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc: Optional[int] = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = None, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    wall = time.monotonic() - t0
    summary: Dict[str, object] = {}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("SUMMARY ")]
    if lines:
        summary = json.loads(lines[-1][8:])
    elif (out / "summary.json").exists():
        summary = json.loads((out / "summary.json").read_text())
    if rc not in (0, None) and not lines:
        print(f"[bench] {label} failed (rc={rc}); stderr tail:\n{stderr[-2000:]}", file=sys.stderr)
    return {"label": label, "rc": rc, "wall": wall, "summary": summary, "stderr_tail": stderr[-600:]}


def fmt(x: object, nd: int = 1) -> str:
    if x is None or x == "":
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def table(results: List[Dict[str, object]]) -> str:
    head = ["run", "status", "exit", "hung?", "wall s", "first step s (target / drafter)",
            "tokens/s target", "tokens/s drafter", "unique graphs", "recompiles", "errors",
            "peak GPU MiB", "τ start → end", "TTC active"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s: Dict = r["summary"] or {}
        tp = s.get("throughput", {}) or {}
        tgt, dra = tp.get("target", {}), tp.get("drafter", {})
        comp = s.get("compile", {}) or {}
        errs = s.get("errors", {}) or {}
        peak = s.get("peak_gpu_mem_bytes")
        ttc = s.get("ttc", {}) or {}
        active = "no (TTC_DISABLE=1)" if s.get("ttc_disable_env") == "1" else (
            "yes" if ttc.get("importable") else "package not importable")
        hung = r["rc"] is None or r["rc"] == 3 or s.get("hung")
        rows.append("| " + " | ".join([
            r["label"], fmt(s.get("status", "timeout" if r["rc"] is None else "no summary")), fmt(r["rc"]),
            "YES" if hung else "no", fmt(r["wall"]),
            f"{fmt(tgt.get('time_to_first_step_s'))} / {fmt(dra.get('time_to_first_step_s'))}",
            fmt(tgt.get("tokens_per_s")), fmt(dra.get("tokens_per_s")), fmt(comp.get("unique_graphs")),
            fmt(comp.get("recompiles")), fmt(errs.get("total")), fmt(peak / 2**20 if peak else None),
            f"{fmt(s.get('tau_initial'), 2)} → {fmt(s.get('tau_final'), 2)}", active,
        ]) + " |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-tiny", help="trainer preset")
    p.add_argument("--steps", type=int, help="override the preset's step count")
    p.add_argument("--extra", default="", help="more trainer flags, one quoted string")
    p.add_argument("--timeout", type=float, default=1800, help="per-run wall limit (s): exceeding it = hung")
    p.add_argument("--hang-timeout", type=float, default=600, help="passed to the trainer's watchdog")
    p.add_argument("--pythonpath", help="prepended to PYTHONPATH for both runs (e.g. an uninstalled checkout)")
    p.add_argument("--only", choices=["with", "without"], help="run one side only")
    p.add_argument("--warm", action="store_true",
                   help="share the user's inductor/triton caches (default: a fresh cache per run, so both sides "
                        "pay cold compiles and time to first step is comparable)")
    p.add_argument("--md", help="also write the markdown table to this file")
    p.add_argument("--work-dir", help="keep run outputs here (default: a temporary directory)")
    a = p.parse_args()

    base = ["--preset", a.preset, "--hang-timeout", str(a.hang_timeout), *shlex.split(a.extra)]
    if a.steps:
        base += ["--steps", str(a.steps)]
    env = {k: v for k, v in os.environ.items() if k != "TTC_DISABLE"}
    if a.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [a.pythonpath, env.get("PYTHONPATH")]))
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="bench-trainer-"))
    runs = [("with TTC", base), ("without TTC (--no-ttc)", base + ["--no-ttc"])]
    if a.only:
        runs = [runs[0]] if a.only == "with" else [runs[1]]
    results = []
    for i, (label, args) in enumerate(runs):
        run_env = dict(env)
        if not a.warm:
            run_env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"run{i}-inductor-cache")
            run_env["TRITON_CACHE_DIR"] = str(work / f"run{i}-triton-cache")
        results.append(run_one(label, args, run_env, work / f"run{i}", a.timeout))
    md = (f"### Trainer benchmark: preset `{a.preset}`{' ' + a.extra if a.extra else ''}"
          f"{f', {a.steps} steps' if a.steps else ''}, {'warm' if a.warm else 'cold'} compile caches\n\n"
          + table(results) + "\n")
    first = [r["summary"].get("errors", {}).get("counted") for r in results if r["summary"]]
    if any(first):
        md += "\nCounted errors:\n" + "".join(f"- {r['label']}: `{json.dumps(r['summary']['errors']['counted'])[:400]}`\n"
                                            for r in results if r["summary"] and r["summary"]["errors"]["counted"])
    print(md)
    if a.md:
        Path(a.md).write_text(md)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
