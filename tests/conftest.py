"""Shared helpers. Hazard tests run their scenario in fresh interpreters (see
``torch_threadsafe_compile.scenarios``): once with ``TTC_DISABLE=1``, where the hazard must show, and once
active, where it must not. A scenario that hangs is killed by the subprocess timeout, never blocking CI."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def torch_version():
    """torch's version without importing torch into the test process (cheap, and keeps it unpatched)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(Version(version("torch")).base_version)


def run_py(code: str, env: dict[str, str] | None = None, timeout: float = 240, cwd: str | None = None,
           args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TTC_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *(args or []), "-c", textwrap.dedent(code)],
        env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd or str(REPO),
    )


def stderr_lines(p: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr lines that come from us (torch's own start-up noise, e.g. a missing numpy, is ignored)."""
    return [line for line in p.stderr.splitlines() if "torch-threadsafe-compile" in line or "Traceback" in line]


@pytest.fixture(scope="session")
def tv():
    return torch_version()


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    if os.environ.get("TTC_DISABLE"):
        skip = pytest.mark.skip(reason="the test process itself must run with the package active (TTC_DISABLE is set)")
        for item in items:
            if "needs_active" in item.keywords:
                item.add_marker(skip)
