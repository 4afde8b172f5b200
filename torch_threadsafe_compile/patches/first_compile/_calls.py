"""The state of one gated call, found from the thread's own frames.

A gated call is a frame of one of the gates (the wrapper around what ``torch.compile()`` returns, or a
gate in front of a graph-break continuation) on the calling thread's Python stack. The frame callback,
which runs in that thread, finds the call it works for by walking back from its caller to the nearest
gate frame; the call's state (:class:`GateCall`: retries, flight) lives in :data:`live`, keyed by that
frame, from the callback's first look until the gate returns. A warm call therefore keeps no state of its
own: the gate tests that :data:`live` is empty on its way out (docs/performance.md).

Only ``torch._dynamo.reset()`` needs to see *other* threads' gated calls (``_reset``). It never walks their
frames: another thread runs between the bytecodes of such a walk (the GIL switches every few milliseconds,
and on free-threaded builds nothing stops it at all), and a frame chain read while its thread returns is not
safe on CPython 3.11 -- a reset once read a tuple where a frame was (the CI run of ``reset_pipeline``), the
class of crashes sampling profilers met there (sentry-python #6119, dd-trace-py #13567). So each gate
pushes onto a per-thread list of calls in progress, which the reset reads (:data:`all_stacks`): about 60 ns
of a warm call (docs/performance.md). Under gevent the lists are per greenlet (``_gevent``) and carry their OS
thread's ident: a reset does not wait for the other greenlets of its own thread, which cannot be inside
dynamo's lookup while it runs (a greenlet switches away in Python code).
"""

from __future__ import annotations

import _thread
import sys
import threading
import types
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe

# A retry is only raised when an entry whose guards (and backend) pass is in the cache, so retries end as
# soon as dynamo's lookup sees it; the bound is a safety net for an entry that passes here but that the
# C lookup would still reject. Spurious misses (see the package docstring) rarely repeat more than twice.
MAX_RETRIES = 16


class Retry(BaseException):
    """Private signal from the frame callback to a gate: the cache now has what this call needs; call again.

    A BaseException so that no ``except Exception`` between the callback and the gate swallows it. The
    frame it is raised for has not started executing, so calling again is safe.
    """


_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")


def hook_free(module: Any) -> bool:
    """True when ``Module._call_impl`` takes its fast path (no hook can have run before ``forward``)."""
    if any(getattr(module, a, None) for a in _HOOK_ATTRS):
        return False
    nn_module = sys.modules.get("torch.nn.modules.module")
    return not any(getattr(nn_module, g, None) for g in _GLOBAL_HOOKS)


class ModuleTarget:
    """The target of ``torch.compile(module)`` / ``module.compile()``'s gate: made once per gate."""

    __slots__ = ("key", "module")

    def __init__(self, key: types.CodeType | None, module: Any) -> None:
        self.key = key
        self.module = module


class GateCall:
    """One gated call in progress: how often it was retried, whether it may be, and its flight."""

    __slots__ = ("key", "resume", "attempt", "retry_ok", "flight", "thread")

    def __init__(self, key: types.CodeType | None, resume: bool = False, retry_ok: bool = True) -> None:
        self.key = key  # the code object of the call's first frame (None: not known, no flights)
        self.resume = resume  # a continuation's gate
        self.attempt = 0
        self.retry_ok = retry_ok  # False when something (a module hook) already ran before that frame
        self.flight: Any = None  # the Flight this call flies once it compiles something
        self.thread = threading.get_ident()

    def may_retry(self) -> bool:
        return self.retry_ok and self.attempt < MAX_RETRIES


# Gate frame -> the state of its call, for calls the frame callback has looked at. Empty while no call is
# past a cache miss, so a warm call's only cost here is one truthiness test. Each thread adds and removes
# its own frames only (one dict operation each: atomic with and without the GIL).
live: dict[types.FrameType, GateCall] = {}

# The gates' code objects (set by ``_gate``, which defines them), by id: whether each is a main gate (the
# generic one and the own-signature variants) or a continuation's. Kept alive here; a bounded number.
GATE_CODES: dict[int, tuple[types.CodeType, bool]] = {}


def add_gate_code(code: types.CodeType, main: bool) -> None:
    GATE_CODES[id(code)] = (code, main)


def is_main_gate(code: types.CodeType) -> bool:
    # Identity, not equality: comparing code objects compares their constants, which can be unhashable.
    entry = GATE_CODES.get(id(code))
    return entry is not None and entry[0] is code and entry[1]


def is_gate(code: types.CodeType) -> bool:
    entry = GATE_CODES.get(id(code))
    return entry is not None and entry[0] is code


