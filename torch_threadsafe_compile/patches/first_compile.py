"""H3 — one compile per guard set, however many threads arrive at once.

Upstream, dynamo's frame callback runs on every cache miss and queues on the global ``compile_lock``;
a thread that waited there does not look again at the cache once it gets the lock, so N threads making
the same first call compile the same graph N times (measured: 8 threads → 8 compiles on an H200), and
past ``recompile_limit`` the rest run *uncompiled* with an "Unexpected recompilation" warning — for
flex_attention, the unfused O(S²) path.

A second upstream race makes threads recompile entries that *are* cached: dynamo's C ``lookup()`` walks a
code object's entry list and runs each entry's root guard manager, whose ``check`` releases the GIL to
take its mutex; meanwhile a hit in another thread moves an entry to the front of the list
(``move_to_front``), and the walking thread never reaches it (a *spurious miss*; dynamo then logs
"Unexpected recompilation: runtime guards failed even though they passed during recompilation-reason
analysis"). Measured: 16 threads calling with inputs whose guard sets were all compiled beforehand,
4–8 extra graphs and 8–14 uncompiled frames in 6 s (torch 2.13). Upstream reworked the lookup after 2.15
(pytorch/pytorch#195355).

This patch makes the threads look again:

* ``torch.compile()`` (every ``_TorchDynamoContext.__call__`` that returns dynamo's ``compile_wrapper``,
  so ``torch.compile(module)``, ``module.compile()``, decorators and torch's own internal compiles) gets
  a thin, transparent *gate* around the wrapper (``functools.wraps``: same name, signature,
  ``__wrapped__``, dynamo attributes). Warm calls never reach the callback, so their only cost is the
  gate's Python call;
* the frame callback (``convert_frame.CatchErrorsWrapper.__call__``, patched on the class so callbacks
  built before activation are covered) recognises the *top* frame of a gated call — the frame whose
  caller is ``compile_wrapper`` called by the gate. For it, it checks the guards (and backend) of the
  cache entries that exist now, first without ``compile_lock`` (a spurious miss) and then holding it
  (another thread compiled what this one needs while it waited); if one passes it raises a private retry
  signal instead of compiling. The frame has not started executing, so the gate calls again and
  dynamo's C lookup hits. Dynamo inserts a new entry only after the callback returned (after the lock
  was released), so a fresh compile result counts as cached for ``PENDING_S``;
* a gated call retries at most ``MAX_RETRIES`` times, then compiles as upstream would (a safety net for
  an entry that passes here but that the C lookup would still reject);
* ``torch.compile(module)`` and ``module.compile()`` reach the compiled ``forward`` through ``nn.Module``'s
  call plumbing (and fx_patcher's dispatcher while a trace has ``Module.__call__`` patched); on its
  hook-free fast path nothing runs before ``forward``, so that frame counts as the top frame too. With
  forward (pre-)hooks registered, the hooks would run twice on a retry: such calls compile as upstream;
* graph-break continuations are called from compiled code, so the gate cannot retry them. Dynamo stores
  each as a global of the compiled function's module (``__resume_at_<offset>``, loaded by name at the
  call), or, when it needs a closure, as a factory global (torch >= 2.12) or a code constant of the
  compiled code (before 2.12). Each gets a retrying gate in its place: the global, the factory's result,
  or a trampoline swapped in by a dynamo bytecode hook. A continuation frame is then the top frame of a
  gated call;
* other inner frames (functions called from compiled code that dynamo compiles on their own) cannot be
  retried. A gated call that compiles anything is a *flight* of its function until the call returns;
  other threads entering the gate of the same function (same top code object, so per-thread
  ``torch.compile(module copy)`` counts as one function) wait for the flight to land before they call,
  holding no lock. The wait lasts while the flight compiles (upstream would wait for ``compile_lock`` as
  long) and at most ``FOLLOW_FACTOR`` times its compile time after that (1 s … ``FOLLOW_MAX_S``), at most
  ``COMPILE_WAIT_MAX_S`` in all; a thread that holds ``compile_lock`` (compiling, exporting) never waits.

Besides a leaf lock for the flight table (nothing is acquired while it is held), no new lock is
introduced: ``compile_lock`` is dynamo's own RLock, taken a few lines earlier than upstream, so no new lock
order can deadlock. A compile that raises releases the lock on the way out and the error reaches that
caller; the waiting threads then find no matching entry and compile themselves (each gets the same error
if it is deterministic). ``KeyboardInterrupt``/``SystemExit`` unwind the same way.

Functions compiled *before* an explicit ``install()`` have no gate: they keep upstream behaviour for H3.
"""

