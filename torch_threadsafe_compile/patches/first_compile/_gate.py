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

import ast
import functools
import sys
import threading
import types
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._rewrite import rewrite_function
from torch_threadsafe_compile._torch import skip_code
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
    fn = getattr(compile_wrapper, "__wrapped__", None)
    factory = _signature_factory(fn) if module is None else None
    if factory is None:
        gate = _gate_factory(compile_wrapper, key, target)
    else:  # the function's own parameters, defaults included: a call forwards them as they are
        gate = factory(compile_wrapper, key, target)
        gate.__defaults__, gate.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__  # type: ignore[union-attr]
    _transparent(gate, compile_wrapper)
    return gate


def _gate_factory(compile_wrapper: Callable[..., Any], key: types.CodeType | None, target: Any) -> Callable[..., Any]:
    # Bound once: no Python call but the wrapper's own on the warm path (a gate can run under dynamo's active
    # frame callback, inside compiled code, where every Python frame would reach the callback). The names
    # the gate's body uses start with ``ttc_``: the own-signature variants below take the user's parameter
    # names, which must not shadow them (``key`` is flex_attention's).
    ttc_wrapper, ttc_key, ttc_target = compile_wrapper, key, target
    ttc_flights, ttc_await, ttc_land = _flights.flights, _flights.await_others, _flights.land
    ttc_live, ttc_end, ttc_barrier, ttc_tls = _calls.live, _calls.end, _reset.barrier, _calls.stacks

    def ttc_gate(*args: Any, **kwargs: Any) -> Any:
        # Counted for a reset (``_calls.all_stacks``) before this call looks at the reset's barrier (_reset).
        ttc_inside = ttc_tls.stack
        ttc_inside.append(ttc_target)
        try:
            if ttc_barrier.closed:  # a reset is under way: a new call waits for it (bounded)
                ttc_barrier.enter(ttc_inside, ttc_target)
            while True:
                try:
                    return ttc_wrapper(*args, **kwargs)
                except Retry:
                    # This call missed the cache and another thread compiled what it needed: it waits
                    # (bounded) for that thread's compiles of the function still under way, then looks again.
                    # A call whose guards pass never gets here: it never waits (issue 38).
                    if ttc_flights and ttc_key is not None:
                        ttc_await(ttc_key)
        finally:
            ttc_inside.pop()
            if ttc_live:  # the callback made a state for some call: this one's leaves, and its flight lands
                ttc_call = ttc_end(sys._getframe())
                if ttc_call is not None and ttc_call.flight is not None and ttc_key is not None:
                    ttc_land(ttc_key, ttc_call.flight)

    return ttc_gate


# -- gates with the compiled function's own signature ---------------------------------------------------
#
# ``def ttc_gate(*args, **kwargs): ... compile_wrapper(*args, **kwargs)`` packs the arguments into a tuple
# and a dict and unpacks them again: about 40 ns of a warm call (CPython 3.11; a call with the function's
# own parameters is an ordinary one). So for a plain function, the gate gets its parameters: the same
# ``ttc_gate`` body, compiled from this module's source with ``_rewrite`` (proved unchanged first, as for
# torch's functions), one variant per parameter-name list, at most ``MAX_SIGNATURES``; the function's own
# defaults go on the gate. Anything else (methods, modules, ``*args``/``**kwargs``, a name the body uses,
# a source that cannot be read) gets the generic gate above.

MAX_SIGNATURES = 64
_factories: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], Callable[..., Any] | None] = {}
_factories_lock = threading.Lock()  # a leaf lock


@_forksafe.in_child
def _after_fork() -> None:
    global _factories_lock
    _factories_lock = threading.Lock()  # a thread of the parent may have held it while making a factory


