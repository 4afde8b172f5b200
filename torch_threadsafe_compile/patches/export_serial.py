"""H7 — two threads' ``torch.export`` calls take turns.

An export keeps per-call state in module globals of ``torch.export._trace``: ``_EXPORT_MODULE_HIERARCHY``
and ``_EXPORT_FLAGS``, set when ``_export`` / ``_export_for_training`` start and cleared by their
``_log_export_wrapper`` when they end. A second thread's export clears them under the first, which then
fails (``AssertionError: _EXPORT_MODULE_HIERARCHY must not be None``); unpatched, the two exports' fake
and proxy modes also collide (``ProxyTorchDispatchMode slot already occupied``). Measured on torch 2.13 CPU,
two threads exporting a small module for 5 s: 141 of 299 exports failed unpatched; found by the 64-thread
torture (``bench/soak.py --tracers 2 --reset-every 2``), where it was the only error left.

The patch puts one re-entrant lock around those two entry points (an export calls the second from the
first), so exports take turns, as compiles do with each other. Everything else runs beside them as
upstream. Lock order: this lock, then dynamo's ``compile_lock`` (a strict export's capture and
``export_lock`` take it inside); nothing takes this lock while holding ``compile_lock``, since no compile
calls ``torch.export``.

Upstream: pytorch/pytorch#105943 (PT2 is not thread safe).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes, run_in_thread
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["export_serial"]

ENTRY_POINTS = ("_export", "_export_for_training")
GLOBALS = ("_EXPORT_MODULE_HIERARCHY", "_EXPORT_FLAGS")

_lock = threading.RLock()


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()  # another thread of the parent may have been exporting


def _present(mod: Any) -> list[str]:
    return [name for name in ENTRY_POINTS if callable(mod.__dict__.get(name))]


def check() -> str | None:
    mod = loaded(SPEC.modules[0])
    if not _present(mod):
        return "torch.export._trace._export not found"
    missing = [g for g in GLOBALS if g not in mod.__dict__]
    if len(missing) == len(GLOBALS):
        return "torch.export._trace keeps no per-export module globals here (" + ", ".join(GLOBALS) + ")"
    return None


def _serial(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def export_in_turn(*args: Any, **kwargs: Any) -> Any:
        with _lock:  # read at call time: a forked child has a fresh one
            return original(*args, **kwargs)

    return export_in_turn


def apply(changes: Changes) -> dict[str, Any]:
    # torch.export.export imports _export from the module at call time, and _export calls
    # _export_for_training by its global name: replacing the attributes reaches both.
    mod = loaded(SPEC.modules[0])
    names = _present(mod)
    for name in names:
        changes.setattr(mod, name, _serial(mod.__dict__[name]))
    return {"wrapped": names}


def verify() -> None:
    mod = loaded(SPEC.modules[0])
    for name in _present(mod):
        if getattr(mod.__dict__[name], "__wrapped__", None) is None:
            raise AssertionError(f"torch.export._trace.{name} is not wrapped")
    def other_thread_takes_it() -> bool:
        if not _lock.acquire(False):
            return False
        _lock.release()
        return True

    with _lock:  # held here: another thread cannot take it, this one can again (an export calls the other)
        if run_in_thread(other_thread_takes_it):
            raise AssertionError("another thread took the export lock while this one held it")
        with _lock:
            pass
