"""Shared helpers. Hazard tests run their scenario in fresh interpreters (see
``ttc_testing/scenarios/``): once with ``TTC_DISABLE=1``, where the hazard must show, and once
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


def cuda_build_without_gpu() -> bool:
    """A CUDA build of torch on a machine without a GPU (e.g. torch 2.11 from PyPI on a CPU machine).

    There, ``FakeTensorMode.__enter__`` (every compile) re-registers a CUDA device-guard implementation
    while other threads dispatch ops, and the process can segfault, with or without this package
    (docs/hazards.md, H3). Tests that run compiled code in some threads while others compile skip there.
    """
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    try:  # torch/version.py, read as text so that the test process does not import torch
        text = Path(spec.origin).with_name("version.py").read_text()
    except OSError:
        return False
    built_for_cuda = re.search(r"^cuda\b[^=]*=\s*['\"]\d", text, re.M) is not None
    return built_for_cuda and not os.path.exists("/dev/nvidia0")


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
