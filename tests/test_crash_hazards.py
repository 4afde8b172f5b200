"""The crashes found by running PyTorch's own tests with pytest-run-parallel (H8, H9 of docs/hazards.md),
reproduced without pytest (ttc_testing/crash_scenarios.py), unpatched vs active, in fresh interpreters.

The hazard must show with ``TTC_DISABLE=1`` — a crash (a signal) counts — in at most ``TRIES`` runs (each
crashes in most runs on torch 2.13 CPU); the active runs must all complete.
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from conftest import torch_version
from ttc_testing import crash_scenarios

TV = torch_version()
OFF = {"TTC_DISABLE": "1"}
ON = {"TTC_DISABLE": "0"}
TRIES = 4

needs_26 = pytest.mark.skipif(TV < Version("2.6"), reason="the patches cover torch >= 2.6")


def _env(extra: dict[str, str]) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TTC_")}
    env.update(extra)
    return env


def crashes_unpatched(name: str, **kwargs: object) -> dict:
    runs = []
    for _ in range(TRIES):
        res = crash_scenarios.run(name, env=_env(OFF), **kwargs)
        runs.append(res)
        if res.get("crashed"):
            return res
    pytest.fail(f"{name}: no crash unpatched in {TRIES} runs: {runs}")


def completes_active(name: str, runs: int = 2, **kwargs: object) -> list[dict]:
    out = []
    for _ in range(runs):
        res = crash_scenarios.run(name, env=_env(ON), **kwargs)
        assert not res.get("crashed") and not res.get("timed_out") and res.get("rc") == 0, res
        out.append(res)
    return out


@needs_26
def test_h8_guard_invalidation_during_lookups_does_not_crash() -> None:
    """patch guard_invalidation: weakref-finalizer invalidations while other threads evaluate the guards."""
    off = crashes_unpatched("guard_invalidation_race", seconds=8)
    assert off["signal"] in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS"), off
    for res in completes_active("guard_invalidation_race", seconds=8):
        assert res["calls"] > 0 and res["errors"] == 0, res


@needs_26
def test_h9_export_beside_compiled_calls_does_not_crash() -> None:
    """patch code_reset: torch._dynamo.export (reset_code) while other threads call the function compiled."""
    off = crashes_unpatched("export_beside_calls", seconds=8)
    assert off["signal"] in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS"), off
    for res in completes_active("export_beside_calls", seconds=8):
        assert res["exports"] > 0 and res["calls"] > 0, res
