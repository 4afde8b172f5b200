"""The crashes found by running PyTorch's own tests with pytest-run-parallel (H8, H9 of docs/hazards.md),
reproduced without pytest (ttc_testing/crash_scenarios.py), unpatched vs active, in fresh interpreters.

The active runs must all complete. The hazard is a race: unpatched, a crash (a signal) shows it in most runs
of a busy machine (3 of 4 on torch 2.13 CPU under load) and in fewer on a quiet one (0 of 4 seen once). So
the unpatched side runs up to ``TRIES`` times and stops at the first crash; where no run crashed the test
cannot tell the patch from its absence and skips, saying so, instead of passing. ``bench/stress.py``-style
repetition is the measurement (docs/upstream-tests.md).
"""

from __future__ import annotations

import pytest
from packaging.version import Version

from conftest import torch_version
from ttc_testing import crash_scenarios

TV = torch_version()
OFF = {"TTC_DISABLE": "1"}
ON = {"TTC_DISABLE": "0"}
TRIES = 6

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
    pytest.skip(f"{name}: the race did not crash unpatched torch in {TRIES} runs here (nothing to compare): {runs[-1]}")


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
    for res in completes_active("guard_invalidation_race", seconds=8):
        assert res["calls"] > 0 and res["errors"] == 0, res
    off = crashes_unpatched("guard_invalidation_race", seconds=8)
    assert off["signal"] in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS"), off


@needs_26
def test_h9_export_beside_compiled_calls_does_not_crash() -> None:
    """patch code_reset: torch._dynamo.export (reset_code) while other threads call the function compiled."""
    for res in completes_active("export_beside_calls", seconds=8):
        # no errors either: ~190 exports in 8 s used to reach accumulated_recompile_limit (the soft reset
        # kept the frame's compile count; upstream's reset starts a new one)
        assert res["exports"] > 0 and res["calls"] > 0 and res["errors"] == 0, res
    off = crashes_unpatched("export_beside_calls", seconds=8)
    assert off["signal"] in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS"), off


_SOFT_RESET = r"""
import threading, json
import torch, torch._dynamo
from torch._dynamo.testing import CompileCounter
torch._dynamo.config.recompile_limit = 4
# dynamo also refuses a frame's compile once its per-frame-id count reaches this limit; upstream's reset
# starts a new count (a new frame id), so ten resets must not reach it either
acc = "accumulated_recompile_limit" if "accumulated_recompile_limit" in torch._dynamo.config._config else "accumulated_cache_size_limit"
setattr(torch._dynamo.config, acc, 6)
cnt = CompileCounter()
def f(x):
    return x.sin() + 1
opt = torch.compile(f, backend=cnt)
x = torch.randn(3)
hold, release = threading.Event(), threading.Event()
t = threading.Thread(target=lambda: (hold.set(), release.wait(60)))
t.start(); hold.wait()
frames = []
for _ in range(10):  # more resets than recompile_limit: each must compile afresh, none may hit the limit
    opt(x); opt(x)
    torch._dynamo.eval_frame.remove_from_cache(f)
    frames.append(cnt.frame_count)
release.set(); t.join()
opt(x)
torch._dynamo.eval_frame.remove_from_cache(f)  # no other thread: upstream's reset_code
opt(x)
import torch_threadsafe_compile as ttc
rep = [p for p in ttc.status()["patches"] if p["id"] == "code_reset"][0]
print("OUT " + json.dumps({"frames": frames, "final": cnt.frame_count, "state": rep["state"],
                           "entries": len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__))}))
"""


@needs_26
def test_h9_reset_code_with_other_threads_recompiles_like_upstream() -> None:
    """patch code_reset: while another thread exists, each remove_from_cache still makes the next call compile
    afresh, more often than recompile_limit and accumulated_recompile_limit (each reset starts a new count,
    as upstream's does); without other threads, reset_code is upstream's (entries freed)."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _SOFT_RESET], env=_env(ON), capture_output=True, text=True, timeout=300)
    line = [x for x in p.stdout.splitlines() if x.startswith("OUT ")]
    assert p.returncode == 0 and line, p.stderr[-2000:]
    out = json.loads(line[0][4:])
    assert out["state"] == "applied", out
    assert out["frames"] == list(range(1, 11)), out
    assert out["final"] == 12 and out["entries"] == 1, out
