"""Scenarios for free-threaded CPython (3.13t and later, ``PYTHON_GIL=0``), each in a fresh interpreter.

They register on top of the hazard scenarios (``ttc_testing/scenarios/``) and run the same way:

    python -m ttc_testing.freethreaded NAME [key=value ...]

``warm_calls`` is both the reproducer of dynamo's eval-frame shim race (``patches/eval_frame_shim.py``) and
the workload of ``bench/freethreaded.py`` (warm compiled calls per second). With ``TTC_FT_FORCE=1`` every
scenario runs with the free-threading patches applied even where they are not registered yet, e.g.
``TTC_FT_FORCE=1 PYTHON_GIL=0 python -m ttc_testing.freethreaded lookup_race``.
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
__all__ = ["SCENARIOS", "FT_PATCHES", "run", "gil_state", "force_ft_patches"]


def gil_state() -> dict[str, Any]:
    """The build (free-threaded or not) and whether the GIL is on right now."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return {
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "gil_enabled": bool(is_enabled()) if is_enabled is not None else True,
        "python": sys.version.split()[0],
    }


FT_PATCHES = ("eval_frame_shim", "entry_list_order")
_forced: dict[str, str] = {}  # patches force_ft_patches applied in this process (never twice)


def force_ft_patches(force: int = 1) -> dict[str, str]:
    """The state of the free-threading patches (``FT_PATCHES``): as the package's lifecycle left them where
    they are registered; with ``force=1`` applied here where they are not (the package active, the patch not
    registered yet). Forcing imports ``torch._dynamo`` (the patches' module) if it is not imported yet."""
    import torch_threadsafe_compile as ttc

    status = ttc.status()
    if status["activation"] == "disabled":  # the package's word: TTC_DISABLE has several spellings
        return dict.fromkeys(FT_PATCHES, "disabled")
    states = {row["id"]: str(row["state"]) for row in status.get("patches", [])}
    out = {}
    for name in FT_PATCHES:
        if name in states or name in _forced:
            out[name] = states.get(name) or _forced[name]
            continue
        if not force:
            out[name] = "not registered"
            continue
        import importlib

        import torch._dynamo.eval_frame  # noqa: F401 - the patches' module

        from torch_threadsafe_compile._journal import Changes

        patch = importlib.import_module(f"torch_threadsafe_compile.patches.{name}")
        reason = patch.check()
        if reason:
            out[name] = f"skipped: {reason}"
            continue
        patch.apply(Changes(name))
        patch.verify()
        out[name] = _forced[name] = "applied (forced)"
    return out


@scenario
def warm_calls(threads: int = 2, seconds: float = 5.0, backend: str = "aot_eager", force: int = 0,
               size: int = 16) -> dict[str, Any]:
    """``threads`` threads call one warm compiled function (``x * 2 + 1``) for ``seconds``; calls per second,
    errors, frames that ran uncompiled. ``force=1``: apply the free-threading patches here where the package is
    active and they are not registered yet (``force_ft_patches``). Upstream on a free-threaded build without the GIL, two or more threads
    overflow the C stack in dynamo's shim (see ``patches/eval_frame_shim.py``)."""
    import torch
    import torch._dynamo.utils as du

    f = torch.compile(lambda x: x * 2 + 1, backend=backend)
    x = torch.randn(size)
    f(x)  # compiled here, before the threads start: every call below is warm
    patches = force_ft_patches(force)
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
        "ft_patches": patches,
    }


def run(name: str, env: dict[str, str] | None = None, timeout: float = 300, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter (the repository root on its path); its JSON result, or
    ``rc``/``tail``/``timeout`` when it produced none."""
    return selftest.run(name, env=scenarios._env(env), timeout=timeout, module=MODULE, **kwargs)


if __name__ == "__main__":
    # TTC_FT_FORCE=1: any scenario (these and those of ttc_testing/scenarios/) with the free-threading patches forced.
    if os.environ.get("TTC_FT_FORCE") == "1":
        force_ft_patches(1)
    sys.exit(selftest._main(sys.argv[1:], module=MODULE))
