"""H2 — the compile-session flag becomes per-thread.

From torch 2.13 dynamo holds ``torch.compiler._is_compiling_flag`` True for a whole compile session
(``_compile_session_context``), and export sets it too (``_compiling_state_context``). The flag is one
module global, so ``torch.compiler.is_compiling()`` answers True in *other* threads running eager code:
``nn.Module.__call__`` takes its compiled-mode path, flex_attention lifts closures as if traced, warnings
are suppressed. Measured on 2.13: an eager thread saw True in 8.9 M of 60 M polls while another compiled.

The flag is made per-thread the same way as H1: ``is_compiling`` and ``_compile_session_context`` keep
their function objects with code that reads a thread-local, and ``torch.compiler._is_compiling_flag``
reads/writes from other modules (export) go through a property. Threads working on a compile's behalf:
inductor's parallel compile workers are subprocesses and do not read the flag; lazy backward compiles in
autograd engine threads are not inside a compile session upstream either, so nothing is lost.
"""

from __future__ import annotations

from typing import Any

from torch_threadsafe_compile._journal import Changes, run_in_thread
from torch_threadsafe_compile._rewrite import thread_local_global
from torch_threadsafe_compile._torch import compiler_flag_users, loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["compile_session_flag"]

FLAG = "_is_compiling_flag"


def _module() -> Any:
    return loaded(SPEC.modules[0])


def _state_context_template():  # type: ignore[no-untyped-def]
    """The code ``torch._export.utils._compiling_state_context`` runs (a generator: a context manager):
    ``torch.compiler``'s flags redirected while it runs, then upstream's body (``_rewrite._holding``)."""
    return (yield from _ttc_held_is_compiling_flag())  # type: ignore[name-defined]  # noqa: F821


def _functions(mod: Any) -> list[Any]:
    out = [mod.is_compiling]
    ctx = getattr(mod, "_compile_session_context", None)
    if ctx is not None:
        # contextlib.contextmanager keeps the generator function as __wrapped__ and calls that very object.
        out.append(getattr(ctx, "__wrapped__", ctx))
    return out


def check() -> str | None:
    mod = _module()
    if FLAG not in mod.__dict__:
        return f"torch.compiler.{FLAG} not found"
    if not callable(getattr(mod, "is_compiling", None)):
        return "torch.compiler.is_compiling not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    mod = _module()
    # Every thread starts outside a compile (upstream's initial value), also when install() runs while
    # another thread compiles and the global is True for now: that would leave is_compiling() True in every
    # thread for good.
    thread_local_global(changes, mod, FLAG, _functions(mod), default=False, held_by=compiler_flag_users(_state_context_template))
    return {}


def verify() -> None:
    mod = _module()
    tls = mod.__dict__["_ttc_tls_is_compiling_flag"]
    old = tls.value
    tls.value = True
    try:
        if not mod.is_compiling():
            raise AssertionError("is_compiling() does not see this thread's flag")
        if run_in_thread(mod.is_compiling):
            raise AssertionError("another thread sees this thread's compile-session flag")
    finally:
        tls.value = old
    seen = []
    ctx = getattr(mod, "_compile_session_context", None)
    if ctx is not None:
        with ctx():
            seen.append(mod.is_compiling())
            seen.append(run_in_thread(mod.is_compiling))
        if seen != [True, False]:
            raise AssertionError(f"_compile_session_context is not per-thread: {seen}")
