"""H7 — ``torch.compiler.is_exporting()`` answers for the calling thread only.

``torch.export`` sets ``torch.compiler._is_exporting_flag`` (``torch/_export/utils.py``,
``_compiling_state_context``) for the whole export, and the flag is one module global. Meanwhile, in
every *other* thread, ``torch.compile(fn)`` warns "torch.compile is ignored when called inside
torch.export region" and returns ``fn`` itself: that thread's work then runs uncompiled for good, with
no error. Measured in the soak suite (torch 2.13, one thread exporting while 16 compile).

Same mechanism as H1/H2: ``is_exporting`` keeps its function object with code that reads a
thread-local, and reads/writes of ``torch.compiler._is_exporting_flag`` from other modules (export,
dynamo) go through a property of the module's class.
"""

from __future__ import annotations

from typing import Any

from torch_threadsafe_compile._journal import Changes, ModuleRedirect, run_in_thread
from torch_threadsafe_compile._rewrite import thread_local_global
from torch_threadsafe_compile._torch import compiler_flag_users, loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["export_flag"]

FLAG = "_is_exporting_flag"


def _module() -> Any:
    return loaded(SPEC.modules[0])


def _state_context_template():  # type: ignore[no-untyped-def]
    """The code ``torch._export.utils._compiling_state_context`` runs (a generator: a context manager):
    ``torch.compiler``'s flags redirected while it runs, then upstream's body (``_rewrite._holding``)."""
    return (yield from _ttc_held_is_exporting_flag())  # type: ignore[name-defined]  # noqa: F821


def check() -> str | None:
    mod = _module()
    if FLAG not in mod.__dict__:
        return f"torch.compiler.{FLAG} not found"
    if not callable(getattr(mod, "is_exporting", None)):
        return "torch.compiler.is_exporting not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    mod = _module()
    thread_local_global(changes, mod, FLAG, [mod.is_exporting], held_by=compiler_flag_users(_state_context_template))
    return {}


def verify() -> None:
    mod = _module()
    with ModuleRedirect.of(mod):  # as while torch/_export/utils.py's context runs
        setattr(mod, FLAG, True)  # the way that context sets it
        try:
            if not mod.is_exporting():
                raise AssertionError("is_exporting() does not see this thread's flag")
            if run_in_thread(mod.is_exporting):
                raise AssertionError("another thread sees this thread's export flag")
        finally:
            setattr(mod, FLAG, False)
