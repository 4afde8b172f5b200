"""``python -m torch_threadsafe_compile doctor [--selftest] [--json]``.

``doctor`` imports torch (and, to show every patch's real state, ``torch._dynamo`` and
``torch._functorch.config``; pass ``--no-dynamo`` to skip that), then prints versions, how activation
happened, and one row per patch. ``--selftest`` runs the hazard scenarios in subprocesses, unpatched
(``TTC_DISABLE=1``) and active, and prints a before/after table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# What --selftest runs: (scenario, kwargs, metric shown, hazard).
# (config_threads last: it leaves a config assignment behind in its interpreter.)
SELFTEST = (
    ("fx_flag_poll", {"seconds": 1.0}, "true_in_other_thread", "H1"),
    ("is_compiling_leak", {"seconds": 1.0}, "true_in_eager_thread", "H2"),
    ("stampede", {"threads": 8, "shapes": 1}, "graphs", "H3"),
    ("config_threads", {}, "new_thread_sees", "H6"),
)


def _doctor(args: argparse.Namespace) -> int:
    import torch_threadsafe_compile as ttc
    from torch_threadsafe_compile import _bootstrap

    expected = os.environ.get("TTC_DISABLE", "").strip().lower() not in ("1", "true", "yes", "on", "all")
    try:
        import torch

        if not args.no_dynamo:
            import torch._dynamo  # noqa: F401
            import torch._functorch.config  # noqa: F401
        torch_error = None
    except Exception as e:  # a broken torch is exactly what a doctor must be able to report
        torch, torch_error = None, f"{type(e).__name__}: {e}"
    st = ttc.status()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"torch-threadsafe-compile {st['version']}")
    print(f"python      {st['python']}  ({sys.executable})")
    print(f"torch       {st['torch'] if torch is not None else 'not importable: ' + str(torch_error)}")
    act = st["activation"]
    if act == "disabled":
        act += f" ({_bootstrap.inactive_reason or 'TTC_DISABLE=' + os.environ.get('TTC_DISABLE', '')})"
    elif act == "not activated" and expected:
        act += " — the start-up hook did not run: is the package installed with pip (the .pth file), or sitecustomize/ on PYTHONPATH? install() still works"
    print(f"activation  {act}")
    print()
    rows = [("patch", "hazard", "torch", "state", "detail")]
    for p in st["patches"]:
        detail = p["reason"]
        if p.get("replaced_by_others"):
            detail = "replaced by another patcher since: " + ", ".join(p["replaced_by_others"])
        rows.append((p["id"], p["hazard"], p["torch_versions"], p["state"], detail))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r[:4], widths)) + "  " + str(r[4]))
    for p in st["patches"]:
        stats = p.get("stats")
        if p["id"] == "first_compile" and stats:
            print("\ncompiles per function (first_compile):")
            for fn, row in stats.items():
                print(f"  {fn}: {row}")
    if args.selftest:
        print()
        return _selftest()
    return 0


def _selftest() -> int:
    from torch_threadsafe_compile import scenarios

    print("selftest: the hazard scenarios in two fresh interpreters, unpatched (TTC_DISABLE=1) and active, side by side")
    plan = [(name, kwargs) for name, kwargs, _, _ in SELFTEST]
    procs = {d: scenarios.start_many(plan, env={"TTC_DISABLE": d}) for d in ("1", "0")}
    results = {d: scenarios.collect_many(p, timeout=300) for d, p in procs.items()}
    print(f"  {'hazard':6}  {'scenario':18}  {'metric':22}  {'unpatched':>10}  {'active':>10}")
    failed = 0
    for name, _, metric, hazard in SELFTEST:
        vals = [results[d].get(name, {}).get(metric, "n/a") for d in ("1", "0")]
        failed += not all(isinstance(v, (int, float, bool)) for v in vals)
        print(f"  {hazard:6}  {name:18}  {metric:22}  {vals[0]!s:>10}  {vals[1]!s:>10}")
    for d, label in (("1", "unpatched"), ("0", "active")):
        if "_error" in results[d]:
            print(f"  {label} interpreter: {results[d]['_error']}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_threadsafe_compile")
    sub = parser.add_subparsers(dest="cmd")
    d = sub.add_parser("doctor", help="versions, activation and the state of every patch")
    d.add_argument("--selftest", action="store_true", help="run the hazard scenarios unpatched vs active")
    d.add_argument("--json", action="store_true", help="print status() as JSON")
    d.add_argument("--no-dynamo", action="store_true", help="do not import torch._dynamo to resolve lazy patches")
    args = parser.parse_args(argv)
    if args.cmd != "doctor":
        parser.print_help()
        return 2
    return _doctor(args)


if __name__ == "__main__":
    sys.exit(main())
