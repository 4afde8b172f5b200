"""H3 — one compile per guard set, however many threads arrive at once.

Upstream, dynamo's frame callback runs on every cache miss and queues on the global ``compile_lock``;
a thread that waited there does not look again at the cache once it gets the lock, so N threads making
the same first call compile the same graph N times (measured: 8 threads → 8 compiles on an H200), and
past ``recompile_limit`` the rest run *uncompiled* with an "Unexpected recompilation" warning — for
flex_attention, the unfused O(S²) path.

This patch makes the waiting threads look again:

* ``torch.compile()`` (every ``_TorchDynamoContext.__call__`` that returns dynamo's ``compile_wrapper``,
  so ``torch.compile(module)``, ``module.compile()``, decorators and torch's own internal compiles) gets
  a thin, transparent *gate* around the wrapper (``functools.wraps``: same name, signature,
  ``__wrapped__``, dynamo attributes). Warm calls never reach the callback, so their only cost is the
  gate's Python call;
* the frame callback (``convert_frame.CatchErrorsWrapper.__call__``, patched on the class so callbacks
  built before activation are covered) recognises the *top* frame of a gated call — the frame whose
  caller is ``compile_wrapper`` called by the gate. For it, it takes ``compile_lock`` first and then
  checks the guards of the cache entries that exist *now*; if one passes, another thread compiled what
  this one needs while it waited, so it raises a private retry signal instead of compiling. The frame has
  not started executing, so the gate simply calls again and dynamo's C lookup now hits;
* a gated call retries at most ``MAX_RETRIES`` times, then compiles as upstream would (a safety net for
  entries whose guards pass but that dynamo will not use, e.g. another backend's);
* ``torch.compile(module)`` and ``module.compile()`` reach the compiled ``forward`` through ``nn.Module``'s
  call plumbing; on its hook-free fast path nothing runs before ``forward``, so that frame counts as the
  top frame too. With forward (pre-)hooks registered, the hooks would run twice on a retry: such calls
  compile as upstream;
* inner frames (graph-break continuations, functions called from compiled code) cannot be retried that
  way; they are serialized by ``compile_lock`` as upstream. To keep them from being compiled once per
  waiting thread anyway, a thread served by another's compile waits (holding no lock) until that other
  thread's call has returned — by then its continuations are compiled and cached — bounded to
  ``FOLLOW_FACTOR`` times the first compile's duration (1 s … ``FOLLOW_MAX_S``), so that threads that
  depend on each other inside a first call cannot hang. Threads that arrive after the first graph was
  compiled but before its continuations were can still compile a continuation again.

No new lock is introduced (``compile_lock`` is dynamo's own RLock, taken a few lines earlier than
upstream), so no new lock-order can deadlock. A compile that raises releases the lock on the way out and
the error reaches that caller; the waiting threads then find no matching entry and compile themselves
(each gets the same error if it is deterministic). ``KeyboardInterrupt``/``SystemExit`` unwind the same way.

Functions compiled *before* an explicit ``install()`` have no gate: they keep upstream behaviour for H3.
"""

from __future__ import annotations

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

MAX_RETRIES = 3
# A thread served by another thread's compile first waits (no lock held) until that thread's gated call has
# returned, so that the frames this call compiles *after* its first graph (graph-break continuations) are
# compiled once too instead of by every waiting thread. Bounded: at most this many times the first
# compile's duration (at least 1 s, at most FOLLOW_MAX_S), so no dependency between the threads can hang.
FOLLOW_FACTOR = 4.0
FOLLOW_MAX_S = 10.0


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
                self.key(code), {"compiles": 0, "served_by_other_thread": 0, "waits": 0, "wait_s_total": 0.0, "wait_s_max": 0.0}
            )
            row[what] += 1
            if waited > 1e-3:
                row["waits"] += 1
                row["wait_s_total"] = round(row["wait_s_total"] + waited, 4)
                row["wait_s_max"] = round(max(row["wait_s_max"], waited), 4)


stats = _Stats()
_state: dict[str, Any] = {}
# code object -> (thread ident, id of that thread's gate frame, compile seconds) of a first call in flight.
_inflight: dict[types.CodeType, tuple[int, int, float]] = {}


