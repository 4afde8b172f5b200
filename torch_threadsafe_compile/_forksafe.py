"""Fork safety: what the package puts back to its start in a child made by ``os.fork()``.

A forked child has one thread, the one that called ``fork()``. A lock that another thread of the parent
held stays held forever in the child; a wait for another thread's progress (a reset draining gated calls,
a flight landing) never ends; tables describe threads that do not exist. Each module of the package that
keeps such state registers a function here that resets it; they run in the child, in registration order,
before ``fork()`` returns there (``os.register_at_fork``). None of them may raise (each is guarded) or take
a lock that another thread could hold. The forking thread's own state (its stack of gated calls, its
flags) stays: that thread goes on in the child.

Standard library only, and nothing of ours: any module may register.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

__all__ = ["in_child", "forks"]

_handlers: list[Callable[[], None]] = []
forks = 0  # children of this process's forks that ran the handlers (in the child: 1 and up)


def in_child(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` to run in every child forked from now on (a decorator; returns ``fn``)."""
    _handlers.append(fn)
    return fn


def _after_fork_in_child() -> None:
    global forks
    forks += 1
    for fn in list(_handlers):
        try:
            fn()
        except Exception as e:  # the child must run on; say what was not reset
            try:
                sys.stderr.write(f"torch-threadsafe-compile: after fork: {getattr(fn, '__qualname__', fn)} failed: {e!r}\n")
            except Exception:
                pass


if hasattr(os, "register_at_fork"):  # not on Windows (no fork there)
    os.register_at_fork(after_in_child=_after_fork_in_child)
