#!/usr/bin/env python
"""Compatibility matrix: every hazard scenario and every patch, on every supported torch version.

For each torch version this builds (or reuses) a virtual environment with that torch and this package installed
editable, then runs in it, once unpatched (``TTC_DISABLE=1``) and once active:

* ``python -m torch_threadsafe_compile doctor --json`` (activation and each patch's state/reason), and
* the hazard scenarios of ``torch_threadsafe_compile/scenarios.py``, each in a fresh interpreter,

and writes ``docs/compat.md``: one row per hazard scenario and per patch, one column per torch version.

    python bench/compat_matrix.py                                  # all default versions, venvs under .venvs/
    python bench/compat_matrix.py --versions 2.11.0 2.13.0
    python bench/compat_matrix.py --reuse-venv 2.13.0=/path/to/venv --versions 2.13.0 --out /tmp/compat.md

A venv that is missing is created as ``<venv-root>/torch-<V>`` with
``PIP_CONFIG_FILE=/dev/null pip install torch==V wrapt packaging numpy`` (2.13.0: plain ``pip install``, so the
pip configuration's local CPU wheel is taken) and ``pip install --no-deps -e <repo>``.

Standard library only: the script itself runs under any Python >= 3.9; torch only lives in the venvs.
Children get the caller's environment minus ``TTC_*``, ``PYTHONPATH`` and ``VIRTUAL_ENV``. Every cell is independent: a timeout or a crash (segfault, ...) is reported with its exit status and last line
and the matrix goes on. Scenarios run from a neutral working directory so that the venv's installed copy of the
package (and its start-up ``.pth`` hook) is what gets exercised.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VERSIONS = ["2.4.1", "2.6.0", "2.9.1", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
# Versions installed with the machine's pip configuration (local CPU wheel) instead of PIP_CONFIG_FILE=/dev/null.
PLAIN_PIP_VERSIONS = {"2.13.0"}
TORCH_EXTRAS = ["wrapt", "packaging", "numpy"]

_print_lock = threading.Lock()
_children: "set[subprocess.Popen[str]]" = set()  # running scenario processes, killed if we are stopped


def log(msg: str) -> None:
    with _print_lock:
        print(f"[compat {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# What is measured.


class Row:
    """One hazard row: a scenario, the patch that addresses it, and how to read its result."""

    def __init__(self, key: str, hazard: str, title: str, scenario: str, kwargs: Dict[str, Any], patch: Optional[str],
                 bad: Callable[[Dict[str, Any]], bool], show: Callable[[Dict[str, Any]], str],
                 needs: Tuple[str, ...],
                 control: Optional[Callable[[Dict[str, Any], Dict[str, Any]], Optional[str]]] = None) -> None:
        self.key, self.hazard, self.title, self.scenario, self.kwargs = key, hazard, title, scenario, kwargs
        self.patch, self.bad, self.show, self.needs = patch, bad, show, needs
        self.control = control  # (unpatched, active) -> what the package broke, or None

    @property
    def invocation(self) -> str:
        return " ".join([self.scenario] + [f"{k}={v}" for k, v in self.kwargs.items()])


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else str(x)


def _same_thread_bad(r: Dict[str, Any]) -> bool:
    # export may be unavailable on old versions (a string): only a False counts as broken.
    return not (r.get("nested_raised") is True and r.get("symbolic_trace_ok") is True and r.get("make_fx_ok") is True
                and r.get("export_ok") is not False)


def _same_thread_show(r: Dict[str, Any]) -> str:
    broken = [k for k in ("nested_raised", "symbolic_trace_ok", "make_fx_ok", "export_ok") if r.get(k) is False]
    text = "ok" if not broken else "broken: " + ", ".join(f"{k}=False" for k in broken)
    if isinstance(r.get("export_ok"), str):
        text += " (export n/a)"
    return text


def _stampede_bad(r: Dict[str, Any]) -> bool:
    return r["graphs"] > 2 or r["uncompiled_frames"] > 0 or r["errors"] > 0 or r["wrong_results"] > 0


def _stampede_show(r: Dict[str, Any]) -> str:
    s = f"{_n(r['graphs'])} graphs"
    if r["uncompiled_frames"]:
        s += f", {_n(r['uncompiled_frames'])} eager"
    if r["errors"]:
        s += f", {_n(r['errors'])} errors"
    if r["wrong_results"]:
        s += f", {_n(r['wrong_results'])} wrong"
    return s


def _config_bad(r: Dict[str, Any]) -> bool:
    return r["new_thread_sees"] != 64 or r["backward_compile_sees"] != 64


def _config_show(r: Dict[str, Any]) -> str:
    return f"{r['new_thread_sees']}/{r['backward_compile_sees']}"


def _compiling_bad(r: Dict[str, Any]) -> bool:
    return r["true_in_eager_thread"] > 0


def _compiling_show(r: Dict[str, Any]) -> str:
    return f"{_n(r['true_in_eager_thread'])} true polls"


def _compiling_control(u: Dict[str, Any], a: Dict[str, Any]) -> Optional[str]:
    # Before 2.13 is_compiling() is False inside a backend (only dynamo-traced code sees True): compare, not demand.
    if u["compiling_thread_saw_true"] and not a["compiling_thread_saw_true"]:
        return "the compiling thread's backend no longer sees is_compiling() == True"
    return None


def _errors_show(r: Dict[str, Any]) -> str:
    return f"{_n(r['errors'])} errors"


ROWS: List[Row] = [
    Row("fx_flag_leak", "H1", "FX tracing flag leaks to other threads", "fx_flag_leak", {}, "fx_tracing_flag",
        lambda r: r["errors"] > 0, _errors_show, ("errors",)),
    Row("fx_flag_leak_late", "H1", "same, package installed after the fn was compiled", "fx_flag_leak", {"late": 1},
        "fx_tracing_flag", lambda r: r["errors"] > 0, _errors_show, ("errors",)),
    Row("fx_same_thread", "H1", "control: same-thread nested-trace error kept, FX/make_fx/export work",
        "fx_same_thread", {}, "fx_tracing_flag", _same_thread_bad, _same_thread_show, ("nested_raised",)),
    Row("is_compiling_leak", "H2", "is_compiling() True in an eager thread", "is_compiling_leak", {"seconds": 2},
        "compile_session_flag", _compiling_bad, _compiling_show, ("true_in_eager_thread", "compiling_thread_saw_true"),
        _compiling_control),
    Row("config_threads", "H6", "main thread sets recompile_limit=64: value seen by a new thread / a backward compile", "config_threads", {},
        "config_overrides", _config_bad, _config_show, ("new_thread_sees", "backward_compile_sees")),
    Row("stampede", "H3", "first-call stampede: one compile per thread (2 shapes, expect 2 graphs)", "stampede",
        {"threads": 8}, "first_compile", _stampede_bad, _stampede_show,
        ("graphs", "uncompiled_frames", "errors", "wrong_results")),
    Row("guard_sets", "H3", "two guard sets from 6 threads (expect 2 graphs)", "guard_sets", {}, "first_compile",
        lambda r: r["graphs"] > 2 or r["errors"] > 0,
        lambda r: f"{_n(r['graphs'])} graphs" + (f", {_n(r['errors'])} errors" if r["errors"] else ""),
        ("graphs", "errors")),
    Row("lookup_race", "H3", "spurious cache misses: graphs compiled after every guard set was (graph break, 16 threads)",
        "lookup_race", {"graph_break": 1, "seconds": 5}, "first_compile",
        lambda r: r["extra_graphs"] > 0 or r["uncompiled_frames"] > 0 or r["errors"] > 0,
        lambda r: f"{_n(r['extra_graphs'])} extra graphs, {_n(r['uncompiled_frames'])} eager",
        ("extra_graphs", "uncompiled_frames", "errors")),
    Row("dynamic_flag_poll", "H5", "dynamic=True calls flip assume_static_by_default for other threads", "dynamic_flag_poll",
        {"seconds": 2}, "dynamic_flags", lambda r: r["flipped"] > 0, lambda r: f"{_n(r['flipped'])} flipped polls",
        ("flipped",)),
    Row("export_flag_poll", "H7", "is_exporting() True in other threads while one exports", "export_flag_poll",
        {"seconds": 3}, "export_flag", lambda r: r["true"] > 0 or r["raw_returned"] > 0,
        lambda r: f"{_n(r['true'])} true polls, {_n(r['raw_returned'])} raw fns", ("true", "raw_returned")),
    Row("export_vs_compile", "H7", "compiles in 3 threads while one exports (errors)", "export_vs_compile",
        {"seconds": 6}, "export_lock", lambda r: r["compile_errors"] + r["export_errors"] > 0,
        lambda r: f"{_n(r['compile_errors'] + r['export_errors'])} errors", ("compile_errors", "export_errors")),
]


# --------------------------------------------------------------------------------------------------------------
# Paths never reach the document.


class Scrubber:
    def __init__(self) -> None:
        self.pairs: List[Tuple[str, str]] = []
        self.add(str(ROOT), "<repo>")
        self.add(sys.base_prefix, "<python>")
        self.add(sys.prefix, "<python>")
        self.add(tempfile.gettempdir(), "<tmp>")
        self.add(str(Path.home()), "~")

    def add(self, path: str, label: str) -> None:
        path = str(path).rstrip("/")
        if len(path) > 1 and (path, label) not in self.pairs:
            self.pairs.append((path, label))
            try:
                real = os.path.realpath(path)
                if real != path and (real, label) not in self.pairs:
                    self.pairs.append((real, label))
            except OSError:
                pass
            self.pairs.sort(key=lambda p: -len(p[0]))  # longest (most specific) first

    def __call__(self, text: str) -> str:
        for path, label in self.pairs:
            text = text.replace(path, label)
        # Anything absolute that is left: keep what follows site-packages / the stdlib, drop the rest.
        text = re.sub(r"(?<![\w.<>~])/(?:[^\s\"':,()]+/)*site-packages/", "<site-packages>/", text)
        text = re.sub(r"(?<![\w.<>~])/(?:[^\s\"':,()]+/)*lib/python3\.\d+/", "<stdlib>/", text)
        text = re.sub(r"(?<![\w.<>~])/(?:[A-Za-z0-9_.@+-]+/){2,}", "<path>/", text)
        return text


SCRUB = Scrubber()


# --------------------------------------------------------------------------------------------------------------
# Running things.


def _signal_name(rc: int) -> str:
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 else 0)
    if sig:
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"signal {sig}"
    return ""


def _kill_group(p: "subprocess.Popen[str]") -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the child leads its own session: this is its group only
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except OSError:
            pass


def _on_stop(signum: int, _frame: Any) -> None:
    for p in list(_children):
        _kill_group(p)
    raise SystemExit(128 + signum)


def run_proc(cmd: List[str], env: Dict[str, str], timeout: float, cwd: Optional[str] = None) -> Dict[str, Any]:
    """Run ``cmd`` in its own process group; on timeout kill that group. Never raises for the child's sake."""
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", start_new_session=True)
    except OSError as e:
        return {"rc": None, "stdout": "", "stderr": f"{type(e).__name__}: {e}", "timeout": False, "secs": 0.0}
    _children.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        timed_out = True
    finally:
        _children.discard(p)
    return {"rc": p.returncode, "stdout": out or "", "stderr": err or "", "timeout": timed_out,
            "secs": round(time.monotonic() - t0, 1)}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _crash_stack(text: str) -> Tuple[str, str]:
    """From faulthandler's dump: the crashing thread's frames (innermost first) and its innermost frame."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    if start is None:
        return "", ""
    block = [lines[start]]
    for ln in lines[start + 1:]:
        if not ln.strip():
            break
        block.append(ln)
    top = ""
    m = re.match(r'\s*File "(.+)", line (\d+) in (\S+)', block[1]) if len(block) > 1 else None
    if m:
        path = m.group(1)
        path = path.split("site-packages/", 1)[-1] if "site-packages/" in path else os.path.basename(path)
        top = f"{path}:{m.group(2)} {m.group(3)}"
    return "\n".join(block[:30]), top


def failure_info(pr: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Summary of a run that produced no result: rc, signal, the last line, and faulthandler's headline."""
    both = (pr["stderr"] or "") + "\n" + (pr["stdout"] or "")
    fatal = next((ln.strip() for ln in both.splitlines() if ln.startswith("Fatal Python error")), "")
    stack, top = _crash_stack(both)
    threads = sum(1 for ln in both.splitlines() if ln.startswith(("Thread 0x", "Current thread")))
    if stack:
        tail = f"{fatal}\n\n{stack}\n\n({threads} threads in the dump; the crashing one is shown)"
    else:
        tail = "\n".join(ln for ln in both.strip().splitlines() if not ln.startswith("Extension modules"))
        tail = "\n".join(tail.splitlines()[-25:])
    info: Dict[str, Any] = {
        "failed": True,
        "rc": pr["rc"],
        "signal": _signal_name(pr["rc"]) if isinstance(pr["rc"], int) else "",
        "timeout": pr["timeout"],
        "fatal": SCRUB(fatal),
        "crash_site": SCRUB(top),
        "last_line": SCRUB(_last_line(pr["stderr"]) or _last_line(pr["stdout"]))[:300],
        "tail": SCRUB(tail),
        "secs": pr["secs"],
    }
    if pr["timeout"]:
        info["short"] = f"timeout after {timeout:g} s"
    else:
        what = f"rc={pr['rc']}" + (f" {info['signal']}" if info["signal"] else "")
        if top:
            line = f"in {info['crash_site']}"
            head = info["fatal"].replace("Fatal Python error: ", "")
            if head and head.lower() not in ("segmentation fault", "aborted", "bus error", "floating point exception"):
                line = f"{head} {line}"
        else:
            line = info["fatal"] or info["last_line"]
        info["short"] = f"crash {what}" + (f": {line[:110]}" if line else "")
    return info