from __future__ import annotations

import builtins
import functools
import os
import sys
import threading
import time
import types
from typing import Any, Callable

from torch_threadsafe_compile._patching import Changes
from torch_threadsafe_compile.registry import PatchSpec

SPEC = PatchSpec(
    id="first_compile",
    hazard="H3",
    summary="threads that need the same graph wait for one compile instead of compiling it again",
    upstream="pytorch/pytorch#118260, #136833 (thread safety of torch.compile); compile_lock only queues compiles",
    torch_versions=">=2.4",
    modules=("torch._dynamo.eval_frame", "torch._dynamo.convert_frame"),
    after=("compile_lock_watchdog",),
    tested="2.11.0, 2.13.0",
)

# A retry is only raised when an entry whose guards (and backend) pass is in the cache, so retries end as
# soon as dynamo's lookup sees it; the bound is a safety net for an entry that passes here but that the
# C lookup would still reject. Spurious misses (see the module docstring) rarely repeat more than twice.
MAX_RETRIES = 16
PENDING_S = 2.0  # how long a compile result counts as in the cache before dynamo has inserted it
CALL_RESUME = "__torch_threadsafe_compile_call_resume__"  # builtins name the closure trampolines call
# Bounds of the wait for another thread's flight (see the module docstring): after its last compile
# ended, at most FOLLOW_FACTOR x its compile time (at least 1 s, at most FOLLOW_MAX_S); in all, at most
# COMPILE_WAIT_MAX_S. A thread that is itself compiling (a backend that runs compiled code) never waits.
FOLLOW_FACTOR = 4.0
FOLLOW_MAX_S = 10.0
COMPILE_WAIT_MAX_S = 60.0


class _Retry(BaseException):
    """Private signal from the frame callback to the gate: the cache now has what this call needs.

    A BaseException so that no ``except Exception`` between the callback and the gate swallows it.
    """


def _find_nested_code(owner: type, names: tuple[str, ...]) -> types.CodeType | None:
    """The code object of the wrapper function that ``_TorchDynamoContext.__call__`` creates."""
    for attr in ("__call__", "_call", "_get_compile_wrapper"):
        fn = owner.__dict__.get(attr)
        code = getattr(fn, "__code__", None)
        stack = [code] if code is not None else []
        while stack:
            c = stack.pop()
            for const in c.co_consts:
                if isinstance(const, types.CodeType):
                    if const.co_name in names:
                        return const
                    stack.append(const)
    return None


