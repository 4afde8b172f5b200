"""Scenarios for free-threaded CPython (3.13t and later, ``PYTHON_GIL=0``), each in a fresh interpreter.

They register on top of the hazard scenarios (``ttc_testing/scenarios.py``) and run the same way:

    python -m ttc_testing.freethreaded NAME [key=value ...]

``warm_calls`` is both the reproducer of dynamo's eval-frame shim race (``patches/eval_frame_shim.py``) and
the workload of ``bench/freethreaded.py`` (warm compiled calls per second).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from typing import Any

from torch_threadsafe_compile import selftest
from ttc_testing import scenarios
from ttc_testing.scenarios import SCENARIOS, scenario

MODULE = "ttc_testing.freethreaded"
__all__ = ["SCENARIOS", "run", "gil_state", "shim_patch_state"]


def gil_state() -> dict[str, Any]:
    """The build (free-threaded or not) and whether the GIL is on right now."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return {
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "gil_enabled": bool(is_enabled()) if is_enabled is not None else True,
        "python": sys.version.split()[0],
    }


def shim_patch_state(force: int) -> str:
    """The state of ``eval_frame_shim``: applied by the package's lifecycle where it is registered; with
    ``force=1`` applied here where it is not (the package active, the patch not registered yet)."""
    if os.environ.get("TTC_DISABLE"):
        return "disabled"
    import torch_threadsafe_compile as ttc

    for row in ttc.status().get("patches", []):
        if row["id"] == "eval_frame_shim":
            return str(row["state"])
    if not force:
        return "not registered"
    import torch._dynamo.eval_frame  # noqa: F401 - the patch's module

    from torch_threadsafe_compile._patching import Changes
    from torch_threadsafe_compile.patches import eval_frame_shim

    reason = eval_frame_shim.check()
    if reason:
        return f"skipped: {reason}"
    eval_frame_shim.apply(Changes("eval_frame_shim"))
    eval_frame_shim.verify()
    return "applied (forced)"


@scenario
def warm_calls(threads: int = 2, seconds: float = 5.0, backend: str = "aot_eager", shim_lock: int = 0,
               size: int = 16) -> dict[str, Any]:
    """``threads`` threads call one warm compiled function (``x * 2 + 1``) for ``seconds``; calls per second,
    errors, frames that ran uncompiled. ``shim_lock=1``: apply ``eval_frame_shim`` here if the package is active
    and the patch is not registered. Upstream on a free-threaded build without the GIL, two or more threads
    overflow the C stack in dynamo's shim (see ``patches/eval_frame_shim.py``)."""
    import torch
    import torch._dynamo.utils as du

    f = torch.compile(lambda x: x * 2 + 1, backend=backend)
    x = torch.randn(size)
    f(x)  # compiled here, before the threads start: every call below is warm
    shim = shim_patch_state(shim_lock)
    graphs = int(du.counters["stats"]["unique_graphs"])
    counts = [0] * threads
    errors: list[str] = []
    wrong = [0]
    want = x * 2 + 1
    go = threading.Barrier(threads + 1)
    stop = [0.0]

    def worker(i: int) -> None:
        go.wait()
        n = 0
        try:
            while time.monotonic() < stop[0]:
                out = f(x)
                n += 1
                if n % 1024 == 0 and not torch.equal(out, want):
                    wrong[0] += 1
        except Exception as e:  # counted; the run goes on in the other threads
            errors.append(f"{type(e).__name__}: {str(e)[:120]}")
        counts[i] = n

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    stop[0] = time.monotonic() + seconds
    t0 = time.monotonic()
    go.wait()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    return {
        **gil_state(),
        "threads": threads,
        "calls": sum(counts),
        "calls_per_s": round(sum(counts) / wall),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "wrong": wrong[0],
        "extra_graphs": int(du.counters["stats"]["unique_graphs"]) - graphs,
        "uncompiled_frames": selftest._uncompiled_frames(),
        "eval_frame_shim": shim,
    }


def run(name: str, env: dict[str, str] | None = None, timeout: float = 300, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter (the repository root on its path); its JSON result, or
    ``rc``/``tail``/``timeout`` when it produced none."""
    return selftest.run(name, env=scenarios._env(env), timeout=timeout, module=MODULE, **kwargs)


if __name__ == "__main__":
    sys.exit(selftest._main(sys.argv[1:], module=MODULE))