def child_env(disable: bool) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTC_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TTC_DISABLE"] = "1" if disable else "0"
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def run_scenario(py: str, row: Row, disable: bool, timeout: float, cwd: str) -> Dict[str, Any]:
    cmd = [py, "-X", "faulthandler", "-m", "torch_threadsafe_compile.scenarios", row.scenario]
    cmd += [f"{k}={v}" for k, v in row.kwargs.items()]
    pr = run_proc(cmd, child_env(disable), timeout, cwd=cwd)
    for line in reversed(pr["stdout"].splitlines()):
        if line.startswith("RESULT "):
            try:
                res = json.loads(line[7:])
            except ValueError:
                break
            res["secs"] = pr["secs"]
            missing = [k for k in row.needs if k not in res]
            if missing:
                return {"failed": True, "rc": pr["rc"], "signal": "", "timeout": False, "fatal": "",
                        "last_line": f"result lacks {missing}", "tail": SCRUB(line), "secs": pr["secs"],
                        "short": f"result lacks {', '.join(missing)}"}
            return res
    return failure_info(pr, timeout)


def run_doctor(py: str, disable: bool, timeout: float, cwd: str) -> Dict[str, Any]:
    pr = run_proc([py, "-X", "faulthandler", "-m", "torch_threadsafe_compile", "doctor", "--json"],
                  child_env(disable), timeout, cwd=cwd)
    out = pr["stdout"]
    start = out.find("{")
    if pr["rc"] == 0 and start >= 0:
        try:
            st = json.loads(out[start:])
            st["secs"] = pr["secs"]
            warnings = [SCRUB(ln) for ln in pr["stderr"].splitlines() if "torch-threadsafe-compile" in ln]
            if warnings:
                st["stderr_warnings"] = warnings[-5:]
            return st
        except ValueError:
            pass
    return failure_info(pr, timeout)


