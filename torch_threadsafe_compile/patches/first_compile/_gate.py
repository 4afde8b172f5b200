"""The gate: a thin, transparent wrapper around what ``torch.compile()`` returns.

``torch.compile()`` (every ``_TorchDynamoContext.__call__`` that returns dynamo's ``compile_wrapper``, so
``torch.compile(module)``, ``module.compile()``, decorators and torch's own internal compiles) gets a gate
around the wrapper (``functools.wraps``: same name, signature, ``__wrapped__``, dynamo's attributes). A warm
call never reaches dynamo's frame callback, so its only cost is the gate's own Python call and three
tests of module state that is empty or false while nothing compiles or resets (on free-threaded builds
also a push and a pop: ``_calls``). A call whose first frame the callback finds in the cache
after all is answered with :class:`Retry`, and the gate calls again; a call that compiled something lands
its flight when it returns.

A plain function, not ``wrapt``: this is the hot path of every compiled call, and a ``FunctionWrapper``
adds a layer of calls; ``functools.update_wrapper`` gives the same transparency here (docs/architecture.md).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

from torch_threadsafe_compile.patches.first_compile import _calls, _flights, _reset
from torch_threadsafe_compile.patches.first_compile._calls import ModuleTarget, Retry


def target_of(compile_wrapper: Callable[..., Any]) -> tuple[types.CodeType | None, Any]:
    """``(key, module)``: the code object dynamo's callback sees as the first frame of calls through
    ``compile_wrapper``, and the ``nn.Module`` whose call plumbing runs before it (or None).

    ``torch.compile(fn)``: ``fn``'s code. ``torch.compile(module)`` / ``module.compile()`` wrap the module's
    ``__call__`` / ``_call_impl``, and the first frame is its ``forward``. Anything else: key None (the gate
    still retries, but its callers do not wait for each other's flights).
    """
    fn = getattr(compile_wrapper, "__wrapped__", None)
    func = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    nn_module = sys.modules.get("torch.nn.modules.module")
    module = None
    if (
        owner is not None
        and nn_module is not None
        and isinstance(owner, nn_module.Module)
        and getattr(func, "__name__", None) in ("_call_impl", "_wrapped_call_impl", "__call__")
    ):
        module = owner
        try:
            fwd = owner.forward
        except Exception:
            return None, module
        func = getattr(fwd, "__func__", fwd)
    code = getattr(func, "__code__", None)
    return (code if isinstance(code, types.CodeType) else None), module


def make_gate(compile_wrapper: Callable[..., Any]) -> Callable[..., Any]:
    key, module = target_of(compile_wrapper)
    # What the frame callback reads from the gate's frame (``_calls.state``): the key, or for a module its
    # (key, module) pair, made once per gate.
    target = key if module is None else ModuleTarget(key, module)
    # Bound once: no Python call but the wrapper's own on the warm path (a gate can run under dynamo's active
    # frame callback, inside compiled code, where every Python frame would reach the callback).
    flights, await_others, land, live, end = _flights.flights, _flights.await_others, _flights.land, _calls.live, _calls.end
    barrier, counted, tls = _reset.barrier, _calls.COUNTED, _calls.stacks

    def ttc_gate(*args: Any, **kwargs: Any) -> Any:
        # Free-threaded builds only: count the call for the reset before looking at its barrier (_reset).
        inside = tls.stack if counted else None
        if inside is not None:
            inside.append(target)
        if barrier.closed:  # a reset is under way: a new call waits for it (bounded)
            barrier.enter(inside, target)
        try:
            while True:
                if flights and key is not None:
                    await_others(key)
                try:
                    return compile_wrapper(*args, **kwargs)
                except Retry:
                    pass
        finally:
            if inside is not None:
                inside.pop()
            if live:  # the callback made a state for some call: this one's leaves, and its flight lands
                call = end(sys._getframe())
                if call is not None and call.flight is not None and key is not None:
                    land(key, call.flight)

    _transparent(ttc_gate, compile_wrapper)
    return ttc_gate


def _transparent(gate: Callable[..., Any], compile_wrapper: Callable[..., Any]) -> None:
    """The gate looks like dynamo's wrapper: name, docs, signature and dynamo's attributes; ``__wrapped__``
    is the user's function, as on dynamo's wrapper; and dynamo recognises the gate as one of its own wrappers
    (``_torchdynamo_wrapper_id``), so ``torch.compile(torch.compile(fn))`` unwraps it as upstream does."""
    functools.update_wrapper(gate, compile_wrapper)
    gate.__wrapped__ = getattr(compile_wrapper, "__wrapped__", compile_wrapper)  # type: ignore[attr-defined]
    if hasattr(compile_wrapper, "_torchdynamo_wrapper_id"):
        gate._torchdynamo_wrapper_id = id(gate)  # type: ignore[attr-defined]
    gate._ttc_gate = True  # type: ignore[attr-defined]
    gate._ttc_compile_wrapper = compile_wrapper  # type: ignore[attr-defined]


def make_resume_gate(resume_fn: Callable[..., Any], wraps: bool = True) -> Callable[..., Any]:
    """A gate in front of a graph-break continuation: retried like a gated call, flown as part of the
    enclosing ``torch.compile`` call."""
    live, end, counted, tls = _calls.live, _calls.end, _calls.COUNTED, _calls.stacks

    def ttc_resume_gate(*args: Any, **kwargs: Any) -> Any:
        inside = tls.stack if counted else None
        if inside is not None:
            inside.append(None)
        try:
            while True:
                try:
                    return resume_fn(*args, **kwargs)
                except Retry:
                    pass
        finally:
            if inside is not None:
                inside.pop()
            if live:
                end(sys._getframe())

    if wraps:
        functools.update_wrapper(ttc_resume_gate, resume_fn)
    ttc_resume_gate._ttc_gate = True  # type: ignore[attr-defined]
    return ttc_resume_gate


# The code objects of the two gates: dynamo's callback recognises a gated call by them.
GATE_CODE = next(c for c in make_gate.__code__.co_consts if getattr(c, "co_name", None) == "ttc_gate")
RESUME_GATE_CODE = next(c for c in make_resume_gate.__code__.co_consts if getattr(c, "co_name", None) == "ttc_resume_gate")
_calls.MAIN_CODES.append(GATE_CODE)
_calls.RESUME_CODES.append(RESUME_GATE_CODE)
