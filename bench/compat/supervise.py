"""Running children: own process group, timeout, and what is known when one dies without a result.

A crash is summarised as rc, signal name, faulthandler's ``Fatal Python error`` headline and the innermost
frame of the crashing thread (its stack is kept for the details section). Nothing here raises for a child's
sake: every run returns a dict, so that one crash never costs the rest of a matrix.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ._package_env import child_environ

from .scrub import SCRUB

_print_lock = threading.Lock()
_children: "set[subprocess.Popen[str]]" = set()  # running children, killed if we are stopped

# Fatal-error headlines that say no more than the signal already does.
_PLAIN_HEADLINES = ("segmentation fault", "aborted", "bus error", "floating point exception")


def log(msg: str, tag: str = "compat") -> None:
    with _print_lock:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child_env(disable: bool, pythonpath: Optional[str] = None) -> Dict[str, str]:
    """The caller's environment minus ``TTC_*``, ``PYTHONPATH`` and ``VIRTUAL_ENV``, with the package's mode set.

    ``pythonpath``: the only ``PYTHONPATH`` the child gets (the repository root for ``ttc_testing``)."""
    env = {k: v for k, v in child_environ(disable="1" if disable else "0").items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONFAULTHANDLER"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


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


def kill_children_on_stop() -> None:
    """SIGTERM / SIGINT kill every running child's process group before we exit."""
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)


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


def result_line(stdout: str, prefix: str = "RESULT ") -> Optional[Dict[str, Any]]:
    """The JSON object of the last ``prefix`` line, or None (no such line, or not JSON)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            try:
                value = json.loads(line[len(prefix):])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def signal_name(rc: Optional[int]) -> str:
    """``SIGSEGV`` for rc -11 (killed by the signal) or 139 (a shell's 128 + signal); '' for a plain exit."""
    if not isinstance(rc, int):
        return ""
    sig = -rc if rc < 0 else (rc - 128 if rc > 128 else 0)
    if sig:
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"signal {sig}"
    return ""


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def crash_stack(text: str) -> Tuple[str, str]:
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


def fatal_headline(text: str) -> str:
    """faulthandler's ``Fatal Python error: ...`` line, or ''."""
    return next((ln.strip() for ln in text.splitlines() if ln.startswith("Fatal Python error")), "")


def _tail(both: str, fatal: str, stack: str) -> str:
    if stack:
        threads = sum(1 for ln in both.splitlines() if ln.startswith(("Thread 0x", "Current thread")))
        return f"{fatal}\n\n{stack}\n\n({threads} threads in the dump; the crashing one is shown)"
    tail = "\n".join(ln for ln in both.strip().splitlines() if not ln.startswith("Extension modules"))
    return "\n".join(tail.splitlines()[-25:])


def _short(info: Dict[str, Any], timeout: float) -> str:
    """One line for a table cell: ``crash rc=-11 SIGSEGV: in file.py:12 fn`` or ``timeout after N s``."""
    if info["timeout"]:
        return f"timeout after {timeout:g} s"
    what = f"rc={info['rc']}" + (f" {info['signal']}" if info["signal"] else "")
    if info["crash_site"]:
        line = f"in {info['crash_site']}"
        head = info["fatal"].replace("Fatal Python error: ", "")
        if head and head.lower() not in _PLAIN_HEADLINES:
            line = f"{head} {line}"
    else:
        line = info["fatal"] or info["last_line"]
    return f"crash {what}" + (f": {line[:110]}" if line else "")


def failure_info(pr: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """Summary of a run that produced no result: rc, signal, the last line, and faulthandler's headline."""
    both = (pr["stderr"] or "") + "\n" + (pr["stdout"] or "")
    fatal = fatal_headline(both)
    stack, top = crash_stack(both)
    info: Dict[str, Any] = {
        "failed": True,
        "rc": pr["rc"],
        "signal": signal_name(pr["rc"]),
        "timeout": pr["timeout"],
        "fatal": SCRUB(fatal),
        "crash_site": SCRUB(top),
        "last_line": SCRUB(last_line(pr["stderr"]) or last_line(pr["stdout"]))[:300],
        "tail": SCRUB(_tail(both, fatal, stack)),
        "secs": pr["secs"],
    }
    info["short"] = _short(info, timeout)
    return info