# --------------------------------------------------------------------------------------------------------------
# Venvs.

PROBE = (
    "import json, sys\n"
    "out = {'python': sys.version.split()[0]}\n"
    "try:\n"
    "    import torch; out['torch'] = torch.__version__\n"
    "except Exception as e:\n"
    "    out['torch_error'] = f'{type(e).__name__}: {e}'\n"
    "try:\n"
    "    import importlib.util as u; s = u.find_spec('torch_threadsafe_compile'); out['ttc'] = s.origin if s else None\n"
    "except Exception as e:\n"
    "    out['ttc_error'] = repr(e)\n"
    "print('PROBE ' + json.dumps(out))\n"
)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def probe(py: Path, cwd: str) -> Dict[str, Any]:
    env = child_env(disable=True)
    pr = run_proc([str(py), "-c", PROBE], env, 300, cwd=cwd)
    for line in pr["stdout"].splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"probe_error": SCRUB(_last_line(pr["stderr"]) or f"rc={pr['rc']}")}


def base_version(v: str) -> str:
    return v.split("+")[0]


def _pip(py: Path, args: List[str], env: Dict[str, str], label: str) -> None:
    cmd = [str(py), "-m", "pip", *args]
    log(f"{label}: pip {' '.join(shlex.quote(a) for a in args)}")
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"pip {args[0]} failed (rc={p.returncode}): {_last_line(p.stdout)}")


