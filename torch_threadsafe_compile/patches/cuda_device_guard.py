"""H3 (crash) — the CUDA device guard is swapped once per process, not at every compile.

On a machine without a GPU, ``FakeTensorMode.__enter__`` (every compile enters it, export too) calls
``torch._C._ensureCUDADeviceGuardSet()``, which on torch's CUDA builds installs a no-op CUDA device-guard
implementation process-wide, so that CUDA kernels can be traced there. When such a call runs while another
thread is running compiled code, the process can die (measured on the 2.11 CUDA build with upstream's
pytorch/pytorch#118260 reproducer, two threads calling a ``dynamic=False`` function with new shapes: a
segmentation fault in 1–5 of every 6–20 runs with and without the package; faulthandler: one thread in
``fake_tensor.py __enter__`` at that call, during a *later* compile, another in an AOT graph's op call).
Calling it once before the threads start gave 6 of 6 clean runs.

This patch replaces ``torch._C._ensureCUDADeviceGuardSet`` (``__enter__`` looks it up at every call) with a
function that calls the original once, under a lock, and does nothing afterwards. The first call comes from
the first ``FakeTensorMode.__enter__`` with ``avoid_device_init`` — the first compile or export of the
process, before any code compiled by dynamo can run anywhere — exactly where torch itself makes it, so it
never initialises anything torch would not. Later calls would install the same no-op implementation again.
"""

from __future__ import annotations

import threading
from typing import Any

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["cuda_device_guard"]

ENSURE = "_ensureCUDADeviceGuardSet"
_lock = threading.Lock()


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it
_done: list[bool] = []


def _ensure_once(original: Any) -> None:
    with _lock:
        if not _done:
            original()
            _done.append(True)


def check() -> str | None:
    ft = loaded(SPEC.modules[0])
    enter = getattr(getattr(ft, "FakeTensorMode", None), "__dict__", {}).get("__enter__")
    if enter is None:
        return "FakeTensorMode.__enter__ not found"
    if ENSURE not in enter.__code__.co_names:
        return f"FakeTensorMode.__enter__ no longer calls torch._C.{ENSURE}"
    if not callable(getattr(loaded("torch")._C, ENSURE, None)):
        return f"torch._C.{ENSURE} not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    torch_c = loaded("torch")._C
    original = getattr(torch_c, ENSURE)

    def _ensureCUDADeviceGuardSet() -> None:
        """Once per process (torch-threadsafe-compile, H3): see patches/cuda_device_guard.py."""
        if not _done:
            _ensure_once(original)

    _ensureCUDADeviceGuardSet.__wrapped__ = original  # type: ignore[attr-defined]
    changes.setattr(torch_c, ENSURE, _ensureCUDADeviceGuardSet)
    return {}


def verify() -> None:
    if getattr(getattr(loaded("torch")._C, ENSURE), "__wrapped__", None) is None:
        raise AssertionError(f"torch._C.{ENSURE} is not replaced")


def report() -> dict[str, Any]:
    return {"device_guard_set": bool(_done)}
