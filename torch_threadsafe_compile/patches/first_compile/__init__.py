"""H3 — one compile per guard set, however many threads arrive at once.

Upstream, dynamo's frame callback runs on every cache miss and queues on the global ``compile_lock``; a
thread that waited there does not look again at the cache once it gets the lock, so N threads making the
same first call compile the same graph N times (measured: 8 threads → 8 compiles on an H200), and past
``recompile_limit`` the rest run *uncompiled* with an "Unexpected recompilation" warning — for
flex_attention, the unfused O(S²) path. A second upstream race makes threads recompile entries that *are*
cached (a *spurious miss*, ``_cache_probe``): 16 threads calling with inputs whose guard sets were all
compiled beforehand, 4–8 extra graphs and 8–14 uncompiled frames in 6 s (torch 2.13). Upstream reworked the
lookup after 2.15 (pytorch/pytorch#195355).

This patch makes the threads look again. The path of one compiled call (docs/architecture.md):

1. ``_gate``: what ``torch.compile()`` returns gets a transparent gate, which calls dynamo's wrapper.
   Warm calls end there and never wait for other threads; the callback finds a gated call's state from
   the thread's frames (``_calls``).
2. ``_callback``: on a cache miss, dynamo calls its frame callback. For the first frame of a gated call it
   asks the ``_cache_probe`` whether the cache holds an entry that fits (before and after taking
   ``compile_lock``); if so it raises ``Retry``: the gate waits while other threads' flights of the
   function compile (``_flights``: bounded, never for their whole call) and calls again. Otherwise the
   frame compiles as upstream, and the gated call becomes a flight.
3. ``_continuations`` (and ``_continuations_pre212`` before torch 2.12): graph-break continuations, called
   from compiled code, get retrying gates of their own.
4. ``_reset``: ``torch._dynamo.reset()`` waits until no other thread is inside a gated call, and new calls
   wait for it, so no thread walks dynamo's cache entries while they are freed.

Functions compiled *before* an explicit ``install()`` have no gate: they keep upstream behaviour for H3.

The callback also carries H12's rule (``_callback.under_import_lock``): a frame inside a meta-path finder
(its thread holds Python's global import lock) never waits for ``compile_lock``; test
``tests/test_crash_hazards.py::test_h12_*``.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from torch_threadsafe_compile import _version_ranges
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import cache_entry_lister, loaded, skip_code
from torch_threadsafe_compile.patches.first_compile import _calls, _flights, _reset
from torch_threadsafe_compile.patches.first_compile._callback import FrameCallback
from torch_threadsafe_compile.patches.first_compile._calls import Retry
from torch_threadsafe_compile.patches.first_compile._continuations import FACTORY_CODE, ContinuationGates
from torch_threadsafe_compile.patches.first_compile._continuations_pre212 import call_closure_resume, make_hook
from torch_threadsafe_compile.patches.first_compile._gate import GATE_CODE, RESUME_GATE_CODE, make_gate, make_resume_gate
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["first_compile"]

RESET_FUNCTIONS = ("reset", "reset_code_caches")

# The installed callback (for report()); None while the patch is not applied.
_installed: list[FrameCallback] = []


def _find_nested_code(owner: type, names: tuple[str, ...]) -> types.CodeType | None:
    """The code object of the wrapper function that ``_TorchDynamoContext.__call__`` creates."""
    for attr in ("__call__", "_call", "_get_compile_wrapper"):
        code = getattr(owner.__dict__.get(attr), "__code__", None)
        stack = [code] if code is not None else []
        while stack:
            c = stack.pop()
            for const in c.co_consts:
                if isinstance(const, types.CodeType):
                    if const.co_name in names:
                        return const
                    stack.append(const)
    return None


def _modules() -> tuple[Any, Any]:
    return loaded("torch._dynamo.eval_frame"), loaded("torch._dynamo.convert_frame")


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
    params = list(inspect.signature(cew.__dict__["__call__"]).parameters)
    if params[:4] != ["self", "frame", "cache_entry", "frame_state"]:
        return f"CatchErrorsWrapper.__call__{tuple(params)} has an unexpected signature"
    if cache_entry_lister() is None:
        return "torch._C._dynamo.eval_frame._debug_get_cache_entry_list not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    ef, cf = _modules()
    ctx_cls = ef._TorchDynamoContext
    cw_code = _find_nested_code(ctx_cls, ("compile_wrapper", "_fn"))
    if cw_code is None:
        raise AssertionError("compile_wrapper code object disappeared since check()")
    # Our frames that run between compiled code and what it calls, with dynamo's callback active (a gate
    # or a continuation called from compiled code): dynamo must run them as they are. Without skip_code,
    # a gate between compiled code and a continuation would itself be compiled: continuations stay ungated.
    ours = (GATE_CODE, RESUME_GATE_CODE, FACTORY_CODE, call_closure_resume.__code__, make_resume_gate.__code__,
            *_flights.HELPER_CODES, *_calls.HELPER_CODES, *_reset.HELPER_CODES)
    can_skip = all([skip_code(code) for code in ours])  # noqa: C419 - every one of them, no short-circuit
    gates = ContinuationGates(enabled=can_skip)
    frame_return = getattr(cf, "ConvertFrameReturn", None)  # torch >= 2.9 (with non-recursive disable)
    callback = FrameCallback(cf.CatchErrorsWrapper.__dict__["__call__"], cw_code, gates,
                             skip_frame=lambda: frame_return(apply_to_code=False) if frame_return else None,
                             plumbing=changes.require("call_plumbing").values)

    def gate_compiled(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if getattr(result, "__code__", None) is cw_code:
            return make_gate(result)
        return result

    changes.wrap(ctx_cls, "__call__", gate_compiled)
    if can_skip:
        changes.on_revert(gates.restore)
        register = getattr(cf, "register_bytecode_hook", None)
        version = _version_ranges.torch_version()
        if callable(register) and isinstance(version, tuple) and version < (2, 12):
            handle = register(make_hook(skip_code))
            changes.on_revert(handle.remove)
    changes.setattr(cf.CatchErrorsWrapper, "__call__", callback.install())
    dynamo = loaded("torch._dynamo")
    waiters = changes.require("compile_lock.waiters")  # who waits for compile_lock, while the watchdog records it
    for name in RESET_FUNCTIONS:  # a reset waits for other threads' gated calls (_reset)
        if callable(getattr(dynamo, name, None)):
            changes.setattr(dynamo, name, _reset.wrap_reset(getattr(dynamo, name), _reset.barrier, callback.forget, waiters))
    _installed[:] = [callback]
    changes.on_revert(_installed.clear)
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
            raise Retry()
        return x

    gated = make_gate(probe)
    # Compared with the probe's own attributes, never with literals: under ``python -OO`` docstrings are None.
    if (gated.__name__, gated.__doc__, gated._ttc_compile_wrapper) != (probe.__name__, probe.__doc__, probe):  # type: ignore[attr-defined]
        raise AssertionError("the gate is not transparent")
    if gated(7) != 7 or tries != [7, 7] or _calls.stack():
        raise AssertionError("the gate does not retry")


def report() -> dict[str, Any]:
    return _installed[0].stats.report() if _installed else {}


def tables() -> dict[str, int]:
    """Sizes of the package's own per-function tables (for the memory bench): they must not grow with the
    number of functions compiled and dropped."""
    cb = _installed[0] if _installed else None
    return {
        "stats": len(cb.stats) if cb else 0,
        "pending_results": cb.probe.pending_size() if cb else 0,
        "continuation_gates": len(cb.gates) if cb else 0,
        "flights": len(_flights.flights),
    }