def prepare_venv(version: str, venv: Path, reused: bool, cwd: str) -> Dict[str, Any]:
    """Make sure ``venv`` has torch==version and this package (editable). Returns the probe plus notes."""
    notes: List[str] = []
    py = venv_python(venv)
    pip_env_base = {k: v for k, v in os.environ.items() if not k.startswith("TTC_")}
    pip_env_base["TTC_DISABLE"] = "1"
    if not py.exists():
        if reused:
            raise RuntimeError("--reuse-venv path has no Python interpreter")
        log(f"{version}: creating venv")
        venv.parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        if p.returncode != 0:
            raise RuntimeError(f"venv creation failed: {_last_line(p.stdout)}")
        notes.append("venv created")
    info = probe(py, cwd)
    if "probe_error" in info:
        raise RuntimeError(f"venv interpreter does not start: {info['probe_error']}")
    have = base_version(info.get("torch") or "")
    if have != version:
        if reused:
            notes.append(f"reused venv has torch {info.get('torch') or 'none'}, not {version}")
        else:
            env = dict(pip_env_base)
            if version not in PLAIN_PIP_VERSIONS:
                env["PIP_CONFIG_FILE"] = os.devnull
            _pip(py, ["install", f"torch=={version}", *TORCH_EXTRAS], env, version)
            notes.append(f"installed torch=={version}" + ("" if version in PLAIN_PIP_VERSIONS else
                                                            " (PIP_CONFIG_FILE=/dev/null)"))
    origin = info.get("ttc") or ""
    if not origin or not Path(origin).resolve().is_relative_to(ROOT.resolve()):  # type: ignore[attr-defined]
        _pip(py, ["install", "--no-deps", "-e", str(ROOT)], pip_env_base, version)
        notes.append("installed this package (--no-deps -e)" + (" (it resolved elsewhere before)" if origin else ""))
    info = probe(py, cwd)
    if "torch_error" in info:
        raise RuntimeError(f"torch does not import: {SCRUB(info['torch_error'])}")
    origin = info.get("ttc") or ""
    if not origin or not Path(origin).resolve().is_relative_to(ROOT.resolve()):  # type: ignore[attr-defined]
        raise RuntimeError("torch_threadsafe_compile does not resolve to this repository in the venv")
    info["notes"] = notes
    return info


