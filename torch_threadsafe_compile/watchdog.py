"""Hang detector for dynamo's compile lock (H4 and anything like it).

``TTC_WATCHDOG=<seconds>`` (or :func:`start`) runs one daemon thread that looks, about four times per
bound, at the threads waiting for dynamo's ``compile_lock`` (the ``compile_lock_watchdog`` patch counts
them). When one has waited longer than the bound, it writes every thread's stack to stderr once per
episode, with a message naming the likely hazard, and calls ``on_hang`` callbacks (tests use them to fail
fast instead of hanging). It never kills or unblocks anything: it only makes a silent hang visible.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import threading
import time
from typing import Any, Callable, Iterator

from torch_threadsafe_compile import _env, _forksafe

__all__ = ["InstrumentedRLock", "watch", "unwatch", "start", "stop", "running", "hangs"]

# The shortest bound (shared with TTC_WATCHDOG's parsing): see _env.WATCHDOG_MIN_S.
MIN_BOUND_S = _env.WATCHDOG_MIN_S

HINT = (
    "likely H4: a thread holds dynamo's compile_lock while it needs the autograd engine, and the engine's "
    "worker waits for compile_lock in a lazy backward compile (see docs/hazards.md, H4)"
)


class InstrumentedRLock:
    """A re-entrant lock that wraps an existing ``threading.RLock`` and records who waits for it.

    It wraps rather than replaces, so code that captured the original lock still excludes correctly.
    The uncontended path is one non-blocking acquire.

    Short holders (an FX trace, an export's global overrides) take it with :meth:`priority`: while one waits,
    threads that do not hold the lock yet (compiles) let it go first, so a stream of compiles cannot starve
    it. A compile never waits for more than the holder in front of it plus the short holders.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.after_fork()

    def after_fork(self) -> None:
        """(Re)set the bookkeeping: at creation, and in a forked child, where the threads it names do not exist."""
        self.waiting: dict[int, float] = {}  # thread ident -> monotonic time it started waiting
        self._priority_waiting = 0
        self._priority_done = threading.Condition(threading.Lock())

    @property
    def inner(self) -> Any:
        """The ``threading.RLock`` this wraps (the object code that captured it still uses)."""
        return self._inner

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._priority_waiting and blocking and not self._inner._is_owned():
            with self._priority_done:  # a short holder is queued: let it go first (bounded by its turn)
                self._priority_done.wait_for(lambda: not self._priority_waiting, 5.0)
        if self._inner.acquire(False):
            return True
        if not blocking:
            return False
        me = threading.get_ident()
        self.waiting[me] = time.monotonic()
        try:
            return bool(self._inner.acquire(True, timeout))
        finally:
            self.waiting.pop(me, None)

    @contextlib.contextmanager
    def priority(self) -> Iterator[None]:
        """Hold the lock, ahead of threads that are not holding it yet (see the class docstring)."""
        if self._inner._is_owned():
            with self:
                yield
            return
        with self._priority_done:
            self._priority_waiting += 1
        try:
            me = threading.get_ident()
            self.waiting[me] = time.monotonic()
            try:
                self._inner.acquire()
            finally:
                self.waiting.pop(me, None)
        finally:
            with self._priority_done:
                self._priority_waiting -= 1
                self._priority_done.notify_all()
        try:
            yield
        finally:
            self._inner.release()

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self._inner.release()

    def _is_owned(self) -> bool:  # used by threading.Condition
        return bool(self._inner._is_owned())

    def __repr__(self) -> str:
        return f"<InstrumentedRLock {self._inner!r} waiting={len(self.waiting)}>"


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