def _frame_on_stack(top: Any, frame_id: int, gate_code: types.CodeType) -> bool:
    f, depth = top, 0
    while f is not None and depth < 1000:
        if id(f) == frame_id and f.f_code is gate_code:
            return True
        f, depth = f.f_back, depth + 1
    return False


def _follow_first_call(code: types.CodeType, gate_code: types.CodeType) -> None:
    """Wait, bounded, until the call that compiled ``code`` in another thread has returned."""
    info = _inflight.get(code)
    if info is None or info[0] == threading.get_ident():
        return
    ident, frame_id, compile_s = info
    deadline = time.monotonic() + min(FOLLOW_MAX_S, max(1.0, FOLLOW_FACTOR * compile_s))
    while time.monotonic() < deadline:
        top = sys._current_frames().get(ident)
        if top is None or not _frame_on_stack(top, frame_id, gate_code):
            if _inflight.get(code) is info:
                _inflight.pop(code, None)
            return
        del top
        time.sleep(0.002)


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
        def ttc_gate(*args: Any, **kwargs: Any) -> Any:
            attempt = 0  # read by the frame callback through this frame's locals
            while True:
                try:
                    return compile_wrapper(*args, **kwargs)
                except _Retry:
                    attempt += 1

        functools.update_wrapper(ttc_gate, compile_wrapper)
        ttc_gate._ttc_gate = True  # type: ignore[attr-defined]
        return ttc_gate

    gate_code = make_gate(lambda: None).__code__

    def gate_compiled(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if getattr(result, "__code__", None) is cw_code:
            return make_gate(result)
        return result

    def matching_entry(frame: Any) -> bool:
        f_locals = frame.f_locals
        for entry in get_entries(frame.f_code):
            check_fn = _entry_checker(entry)
            if check_fn is not None:
                try:
                    if check_fn(f_locals):
                        return True
                except Exception:
                    continue
        return False

    module_file = os.path.join("torch", "nn", "modules", "module.py")

    def gate_frame_of(caller: Any) -> Any:
        """The gate's frame if the frame being compiled is the first real frame of a gated call.

        Between dynamo's ``compile_wrapper`` and that frame there may only be ``nn.Module``'s call
        plumbing (``torch.compile(module)`` wraps ``module.__call__``; ``module.compile()`` wraps
        ``_call_impl``), and only on its hook-free fast path: then nothing has run that a retry would
        run twice. Anything else (a graph-break continuation, a function called from compiled code):
        None, and the frame compiles as upstream.
        """
        f = caller
        while f is not None and f.f_code is not cw_code:
            code = f.f_code
            if not (code.co_name in ("_call_impl", "_wrapped_call_impl") and code.co_filename.endswith(module_file)):
                return None
            if code.co_name == "_call_impl" and not _hook_free(f.f_locals.get("self"), f.f_globals):
                return None
            f = f.f_back
        if f is None or f.f_back is None or f.f_back.f_code is not gate_code:
            return None
        return f.f_back

    @functools.wraps(orig_cb_call)
    def callback_call(self: Any, frame: Any, cache_entry: Any, frame_state: Any, *rest: Any, **kw: Any) -> Any:
        outer = gate_frame_of(sys._getframe(1))
        if outer is None:
            # Not the top frame of a gated call: upstream behaviour.
            return orig_cb_call(self, frame, cache_entry, frame_state, *rest, **kw)
        code = frame.f_code
        t0 = time.perf_counter()
        with cf.compile_lock:  # read at call time: compile_lock_watchdog may have wrapped it
            waited = time.perf_counter() - t0
            served = outer.f_locals.get("attempt", MAX_RETRIES) < MAX_RETRIES and matching_entry(frame)
            if not served:
                t1 = time.perf_counter()
                result = orig_cb_call(self, frame, cache_entry, frame_state, *rest, **kw)
                if getattr(result, "guarded_code", result) is not None:
                    _inflight[code] = (threading.get_ident(), id(outer), time.perf_counter() - t1)
        if served:
            stats.record(code, "served_by_other_thread", waited)
            _follow_first_call(code, gate_code)  # outside the lock
            raise _Retry()
        if getattr(result, "guarded_code", result) is not None:
            stats.record(code, "compiles", waited)
        return result

    changes.wrap(ctx_cls, "__call__", gate_compiled)
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