# --------------------------------------------------------------------------------------------------------------
# One version.


def run_version(version: str, venv: Path, reused: bool, rows: List[Row], timeout: float) -> Dict[str, Any]:
    res: Dict[str, Any] = {"version": version, "reused": reused, "rows": {}, "t0": time.monotonic()}
    with tempfile.TemporaryDirectory(prefix="ttc-compat-") as cwd:
        try:
            res["venv"] = prepare_venv(version, venv, reused, cwd)
        except Exception as e:
            res["error"] = SCRUB(f"{type(e).__name__}: {e}")
            res["secs"] = round(time.monotonic() - res.pop("t0"), 1)
            log(f"{version}: venv not usable: {res['error']}")
            return res
        py = str(venv_python(venv))
        log(f"{version}: torch {res['venv'].get('torch')} python {res['venv'].get('python')}")
        res["doctor"] = {"unpatched": run_doctor(py, True, timeout, cwd), "active": run_doctor(py, False, timeout, cwd)}
        act = res["doctor"]["active"]
        if act.get("failed"):
            log(f"{version}: doctor (active) failed: {act['short']}")
        for row in rows:
            pair = {}
            for mode, disable in (("unpatched", True), ("active", False)):
                r = run_scenario(py, row, disable, timeout, cwd)
                pair[mode] = r
                shown = r["short"] if r.get("failed") else row.show(r)
                log(f"{version}: {row.invocation:<28} {mode:<9} {shown}  ({r.get('secs')} s)")
            res["rows"][row.key] = pair
    res["secs"] = round(time.monotonic() - res.pop("t0"), 1)
    return res


# --------------------------------------------------------------------------------------------------------------
# The document.


def short_reason(reason: str) -> str:
    m = re.match(r"fixed upstream in torch (\S+)", reason)
    if m:
        return f"fixed upstream in {m.group(1)}"
    m = re.match(r"torch \S+ is outside (.+?) \(hazard absent there\)", reason)
    if m:
        return f"outside {m.group(1)}"
    return reason


def patch_state(vres: Dict[str, Any], patch_id: Optional[str]) -> Optional[Dict[str, Any]]:
    act = vres.get("doctor", {}).get("active", {})
    for p in act.get("patches", []) or []:
        if p.get("id") == patch_id:
            return p
    return None


def _state_text(p: Optional[Dict[str, Any]]) -> str:
    if p is None:
        return "state unknown"
    return p["state"] if p["state"] == "applied" else f"{p['state']}: {short_reason(p.get('reason', ''))}"


def _val(row: Row, r: Dict[str, Any]) -> str:
    return r["short"] if r.get("failed") else row.show(r)


def hazard_cell(row: Row, vres: Dict[str, Any], findings: List[str]) -> str:
    v = vres["version"]
    if "error" in vres:
        return "not run (venv)"
    pair = vres["rows"].get(row.key)
    if pair is None:
        return "not run"
    u, a = pair["unpatched"], pair["active"]
    ps = patch_state(vres, row.patch)
    st = _state_text(ps)
    skipped = ps is not None and ps["state"] == "skipped"
    uv, av = _val(row, u), _val(row, a)
    if u.get("failed") or a.get("failed"):
        if a.get("failed") and not u.get("failed"):
            findings.append(f"torch {v}: `{row.invocation}` fails only when active: {a['short']} "
                            f"(unpatched: {uv}; {row.patch}: {st})")
            return f"ACTIVE FAILS: {uv} → {av} ({st})"
        if u.get("failed") and not a.get("failed"):
            verdict = "still bad" if row.bad(a) else "ok when active"
            if row.bad(a):
                findings.append(f"torch {v}: `{row.invocation}` unpatched {uv}; active still bad: {av} ({st})")
            return f"unpatched failed, {verdict}: {uv} → {av} ({st})"
        findings.append(f"torch {v}: `{row.invocation}` fails in both modes (with and without the package): "
                        f"{uv} / {av}")
        if uv == av:
            return f"failed both: {uv} ({st})"
        return f"failed both: {uv} → {av} ({st})"
    bu, ba = row.bad(u), row.bad(a)
    broke = row.control(u, a) if row.control else None
    if broke:
        findings.append(f"torch {v}: `{row.invocation}` when active: {broke} ({st})")
        return f"BROKEN: {broke}; {uv} → {av} ({st})"
    if row.key == "fx_same_thread":
        if not ba:
            return f"kept ({uv} → {av})" if not bu else f"fixed?! ({uv} → {av}; {st})"
        findings.append(f"torch {v}: `{row.invocation}` control broken when active: {av} (unpatched: {uv}; {st})")
        return f"BROKEN: {uv} → {av} ({st})"
    if bu and not ba:
        return f"reproduced: {uv} → {av} ({st})"
    if bu and ba:
        if skipped:
            findings.append(f"torch {v}: hazard reproduced by `{row.invocation}` but {row.patch} is {st}: {uv} → {av}")
            return f"reproduced, patch {st}: {uv} → {av}"
        findings.append(f"torch {v}: `{row.invocation}` still bad when active: {uv} → {av} ({st})")
        return f"NOT FIXED: {uv} → {av} ({st})"
    if not bu and ba:
        findings.append(f"torch {v}: `{row.invocation}` regresses when active: {uv} → {av} ({st})")
        return f"REGRESSION: {uv} → {av} ({st})"
    if skipped:
        return f"skipped: {short_reason(ps.get('reason', ''))} — absent ({uv} → {av})"  # type: ignore[union-attr]
    return f"absent ({uv} → {av})" + ("" if st == "applied" else f" ({st})")


