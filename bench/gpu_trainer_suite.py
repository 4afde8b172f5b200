#!/usr/bin/env python
"""The reference trainer's GPU measurements in one command, for one GPU, within a wall-clock budget.

    python bench/gpu_trainer_suite.py OUTDIR [--budget 480] [--parts small,multi,8b,profile] [--host-lock small,multi]

Parts, by default in this order (each run is a subprocess with its own timeout; a part that no longer fits the budget is
reported as skipped, never left half-run):

* ``small``  — preset ``cuda-small``: sequential ×2 vs threaded 3+2, sequential ×4 vs threaded 4+4 (the preset's),
               1000 steps (200 excluded from steady: a step takes a few milliseconds).
* ``multi``  — preset ``multi-gpu`` on one GPU: sequential ×1/×2/×3 vs threaded 1+1, 3+2, 5+3, 200 steps
               (40 excluded).
* ``8b``     — preset ``cuda-8b`` (Llama-3.1-8B-shaped target, EAGLE-3 drafter): threaded 1+1, 50 steps
               (10 excluded); then the sequential layout if the budget still allows it.
* ``eager`` (optional, not in the default list) — ``cuda-small`` threaded 3+2 without CUDA graphs and with eager
               mask building (the presets' defaults before they turned both on), to show what they buy.
* ``profile`` (optional) — ``cuda-small`` threaded 3+2 with ``--profile`` (torch.profiler, 5 steady steps).

All runs share one inductor/Triton cache (``--cache-dir``, default a new temporary directory: the first run of
a preset compiles cold, later ones hit the cache, so their "first step" times are warm; steady tokens/s exclude
compilation either way). Writes
OUTDIR/results.json (every run's full summary), OUTDIR/trainer-gpu-suite.md (the tables) and OUTDIR/runs/*/
(stdout, stderr, metrics.jsonl, summary.json per run); prints a compact summary and the acceptance checks.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import child_environ
from bench_trainer import Budget, agreement_text, compare_layouts, layout_table, steady

PARTS = {
    "small": {"preset": "cuda-small", "steps": 1000, "measure_after": 200, "pairs": [(3, 2), (4, 4)], "timeout": 170},
    "8b": {"preset": "cuda-8b", "steps": 50, "measure_after": 10, "pairs": [(1, 1)], "timeout": 330, "hang": 300},
    "multi": {"preset": "multi-gpu", "steps": 200, "measure_after": 40, "pairs": [(1, 1), (3, 2), (5, 3)], "timeout": 150},
    "eager": {"preset": "cuda-small", "steps": 120, "measure_after": 30, "pairs": [(3, 2)], "timeout": 170,
              "extra": ["--no-step-graphs", "--target-compile-mode", "default", "--drafter-compile-mode", "default",
                        "--mask-builder", "dense"]},
    "profile": {"preset": "cuda-small", "steps": 60, "measure_after": 30, "pairs": [(3, 2)], "timeout": 150,
                "extra": ["--profile", "{out}/profile-cuda-small", "--profile-steps", "40:45"],
                "threaded_only": True},
}


def gpu_name() -> str:
    try:
        import torch

        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}" if torch.cuda.is_available() else \
            f"no GPU visible, torch {torch.__version__}"
    except Exception as e:  # pragma: no cover
        return f"unknown ({e})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="results directory (created)")
    ap.add_argument("--budget", type=float, default=480.0, help="wall limit over all runs (s)")
    ap.add_argument("--parts", default="small,multi,8b,profile",
                    help="comma list, run in this order (see above)")
    ap.add_argument("--cache-dir", help="inductor/Triton caches shared by the runs (default: a new temporary "
                                        "directory, so the first run of each preset compiles cold and OUTDIR "
                                        "stays small)")
    ap.add_argument("--extra", default="", help="trainer flags appended to every run, to work around a failing "
                                                "feature; with '=': --extra='--no-streams --autocast off'")
    ap.add_argument("--part-extra", action="append", default=[], metavar="PART:FLAGS",
                    help="trainer flags for one part only, e.g. --part-extra='8b:--batch-size 2'")
    ap.add_argument("--host-lock", default="", metavar="PARTS",
                    help="comma list of parts (small, multi, eager) whose threaded runs are also made with --host-lock")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_one, which kills the run
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = child_environ()
    cache = Path(a.cache_dir) if a.cache_dir else Path(tempfile.mkdtemp(prefix="gpu-trainer-suite-cache-"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    budget = Budget(a.budget)
    started = time.monotonic()
    header = f"GPU trainer suite: {gpu_name()}, Python {platform.python_version()}"
    if a.extra or a.part_extra:
        header += f"; extra flags: {a.extra!r} {a.part_extra!r}"
    print(header, flush=True)
    all_results: dict[str, list[dict[str, Any]]] = {}
    md = [f"# {header}", ""]
    for part in [p.strip() for p in a.parts.split(",") if p.strip()]:
        if part not in PARTS:
            print(f"unknown part {part!r} (known: {', '.join(PARTS)})", file=sys.stderr)
            return 2
        cfg = PARTS[part]
        base = ["--preset", cfg["preset"], "--steps", str(cfg["steps"]), "--measure-after", str(cfg["measure_after"]),
                "--eval-every", "0", "--no-checkpoint", "--hang-timeout", str(cfg.get("hang", 140)),
                *[x.format(out=out) for x in cfg.get("extra", [])], *shlex.split(a.extra),
                *[flag for spec in a.part_extra if spec.split(":", 1)[0] == part
                  for flag in shlex.split(spec.split(":", 1)[1] if ":" in spec else "")]]
        pairs = cfg["pairs"]
        layouts = ("threaded",) if cfg.get("threaded_only") else ("sequential", "threaded")
        # 8B: the threaded layout is the one under test, so it runs first; the sequential one if time remains.
        locked = part in a.host_lock.split(",") and layouts != ("threaded",) and part != "8b"
        variants = [("", [])] + ([(" with host lock", ["--host-lock"])] if locked else [])
        results = compare_layouts(cfg["preset"], pairs, base, env, out / "runs", cfg["timeout"], budget, "user",
                                  tag=f"{part}: ", sequential_first=part != "8b", layouts=layouts, variants=variants)
        all_results[part] = results
        steps, after = effective(base, "--steps"), effective(base, "--measure-after")
        md += [f"## {part}: preset `{cfg['preset']}`, {steps} steps ({after} excluded from "
               f"steady){' ' + ' '.join(cfg.get('extra', [])).format(out=out) if cfg.get('extra') else ''}", "",
               layout_table(results), ""]
        (out / "results.json").write_text(json.dumps(all_results, indent=2, default=str))
        (out / "trainer-gpu-suite.md").write_text("\n".join(md) + "\n")
    md += ["## Checks", ""] + checks(all_results)
    (out / "trainer-gpu-suite.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    print(f"\nsuite wall time {time.monotonic() - started:.0f} s; results in {out}", flush=True)
    failed = [r["label"] for rs in all_results.values() for r in rs if r["rc"] not in (0, "skipped")]
    if failed:
        print(f"runs that failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


def effective(flags: list[str], name: str) -> str:
    """The value the trainer will see for ``name``: the last occurrence wins (argparse)."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == name]
    return values[-1] if values else "?"


