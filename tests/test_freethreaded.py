"""Free-threaded CPython (3.13t): the GIL stays off, and warm compiled calls from several threads do not crash.

The tests that need a free-threaded interpreter skip elsewhere; ``.ci/freethreaded.sh`` runs them with
``PYTHON_GIL=0``. Scenarios: ``ttc_testing/freethreaded.py``; the patches: ``patches/eval_frame_shim.py`` and
``patches/entry_list_order.py`` (forced by the scenarios where they are not registered yet).
"""

from __future__ import annotations

import sysconfig

import pytest
from conftest import run_py

from ttc_testing import freethreaded

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
needs_ft = pytest.mark.skipif(not FREE_THREADED, reason="needs a free-threaded CPython build (python3.13t)")
GIL_OFF = {"PYTHON_GIL": "0"}


@pytest.mark.parametrize("name", freethreaded.FT_PATCHES)
def test_ft_patches_only_on_free_threaded_builds(name: str) -> None:
    """With the GIL, dynamo's set_eval_frame runs whole and first_compile retries the spurious misses of the
    entry-list reordering: the patches say so instead of applying."""
    import importlib

    patch = importlib.import_module(f"torch_threadsafe_compile.patches.{name}")
    if not FREE_THREADED:
        assert "not a free-threaded build" in (patch.check() or "")


@needs_ft
def test_gil_stays_off() -> None:
    """``import torch``, the package's activation and a compile leave the GIL off (PYTHON_GIL=0)."""
    p = run_py("""
        import sys, torch
        import torch_threadsafe_compile as ttc
        f = torch.compile(lambda x: x.sin() + 1, backend="aot_eager")
        f(torch.ones(4))
        print("GIL", sys._is_gil_enabled(), ttc.status()["activation"])
    """, env=GIL_OFF)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "GIL False" in p.stdout, p.stdout + p.stderr[-2000:]


@needs_ft
@pytest.mark.parametrize("threads", [2, 5])
def test_warm_calls_without_gil(threads: int) -> None:
    """Threads making warm calls of one compiled function at once: no crash, no error, nothing uncompiled.
    Without ``eval_frame_shim`` dynamo's shim recursion killed 5 of 16 such runs (5 threads, 8 s)."""
    for _ in range(2):
        res = freethreaded.run("warm_calls", env=GIL_OFF, timeout=240, threads=threads, seconds=4, force=1)
        assert "calls" in res, res
        assert res["gil_enabled"] is False, res
        assert all(state.startswith("applied") for state in res["ft_patches"].values()), res
        assert (res["errors"], res["wrong"], res["uncompiled_frames"], res["extra_graphs"]) == (0, 0, 0, 0), res


@needs_ft
def test_lookup_race_without_gil() -> None:
    """Every guard set compiled first, then 16 threads calling (H3's spurious misses): nothing recompiles,
    nothing errs. Unpatched without the GIL, dynamo's unsynchronized reordering of the entry list gave 16-17
    extra graphs and ~100,000 errors in 6 s (``entry_list_order``)."""
    res = freethreaded.run("lookup_race", env={**GIL_OFF, "TTC_FT_FORCE": "1"}, timeout=300, threads=16, seconds=6)
    assert "calls" in res, res
    assert (res["extra_graphs"], res["uncompiled_frames"], res["errors"], res["wrong_results"]) == (0, 0, 0, 0), res
    assert res["calls"] > 100, res