def patch_cell(patch_id: str, vres: Dict[str, Any], findings: List[str]) -> str:
    if "error" in vres:
        return "not run (venv)"
    act = vres.get("doctor", {}).get("active", {})
    if act.get("failed"):
        return f"doctor {act['short']}"
    p = patch_state(vres, patch_id)
    if p is None:
        return "not in the package when this version ran"
    text = _state_text(p)
    if p["state"] == "failed":
        findings.append(f"torch {vres['version']}: patch {patch_id} failed: {SCRUB(p.get('reason', ''))}")
        text = f"FAILED: {SCRUB(p.get('reason', ''))}"
    elif p["state"] not in ("applied", "skipped"):
        findings.append(f"torch {vres['version']}: patch {patch_id} is {p['state']} after doctor: {p.get('reason')}")
    if p.get("replaced_by_others"):
        text += f" (replaced by others: {', '.join(p['replaced_by_others'])})"
    return text


def md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def command_line(argv: List[str], reuse_labels: Dict[str, str]) -> str:
    """The command as typed, with machine-specific paths replaced (reused venvs become ``V=<venv>``)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd()) if sys.argv[0] else "bench/compat_matrix.py"
    if os.path.abspath(os.getcwd()) != str(ROOT):
        script = "bench/compat_matrix.py"
    parts = ["python", script]
    it = iter(argv)
    for a in it:
        if a == "--reuse-venv" or a.startswith("--reuse-venv="):
            parts.append("--reuse-venv")
            vals = [a.split("=", 1)[1]] if "=" in a and a.startswith("--reuse-venv=") else []
            if not vals:
                vals = [next(it, "")]
            for val in vals:
                ver = val.split("=", 1)[0]
                parts.append(f"{ver}=<venv>")
            continue
        if os.path.isabs(a) or a.startswith("~"):
            p = Path(os.path.expanduser(a)).resolve()
            try:
                parts.append(str(p.relative_to(ROOT)))
            except ValueError:
                parts.append("<dir>/" + p.name)
            continue
        parts.append(SCRUB(a))
    return " ".join(shlex.quote(x) if not x.endswith("=<venv>") and not x.startswith("<dir>") else x for x in parts)


def repo_revision() -> str:
    """HEAD's short hash, plus '+ local changes' when the package's files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "torch_threadsafe_compile", "sitecustomize",
                                "setup.py", "setup.cfg", "pyproject.toml"], cwd=ROOT, capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + local changes to the package" if dirty else "")


