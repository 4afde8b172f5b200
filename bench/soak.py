#!/usr/bin/env python
"""Long-mode concurrency soak: many threads x many compiled functions, active vs ``TTC_DISABLE=1``.

The workload, checks and counters live in ``ttc_testing/soak.py`` (shared with the CI short mode in
``tests/soak/test_soak.py``); this script only runs it and formats the results. Each run is a subprocess
with its own deadline, so a hang is reported, never waited on.

    python bench/soak.py --duration 60 --threads 16 --functions 20            # one row, package active
    python bench/soak.py --duration 60 --threads 16 --functions 20 --disable  # one row, TTC_DISABLE=1
    python bench/soak.py --table                                              # both, updates docs/reliability.md
    python bench/soak.py --backend inductor --flex ...                        # slower variants
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from _repo import ROOT

from ttc_testing import soak as harness

DOC = ROOT / "docs" / "reliability.md"
BEGIN = "<!-- soak-table:begin -->"
END = "<!-- soak-table:end -->"
HEADER = (
    "| torch | device | TTC | threads | functions | duration s | calls | errors | hangs | uncompiled calls "
    "| max \\|diff\\| vs eager (f32 / f64) | compiles / expected graphs (guard sets) | first error |"
)
SEP = "|" + "---|" * (HEADER.count(" | ") + 1)


def fmt_diff(res: dict[str, Any]) -> str:
    md = res.get("max_diff") or {}
    return " / ".join(f"{md[k]:.1e}" if k in md else "–" for k in ("float32", "float64"))


def row(res: dict[str, Any]) -> str:
    """One markdown row. A run that produced no result is shown as such, with what is known."""
    ttc = "off (TTC_DISABLE=1)" if res.get("disable") else "active"
    if "calls" not in res:
        what = "timed out (hang)" if res.get("timeout") else f"no result (rc={res.get('rc')})"
        return f"| ? | ? | {ttc} | | | | | | {what} | | | | |"
    if res.get("import_dynamo_first"):
        ttc += ", `import torch._dynamo` first"
    if res.get("resets") or res.get("config_changes"):
        ttc += f", {res.get('resets', 0)} resets, {res.get('config_changes', 0)} config changes"
    failed = (res.get("ttc") or {}).get("failed") or {}
    if failed and not res.get("disable"):
        ttc += " (failed patches: " + ", ".join(sorted(failed)) + ")"
    first = (res.get("error_msgs") or [""])[0].replace("|", "\\|").replace("\n", " ")[:90]
    mism = f" (+{res['mismatches']} mismatches)" if res.get("mismatches") else ""
    return (
        f"| {res['torch']} | {res['device']} | {ttc} | {res['threads']} (+{res['tracers']} tracer) | {res['functions']} "
        f"| {res['duration']:g} | {res['calls']} | {res['errors']}{mism} | {res['hangs']} | {res['uncompiled_calls']} "
        f"| {fmt_diff(res)} | {res['compiles']} / {res['expected_graphs']} ({res['guard_sets']}) | {first} |"
    )


def config_from(args: argparse.Namespace) -> harness.SoakConfig:
    return harness.SoakConfig(
        threads=args.threads,
        functions=args.functions,
        duration=args.duration,
        backend=args.backend,
        tracers=args.tracers,
        flex=args.flex,
        seed=args.seed,
        device=args.device,
        import_dynamo_first=args.import_dynamo_first,
        reset_every=args.reset_every,
        config_every=args.config_every,
        device_rand=args.device_rand,
        mode=args.mode,
    )


def command_line(args: argparse.Namespace, disable: bool) -> str:
    """The exact command that reproduces one row (relative to the repository root)."""
    parts = ["python", "bench/soak.py", "--duration", f"{args.duration:g}", "--threads", str(args.threads),
             "--functions", str(args.functions), "--tracers", str(args.tracers)]
    if args.backend != "aot_eager":
        parts += ["--backend", args.backend]
    if args.flex:
        parts.append("--flex")
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.device_rand:
        parts.append("--device-rand")
    if args.mode:
        parts += ["--mode", args.mode]
    if args.import_dynamo_first:
        parts.append("--import-dynamo-first")
    if args.reset_every:
        parts += ["--reset-every", f"{args.reset_every:g}"]
    if args.config_every:
        parts += ["--config-every", f"{args.config_every:g}"]
    if disable:
        parts.append("--disable")
    return " ".join(shlex.quote(p) for p in parts)


def update_doc(rows: list[str], commands: list[str]) -> None:
    """Replace this torch/device/TTC's rows in docs/reliability.md's table; keep every other row."""
    text = DOC.read_text() if DOC.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    old = [ln for ln in table.strip().splitlines() if ln.startswith("| ") and not ln.startswith("| torch |")]
    key = lambda ln: tuple(c.strip() for c in ln.split("|")[1:4])  # noqa: E731 - (torch, device, TTC)
    new_keys = {key(r)[:2] + (key(r)[2].split(" (failed")[0],) for r in rows}
    kept = [ln for ln in old if key(ln)[:2] + (key(ln)[2].split(" (failed")[0],) not in new_keys]
    body = "\n".join([HEADER, SEP, *kept, *rows])
    DOC.write_text(f"{head}{BEGIN}\n{body}\n{END}{tail}")
    print(f"[soak] updated {DOC.relative_to(ROOT)}; commands:\n  " + "\n  ".join(commands), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of mixed work per run")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--functions", type=int, default=20)
    p.add_argument("--tracers", type=int, default=1, help="extra threads doing fx.symbolic_trace / make_fx / export")
    p.add_argument("--backend", default="aot_eager", help="aot_eager (default, fast on CPU) or inductor")
    p.add_argument("--flex", action="store_true", help="add a flex_attention forward function (slow compile on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda (inputs and module copies on that device)")
    p.add_argument("--device-rand", action="store_true",
                   help="draw every input in the worker threads from the device's default generator "
                        "(H7: random draws while other threads record CUDA graphs)")
    p.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--import-dynamo-first", action="store_true",
                   help="`import torch._dynamo` before the first torch.compile (works around a package bug, see docs)")
    p.add_argument("--reset-every", type=float, default=None, metavar="S",
                   help="torture: one more thread calls torch._dynamo.reset() every S seconds")
    p.add_argument("--config-every", type=float, default=None, metavar="S",
                   help="torture: one more thread assigns / config.patch()es the recompile limit every S seconds")
    p.add_argument("--disable", action="store_true", help="run with TTC_DISABLE=1")
    p.add_argument("--table", action="store_true", help="run active and TTC_DISABLE=1, update docs/reliability.md")
    p.add_argument("--json", action="store_true", help="also print the full result as JSON")
    args = p.parse_args(argv)
    cfg = config_from(args)
    modes = [False, True] if args.table else [args.disable]
    rows, commands = [], []
    print(HEADER)
    print(SEP)
    for disable in modes:
        res = harness.run_subprocess(cfg, disable=disable)
        rows.append(row(res))
        commands.append(command_line(args, disable))
        print(rows[-1], flush=True)
        if args.json:
            print(json.dumps(res, indent=1))
        elif res.get("stderr_tail"):
            print(res["stderr_tail"][-3000:], file=sys.stderr)
    if args.table:
        update_doc(rows, commands)
    return 0


if __name__ == "__main__":
    sys.exit(main())
