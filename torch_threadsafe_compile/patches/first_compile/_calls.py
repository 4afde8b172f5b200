"""The state of one gated call, kept on a per-thread stack that the gates push and pop.

Every gate (the wrapper around what ``torch.compile()`` returns, and the gates in front of graph-break
continuations) pushes one entry when it is called and pops it when it returns, so the stack mirrors the
gated calls on this thread's Python stack: the frame callback finds the state of the call it works for at
the top (or, for the enclosing ``torch.compile`` call, the nearest main-gate entry). The warm path pushes a
constant (the gate's key) and pops it; a :class:`GateCall` object is made only when a callback needs one.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

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


class _Resume:
    """Marker a continuation gate pushes (its calls have no flight of their own)."""

    def __repr__(self) -> str:
        return "RESUME"


RESUME: Any = _Resume()


class ModuleTarget:
    """What the gate of ``torch.compile(module)`` / ``module.compile()`` pushes: made once per gate."""

    __slots__ = ("key", "module")

    def __init__(self, key: types.CodeType | None, module: Any) -> None:
        self.key = key
        self.module = module


class GateCall:
    """One gated call in progress: how often it was retried, whether it may be, and its flight."""

    __slots__ = ("key", "resume", "attempt", "retry_ok", "flight")

    def __init__(self, key: types.CodeType | None, resume: bool = False, retry_ok: bool = True) -> None:
        self.key = key  # the code object of the call's first frame (None: not known, no flights)
        self.resume = resume  # a continuation's gate
        self.attempt = 0
        self.retry_ok = retry_ok  # False when something (a module hook) already ran before that frame
        self.flight: Any = None  # the Flight this call flies once it compiles something

    def may_retry(self) -> bool:
        return self.retry_ok and self.attempt < MAX_RETRIES


# Every thread's stack, by thread ident, so that a reset can see which threads are inside a gated call
# (``_reset``). A thread registers on its first gated call; entries of finished threads are pruned there.
all_stacks: dict[int, list[Any]] = {}


# Guards all_stacks' registrations and prunings (without the GIL a check-then-delete could drop the entry of
# a new thread that reuses a dead thread's ident). A leaf lock: nothing is taken under it.
stacks_lock = threading.Lock()


def _stacks_init(self: Any) -> None:
    self.stack = []
    with stacks_lock:
        all_stacks[threading.get_ident()] = self.stack


def _new_stacks() -> Any:
    """The per-thread holder of the stacks, built on ``threading.local`` as it is now: gevent's greenlet-local
    once gevent patched threading (greenlets of one thread must not share a stack: their pushes and pops
    interleave when one switches inside a compiled call)."""
    return type("_Stacks", (threading.local,), {"__init__": _stacks_init})()


# ``stacks.stack``: this thread's stack of gated calls: keys (code objects or None), ModuleTarget, RESUME,
# or GateCall objects.
stacks = _new_stacks()


def rebind_locals() -> None:
    """gevent patched threading after this module was imported: gates made from now on keep a stack per
    greenlet (gates made before keep one per OS thread, and their callers are not gated for H3's retries)."""
    global stacks
    stacks = _new_stacks()


@_forksafe.in_child
def _after_fork() -> None:
    """In a forked child only the forking thread exists: its stack stays (its calls go on there)."""
    global stacks_lock
    stacks_lock = threading.Lock()  # another thread of the parent may have held it
    me = threading.get_ident()
    for ident in list(all_stacks):
        if ident != me:
            all_stacks.pop(ident, None)


def stack() -> list[Any]:
    entries: list[Any] = stacks.stack
    return entries



def state(entries: list[Any], index: int) -> GateCall:
    """The :class:`GateCall` at ``entries[index]``, made from the pushed constant on first use."""
    entry = entries[index]
    if entry.__class__ is GateCall:
        return entry  # type: ignore[no-any-return]
    if entry is RESUME:
        call = GateCall(None, resume=True)
    elif entry.__class__ is ModuleTarget:
        # The module's call plumbing runs before ``forward``; on its hook-free fast path nothing else does,
        # so a retry repeats nothing. With forward (pre-)hooks registered they would run twice: no retry.
        call = GateCall(entry.key, retry_ok=hook_free(entry.module))
    else:
        call = GateCall(entry)
    entries[index] = call
    return call


def innermost_main(entries: list[Any]) -> GateCall | None:
    """The state of the innermost ``torch.compile`` call (not a continuation) on this thread, if any."""
    for i in range(len(entries) - 1, -1, -1):
        entry = entries[i]
        if entry is RESUME or (entry.__class__ is GateCall and entry.resume):
            continue
        return state(entries, i)
    return None


# Code objects that may run under dynamo's active frame callback (a gate called from compiled code):
# dynamo must run them as they are.
HELPER_CODES = (_stacks_init.__code__,)
