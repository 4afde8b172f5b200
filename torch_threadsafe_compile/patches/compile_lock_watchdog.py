"""H4 (detector) — make waits on dynamo's ``compile_lock`` observable.

Wraps ``torch._dynamo.convert_frame.compile_lock`` in an :class:`~torch_threadsafe_compile._compile_lock.InstrumentedRLock`
that records waiting threads (the underlying RLock is kept, so code that captured it still excludes
correctly). With ``TTC_WATCHDOG=<seconds>`` or ``torch_threadsafe_compile.watchdog.start(s)`` a watchdog
dumps every stack when a wait exceeds the bound. This is the only defence on versions where the lock-order
inversion exists but ``lazy_backward`` cannot apply (torch 2.9: no ``force_non_lazy_backward_lowering``).

Every module that takes the lock reads ``convert_frame.compile_lock`` at call time (``with compile_lock``
in convert_frame.py reads the module global; compile_fx imports it inside the function), so they all see
the wrapper.
"""

from __future__ import annotations

import threading
from typing import Any

from torch_threadsafe_compile import _env, watchdog
from torch_threadsafe_compile._compile_lock import InstrumentedRLock
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["compile_lock_watchdog"]

_RLOCK_TYPE = type(threading.RLock())


def _cf() -> Any:
    return loaded(SPEC.modules[0])


def check() -> str | None:
    lock = getattr(_cf(), "compile_lock", None)
    if lock is None:
        return "torch._dynamo.convert_frame.compile_lock not found"
    if not isinstance(lock, (_RLOCK_TYPE, InstrumentedRLock)):
        return f"compile_lock is a {type(lock).__name__}, expected an RLock"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    cf = _cf()
    inner = cf.compile_lock
    if isinstance(inner, InstrumentedRLock):
        inner = inner.inner
    lock = InstrumentedRLock(inner)
    changes.setattr(cf, "compile_lock", lock)
    watchdog.watch(lock)
    changes.on_revert(watchdog.unwatch)
    # For short holders (fx_patcher, export_lock) and for resets that must know who waits (first_compile).
    changes.provide("compile_lock.priority", lock.priority)
    changes.provide("compile_lock.waiters", lambda: frozenset(lock.waiting.copy()))  # one C call: threads come and go

    seconds = _env.current().watchdog_s
    if seconds:
        watchdog.start(seconds)
    return {}


def verify() -> None:
    lock = _cf().compile_lock
    with lock:
        with lock:  # re-entrant
            pass


def report() -> dict[str, Any]:
    return {"watchdog_running": watchdog.running(), "hangs_detected": len(watchdog.hangs)}
