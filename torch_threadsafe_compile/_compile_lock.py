"""The instrumented compile lock: dynamo's ``compile_lock``, wrapped so that waits are recorded and short
holders go first.

``compile_lock_watchdog`` (H4) puts an :class:`InstrumentedRLock` at
``torch._dynamo.convert_frame.compile_lock``; the watchdog reads its waiters; ``fx_patcher`` and
``export_lock`` take it through ``_torch.compile_lock_first`` with :meth:`InstrumentedRLock.priority` when
it is there (and plainly when it is not: they need no ordering against that patch, only its effect when
present, declared as ``uses`` in their specs).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

__all__ = ["InstrumentedRLock"]


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
