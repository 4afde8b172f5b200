"""H7 — while ``torch.export`` overrides process-global kernels, compiles wait (dynamo's ``compile_lock``).

During its ATen-level tracing an export changes process-global state: it overrides the Python kernels of
CompositeImplicitAutograd operators and registers fake-tensor rules for them
(``torch.export.exported_program._override_composite_implicit_decomp``: ``op.py_kernels``) and switches the
mkldnn/nnpack/cudnn backends off (``torch.export._trace._ignore_backend_decomps``). A compile running in
another thread at the same time dispatches through those overrides and fails, e.g. ``BackendCompilerFailed:
RuntimeError: Unable to cast NotImplemented to Tensor`` (measured on torch 2.13: 10–31 failed compiles in
8 s with one thread exporting in a loop; 0 with this patch; on every version 2.4–2.15 in docs/compat.md).

The patch makes exactly those two context managers hold dynamo's ``compile_lock`` while they are active,
so the overrides and compiles take turns, as compiles already do with each other. The rest of an export
(dynamo capture, which takes the lock itself; verification; building the ExportedProgram) runs beside
compiles as upstream. No new lock is introduced, and an export traces on fake tensors as a compile does
and never waits for the autograd engine while it holds the lock, so no new lock order appears either.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

from torch_threadsafe_compile._journal import Capability, Changes
from torch_threadsafe_compile._torch import compile_lock, compile_lock_first, present_callables
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["export_lock"]

# (module, context manager) pairs that change process-global state for their duration.
TARGETS = (
    ("torch.export.exported_program", "_override_composite_implicit_decomp"),
    ("torch.export._trace", "_ignore_backend_decomps"),
)


def _present() -> list[tuple[Any, str]]:
    return present_callables(TARGETS)


def check() -> str | None:
    if not _present():
        return "none of " + ", ".join(f"{m}.{a}" for m, a in TARGETS) + " found"
    if compile_lock() is None:
        return "torch._dynamo.convert_frame.compile_lock not found"
    return None


def _locked(original: Callable[..., Any], priority: Capability) -> Callable[..., Any]:
    @functools.wraps(original)
    @contextlib.contextmanager
    def held(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with compile_lock_first(priority):  # ahead of compiles that do not hold the lock yet (see watchdog)
            with original(*args, **kwargs) as value:
                yield value

    return held


def apply(changes: Changes) -> dict[str, Any]:
    # The modules call these by their global name at call time, so replacing the attribute reaches them.
    wrapped = []
    priority = changes.require("compile_lock.priority")  # ahead of queued compiles, while the watchdog provides it
    for mod, attr in _present():
        changes.setattr(mod, attr, _locked(getattr(mod, attr), priority))
        wrapped.append(f"{mod.__name__}.{attr}")
    return {"wrapped": wrapped}


def verify() -> None:
    for mod, attr in _present():
        fn = getattr(mod, attr)
        if getattr(fn, "__wrapped__", None) is None:
            raise AssertionError(f"{mod.__name__}.{attr} is not wrapped")
