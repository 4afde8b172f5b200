"""H1 — the FX tracing flag becomes per-thread.

Upstream (torch ≤ 2.13) keeps ``torch.fx._symbolic_trace._is_fx_tracing_flag`` as one module global.
``Tracer.trace`` sets it for the whole trace, and AOTAutograd's ``make_fx`` traces through ``Tracer.trace``,
so while *one* thread compiles with backward, every *other* thread that calls a compiled function gets
``RuntimeError: Detected that you are using FX to symbolically trace a dynamo-optimized function``
(or, with ``error_on_nested_fx_trace=False``, silently runs it uncompiled). Upstream made the flag
thread-local in 2.14 (``_is_fx_tracing_tls``); this patch backports that behaviour.

How:

* the readers ``is_fx_tracing`` / ``is_fx_symbolic_tracing`` keep their function *objects*; only their code
  is swapped for a copy that reads a thread-local. ``torch.compile()`` wrappers made before we ran hold a
  copy of ``is_fx_symbolic_tracing`` (2.9+; ``is_fx_tracing`` before), dynamo's tables are keyed by these
  functions, and ``torch.export.unflatten`` imports one by name: all keep working and all see the fix;
* ``module._is_fx_tracing_flag`` reads/writes from other modules (``_set_compilation_env`` of eager
  higher-order ops, H5) go to the calling thread's value through a property on the module's class;
* ``Tracer.trace`` (and so ``symbolic_trace``, ``make_fx``, export) sets the calling thread's flag for the
  duration of the call: it keeps its function object (dynamo wraps that very object with ``disable`` on
  import) and gets the code of a same-signature trampoline that sets the flag and calls a copy of the
  original (``_rewrite.scoped_value``; it is too large to recompile cheaply at every ``import torch``).
  What its original code writes to the module global meanwhile is read by nobody.

The legitimate same-thread error — ``fx.symbolic_trace`` of a module that calls a compiled function — stays.
Upstream: pytorch/pytorch#118260 (dynamo is not thread safe); torch 2.14 made the flag thread-local.
"""

from __future__ import annotations

from typing import Any

from torch_threadsafe_compile._journal import Changes, run_in_thread
from torch_threadsafe_compile._rewrite import scoped_value, thread_local_global
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["fx_tracing_flag"]

FLAG = "_is_fx_tracing_flag"
READERS = ("is_fx_tracing", "is_fx_symbolic_tracing")


def _module() -> Any:
    return loaded(SPEC.modules[0])


def _trace_trampoline(self, root, concrete_args=None):  # type: ignore[no-untyped-def]
    """The code ``Tracer.trace`` runs (same signature): the scoped flag, then upstream's body."""
    return _ttc_scoped_trace(self, root, concrete_args)  # type: ignore[name-defined]


def _unwrap(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def check() -> str | None:
    mod = _module()
    if FLAG not in mod.__dict__:
        return f"torch.fx._symbolic_trace.{FLAG} not found"
    if not callable(getattr(mod, "is_fx_tracing", None)):
        return "torch.fx._symbolic_trace.is_fx_tracing not found"
    if not callable(getattr(getattr(mod, "Tracer", None), "trace", None)):
        return "torch.fx.Tracer.trace not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    mod = _module()
    readers = [getattr(mod, n) for n in READERS if callable(getattr(mod, n, None))]
    # Every thread starts untraced (upstream's initial value), even when install() runs while another
    # thread is inside a trace: that trace's original code goes on writing the module global, which nobody
    # reads any more.
    tls = thread_local_global(changes, mod, FLAG, readers, default=False)
    scoped_value(changes, _unwrap(mod.Tracer.__dict__["trace"]), _trace_trampoline, tls, True)
    return {"readers": [f.__name__ for f in readers]}


def _isolated(reader: Any) -> Any:
    """``reader`` over a copy of its module's globals in which ``torch.compiler.is_compiling()`` is False.

    ``is_fx_symbolic_tracing`` is ``flag and not torch.compiler.is_compiling()``: while another thread
    compiles and H2's patch (which applies after this one) is not in place yet, the process-wide compiling
    flag is True, and a check through the real globals would fail for a reason that is not this patch's
    (a late ``install()`` under load did). ``is_fx_tracing`` itself logs upstream's one-time warning.
    """
    import types

    not_compiling = types.SimpleNamespace(compiler=types.SimpleNamespace(is_compiling=lambda: False))
    scope = dict(reader.__globals__, torch=not_compiling)
    return types.FunctionType(reader.__code__, scope, reader.__name__, reader.__defaults__, reader.__closure__)


def verify() -> None:
    mod = _module()
    tls = mod.__dict__["_ttc_tls_is_fx_tracing_flag"]
    old = tls.value
    tls.value = True
    try:
        # Copied after the flag is set: the copy's globals hold the count of threads with the flag set.
        reader = _isolated(getattr(mod, "is_fx_symbolic_tracing", None) or mod.is_fx_tracing)
        if not reader():
            raise AssertionError(f"{reader.__name__}() does not see this thread's flag")
        if run_in_thread(reader):
            raise AssertionError("another thread sees this thread's FX tracing flag")
        if getattr(mod, FLAG) is not True:
            raise AssertionError("module attribute does not read the thread's flag")
    finally:
        tls.value = old
