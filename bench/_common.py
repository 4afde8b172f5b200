"""Helpers shared by the bench scripts: alternate runs of the active and unpatched (TTC_DISABLE=1)
configurations in one invocation, and report medians and their ratio."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from typing import Callable

import _repo  # noqa: F401 - the repository root on sys.path
from torch_threadsafe_compile._env import child_environ


def child_env(disabled: bool, tree: str | None = None) -> dict[str, str]:
    """The environment of a benchmark child: the caller's without ``TTC_*``; ``TTC_DISABLE=1`` when
    ``disabled``; with ``tree`` (a checkout of this project) first on ``PYTHONPATH``, so that the child's
    start-up hook activates that tree's package instead of the installed one (two commits in one run)."""
    env = child_environ(disable="1" if disabled else None)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH", "")) if p)
    # Measure as users run: with bytecode caching (pip install writes .pyc files; an environment that
    # forbids writing them would make every start compile our sources, ~3 ms, and torch's).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_child(code: str, disabled: bool, args: tuple[str, ...] = (), tree: str | None = None) -> str:
    p = subprocess.run([sys.executable, *args, "-c", code], env=child_env(disabled, tree), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"benchmark child failed (rc={p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout


def alternate(measure: Callable[[bool], float], rounds: int) -> dict[str, float]:
    """Run ``measure(disabled)`` alternately (ABAB...) so drifts of the machine hit both sides alike."""
    on: list[float] = []
    off: list[float] = []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        for disabled in order:
            (off if disabled else on).append(measure(disabled))
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"active_median": m_on, "unpatched_median": m_off, "ratio": m_on / m_off, "rounds": rounds}
