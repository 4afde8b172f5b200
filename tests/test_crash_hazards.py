"""The crashes found by running PyTorch's own tests with pytest-run-parallel, or their shapes in threads (H8,
H9, H11 of docs/hazards.md), reproduced without pytest (ttc_testing/crash_scenarios.py), unpatched vs
active, in fresh interpreters.

The active runs must all complete. The hazard is a race: unpatched, a crash (a signal) shows it in most runs
of a busy machine (3 of 4 on torch 2.13 CPU under load) and in fewer on a quiet one (0 of 4 seen once). So
the unpatched side runs up to ``TRIES`` times and stops at the first crash; where no run crashed the test
cannot tell the patch from its absence and skips, saying so, instead of passing. ``bench/stress.py``-style
repetition is the measurement (docs/upstream-tests.md). H11 crashed only with the package: there the point
is that the active runs never crash or hang where the unpatched one completes.
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


def hangs_unpatched(name: str, timeout: float, tries: int = 2, **kwargs: object) -> dict:
    """A deadlock scenario with ``TTC_DISABLE=1``: it must hang (its bound ends it: ``timed_out``) within
    ``tries`` runs, else the test is skipped (a race that did not show here: nothing to compare)."""
    runs = []
    for _ in range(tries):
        res = crash_scenarios.run(name, env=_env(OFF), timeout=timeout, **kwargs)
        runs.append(res)
        if res.get("timed_out"):
            return res
    pytest.skip(f"{name}: the deadlock did not show unpatched in {tries} runs here: {runs}")


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
        assert res["exports"] > 0 and res["calls"] > 0, res
        # No recompile-limit error: ~190 exports in 8 s used to reach accumulated_recompile_limit (the soft
        # reset kept the frame's compile count; upstream's reset starts a new one). Other errors are counted,
        # not failed on: on a loaded machine torch._dynamo.export beside compiled calls still raises now and
        # then (KeyError in dynamo's tracing state, "RuntimeError when making fake tensor call": 0-8 in 8 s,
        # the same on the tree before H11); unpatched the process dies first, so there is no upstream count
        # to compare with (docs/hazards.md, H9, open).
        limit = {k: n for k, n in res.get("by_kind", {}).items() if "limit" in k.lower() or "Recompile" in k}
        assert not limit, res
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


@needs_26
def test_h11_export_unflatten_compile_never_crashes_where_unpatched_completes() -> None:
    """patches first_compile (reset barrier), code_reset, guard_invalidation: a strict export resets dynamo
    while holding compile_lock, beside threads compiling frames of code objects they all share."""
    off = crash_scenarios.run("export_unflatten_compile", env=_env(OFF), timeout=300)
    runs = []
    for _ in range(2):
        on = crash_scenarios.run("export_unflatten_compile", env=_env(ON), timeout=300)
        ok = not on.get("crashed") and not on.get("timed_out") and on.get("rc") == 0
        if off.get("crashed") or off.get("timed_out"):
            assert ok, f"active crashed or hung (unpatched crashed or hung too: {off}): {on}"
        else:
            assert ok, f"active crashed or hung where unpatched completed: active {on}, unpatched {off}"
        assert on["done"] + on["errors"] == 12, on  # every round ended, one way or the other
        runs.append(on)
    # Exports take turns (export_serial): upstream's export races are gone. A rare error of an export beside
    # compiles is left (1 round of 12 in one CI run on torch 2.11 under two test processes, not reproduced in 12
    # runs here; docs/hazards.md H9, open): counted, and failed on when both runs have one.
    assert min(r["errors"] for r in runs) == 0, runs


_RESET_HOLDING_LOCK = r"""
import threading, time, json
import torch, torch._dynamo
from torch._dynamo.testing import CompileCounter
cnt = CompileCounter()
def f(x):
    return x.sin() + 1
opt = torch.compile(f, backend=cnt)
x = torch.randn(3)
opt(x)  # compiled once: f's cache state exists
torch._dynamo.config.recompile_limit = 64
lock = torch._dynamo.convert_frame.compile_lock
out = {}
def other():
    out["y"] = opt(x.double())  # a miss: its frame waits in dynamo's callback for the lock held below