def render(results: List[Dict[str, Any]], rows: List[Row], cmd: str, started: str, total_s: float,
           revision: str) -> str:
    findings: List[str] = []
    versions = [r["version"] for r in results]
    patch_ids: List[str] = []
    hazards: Dict[str, str] = {}
    for r in results:
        for p in r.get("doctor", {}).get("active", {}).get("patches", []) or []:
            if p["id"] not in patch_ids:
                patch_ids.append(p["id"])
                hazards[p["id"]] = p.get("hazard", "")
    out: List[str] = []
    w = out.append
    w("# Compatibility matrix")
    w("")
    w("Generated by `bench/compat_matrix.py`; do not edit by hand. Produced with:")
    w("")
    w("```")
    w(cmd)
    w("```")
    w("")
    pyvers = sorted({r.get("venv", {}).get("python", "?") for r in results if "venv" in r})
    w(f"- date: {started} (UTC), {total_s / 60:.1f} min; package at commit {revision}")
    w(f"- python: {', '.join(pyvers) or '?'} in the venvs (driver: {platform.python_version()}), "
      f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs")
    w("- every scenario ran once, on CPU, in a fresh interpreter from a neutral directory; numbers are single runs "
      "on a shared machine: evidence that a hazard exists, not benchmarks")
    w("")
    w("## Legend")
    w("")
    w("Hazard cells read `verdict: unpatched → active (state of the patch that addresses it)`; "
      "unpatched is `TTC_DISABLE=1`, active is the start-up `.pth` activation.")
    w("")
    w("- **reproduced**: the hazard shows unpatched and is gone when active.")
    w("- **absent**: the hazard does not show on this version, with or without the package.")
    w("- **skipped: reason**: the patch did not apply (`fixed upstream in X`, or the version is outside its range); "
      "the numbers show that the hazard is indeed absent.")
    w("- **kept**: (control row) the legitimate same-thread error and plain FX / make_fx / export still behave.")
    w("- **NOT FIXED / REGRESSION / ACTIVE FAILS / BROKEN**: a problem of the package; see *Findings*.")
    w("- **crash rc=-11 SIGSEGV: …** / **timeout after N s**: the interpreter died or was killed; the exit status and "
      "the crash headline (faulthandler's `Fatal Python error`, else the last line) are shown; stacks are in the "
      "per-version details. **unpatched failed** means the crash happened without the package.")
    w("- Patch rows give the state `doctor --json` reports when active (`applied`, `skipped: reason`, "
      "`FAILED: error`); unpatched, every patch reads `disabled`.")
    w("")
    w("## Matrix")
    w("")
    w("| hazard / patch | " + " | ".join(versions) + " |")
    w("|---|" + "---|" * len(versions))
    w("| torch build | " + " | ".join(md_escape(r.get("venv", {}).get("torch", "–") or "–") for r in results) + " |")
    w("| activation (unpatched / active) | " + " | ".join(
        md_escape(f"{r.get('doctor', {}).get('unpatched', {}).get('activation', '–')} / "
                  f"{r.get('doctor', {}).get('active', {}).get('activation', '–')}") for r in results) + " |")
    for row in rows:
        label = f"{row.hazard} {row.title} (`{row.invocation}`)"
        w(f"| {md_escape(label)} | " + " | ".join(md_escape(hazard_cell(row, r, findings)) for r in results) + " |")
    for pid in patch_ids:
        label = f"patch `{pid}` ({hazards.get(pid, '')})"
        w(f"| {md_escape(label)} | " + " | ".join(md_escape(patch_cell(pid, r, findings)) for r in results) + " |")
    for r in results:
        act = r.get("doctor", {}).get("active", {})
        if act and not act.get("failed") and act.get("activation") not in ("pth", "start", "sitecustomize", "explicit"):
            findings.append(f"torch {r['version']}: activation when active is {act.get('activation')!r} "
                            f"({act.get('inactive_reason')})")
        unp = r.get("doctor", {}).get("unpatched", {})
        if unp and not unp.get("failed"):
            not_disabled = [p["id"] for p in unp.get("patches", []) if p.get("state") != "disabled"]
            if not_disabled or unp.get("activation") != "disabled":
                findings.append(f"torch {r['version']}: with TTC_DISABLE=1 activation is {unp.get('activation')!r}, "
                                f"patches not disabled: {not_disabled}")
        for mode in ("unpatched", "active"):
            d = r.get("doctor", {}).get(mode, {})
            if d.get("failed"):
                findings.append(f"torch {r['version']}: doctor ({mode}) {d['short']}")
        if "error" in r:
            findings.append(f"torch {r['version']}: not run: {r['error']}")
    w("")
    w("## Findings")
    w("")
    if findings:
        seen = set()
        for f in findings:
            if f not in seen:
                seen.add(f)
                w(f"- {md_escape(SCRUB(f))}")
    else:
        w("None: every hazard that reproduced is gone when active, no patch failed, no control regressed.")
    w("")
    w("## Details per version")
    for r in results:
        w("")
        w(f"### torch {r['version']}")
        w("")
        if "error" in r:
            w(f"Not run: {md_escape(r['error'])}")
            continue
        vinfo = r["venv"]
        where = "reused venv (`--reuse-venv`)" if r["reused"] else f"venv `torch-{r['version']}` under the venv root"
        notes = "; ".join(vinfo.get("notes", [])) or "used as found"
        w(f"torch `{vinfo.get('torch')}`, python {vinfo.get('python')}, {where} ({notes}); "
          f"{r.get('secs', 0):.0f} s in all.")
        w("")
        w("| run | unpatched (TTC_DISABLE=1) | active |")
        w("|---|---|---|")
        for mode_pair_key in ("doctor",):
            dd = r.get("doctor", {})
            cells = []
            for mode in ("unpatched", "active"):
                d = dd.get(mode, {})
                if d.get("failed"):
                    cells.append(d["short"])
                else:
                    st = ", ".join(f"{p['id']}={p['state']}" for p in d.get("patches", []))
                    cells.append(f"activation={d.get('activation')}; {st} ({d.get('secs')} s)")
            w(f"| `doctor --json` | {md_escape(cells[0])} | {md_escape(cells[1])} |")
        for row in rows:
            pair = r["rows"].get(row.key)
            if not pair:
                continue
            cells = []
            for mode in ("unpatched", "active"):
                x = pair[mode]
                if x.get("failed"):
                    cells.append(f"{x['short']} ({x['secs']} s)")
                else:
                    cells.append(f"`{json.dumps({k: v for k, v in x.items() if k != 'secs'})}` ({x['secs']} s)")
            w(f"| `{row.invocation}` | {md_escape(SCRUB(cells[0]))} | {md_escape(SCRUB(cells[1]))} |")
        reasons = [p for p in r.get("doctor", {}).get("active", {}).get("patches", []) if p.get("reason")]
        if reasons:
            w("")
            w("Patch reasons (active): " + "; ".join(f"`{p['id']}` {md_escape(SCRUB(p['reason']))}" for p in reasons))
        warns = r.get("doctor", {}).get("active", {}).get("stderr_warnings")
        if warns:
            w("")
            w("doctor (active) warned: " + md_escape(" / ".join(warns)))
        for row in rows:
            pair = r["rows"].get(row.key) or {}
            for mode in ("unpatched", "active"):
                x = pair.get(mode)
                if x and x.get("failed") and x.get("tail"):
                    w("")
                    w(f"<details><summary>{row.invocation}, {mode}: {md_escape(x['short'])}</summary>")
                    w("")
                    w("```")
                    w(x["tail"])
                    w("```")
                    w("</details>")
    w("")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv-root", default=str(ROOT / ".venvs"), help="where torch-<V> venvs live (default: .venvs/)")
    ap.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS, metavar="V", help="torch versions")
    ap.add_argument("--out", default=str(ROOT / "docs" / "compat.md"), help="markdown output (default docs/compat.md)")
    ap.add_argument("--jobs", type=int, default=1, help="versions run in parallel (default 1: scenarios are CPU-heavy)")
    ap.add_argument("--reuse-venv", action="append", default=[], metavar="V=PATH",
                    help="use an existing venv for version V (repeatable)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per scenario run (default 300)")
    ap.add_argument("--only", nargs="+", metavar="ROW", choices=[r.key for r in ROWS],
                    help="run only these scenario rows (for a quick check)")
    ap.add_argument("--json", metavar="PATH", help="also dump the raw results (paths scrubbed) as JSON")
    ap.add_argument("--from-json", metavar="PATH", help="run nothing: re-render --out from a --json dump")
    args = ap.parse_args(argv)

    reuse: Dict[str, Path] = {}
    for item in args.reuse_venv:
        ver, sep, path = item.partition("=")
        if not sep or not ver or not path:
            ap.error(f"--reuse-venv wants V=PATH, got {item!r}")
        reuse[ver] = Path(path).expanduser().absolute()
        SCRUB.add(str(reuse[ver]), "<venv>")
    versions = list(dict.fromkeys(args.versions))
    unknown = [v for v in reuse if v not in versions]
    if unknown:
        log(f"--reuse-venv for versions not in --versions, ignored: {unknown}")
    venv_root = Path(args.venv_root).expanduser().absolute()
    SCRUB.add(str(venv_root), "<venv-root>")
    rows = [r for r in ROWS if not args.only or r.key in args.only]

    if args.from_json:
        dump = json.loads(Path(args.from_json).read_text())
        results, cmd, started, total = dump["results"], dump["command"], dump["date"], dump["secs"]
        revision = dump.get("revision", "unknown")
        keys = set(dump.get("rows") or [r.key for r in ROWS])
        rows = [r for r in ROWS if r.key in keys]
    else:
        cmd = command_line(argv, {})
        revision = repo_revision()
        started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        t0 = time.monotonic()
        jobs = []
        for v in versions:
            venv = reuse.get(v, venv_root / f"torch-{v}")
            jobs.append((v, venv, v in reuse))

        def one(job: Tuple[str, Path, bool]) -> Dict[str, Any]:
            v, venv, reused = job
            try:
                return run_version(v, venv, reused, rows, args.timeout)
            except Exception as e:  # a bug here must not cost the other versions
                return {"version": v, "reused": reused, "rows": {}, "error": SCRUB(f"{type(e).__name__}: {e}")}

        if args.jobs <= 1:
            results = [one(j) for j in jobs]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
                results = list(ex.map(one, jobs))
        total = time.monotonic() - t0
        end_revision = repo_revision()
        if end_revision != revision:
            revision = f"{revision} at the start, {end_revision} at the end (the package changed during the run)"
        if args.json:
            dump = {"command": cmd, "date": started, "secs": total, "revision": revision, "rows": [r.key for r in rows], "results": results}
            Path(args.json).write_text(SCRUB(json.dumps(dump, indent=1, default=str)))

    doc = render(results, rows, cmd, started, total, revision)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    log(f"wrote {SCRUB(str(out.absolute()))} ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
