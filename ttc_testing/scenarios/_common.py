"""Helpers shared by the scenario modules of this package, and the child environment of ``run``."""

from __future__ import annotations

import os
import threading
import time

# The repository root: a scenario runs as ``python -m ttc_testing.scenarios`` from the source tree.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_for(ts: list[threading.Thread], seconds: float, stop: threading.Event) -> None:
    """Start ``ts``, let them run for ``seconds``, then set ``stop`` and join them."""
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()


def _wait_child(pid: int, timeout: float) -> int | None:
    """The exit code of forked child ``pid``, or None when it had not ended after ``timeout`` s (then it is
    killed): a hung child fails the scenario instead of hanging it."""
    import signal

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _env(env: dict[str, str] | None) -> dict[str, str]:
    """The repository root goes on the child's ``PYTHONPATH`` so that ``-m ttc_testing.scenarios`` resolves."""
    out = dict(env or {})
    base = out.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, base) if p)
    return out