def state(frame: types.FrameType) -> GateCall:
    """The :class:`GateCall` of gate frame ``frame`` (made on first use, from the gate's target)."""
    call = live.get(frame)
    if call is not None:
        return call
    if not is_main_gate(frame.f_code):
        call = GateCall(None, resume=True)
    else:
        # The gate's own closure value (``_gate``), read from its frame: the one place it is kept, so that a
        # warm call stores nothing. Only here, on a cache miss.
        target: Any = frame.f_locals.get("ttc_target")
        # A module's call plumbing runs before ``forward``; on its hook-free fast path nothing else does,
        # so a retry repeats nothing. With forward (pre-)hooks registered they would run twice: no retry.
        is_module = target.__class__ is ModuleTarget
        call = GateCall(target.key, retry_ok=hook_free(target.module)) if is_module else GateCall(target)
    live[frame] = call
    return call


def innermost_main(frame: types.FrameType | None) -> GateCall | None:
    """The state of the innermost ``torch.compile`` call (not a continuation) at or below ``frame``."""
    while frame is not None:
        if is_main_gate(frame.f_code):
            return state(frame)
        frame = frame.f_back
    return None


def end(gate_frame: types.FrameType) -> GateCall | None:
    """The gate of ``gate_frame`` returns: its state, if the callback made one, leaves :data:`live`."""
    return live.pop(gate_frame, None)


# Every thread's list of gated calls in progress: id of the list -> (OS thread ident, list). A thread registers
# on its first gated call, and its entry goes when its local storage goes (the thread or greenlet ended).
# Single dict operations only, with and without the GIL: no lock, and so none to hold when a registration
# runs Python code (below).
all_stacks: dict[int, tuple[int, list[Any]]] = {}


class _Registration:
    """Kept in the thread's local storage beside its list: freed with it, it takes the list's entry out."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key

    def __del__(self, _pop: Any = all_stacks.pop) -> None:  # bound now: module globals may be gone at exit
        _pop(self.key, None)


def _c_get_ident() -> Callable[[], int]:
    """The OS thread's ident, in C. gevent replaces ``_thread.get_ident`` with Python code (a greenlet's id),
    and a gate can run under the frame callback that another greenlet's compiled call left set on the OS
    thread: dynamo would compile that function, and the compile can switch greenlets while it holds
    ``compile_lock`` (measured: the gevent test's calls then released that lock unheld)."""
    ident = _thread.get_ident
    if isinstance(ident, types.BuiltinFunctionType):
        return ident
    monkey = sys.modules.get("gevent.monkey")
    original = getattr(monkey, "get_original", None)
    ident = original("_thread", "get_ident") if original else ident
    return ident if isinstance(ident, types.BuiltinFunctionType) else threading.get_ident


# The ident the lists carry (``all_stacks``), and that a reset compares them with.
os_ident = _c_get_ident()


def _stacks_init(self: Any) -> None:
    # No Python call and no lock here (see _c_get_ident: a lock held here once stayed held across a
    # greenlet switch, and the next greenlet waited for it forever).
    stack: list[Any] = []
    self.stack = stack
    self.registration = _Registration(id(stack))
    all_stacks[id(stack)] = (os_ident(), stack)


def _new_stacks() -> Any:
    """The per-thread holder of the lists, built on ``threading.local`` as it is now: gevent's greenlet-local
    once gevent patched threading."""
    return type("_Stacks", (threading.local,), {"__init__": _stacks_init})()


# ``stacks.stack``: this thread's list of gated calls in progress.
stacks = _new_stacks()


def rebind_locals() -> None:
    """gevent patched threading after this module was imported: gates made from now on count per greenlet."""
    global stacks
    stacks = _new_stacks()


@_forksafe.in_child
def _after_fork() -> None:
    """In a forked child only the forking thread exists: its calls go on, the others' state is dropped."""
    me = os_ident()
    for key, (ident, _) in list(all_stacks.items()):
        if ident != me:
            all_stacks.pop(key, None)
    me = threading.get_ident()
    for frame, call in list(live.items()):
        if call.thread != me:
            live.pop(frame, None)


def stack() -> list[Any]:
    entries: list[Any] = stacks.stack
    return entries


# Code objects that may run under dynamo's active frame callback (a gate called from compiled code):
# dynamo must run them as they are.
HELPER_CODES = (_stacks_init.__code__, _Registration.__init__.__code__, _Registration.__del__.__code__, end.__code__,
                is_gate.__code__, is_main_gate.__code__)
