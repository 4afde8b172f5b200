"""One torch version: doctor and every row, each in a fresh interpreter, unpatched (``TTC_DISABLE=1``) and active.

Children run from a neutral (empty, temporary) working directory so that what gets exercised is the venv's
installed copy of the package and its start-up ``.pth`` hook. Scenario children get the repository root as
their only ``PYTHONPATH``: ``ttc_testing`` is not installed, it is imported from the source tree.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import result_line, run_proc

from . import ROOT
from .rows import Row
from .scrub import SCRUB
from .supervise import child_env, failure_info, log
from .venvs import prepare_venv, venv_python

MODES = (("unpatched", True), ("active", False))  # (name, TTC_DISABLE)


def _lacks(pr: dict[str, Any], res: dict[str, Any], missing: list[str]) -> dict[str, Any]:
    return {"failed": True, "rc": pr["rc"], "signal": "", "timeout": False, "fatal": "",
            "last_line": f"result lacks {missing}", "tail": SCRUB("RESULT " + json.dumps(res)), "secs": pr["secs"],
            "short": f"result lacks {', '.join(missing)}"}


def run_scenario(py: str, row: Row, disable: bool, timeout: float, cwd: str) -> dict[str, Any]:
    cmd = [py, "-X", "faulthandler", "-m", row.module, *row.args]
    pr = run_proc(cmd, child_env(disable, pythonpath=str(ROOT)), timeout, cwd=cwd)
    res = result_line(pr["stdout"])
    if res is None:
        return failure_info(pr, timeout)
    res["secs"] = pr["secs"]
    missing = [k for k in row.needs if k not in res]
    return _lacks(pr, res, missing) if missing else res


def run_doctor(py: str, disable: bool, timeout: float, cwd: str) -> dict[str, Any]:
    pr = run_proc([py, "-X", "faulthandler", "-m", "torch_threadsafe_compile", "doctor", "--json"],
                  child_env(disable), timeout, cwd=cwd)
    out = pr["stdout"]
    start = out.find("{")
    # doctor exits 1 when a hazard of this torch is left open (its JSON then lists protection_missing):
    # that is a finding about the patches, reported per patch, not a failed doctor run.
    if pr["rc"] in (0, 1) and start >= 0:
        try:
            st = json.loads(out[start:])
        except ValueError:
            return failure_info(pr, timeout)
        st["secs"] = pr["secs"]
        warnings = [SCRUB(ln) for ln in pr["stderr"].splitlines() if "torch-threadsafe-compile" in ln]
        if warnings:
            st["stderr_warnings"] = warnings[-5:]
        return st
    return failure_info(pr, timeout)


def _run_rows(version: str, py: str, rows: list[Row], timeout: float, cwd: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        pair = {}
        for mode, disable in MODES:
            r = run_scenario(py, row, disable, timeout, cwd)
            pair[mode] = r
            shown = r["short"] if r.get("failed") else row.show(r)
            log(f"{version}: {row.invocation:<28} {mode:<9} {shown}  ({r.get('secs')} s)")
        out[row.key] = pair
    return out


def run_version(version: str, venv: Path, reused: bool, rows: list[Row], timeout: float,
                min_free_gb: float) -> dict[str, Any]:
    """Everything measured for one version; ``error`` instead of results when the venv is not usable."""
    res: dict[str, Any] = {"version": version, "reused": reused, "rows": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ttc-compat-") as cwd:
        try:
            res["venv"] = prepare_venv(version, venv, reused, cwd, min_free_gb)
        except Exception as e:
            res["error"] = SCRUB(f"{type(e).__name__}: {e}")
            res["secs"] = round(time.monotonic() - t0, 1)
            log(f"{version}: venv not usable: {res['error']}")
            return res
        py = str(venv_python(venv))
        log(f"{version}: torch {res['venv'].get('torch')} python {res['venv'].get('python')}")
        res["doctor"] = {mode: run_doctor(py, disable, timeout, cwd) for mode, disable in MODES}
        act = res["doctor"]["active"]
        if act.get("failed"):
            log(f"{version}: doctor (active) failed: {act['short']}")
        res["rows"] = _run_rows(version, py, rows, timeout, cwd)
    res["secs"] = round(time.monotonic() - t0, 1)
    return res
