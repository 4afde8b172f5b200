"""What is known when a child dies without a result, and the environment of the matrix's children.

Children run under the bench harness (``bench/_harness.py``: ``run_proc``, own process group, timeout, never
raising for the child's sake). A crash is summarised here as rc, signal name, faulthandler's ``Fatal Python
error`` headline and the innermost frame of the crashing thread (its stack is kept for the details section):
every run returns a dict, so that one crash never costs the rest of a matrix.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from _harness import child_environ
from _harness import log as _log

from .scrub import SCRUB

# Fatal-error headlines that say no more than the signal already does.
_PLAIN_HEADLINES = ("segmentation fault", "aborted", "bus error", "floating point exception")


def log(msg: str, tag: str = "compat") -> None:
    """The harness's progress line, tagged ``compat`` unless said otherwise."""
    _log(msg, tag)


def child_env(disable: bool, pythonpath: str | None = None) -> dict[str, str]:
    """The caller's environment minus ``TTC_*``, ``PYTHONPATH`` and ``VIRTUAL_ENV``, with the package's mode set.

    ``pythonpath``: the only ``PYTHONPATH`` the child gets (the repository root for ``ttc_testing``)."""
    env = {k: v for k, v in child_environ(disable="1" if disable else "0").items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["PYTHONFAULTHANDLER"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def signal_name(rc: int | None) -> str:
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


def crash_stack(text: str) -> tuple[str, str]:
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


def _short(info: dict[str, Any], timeout: float) -> str:
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


def failure_info(pr: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Summary of a run that produced no result: rc, signal, the last line, and faulthandler's headline."""
    both = (pr["stderr"] or "") + "\n" + (pr["stdout"] or "")
    fatal = fatal_headline(both)
    stack, top = crash_stack(both)
    info: dict[str, Any] = {
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
