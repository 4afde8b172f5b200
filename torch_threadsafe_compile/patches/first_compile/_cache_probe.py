"""Does dynamo's cache already hold what this frame needs? (guards and backend, as dynamo's lookup checks)

Dynamo's C ``lookup()`` walks a code object's entry list and runs each entry's root guard manager, whose
``check`` releases the GIL to take its mutex; meanwhile a hit in another thread moves an entry to the front
of the list (``move_to_front``), and the walking thread never reaches it: a *spurious miss*. The probe
looks again, from Python, at the entries as they are now. It also counts a compile result that dynamo has
not inserted yet: the C code inserts an entry only after the frame callback returned, i.e. after
``compile_lock`` was released, so a thread that takes the lock in that window would not see it; such a
result counts as cached for ``PENDING_S``.
"""

from __future__ import annotations

import threading
import time
import types
import weakref
from typing import Any, Callable

from torch_threadsafe_compile._torch import cache_entry_lister

PENDING_S = 2.0

Checker = Callable[[dict[str, Any]], Any]


def entry_checker(entry: Any) -> Checker | None:
    """The guard check of a cache entry or compile result (attribute names differ across versions)."""
    gm = getattr(entry, "guard_manager", None)
    if gm is not None and hasattr(gm, "check"):
        return gm.check  # type: ignore[no-any-return]
    fn = getattr(entry, "check_fn", None)  # torch 2.4/2.5: a GuardManager wrapper with .check, or a callable
    if fn is not None and hasattr(fn, "check"):
        return fn.check  # type: ignore[no-any-return]
    return fn if callable(fn) else None


def backend_of(callback: Any) -> Any:
    """The backend dynamo's C lookup compares cache entries against (``get_backend`` in eval_frame)."""
    seen = 0
    while hasattr(callback, "_torchdynamo_orig_backend") and seen < 32:
        callback, seen = callback._torchdynamo_orig_backend, seen + 1
    return callback


def same_backend(saved: Any, backend: Any) -> bool:
    if saved is backend:
        return True
    try:
        return type(saved) is type(backend) and bool(saved == backend)
    except Exception:
        return False


class CacheProbe:
    """Guard checks of the entries cached for a code object, plus results compiled but not yet inserted.

    The table of such results is keyed weakly by code object and pruned as entries expire, so it holds
    at most what was compiled in the last ``PENDING_S`` seconds, whatever the number of functions.
    """

    def __init__(self) -> None:
        lister = cache_entry_lister()
        if lister is None:
            raise RuntimeError("torch._C._dynamo.eval_frame._debug_get_cache_entry_list not found")
        self._entries = lister
        self._pending: weakref.WeakKeyDictionary[types.CodeType, list[tuple[float, Checker, Any]]] = weakref.WeakKeyDictionary()
        # A leaf lock around the table: compile results are remembered outside compile_lock (flights without
        # a key) and, without the GIL, iterating it while another thread changes it raises.
        self._lock = threading.Lock()

    def remember(self, code: types.CodeType, result: Any, backend: Any) -> None:
        guarded = getattr(result, "guarded_code", result)
        checker = entry_checker(guarded) if guarded is not None else None
        if checker is None:
            return
        now = time.monotonic()
        with self._lock:
            for other in list(self._pending.keys()):  # prune: expired results of any code object
                fresh = [p for p in self._pending.get(other, ()) if now - p[0] < PENDING_S]
                if fresh:
                    self._pending[other] = fresh
                else:
                    self._pending.pop(other, None)
            self._pending[code] = [*self._pending.get(code, ()), (now, checker, backend)]

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()

    def pending_size(self) -> int:
        with self._lock:
            return len(self._pending)

    def matches(self, frame: Any, backend: Any) -> bool:
        """Whether the cache holds an entry dynamo's lookup would use for ``frame`` (guards and backend),
        counting a compile result that dynamo has not inserted yet."""
        now = time.monotonic()
        with self._lock:
            pending = list(self._pending.get(frame.f_code, ()))
        candidates: list[tuple[Checker | None, Any]] = [(check, saved) for created, check, saved in pending if now - created < PENDING_S]
        candidates += [(entry_checker(e), getattr(e, "backend", backend)) for e in self._entries(frame.f_code)]
        f_locals = frame.f_locals  # the frame's arguments, as the guards see them (not control flow of ours)
        for check, saved in candidates:
            if check is None or not same_backend(saved, backend):
                continue
            try:
                if check(f_locals):
                    return True
            except Exception:
                continue
        return False