class _OwnSignature(ast.NodeTransformer):
    """``ttc_gate``'s parameters and its call of dynamo's wrapper (``ttc_wrapper``) become the given names."""

    def __init__(self, posonly: tuple[str, ...], args: tuple[str, ...], kwonly: tuple[str, ...]) -> None:
        self.posonly, self.args, self.kwonly = posonly, args, kwonly
        self.hits = 0

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        if node.name == "ttc_gate":
            self.hits += 1
            node.args = ast.arguments(
                posonlyargs=[ast.arg(arg=n) for n in self.posonly], args=[ast.arg(arg=n) for n in self.args],
                vararg=None, kwonlyargs=[ast.arg(arg=n) for n in self.kwonly], kw_defaults=[None] * len(self.kwonly),
                kwarg=None, defaults=[])
            node.returns = None
        self.generic_visit(node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "ttc_wrapper":
            self.hits += 1
            node.args = [ast.Name(id=n, ctx=ast.Load()) for n in self.posonly + self.args]
            node.keywords = [ast.keyword(arg=n, value=ast.Name(id=n, ctx=ast.Load())) for n in self.kwonly]
        return node


def _signature_factory(fn: Any) -> Callable[..., Any] | None:
    """A gate factory with ``fn``'s parameters, or None (the generic gate)."""
    code = getattr(fn, "__code__", None)
    if type(fn) is not types.FunctionType or not isinstance(code, types.CodeType) or code.co_flags & 0x0C:
        return None  # not a plain function, or it takes *args / **kwargs
    n_pos, n_kw = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames[: n_pos + n_kw]
    if set(names) & _GATE_NAMES:
        return None  # a parameter would shadow a name the gate's body uses
    sig = (names[: code.co_posonlyargcount], names[code.co_posonlyargcount : n_pos], names[n_pos:])
    with _factories_lock:
        if sig in _factories:
            return _factories[sig]
        if len(_factories) >= MAX_SIGNATURES:
            return None
    factory = _compile_factory(*sig)
    with _factories_lock:
        return _factories.setdefault(sig, factory)


def _compile_factory(posonly: tuple[str, ...], args: tuple[str, ...], kwonly: tuple[str, ...]) -> Callable[..., Any] | None:
    try:
        code = rewrite_function(_gate_factory, _OwnSignature(posonly, args, kwonly), "ttc_gate")  # type: ignore[arg-type]
    except Exception:  # source not readable or not ours any more: the generic gate, always correct
        return None
    gate_code = next(c for c in code.co_consts if getattr(c, "co_name", None) == "ttc_gate")
    _calls.add_gate_code(gate_code, main=True)
    skip_code(gate_code)  # dynamo runs it as it is (see the patch's apply)
    return types.FunctionType(code, _gate_factory.__globals__, "_gate_factory")


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
    live, end, tls = _calls.live, _calls.end, _calls.stacks

    def ttc_resume_gate(*args: Any, **kwargs: Any) -> Any:
        inside = tls.stack
        inside.append(None)
        try:
            while True:
                try:
                    return resume_fn(*args, **kwargs)
                except Retry:
                    pass
        finally:
            inside.pop()
            if live:
                end(sys._getframe())

    if wraps:
        functools.update_wrapper(ttc_resume_gate, resume_fn)
    inline_as(ttc_resume_gate, resume_fn)
    ttc_resume_gate._ttc_gate = True  # type: ignore[attr-defined]
    return ttc_resume_gate


def inline_as(gate: Callable[..., Any], fn: Callable[..., Any]) -> None:
    """Dynamo traces ``fn`` where it meets a call of ``gate`` while tracing: never the gate's own body.

    A continuation is not only called from compiled code. From torch 2.13 a graph break inside an inlined
    call makes nested continuations: the outer one receives the inner ones (``__nested_resume_fns``, loaded
    from the globals the gates replace) and calls them from its own body, which dynamo traces when it
    compiles the outer one. Traced, the gate's bookkeeping (``sys._getframe``) is a graph break inside the
    gate, whose continuation calls the gate again: endless recursion (issue 37: 10 upstream tests of
    ``dynamo/test_misc.py``/``test_repros.py`` failed with RecursionError). ``_torchdynamo_inline`` is how
    dynamo's own ``compile_wrapper`` tells its tracer which function to inline in its place
    (``WrapperUserFunctionVariable``, every supported release): the tracer then sees upstream's function.
    """
    gate._torchdynamo_inline = fn  # type: ignore[attr-defined]


# The code objects of the two generic gates: dynamo's callback recognises a gated call by them (and by the
# own-signature variants, ``_calls.add_gate_code``).
GATE_CODE = next(c for c in _gate_factory.__code__.co_consts if getattr(c, "co_name", None) == "ttc_gate")
# Every name the gate's body uses: a parameter of that name would change what the body means.
_GATE_NAMES = frozenset(GATE_CODE.co_names + GATE_CODE.co_freevars + GATE_CODE.co_varnames) - {"args", "kwargs"}
RESUME_GATE_CODE = next(c for c in make_resume_gate.__code__.co_consts if getattr(c, "co_name", None) == "ttc_resume_gate")
_calls.add_gate_code(GATE_CODE, main=True)
_calls.add_gate_code(RESUME_GATE_CODE, main=False)
