"""Hang detector for dynamo's compile lock (H4 and anything like it).

The lock's instrumentation (who waits, priority for short holders) is ``_compile_lock``; this module only
looks at it.

``TTC_WATCHDOG=<seconds>`` (or :func:`start`) runs one daemon thread that looks, about four times per
bound, at the threads waiting for dynamo's ``compile_lock`` (the ``compile_lock_watchdog`` patch counts
them). When one has waited longer than the bound, it writes every thread's stack to stderr once per
episode, with a message naming the likely hazard, and calls ``on_hang`` callbacks (tests use them to fail
fast instead of hanging). It never kills or unblocks anything: it only makes a silent hang visible.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from typing import Callable

from torch_threadsafe_compile import _env, _forksafe
from torch_threadsafe_compile._compile_lock import InstrumentedRLock

__all__ = ["InstrumentedRLock", "watch", "unwatch", "start", "stop", "running", "hangs"]  # InstrumentedRLock: _compile_lock

# The shortest bound (shared with TTC_WATCHDOG's parsing): see _env.WATCHDOG_MIN_S.
MIN_BOUND_S = _env.WATCHDOG_MIN_S

HINT = (
    "likely H4: a thread holds dynamo's compile_lock while it needs the autograd engine, and the engine's "
    "worker waits for compile_lock in a lazy backward compile (see docs/hazards.md, H4)"
)


_lock_ref: list[InstrumentedRLock] = []
_thread: threading.Thread | None = None
_bound: float | None = None  # the running watchdog's bound in seconds
_stop = threading.Event()
_callbacks: list[Callable[[str], None]] = []
hangs: list[str] = []  # messages of the episodes detected in this process


@_forksafe.in_child
def _after_fork() -> None:
    """In a forked child: the watched lock's waiters are gone, and the watchdog thread too; a child of a
    watched process is watched as well."""
    global _thread, _stop
    for lock in _lock_ref:
        lock.after_fork()
    was = _bound if _thread is not None else None
    _thread, _stop = None, threading.Event()
    if was is not None:
        start(was)


def watch(lock: InstrumentedRLock) -> None:
    """The lock whose waiters the watchdog looks at (dynamo's compile_lock, once instrumented)."""
    _lock_ref[:] = [lock]


def unwatch() -> None:
    _lock_ref.clear()


def running() -> bool:
    return _thread is not None and _thread.is_alive()


def start(seconds: float, on_hang: Callable[[str], None] | None = None) -> None:
    """Start (or re-arm) the watchdog with a bound in seconds."""
    global _thread, _bound
    if not seconds >= MIN_BOUND_S:
        raise ValueError(f"seconds must be >= {MIN_BOUND_S}")
    if on_hang is not None:
        _callbacks.append(on_hang)
    if running():
        return
    _stop.clear()
    _bound = float(seconds)
    _thread = threading.Thread(target=_run, args=(float(seconds),), name="ttc-watchdog", daemon=True)
    _thread.start()


def stop() -> None:
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(5)
    _thread = None
    _callbacks.clear()


def _run(bound: float) -> None:
    reported = False
    while not _stop.wait(min(1.0, bound / 4)):
        lock = _lock_ref[0] if _lock_ref else None
        if lock is None:
            continue
        now = time.monotonic()
        stuck = {t: now - s for t, s in list(lock.waiting.items()) if now - s > bound}
        if not stuck:
            reported = False
            continue
        if reported:
            continue
        reported = True
        names = {t.ident: t.name for t in threading.enumerate()}
        who = ", ".join(f"{names.get(t, t)} ({w:.0f} s)" for t, w in stuck.items())
        msg = f"torch-threadsafe-compile watchdog: waiting for dynamo's compile_lock longer than {bound:g} s: {who}; {HINT}"
        hangs.append(msg)
        try:
            sys.stderr.write(msg + "\n")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:
            pass
        for cb in list(_callbacks):
            try:
                cb(msg)
            except Exception:
                pass
