"""The frame callback: what happens on a cache miss (dynamo calls it only then, never on a warm call).

For the first frame of a gated call, the callback checks whether the cache holds what the frame needs,
first without ``compile_lock`` (a spurious miss) and then holding it (another thread compiled it while
this one waited); if so it raises :class:`Retry` instead of compiling, and the gate calls again so that
dynamo's C lookup hits. Otherwise the frame compiles as upstream, as part of the gated call's flight.
Frames that are not the first frame of a gated call (functions called from compiled code that dynamo
compiles on their own) compile as upstream, as part of the flight of the enclosing ``torch.compile`` call.

``compile_lock`` is dynamo's own RLock, taken a few lines earlier than upstream: no new lock, so no new lock
order. A compile that raises releases the lock on the way out and the error reaches that caller.

One exception to "as upstream" (H12 in docs/hazards.md): a frame that runs inside a meta-path finder called by
importlib -- this thread holds Python's global import lock -- never waits for ``compile_lock``. Upstream's
callback would (dynamo skips its own and the standard library's frames, not a third party's finder), while the
thread holding ``compile_lock`` may be tracing an ``import`` that waits for the import lock: a deadlock of
both threads, for good. When the lock is taken, such a frame runs as it is this time (what dynamo does with
a frame it skips; a finder's frame holds no tensor code for dynamo to capture); when it is free, this thread
holds it for the callback, so upstream's own acquire inside cannot wait either. Single-threaded nothing
changes: the lock is always free.
"""

from __future__ import annotations

import _imp
import functools
import os
import sys
import time
import types
from typing import Any, Callable

from torch_threadsafe_compile._torch import compile_lock
from torch_threadsafe_compile.patches.first_compile import _calls, _flights
from torch_threadsafe_compile.patches.first_compile._cache_probe import CacheProbe, backend_of
from torch_threadsafe_compile.patches.first_compile._calls import GateCall, Retry
from torch_threadsafe_compile.patches.first_compile._continuations import ContinuationGates
from torch_threadsafe_compile.patches.first_compile._gate import RESUME_GATE_CODE
from torch_threadsafe_compile.patches.first_compile._stats import Stats

_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")
_MODULE_PLUMBING = ("_call_impl", "_wrapped_call_impl")


# importlib calls every meta-path finder's ``find_spec`` from this function, holding the global import lock
# (``with _ImportLockContext()`` around each call; path hooks run inside PathFinder, inside it too).
_FIND_SPEC_CODE = getattr(getattr(sys.modules.get("_frozen_importlib"), "_find_spec", None), "__code__", None)


def under_import_lock(caller: Any) -> bool:
    """Whether this thread is inside importlib's ``_find_spec`` (a meta-path finder or something it calls),
    so holds Python's global import lock. ``_imp.lock_held()`` (held by any thread) is the cheap first test:
    the stack is walked only while some thread holds that lock."""
    if not _imp.lock_held():
        return False
    f = caller
    while f is not None:
        code = f.f_code
        if code is _FIND_SPEC_CODE or (code.co_name == "_find_spec" and code.co_filename.startswith("<frozen importlib")):
            return True
        f = f.f_back
    return False


def first_frame_gate(caller: Any, cw_code: types.CodeType, plumbing: list[types.CodeType]) -> Any:
    """The gate frame of the gated call whose first real frame is the frame being compiled (called from
    ``caller``), or None when that frame is not the first frame of a gated call.

    Between dynamo's ``compile_wrapper`` and that frame there may only be ``nn.Module``'s call plumbing
    (``torch.compile(module)`` wraps ``module.__call__``; ``module.compile()`` wraps ``_call_impl``) and
    registered plumbing of ours (``plumbing``: the values of capability ``call_plumbing``). A continuation called through its gate is a
    first frame too. Anything else (a function called from compiled code): None.
    """
    if caller is None:
        return None
    if caller.f_code is RESUME_GATE_CODE:
        return caller
    f = caller
    while f is not None and f.f_code is not cw_code:
        code = f.f_code
        # Identity, not equality: comparing code objects compares their constants, which can be unhashable.
        if not any(code is c for c in plumbing) and not (
            code.co_name in _MODULE_PLUMBING and code.co_filename.endswith(_MODULE_FILE)
        ):
            return None
        f = f.f_back
    gate = f.f_back if f is not None else None
    return gate if gate is not None and _calls.is_main_gate(gate.f_code) else None