t = threading.Thread(target=other)
with lock:
    t.start()
    deadline = time.monotonic() + 60
    while t.ident not in getattr(lock, "waiting", {}) and time.monotonic() < deadline:
        time.sleep(0.01)
    waiting = t.ident in getattr(lock, "waiting", {})
    t0 = time.monotonic()
    torch._dynamo.reset()  # as a strict export does, inside export_lock's hold of compile_lock
    reset_s = time.monotonic() - t0
t.join(60)
ok = not t.is_alive() and torch.allclose(out["y"], x.double().sin() + 1)
after = torch.allclose(opt(x), x.sin() + 1)  # the reset still means: compile afresh
print("OUT " + json.dumps({"waiting": waiting, "reset_s": reset_s, "ok": ok, "after": after,
                           "frames": cnt.frame_count}))
"""


@needs_26
def test_h11_reset_holding_compile_lock_does_not_wait_for_or_free_under_waiting_compiles() -> None:
    """patches first_compile, code_reset: torch._dynamo.reset() from a thread that holds compile_lock while
    another thread's compiled call waits for that lock in dynamo's frame callback. Upstream frees the waiting
    frame's cache state under it; the barrier used to wait 120 s for that call (a cycle), then free it."""
    import json
    import subprocess
    import sys

    try:
        p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _RESET_HOLDING_LOCK], env=_env(ON),
                           capture_output=True, text=True, timeout=110)
    except subprocess.TimeoutExpired:
        pytest.fail("the reset waited for a compiled call that waits for the compile_lock the reset holds")
    line = [x for x in p.stdout.splitlines() if x.startswith("OUT ")]
    assert p.returncode == 0 and line, (p.returncode, p.stderr[-3000:])
    out = json.loads(line[0][4:])
    assert out["waiting"], out  # the lock is instrumented (compile_lock_watchdog) and the other thread waited
    assert out["reset_s"] < 30 and out["ok"] and out["after"], out
    assert out["frames"] == 3, out  # f, f for double, f again after the reset


def test_h12_a_finder_under_the_import_lock_never_waits_for_a_compile() -> None:
    """patch first_compile (its frame callback): an import inside a compiled function's frame that dynamo runs
    as it is calls a meta-path finder written in Python under importlib's global import lock; upstream's
    callback waits there for ``compile_lock``, held by a thread whose tracing imports and waits for the import
    lock (``dynamo/test_misc.py::test_raises_importerror1`` in 4 threads). The scenario installs its own
    Python finder (``others="python"``), so the hazard does not depend on what the environment installed.
    Unpatched must hang (the bound ends it: ``timed_out``), active must complete: each within its bound."""
    # A race: the unpatched run hung in every run measured (docs/hazards.md, H12).
    hangs_unpatched("finder_under_import_lock_deadlock", timeout=45, others="python")
    for on in completes_active("finder_under_import_lock_deadlock", timeout=120, others="python"):
        assert on["errors"] == 0 and on["meta_path"][0] == "_PythonFinder", on


def test_h13_dynamo_code_callbacks_never_deadlock_with_the_traceback_free_list() -> None:
    """patch deferred_code_callbacks: 4 threads capture tracebacks inside fresh functions whose code objects
    dynamo has recorded as it records every code object it makes (``CleanupManager.instance``,
    ``output_codes``), then drop both: torch frees the code objects under its traceback free-list mutex, and
    dynamo's Python weakref callbacks hand the GIL to a thread that waits for that mutex
    (``dynamo/test_aot_autograd.py`` at 4 threads). Unpatched must hang (the bound ends it), active must complete,
    with every callback done (the dictionary holds only what is still alive)."""
    # A race: the unpatched run hung in every run measured (docs/hazards.md, H13).
    hangs_unpatched("captured_traceback_free_deadlock", timeout=40, callbacks="dynamo")
    for on in completes_active("captured_traceback_free_deadlock", timeout=120, callbacks="dynamo"):
        assert on["tracebacks"] > 1000 and on["left"] == 0, on