def checks(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's acceptance criteria, evaluated on what ran."""
    lines = []
    for part in ("small", "multi"):
        for r in results.get(part, []):
            if "ratio_value" in r:
                v = r["ratio_value"]
                lines.append(f"- {r['label']}: threaded / sequential = {v:.2f} (target ≥ 1.3): "
                             f"{'PASS' if v and v >= 1.3 else 'FAIL'}" if v else f"- {r['label']}: no ratio")
            if r.get("losses"):  # same batches, same averaged gradients: the same training as the sequential run
                lines.append(f"- {r['label']}: per-step losses vs sequential: {agreement_text(r['losses'])}: "
                             f"{'PASS' if r['losses']['agree'] else 'FAIL'}")
    threaded = [r for r in results.get("multi", []) if r.get("layout") == "threaded"]
    for variant in dict.fromkeys(r.get("variant", "") for r in threaded):
        rates = [(r["label"], steady(r)) for r in threaded if r.get("variant", "") == variant]
        if len(rates) > 1 and all(v for _, v in rates):
            mono = all(b >= 0.97 * a for (_, a), (_, b) in zip(rates, rates[1:]))
            lines.append(f"- multi-gpu{', ' + variant if variant else ''}, more threads no slower than fewer "
                         f"({' → '.join(f'{v:,.0f}' for _, v in rates)} tokens/s, 3 % tolerance): "
                         f"{'PASS' if mono else 'FAIL'}")
    for r in results.get("8b", []):
        s = r["summary"] or {}
        mfu = s.get("mfu") or {}
        get = lambda k, mfu=mfu: (mfu.get(k) or {}).get("mfu") if isinstance(mfu.get(k), dict) else mfu.get(k)  # noqa: E731
        phases = mfu.get("phases") or {}
        lines.append(f"- {r['label']}: status {s.get('status')}, steps {s.get('steps_done')}, drafter "
                     f"{steady(r) or 0:,.0f} tokens/s, target {steady(r, 'target') or 0:,.0f} tokens/s; MFU share "
                     f"target {get('target')}, drafter {get('drafter')}; MFU in interval target "
                     f"{(phases.get('target') or {}).get('mfu_in_interval')}, drafter "
                     f"{(phases.get('drafter') or {}).get('mfu_in_interval')} (goal 0.40)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