class FrameCallback:
    """Replaces ``convert_frame.CatchErrorsWrapper.__call__`` (on the class, so callbacks made before
    activation are covered too)."""

    def __init__(self, original: Callable[..., Any], cw_code: types.CodeType, gates: ContinuationGates,
                 skip_frame: Callable[[], Any], plumbing: list[types.CodeType]) -> None:
        self.original = original
        self.plumbing = plumbing  # the live values of capability call_plumbing
        self.skip_frame = skip_frame
        self.cw_code = cw_code
        self.gates = gates
        self.probe = CacheProbe()
        self.stats = Stats()

    def forget(self) -> None:
        """After ``torch._dynamo.reset()``: the compile results and statistics refer to entries that are gone."""
        self.probe.clear()
        self.stats.clear()

    def compile_frame(self, callback: Any, frame: Any, args: tuple[Any, ...], kwargs: dict[str, Any], backend: Any) -> Any:
        """Upstream's callback, then the bookkeeping of what it compiled."""
        internal = _flights.internal
        internal.compiling += 1
        try:
            result = self.original(callback, frame, *args, **kwargs)
        finally:
            internal.compiling -= 1
        if getattr(result, "guarded_code", result) is not None:
            self.probe.remember(frame.f_code, result, backend)
        self.gates.install(frame.f_globals, result)
        return result

    def install(self) -> Callable[..., Any]:
        """The function to put at ``CatchErrorsWrapper.__call__``."""
        handle = self.handle

        @functools.wraps(self.original)
        def __call__(callback: Any, frame: Any, *args: Any, **kwargs: Any) -> Any:
            # The frame below this one is the caller of the frame being compiled (that frame is not on the
            # Python stack yet): a gate, dynamo's compile_wrapper, module plumbing, or compiled code. There
            # is none for the first frame of a greenlet (gevent), which C code starts on an empty stack.
            try:
                caller = sys._getframe(1)
            except ValueError:
                caller = None
            return handle(callback, frame, caller, args, kwargs)

        return __call__

    def _nonrecursively_disabled(self, caller: Any) -> bool:
        """Upstream's callback skips a frame called by ``torch.compiler.disable(recursive=False)``'s wrapper,
        which it finds by walking back past its own (convert_frame.py) frames: ours would be in the way."""
        decorators = sys.modules.get("torch._dynamo.decorators")
        code = getattr(decorators, "_nonrecursive_disable_wrapper_code", None)
        return code is not None and caller is not None and caller.f_code is code

    def handle(self, callback: Any, frame: Any, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if under_import_lock(caller):  # its own first test is the cheap _imp.lock_held()
            # H12: never wait for compile_lock while holding the import lock (see the module docstring).
            lock = compile_lock()
            held = _flights.hold_count(lock)
            before = held()
            try:
                if not lock.acquire(False):
                    del caller
                    return self.skip_frame()
                return self._handle(callback, frame, caller, args, kwargs)
            finally:
                while held() > before:
                    lock.release()
        return self._handle(callback, frame, caller, args, kwargs)

    def _handle(self, callback: Any, frame: Any, caller: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _flights.internal.busy:  # a frame created by the flight bookkeeping itself
            del caller
            return self.original(callback, frame, *args, **kwargs)
        if self._nonrecursively_disabled(caller):
            del caller
            return self.skip_frame()  # what upstream returns for it: run the frame as it is, this time
        backend = backend_of(callback)  # what dynamo's lookup compares entries against
        compile_fn = functools.partial(self.compile_frame, callback, frame, args, kwargs, backend)
        gate = first_frame_gate(caller, self.cw_code, self.plumbing)
        if gate is None:
            owner = _calls.innermost_main(caller)
            del caller
            return _flights.fly(owner.key if owner else None, owner, compile_fn, compile_lock())
        del caller
        call = _calls.state(gate)
        # A continuation's compile is part of the enclosing torch.compile call's flight.
        owner = _calls.innermost_main(gate.f_back) if call.resume else call
        del gate
        return self._first_frame(call, owner, frame, backend, compile_fn)

    def _first_frame(self, call: GateCall, owner: GateCall | None, frame: Any, backend: Any,
                     compile_fn: Callable[[], Any]) -> Any:
        code = frame.f_code
        retry = call.may_retry()
        if retry and self.probe.matches(frame, backend):
            # Dynamo's lookup missed an entry that is in the cache: it walks the entry list while other
            # threads move entries to its front (see the package docstring). Look again.
            call.attempt += 1
            self.stats.record(code, "lookup_retries")
            raise Retry()
        t0 = time.perf_counter()
        lock = compile_lock()  # read at call time: compile_lock_watchdog may have wrapped it
        flight = owner.flight if owner is not None else None
        # Given back by hold count, whatever point an asynchronous exception arrives at (see _flights.fly).
        held = _flights.hold_count(lock)
        before = held()
        try:
            if flight is not None:
                flight.queued += 1  # its waiters need not wait for this thread's turn at the lock
            try:
                lock.acquire()
            finally:
                if flight is not None:
                    flight.queued -= 1
            waited = time.perf_counter() - t0
            served = retry and self.probe.matches(frame, backend)
            if not served:
                result = _flights.fly(owner.key if owner else None, owner, compile_fn, lock)
        finally:
            while held() > before:
                lock.release()
        if served:
            call.attempt += 1
            self.stats.record(code, "served_by_other_thread", waited)
            raise Retry()  # the gate waits for the server's flight's compiles (_flights.await_others), then calls again
        if getattr(result, "guarded_code", result) is not None:
            self.stats.record(code, "compiles", waited)
        return result
