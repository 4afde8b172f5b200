"""Objects that dynamo's C code may still be using in another thread, kept alive until it cannot be.

Dynamo's C ``lookup()`` reads raw pointers (an entry's ``root_mgr``, ``diff_guard_root_mgr``, the code
object's ``ExtraState``) and evaluates guard trees while other threads run (each guard check drops the GIL).
From Python it cannot be seen which thread is inside such a check. What can be seen: which threads exist.
A *tomb* keeps its objects together with the threads that were alive when they were released, other than
the releasing one; it is dropped once none of those threads is alive (:func:`release`, at each new tomb and
at ``torch._dynamo.reset()``), or all at once at a reset (which frees every cache entry anyway).

Used by the patches of H8 (``guard_invalidation``) and H9 (``code_reset``), and by the reset barrier of H3
(``first_compile``), which marks a reset that has seen no other thread inside dynamo (:func:`quiesced`):
only then, or in a single-threaded process, may a reset free caches and kept trees as upstream does
(:func:`may_free`; H11). Standard library only.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

from torch_threadsafe_compile import _forksafe

__all__ = ["others", "keep", "release", "held", "waits_for", "forget", "stats", "quiesced", "may_free"]

_lock = threading.Lock()
_quiet = threading.local()  # depth: this thread runs a reset that saw no other thread inside dynamo
_tombs: list[tuple[tuple[Any, ...], frozenset[int]]] = []
stats = {"kept": 0, "released": 0}


@_forksafe.in_child
def _after_fork() -> None:
    global _lock, _quiet
    _lock = threading.Lock()
    _quiet = threading.local()  # a reset of the parent does not go on in the child
    _tombs.clear()  # the recorded threads do not exist in a forked child


def _alive() -> set[int]:
    """Threads that may be running Python: every thread with a Python frame, and every thread ``threading``
    knows (one entered from C may have no frame yet)."""
    idents = set(sys._current_frames())
    idents.update(t.ident for t in threading.enumerate() if t.ident is not None)
    return idents


def others() -> frozenset[int]:
    """The threads alive now other than the calling one (empty: a single-threaded process)."""
    me = threading.get_ident()
    return frozenset(i for i in _alive() if i != me)


@contextlib.contextmanager
def quiesced() -> Iterator[None]:
    """For the duration, the calling thread runs a reset that has seen no other thread inside dynamo's
    cache (first_compile's barrier drained them): freeing code caches and kept trees is safe."""
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        yield
    finally:
        _quiet.depth -= 1


def may_free() -> bool:
    """Whether dynamo may free a code object's cache (``ExtraState``) or every kept tree now: no other thread
    exists, or the calling thread's reset is :func:`quiesced`. Otherwise another thread may be walking that
    cache, or compiling a frame of that code and about to insert its entry (H9, H11)."""
    return getattr(_quiet, "depth", 0) > 0 or not others()


def keep(objs: tuple[Any, ...], threads: frozenset[int]) -> None:
    with _lock:
        _tombs.append((objs, threads))
        stats["kept"] += 1


def release(everything: bool = False) -> int:
    """Drop the tombs whose threads have all ended (every tomb with ``everything``). The objects die outside
    the lock: their destructors can run Python code (finalizers) that comes back here."""
    with _lock:
        if not _tombs:
            return 0
        if everything:
            gone = list(_tombs)
            _tombs.clear()
        else:
            alive = _alive()
            gone = [t for t in _tombs if not (t[1] & alive)]
            if not gone:
                return 0
            _tombs[:] = [t for t in _tombs if t[1] & alive]
        stats["released"] += len(gone)
    n = len(gone)
    del gone
    return n


def held(obj: Any) -> bool:
    with _lock:
        return any(o is obj for objs, _ in _tombs for o in objs)


def waits_for(obj: Any) -> frozenset[int]:
    """The threads still alive that keep ``obj``'s tomb (empty when it is not kept, or could be dropped)."""
    alive = _alive()
    with _lock:
        return frozenset().union(*(threads & alive for objs, threads in _tombs if any(o is obj for o in objs)))


def forget(obj: Any) -> None:
    """Drop the tombs holding ``obj`` (a self-check's probe)."""
    with _lock:
        _tombs[:] = [t for t in _tombs if not any(o is obj for o in t[0])]


def count() -> int:
    with _lock:
        return len(_tombs)
