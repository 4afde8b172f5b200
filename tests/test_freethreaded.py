"""Free-threaded CPython (3.13t): the GIL stays off, and warm compiled calls from several threads do not crash.

The tests that need a free-threaded interpreter skip elsewhere; ``.ci/freethreaded.sh`` runs them with
``PYTHON_GIL=0``. Scenarios: ``ttc_testing/freethreaded.py``; the patch: ``patches/eval_frame_shim.py``.
"""

from __future__ import annotations

import sysconfig

import pytest
from conftest import run_py

from ttc_testing import freethreaded

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
needs_ft = pytest.mark.skipif(not FREE_THREADED, reason="needs a free-threaded CPython build (python3.13t)")
GIL_OFF = {"PYTHON_GIL": "0"}


def test_eval_frame_shim_only_on_free_threaded_builds() -> None:
    """With the GIL, dynamo's set_eval_frame runs whole: the patch says so instead of applying."""
    from torch_threadsafe_compile.patches import eval_frame_shim

    assert eval_frame_shim.free_threaded_build() is FREE_THREADED
    if not FREE_THREADED:
        assert "not a free-threaded build" in (eval_frame_shim.check() or "")


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
    Without ``eval_frame_shim`` dynamo's shim recursion killed 2 of 4 such runs (5 threads, 8 s)."""
    for _ in range(2):
        res = freethreaded.run("warm_calls", env=GIL_OFF, timeout=240, threads=threads, seconds=4, shim_lock=1)
        assert "calls" in res, res
        assert res["gil_enabled"] is False, res
        assert res["eval_frame_shim"].startswith("applied"), res
        assert (res["errors"], res["wrong"], res["uncompiled_frames"], res["extra_graphs"]) == (0, 0, 0, 0), res