class _Stats:
    """Per compiled code object: compiles, calls served by another thread's compile, waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_code: dict[str, dict[str, Any]] = {}

    @staticmethod
    def key(code: types.CodeType) -> str:
        return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"

    def record(self, code: types.CodeType, what: str, waited: float) -> None:
        with self._lock:
            row = self.by_code.setdefault(
                self.key(code), {"compiles": 0, "served_by_other_thread": 0, "lookup_retries": 0, "waits": 0, "wait_s_total": 0.0, "wait_s_max": 0.0}
            )
            row[what] += 1
            if waited > 1e-3:
                row["waits"] += 1
                row["wait_s_total"] = round(row["wait_s_total"] + waited, 4)
                row["wait_s_max"] = round(max(row["wait_s_max"], waited), 4)


stats = _Stats()
_state: dict[str, Any] = {}
# code object -> (thread ident, id of that thread's gate frame, compile seconds) of a first call in flight.


class _Flight:
    """A gated call, in one thread, that compiled something: its function's other callers wait for it."""

    __slots__ = ("owner", "gate_frame_id", "landed", "compiling", "compile_s", "idle_since")

    def __init__(self, gate_frame_id: int) -> None:
        self.owner = threading.get_ident()
        self.gate_frame_id = gate_frame_id
        self.landed = threading.Event()
        self.compiling = 0  # callbacks of this flight under way
        self.compile_s = 0.0
        self.idle_since = time.monotonic()


# top code object of a gated function -> its flights. Non-empty only while first calls are under way,
# so the gate's warm path pays one truthiness test. _flights_lock is a leaf lock: nothing else is
# acquired while it is held.
_flights: dict[types.CodeType, list[_Flight]] = {}
_flights_lock = threading.Lock()


# Set while this thread runs the flight bookkeeping below. These helpers can run under an active dynamo
# callback (a gated function called from compiled code), so the frames they create (threading's Event,
# Condition) reach the frame callback; it must not re-enter the bookkeeping (the leaf lock is held).
_internal = threading.local()


def _takeoff(key: types.CodeType, gate_frame_id: int) -> _Flight:
    """The flight of this thread's gated call (frame ``gate_frame_id``), created on its first compile."""
    me = threading.get_ident()
    _internal.busy = True
    try:
        with _flights_lock:
            flights = _flights.setdefault(key, [])
            for fl in flights:
                if fl.owner == me and fl.gate_frame_id == gate_frame_id:
                    return fl
            fl = _Flight(gate_frame_id)
            flights.append(fl)
            return fl
    finally:
        _internal.busy = False


def _land(key: Any, gate_frame: Any) -> None:
    """The gated call in ``gate_frame`` returned (or raised): its flight, if any, lands."""
    me, fid = threading.get_ident(), id(gate_frame)
    landed = []
    _internal.busy = True
    try:
        with _flights_lock:
            flights = _flights.get(key)
            if not flights:
                return
            rest = []
            for fl in flights:  # no comprehension: one frame less under a possibly active callback
                (landed if fl.owner == me and fl.gate_frame_id == fid else rest).append(fl)
            if not landed:
                return
            if rest:
                _flights[key] = rest
            else:
                del _flights[key]
        for fl in landed:
            fl.landed.set()
    finally:
        _internal.busy = False


# Per thread: how many dynamo callbacks (compiles) are under way in this thread. A compiling thread holds
# (or is about to take) compile_lock, and so does an exporting or FX-tracing one: none of them may wait for
# another thread's flight, which may need the lock.
_compiling = threading.local()


def _holds_compile_lock() -> bool:
    """Whether this thread holds dynamo's compile_lock (a compile, an export, an FX trace)."""
    cf = sys.modules.get("torch._dynamo.convert_frame")
    is_owned = getattr(getattr(cf, "compile_lock", None), "_is_owned", None)
    return bool(is_owned()) if callable(is_owned) else False


def _await_flights(key: Any) -> float:
    """Wait (bounded, no lock held) until other threads' flights of ``key`` have landed; seconds waited."""
    flights = _flights.get(key)
    if not flights or getattr(_compiling, "depth", 0) or _holds_compile_lock():
        return 0.0
    me = threading.get_ident()
    t0 = time.monotonic()
    _internal.busy = True
    try:
        for fl in list(flights):
            if fl.owner == me:
                continue
            while not fl.landed.wait(0.02):
                now = time.monotonic()
                if now - t0 > COMPILE_WAIT_MAX_S:
                    return now - t0
                if not fl.compiling and now - fl.idle_since > min(FOLLOW_MAX_S, max(1.0, FOLLOW_FACTOR * fl.compile_s)):
                    break
        return time.monotonic() - t0
    finally:
        _internal.busy = False


