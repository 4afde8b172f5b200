"""``python -m torch_threadsafe_compile [--version] doctor [--selftest] [--json] [--no-dynamo]``.

``doctor`` imports torch (and, to show every patch's real state, every torch module some patch waits for,
from the patch table: ``torch._dynamo``, ``torch._functorch.aot_autograd``, ``torch.export._trace``,
``torch._inductor.cudagraph_trees``, ...; importing them initialises no device; ``--no-dynamo`` skips them),
then prints versions, how activation happened, one row per patch, and the capabilities patches hand each
other (who provides each now, who reads it). ``--selftest`` runs the hazard
scenarios in subprocesses, unpatched (``TTC_DISABLE=1``) and active, and prints a before/after table.

Exit status of ``doctor`` (``EXIT_CODES``): 0 every hazard of this torch is covered, or the package is off on
purpose (``TTC_DISABLE``); 1 protection is missing (torch not importable, the package not activated, a patch
failed or skipped for a reason other than the torch version) or, with ``--selftest``, a hazard showed in the
active run; 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torch_threadsafe_compile._package_version import __version__

EXIT_CODES = (
    "exit status: 0 every hazard of this torch is covered, or the package is off on purpose (TTC_DISABLE); "
    "1 protection is missing (torch not importable, the package not activated, a patch failed or was skipped "
    "for a reason other than the torch version) or, with --selftest, a hazard showed in the active run; 2 usage"
)
CODE_CACHE = ("none: rewritten functions are compiled at activation from torch's own source, after checking "
              "that it is the code that runs; nothing is read from or written to disk")


def _import_torch(with_targets: bool) -> str | None:
    """Import torch (and the patch targets); the error text when torch is broken."""
    try:
        import importlib

        importlib.import_module("torch")
        if with_targets:  # every module some patch waits for (the table's), so that every patch can settle
            from torch_threadsafe_compile import registry

            for name in sorted(registry.watched_modules()):
                importlib.import_module(name)
        return None
    except Exception as e:  # a broken torch is exactly what a doctor must be able to report
        return f"{type(e).__name__}: {e}"


def _activation_line(st: dict[str, Any]) -> str:
    act = st["activation"]
    if act == "disabled":
        return f"{act} ({st['inactive_reason']})"
    if act == "not activated":
        return (f"{act} — the start-up hook did not run: is the package installed with pip (the .pth file), "
                "or sitecustomize/ on PYTHONPATH? install() still works")
    if act == "uninstalled":
        return f"{act} — uninstall() reverted every patch in this process; install() activates it again"
    return str(act)


def _table(patches: list[dict[str, Any]]) -> list[str]:
    rows = [("patch", "hazard", "torch", "state", "detail")]
    for p in patches:
        detail = p["reason"]
        if p.get("replaced_by_others"):
            detail = "replaced by another patcher since: " + ", ".join(p["replaced_by_others"])
        rows.append((p["id"], p["hazard"], p["torch_versions"], p["state"], detail))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    return [("  ".join(str(c).ljust(w) for c, w in zip(r[:4], widths)) + "  " + str(r[4])).rstrip() for r in rows]


def _missing(st: dict[str, Any], torch_error: str | None) -> list[str]:
    """Why protection is missing in this process (empty: every hazard of this torch is covered, or the
    package is off on purpose, ``TTC_DISABLE``): ``status()``'s list, and torch itself when it cannot be
    imported (every patch then waits for it, and none ever applies)."""
    missing = list(st["protection_missing"])
    if torch_error is not None and st["activation"] != "disabled":
        missing.insert(0, f"torch not importable ({torch_error})")
    return missing


def _doctor(args: argparse.Namespace) -> int:
    """Exit status: 0 protected (or off on purpose), 1 protection missing or a hazard shown while active
    (``--selftest``), 2 usage."""
    import torch_threadsafe_compile as ttc

    torch_error = _import_torch(not args.no_dynamo)
    st = ttc.status()
    missing = _missing(st, torch_error)
    if args.json:
        print(json.dumps(dict(st, code_cache=CODE_CACHE, protection_missing=missing), indent=2))
        return 1 if missing else 0
    print(f"torch-threadsafe-compile {st['version']}")
    print(f"python      {st['python']}  ({sys.executable})")
    print(f"torch       {st['torch'] if torch_error is None else 'not importable: ' + torch_error}")
    print(f"activation  {_activation_line(st)}")
    print(f"code cache  {CODE_CACHE}")
    print()
    print("\n".join(_table(st["patches"])))
    print("\ncapabilities (provided now by -> read by):")
    for name, cap in st["capabilities"].items():
        provided = ", ".join(cap["provided_by"]) or f"nobody ({', '.join(cap['declared_by'])} not applied)"
        print(f"  {name}: {provided} -> {', '.join(cap['required_by'])}")
    for p in st["patches"]:
        if p["id"] == "first_compile" and p.get("stats"):
            print("\ncompiles per function (first_compile):")
            for fn, row in p["stats"].items():
                print(f"  {fn}: {row}")
    if missing:
        print("\nprotection missing: " + "; ".join(missing))
    if args.selftest:
        print()
        return max(_selftest(), 1 if missing else 0)
    return 1 if missing else 0


def _selftest() -> int:
    from torch_threadsafe_compile import selftest

    print("selftest: the hazard scenarios in two fresh interpreters, unpatched (TTC_DISABLE=1) and active, side by side")
    plan = [(c.scenario, c.kwargs) for c in selftest.PLAN]
    procs = {d: selftest.start_many(plan, env={"TTC_DISABLE": d}) for d in ("1", "0")}
    results = {d: selftest.collect_many(p, timeout=300) for d, p in procs.items()}
    print(f"  {'hazard':6}  {'scenario':18}  {'metric':22}  {'unpatched':>10}  {'active':>10}  {'safe':>6}  active ok")
    failed = 0
    for c in selftest.PLAN:
        vals = [results[d].get(c.scenario, {}).get(c.metric, "n/a") for d in ("1", "0")]
        ok = isinstance(vals[1], (int, float, bool)) and vals[1] == c.safe  # the hazard does not show active
        failed += not ok
        print(f"  {c.hazard:6}  {c.scenario:18}  {c.metric:22}  {vals[0]!s:>10}  {vals[1]!s:>10}  {c.safe!s:>6}  {'yes' if ok else 'NO'}")
    for d, label in (("1", "unpatched"), ("0", "active")):
        if "_error" in results[d]:
            print(f"  {label} interpreter: {results[d]['_error']}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_threadsafe_compile")
    parser.add_argument("--version", action="version", version=f"torch-threadsafe-compile {__version__}")
    sub = parser.add_subparsers(dest="cmd")
    d = sub.add_parser("doctor", help="versions, activation and the state of every patch", epilog=EXIT_CODES)
    d.add_argument("--selftest", action="store_true", help="run the hazard scenarios unpatched vs active")
    d.add_argument("--json", action="store_true", help="print status() as JSON")
    d.add_argument("--no-dynamo", action="store_true", help="import only torch (patches on dynamo stay pending)")
    args = parser.parse_args(argv)
    if args.cmd != "doctor":
        parser.print_help()
        return 2
    try:
        return _doctor(args)
    except BrokenPipeError:
        # `doctor | head`: the reader is gone. Say nothing more (Python would print a traceback at exit
        # while flushing stdout): point stdout at /dev/null, as the Python docs recommend.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
