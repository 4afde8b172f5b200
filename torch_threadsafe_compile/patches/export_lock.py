"""H7 — ``torch.export`` runs under dynamo's ``compile_lock``, like a compile.

An export changes process-global state for its whole duration: it overrides the Python kernels of
CompositeImplicitAutograd operators (``_override_composite_implicit_decomp``: ``op.py_kernels``, fake
tensor rules) and switches the mkldnn/nnpack/cudnn backends off (``_ignore_backend_decomps``). A
compile running in another thread at the same time dispatches through those overrides and fails, e.g.
``BackendCompilerFailed: RuntimeError: Unable to cast NotImplemented to Tensor`` (measured on torch
2.13: ~50 failed compiles in 15 s with one thread exporting in a loop; 0 with this patch).

The patch makes ``torch.export._trace._export`` (behind ``torch.export.export``) hold dynamo's
``compile_lock``, so exports and compiles take turns, as compiles already do with each other. A strict
export runs dynamo inside, which takes the same (re-entrant) lock. No new lock is introduced, and an
export runs the model on fake tensors as a compile does, so no new lock order appears either.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch_threadsafe_compile._patching import Changes
from torch_threadsafe_compile.registry import PatchSpec

SPEC = PatchSpec(
    id="export_lock",
    hazard="H7",
    summary="torch.export holds dynamo's compile_lock, so compiles never see its global overrides",
    upstream="pytorch/pytorch#105943 (PT2 is not thread safe); export patches op.py_kernels process-wide",
    torch_versions=">=2.4",
    modules=("torch.export._trace", "torch._dynamo.convert_frame"),
    tested="2.11.0, 2.13.0",
)


def _module() -> Any:
    return sys.modules["torch.export._trace"]


def check() -> str | None:
    if not callable(getattr(_module(), "_export", None)):
        return "torch.export._trace._export not found"
    if getattr(sys.modules["torch._dynamo.convert_frame"], "compile_lock", None) is None:
        return "torch._dynamo.convert_frame.compile_lock not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    mod = _module()
    original = mod._export
    cf = sys.modules["torch._dynamo.convert_frame"]

    @functools.wraps(original)
    def _export(*args: Any, **kwargs: Any) -> Any:
        with cf.compile_lock:  # read at call time: compile_lock_watchdog may have wrapped it
            return original(*args, **kwargs)

    changes.setattr(mod, "_export", _export)
    return {}


def verify() -> None:
    fn = _module()._export
    if getattr(fn, "__wrapped__", None) is None:
        raise AssertionError("torch.export._trace._export is not wrapped")