# Code objects dynamo must run as they are when a gated call happens inside compiled code.
_HELPER_CODES = (_takeoff.__code__, _land.__code__, _await_flights.__code__, _holds_compile_lock.__code__, _Flight.__init__.__code__)


def _gate_key(compile_wrapper: Callable[..., Any]) -> types.CodeType | None:
    """The code object dynamo's callback sees as the top frame of calls through ``compile_wrapper``.

    ``torch.compile(fn)``: ``fn``'s code. ``torch.compile(module)`` / ``module.compile()`` wrap the
    module's ``__call__`` / ``_call_impl``, and the top frame is its ``forward``. Anything else (None):
    the gate still retries, but its callers do not wait for each other's flights.
    """
    fn = getattr(compile_wrapper, "__wrapped__", None)
    func = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    nn_module = sys.modules.get("torch.nn.modules.module")
    if (
        owner is not None
        and nn_module is not None
        and isinstance(owner, nn_module.Module)
        and getattr(func, "__name__", None) in ("_call_impl", "_wrapped_call_impl", "__call__")
    ):
        try:
            fwd = owner.forward
        except Exception:
            return None
        func = getattr(fwd, "__func__", fwd)
    code = getattr(func, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def _cache_entry_lister() -> Callable[[types.CodeType], list[Any]] | None:
    """The C function listing a code object's cache entries. Reached as an attribute: on torch 2.4
    ``torch._C._dynamo.eval_frame`` is not registered in ``sys.modules``."""
    import torch

    ef = getattr(getattr(getattr(torch, "_C", None), "_dynamo", None), "eval_frame", None)
    fn = getattr(ef, "_debug_get_cache_entry_list", None)
    return fn if callable(fn) else None


def _modules() -> tuple[Any, Any]:
    return sys.modules["torch._dynamo.eval_frame"], sys.modules["torch._dynamo.convert_frame"]


def _entry_checker(entry: Any) -> Callable[[dict[str, Any]], Any] | None:
    gm = getattr(entry, "guard_manager", None)
    if gm is not None and hasattr(gm, "check"):
        return gm.check
    fn = getattr(entry, "check_fn", None)  # torch 2.4/2.5: a GuardManager wrapper with .check, or a callable
    if fn is not None and hasattr(fn, "check"):
        return fn.check
    return fn if callable(fn) else None


_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")


def _hook_free(module: Any, module_globals: dict[str, Any]) -> bool:
    """True when ``Module._call_impl`` takes its fast path (no hook can have run before ``forward``)."""
    if module is None:
        return False
    if any(getattr(module, a, None) for a in _HOOK_ATTRS):
        return False
    return not any(module_globals.get(g) for g in _GLOBAL_HOOKS)


def _backend_of(callback: Any) -> Any:
    """The backend dynamo's C lookup compares cache entries against (``get_backend`` in eval_frame)."""
    seen = 0
    while hasattr(callback, "_torchdynamo_orig_backend") and seen < 32:
        callback, seen = callback._torchdynamo_orig_backend, seen + 1
    return callback


def _same_backend(saved: Any, backend: Any) -> bool:
    if saved is backend:
        return True
    try:
        return type(saved) is type(backend) and bool(saved == backend)
    except Exception:
        return False


def check() -> str | None:
    ef, cf = _modules()
    ctx = getattr(ef, "_TorchDynamoContext", None)
    if ctx is None or "__call__" not in ctx.__dict__:
        return "eval_frame._TorchDynamoContext.__call__ not found"
    if _find_nested_code(ctx, ("compile_wrapper", "_fn")) is None:
        return "dynamo's compile_wrapper code object not found"
    cew = getattr(cf, "CatchErrorsWrapper", None)
    if not isinstance(cew, type) or "__call__" not in cew.__dict__:
        return "convert_frame.CatchErrorsWrapper class not found (frame callback is a closure here)"
    import inspect

    params = list(inspect.signature(cew.__dict__["__call__"]).parameters)
    if params[:4] != ["self", "frame", "cache_entry", "frame_state"]:
        return f"CatchErrorsWrapper.__call__{tuple(params)} has an unexpected signature"
    if _cache_entry_lister() is None:
        return "torch._C._dynamo.eval_frame._debug_get_cache_entry_list not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    ef, cf = _modules()
    ctx_cls = ef._TorchDynamoContext
    cw_code = _find_nested_code(ctx_cls, ("compile_wrapper", "_fn"))
    get_entries = _cache_entry_lister()
    orig_cb_call = cf.CatchErrorsWrapper.__dict__["__call__"]

    def make_gate(compile_wrapper: Callable[..., Any]) -> Callable[..., Any]:
        key = _gate_key(compile_wrapper)

        def ttc_gate(*args: Any, **kwargs: Any) -> Any:
            attempt = 0  # read by the frame callback through this frame's locals, as is `key`
            try:
                while True:
                    if _flights and key is not None:
                        _await_flights(key)
                    try:
                        return compile_wrapper(*args, **kwargs)
                    except _Retry:
                        attempt += 1
            finally:
                if _flights:
                    _land(key, sys._getframe())

        functools.update_wrapper(ttc_gate, compile_wrapper)
        ttc_gate._ttc_gate = True  # type: ignore[attr-defined]
        return ttc_gate

    gate_code = make_gate(lambda: None).__code__

    def gate_compiled(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if getattr(result, "__code__", None) is cw_code:
            return make_gate(result)
        return result

    # Code just compiled whose cache entry dynamo has not inserted yet: the C code inserts it after the
    # callback returned, i.e. after compile_lock was released, so a thread that takes the lock in that
    # window would not see it in the cache. Kept for PENDING_S; keyed by the frame's code object.
    pending: dict[types.CodeType, list[tuple[float, Any, Any]]] = {}

    def remember_pending(code: types.CodeType, result: Any, backend: Any) -> None:
        guarded = getattr(result, "guarded_code", result)
        checker = _entry_checker(guarded) if guarded is not None else None
        if checker is None:
            return
        now = time.monotonic()
        fresh = [p for p in pending.get(code, ()) if now - p[0] < PENDING_S]
        fresh.append((now, checker, backend))
        pending[code] = fresh

    def matching_entry(frame: Any, backend: Any) -> bool:
        """Whether the cache holds an entry dynamo's lookup would use for ``frame`` (guards and backend),
        counting a compile result that dynamo has not inserted yet."""
        now = time.monotonic()
        candidates = [(check_fn, saved) for created, check_fn, saved in pending.get(frame.f_code, ()) if now - created < PENDING_S]
        candidates += [(_entry_checker(e), getattr(e, "backend", backend)) for e in get_entries(frame.f_code)]
        f_locals = frame.f_locals
        for check_fn, saved_backend in candidates:
            if check_fn is None or not _same_backend(saved_backend, backend):
                continue
            try:
                if check_fn(f_locals):
                    return True
            except Exception:
                continue
        return False

    module_file = os.path.join("torch", "nn", "modules", "module.py")
    # While another thread's FX trace (e.g. the make_fx inside an AOT compile) has ``Module.__call__``
    # patched, calls pass through fx_patcher's dispatcher (H7): plumbing too, it runs nothing else.
    from torch_threadsafe_compile.patches.fx_patcher import DISPATCH_CODE as dispatch_code

    def gate_frame_of(caller: Any) -> Any:
        """The gate's frame if the frame being compiled is the first real frame of a gated call.

        Between dynamo's ``compile_wrapper`` and that frame there may only be ``nn.Module``'s call
        plumbing (``torch.compile(module)`` wraps ``module.__call__``; ``module.compile()`` wraps
        ``_call_impl``; fx_patcher's dispatcher while a trace has ``Module.__call__`` patched), and only
        on its hook-free fast path: then nothing has run that a retry would
        run twice. Anything else (a graph-break continuation, a function called from compiled code):
        None, and the frame compiles as upstream.
        """
        if caller is not None and caller.f_code is resume_gate_code:
            return caller  # a continuation called through its gate
        f = caller
        while f is not None and f.f_code is not cw_code:
            code = f.f_code
            if code is dispatch_code:
                f = f.f_back
                continue
            if not (code.co_name in ("_call_impl", "_wrapped_call_impl") and code.co_filename.endswith(module_file)):
                return None
            if code.co_name == "_call_impl" and not _hook_free(f.f_locals.get("self"), f.f_globals):
                return None
            f = f.f_back
        if f is None or f.f_back is None or f.f_back.f_code is not gate_code:
            return None
        return f.f_back

    def make_resume_gate(resume_fn: Callable[..., Any], wraps: bool = True) -> Callable[..., Any]:
        def ttc_resume_gate(*args: Any, **kwargs: Any) -> Any:
            attempt = 0  # read by the frame callback through this frame's locals
            while True:
                try:
                    return resume_fn(*args, **kwargs)
                except _Retry:
                    attempt += 1

        if wraps:
            functools.update_wrapper(ttc_resume_gate, resume_fn)
        ttc_resume_gate._ttc_gate = True  # type: ignore[attr-defined]
        return ttc_resume_gate

    def make_gated_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
        """torch >= 2.12 builds a continuation that needs a closure with a factory stored as the global."""

        def ttc_resume_factory(*args: Any, **kwargs: Any) -> Any:
            return make_resume_gate(factory(*args, **kwargs), wraps=False)

        functools.update_wrapper(ttc_resume_factory, factory)
        ttc_resume_factory._ttc_gate = True  # type: ignore[attr-defined]
        return ttc_resume_factory

    resume_gate_code = make_resume_gate(lambda: None).__code__
    skip_code = getattr(ef, "skip_code", None)
    if callable(skip_code):
        # The gate and the factory run between compiled code and the continuation, with dynamo's
        # callback active: dynamo must run them as they are (the continuation itself is compiled).
        for helper in (gate_code, resume_gate_code, make_gated_factory(lambda: None).__code__, *_HELPER_CODES):
            skip_code(helper)
    resume_gates: list[tuple[dict[str, Any], str, Any, Any]] = []
    closure_resumes: list[types.CodeType] = []
    output_graph_file = os.path.join("torch", "_dynamo", "output_graph.py")

    def gate_continuations(frame: Any, result: Any) -> None:
        """Put a retrying gate in front of the continuations the code just compiled for ``frame`` calls.

        Dynamo stores each graph-break continuation (``__resume_at_<offset>``) as a global of the
        compiled function's module, and the compiled code loads it by name when it calls it. Behind a
        gate, a continuation frame is the top frame of a gated call: a spurious cache miss there is
        retried instead of compiled again. A continuation that needs a closure is built at call time:
        from torch 2.12 by a factory stored as that global (which gets a gated factory); before 2.12 by
        the compiled code itself, from a code object among its constants (which a dynamo bytecode hook
        swaps for a trampoline with the same free variables, see ``closure_trampoline``).
        """
        if not callable(skip_code):
            return
        code = getattr(getattr(result, "guarded_code", result), "code", None)
        if not isinstance(code, types.CodeType):
            return
        scope = frame.f_globals
        for name in code.co_names:
            if not name.startswith("__resume_at_"):
                continue
            fn = scope.get(name)
            if type(fn) is not types.FunctionType or getattr(fn, "_ttc_gate", False):
                continue
            fn_code = fn.__code__
            if not fn_code.co_freevars:
                gate = make_resume_gate(fn)
            elif fn_code.co_name == "_make_fn" and fn_code.co_filename.endswith(output_graph_file):
                gate = make_gated_factory(fn)
            else:
                continue
            scope[name] = gate
            resume_gates.append((scope, name, fn, gate))

    def closure_trampoline(real: types.CodeType) -> types.CodeType | None:
        """A code object that the compiled code can make a function of, with the same closure cells, and
        that calls ``real`` (made a function of those cells) through a resume gate. None if the free
        variables cannot be reproduced in the same order (the continuation then stays as upstream)."""
        fvs = real.co_freevars
        if not all(n.isidentifier() for n in fvs):
            return None
        key = len(closure_resumes)
        body = "\n".join(f"    {n} = None" for n in fvs)
        src = (
            f"def ttc_outer():\n{body}\n"
            f"    def {real.co_name}(*args, **kwargs):\n"
            f"        def ttc_cells():\n"
            f"            return ({', '.join(fvs)},)\n"
            f"        return {CALL_RESUME}({key}, ttc_cells, args, kwargs)\n"
            f"    return {real.co_name}\n"
        )
        ns: dict[str, Any] = {}
        exec(compile(src, "<torch-threadsafe-compile continuation trampoline>", "exec"), ns)
        tramp = ns["ttc_outer"]().__code__
        if tramp.co_freevars != fvs:
            return None
        closure_resumes.append(real)
        skip_code(tramp)
        return tramp

    def call_closure_resume(key: int, cells_fn: Any, args: Any, kwargs: Any) -> Any:
        # Runs under dynamo's callback (called from compiled code): no comprehension, no Python
        # callee that is not skipped, so that dynamo sees no frame of ours but the continuation's.
        real = closure_resumes[key]
        by_name = dict(zip(cells_fn.__code__.co_freevars, cells_fn.__closure__))
        cells = []
        for n in real.co_freevars:
            cells.append(by_name[n])
        fn = types.FunctionType(real, sys._getframe(1).f_globals, real.co_name, None, tuple(cells))
        return make_resume_gate(fn, wraps=False)(*args, **kwargs)

    def closure_continuations_hook(code: types.CodeType, out_code: types.CodeType) -> types.CodeType | None:
        """Dynamo bytecode hook: swap the code constants of closure continuations for trampolines."""
        consts = list(out_code.co_consts)
        changed = False
        for i, c in enumerate(consts):
            if isinstance(c, types.CodeType) and c.co_freevars and c.co_name.startswith("torch_dynamo_resume_in_"):
                tramp = closure_trampoline(c)
                if tramp is not None:
                    consts[i], changed = tramp, True
        return out_code.replace(co_consts=tuple(consts)) if changed else None

    def restore_continuations() -> None:
        for scope, name, fn, gate in resume_gates:
            if scope.get(name) is gate:
                scope[name] = fn
        resume_gates.clear()

    def flight_gate(f: Any) -> Any:
        """The nearest gated ``torch.compile`` call on the stack from ``f``: the call a compile belongs to."""
        depth = 0
        while f is not None and depth < 200:
            if f.f_code is gate_code:
                return f
            f, depth = f.f_back, depth + 1
        return None

    def compile_in_flight(gate: Any, call: Callable[[], Any]) -> Any:
        """Run dynamo's callback as part of the flight of the gated call in frame ``gate``."""
        key = gate.f_locals.get("key") if gate is not None else None
        if key is None:
            return call()
        fl = _takeoff(key, id(gate))
        fl.compiling += 1
        t1 = time.perf_counter()
        try:
            return call()
        finally:
            fl.compile_s += time.perf_counter() - t1
            fl.idle_since = time.monotonic()
            fl.compiling -= 1

    @functools.wraps(orig_cb_call)
    def callback_call(self: Any, frame: Any, cache_entry: Any, frame_state: Any, *rest: Any, **kw: Any) -> Any:
        if getattr(_internal, "busy", False):  # a frame created by the flight bookkeeping itself
            return orig_cb_call(self, frame, cache_entry, frame_state, *rest, **kw)
        backend = _backend_of(self)  # what dynamo's lookup compares entries against

        def compile_frame() -> Any:
            _compiling.depth = getattr(_compiling, "depth", 0) + 1
            try:
                result = orig_cb_call(self, frame, cache_entry, frame_state, *rest, **kw)
            finally:
                _compiling.depth -= 1
            if getattr(result, "guarded_code", result) is not None:
                remember_pending(frame.f_code, result, backend)
            gate_continuations(frame, result)
            return result

        caller = sys._getframe(1)
        outer = gate_frame_of(caller)
        if outer is None:
            # Not the top frame of a gated call: compiled as upstream, as part of the enclosing gated
            # call's flight if there is one (a callee of compiled code, a continuation with a closure).
            gate = flight_gate(caller)
            del caller
            return compile_in_flight(gate, compile_frame)
        del caller
        code = frame.f_code
        retry_allowed = outer.f_locals.get("attempt", MAX_RETRIES) < MAX_RETRIES
        if retry_allowed and matching_entry(frame, backend):
            # Dynamo's lookup missed an entry that is in the cache: it walks the entry list while
            # other threads move entries to its front (see the module docstring). Look again.
            stats.record(code, "lookup_retries", 0.0)
            raise _Retry()
        t0 = time.perf_counter()
        with cf.compile_lock:  # read at call time: compile_lock_watchdog may have wrapped it
            waited = time.perf_counter() - t0
            served = retry_allowed and matching_entry(frame, backend)
            if not served:
                result = compile_in_flight(outer if outer.f_code is gate_code else flight_gate(outer), compile_frame)
        if served:
            stats.record(code, "served_by_other_thread", waited)
            raise _Retry()  # the gate waits for the server's flight to land, then calls again
        if getattr(result, "guarded_code", result) is not None:
            stats.record(code, "compiles", waited)
        return result

    changes.wrap(ctx_cls, "__call__", gate_compiled)
    changes.on_revert(restore_continuations)
    if callable(skip_code):
        # Trampolines are made into functions with the compiled frame's globals, so they find their
        # helper through the builtins (a private name).
        changes.inject(builtins, CALL_RESUME, call_closure_resume)
        skip_code(call_closure_resume.__code__)
        skip_code(make_resume_gate.__code__)
        register = getattr(cf, "register_bytecode_hook", None)
        if callable(register):  # dynamo's own API for rewriting the code it generates
            handle = register(closure_continuations_hook)
            changes.on_revert(handle.remove)
    changes.setattr(cf.CatchErrorsWrapper, "__call__", callback_call)
    _state.update(cw_code=cw_code, gate_code=gate_code, make_gate=make_gate)
    return {}


def verify() -> None:
    """Cheap: the gate is transparent and retries; dynamo's factory is wrapped. (Calling ``torch.compile``
    here would import dynamo's backends, about a second that users who only import dynamo should not pay.)"""
    ef, _ = _modules()
    if not getattr(ef._TorchDynamoContext.__dict__["__call__"], "__wrapped__", None):
        raise AssertionError("_TorchDynamoContext.__call__ is not wrapped")
    tries = []

    def probe(x: Any) -> Any:
        """doc"""
        tries.append(x)
        if len(tries) == 1:
            raise _Retry()
        return x

    gated = _state["make_gate"](probe)
    if gated.__name__ != "probe" or gated.__doc__ != "doc" or gated.__wrapped__ is not probe:
        raise AssertionError("the gate is not transparent")
    if gated(7) != 7 or tries != [7, 7]:
        raise AssertionError("the gate does not retry")


def report() -> dict[str, Any]:
    with stats._lock:
        return {k: dict(v) for k, v in stats.by_code.items()}
