"""What several patches need to know about torch's internals, in one place (patches import this, never
each other). Nothing here imports torch at module level: every accessor reads ``sys.modules`` at call
time, so it only ever sees what the program itself has imported.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Callable, ContextManager

# The releases whose sources were read for code outside ``torch.compiler`` that uses its flags live in the
# table (registry.py), so that a new torch release is one edit there.
from torch_threadsafe_compile.registry import COMPILER_FLAG_USERS_KNOWN

if TYPE_CHECKING:
    from torch_threadsafe_compile._journal import Capability

__all__ = [
    "loaded", "present_callables", "compile_lock", "holds_compile_lock", "compile_lock_waiters", "compile_lock_or_null",
    "skip_code", "cache_entry_lister",
    "CONFIG_MODULE", "config_unset", "config_entries", "reset_config_caches", "program_threads_started",
    "COMPILER_FLAG_USERS_KNOWN", "compiler_flag_users",
]

CONFIG_MODULE = "torch.utils._config_module"
CONVERT_FRAME = "torch._dynamo.convert_frame"
EVAL_FRAME = "torch._dynamo.eval_frame"


def loaded(name: str) -> types.ModuleType:
    """An imported torch module (a patch only runs once its modules are imported: ``KeyError`` otherwise)."""
    return sys.modules[name]


def present_callables(targets: tuple[tuple[str, str], ...]) -> list[tuple[types.ModuleType, str]]:
    """The ``(module, attribute)`` pairs of ``targets`` whose module is imported and whose attribute is callable."""
    out = []
    for mod_name, attr in targets:
        mod = sys.modules.get(mod_name)
        if mod is not None and callable(getattr(mod, attr, None)):
            out.append((mod, attr))
    return out


# -- dynamo's compile lock ------------------------------------------------------------------------------


def compile_lock() -> Any:
    """dynamo's ``compile_lock`` as it is now (read at call time: ``compile_lock_watchdog`` wraps it), or
    None while ``torch._dynamo`` is not imported."""
    cf = sys.modules.get(CONVERT_FRAME)
    return getattr(cf, "compile_lock", None) if cf is not None else None


def compile_lock_or_null() -> ContextManager[Any]:
    import contextlib

    lock = compile_lock()
    return lock if lock is not None else contextlib.nullcontext()


def compile_lock_first(priority: Capability) -> ContextManager[Any]:
    """dynamo's ``compile_lock`` for a short holder (an FX trace, an export's overrides): ahead of compiles
    that do not hold it yet while ``compile_lock_watchdog`` provides ``priority`` (capability
    ``compile_lock.priority``, see ``watchdog``); else the lock as upstream has it."""
    enter = priority.get()
    return enter() if enter is not None else compile_lock_or_null()


def holds_compile_lock() -> bool:
    """Whether the calling thread holds dynamo's ``compile_lock`` (a compile, an export, an FX trace)."""
    is_owned = getattr(compile_lock(), "_is_owned", None)
    return bool(is_owned()) if callable(is_owned) else False


def compile_lock_waiters(waiters: Capability) -> frozenset[int] | None:
    """The threads waiting for dynamo's ``compile_lock`` now, or None when nobody records them (capability
    ``compile_lock.waiters`` not provided: ``compile_lock_watchdog`` off)."""
    list_waiters = waiters.get()
    return list_waiters() if list_waiters is not None else None


def skip_code(code: types.CodeType) -> bool:
    """Tell dynamo never to compile frames of ``code`` (as it skips its own files). False if unavailable."""
    ef = sys.modules.get(EVAL_FRAME)
    skip = getattr(ef, "skip_code", None) if ef is not None else None
    if skip is None:
        return False
    skip(code)
    return True


def cache_entry_lister() -> Callable[[types.CodeType], list[Any]] | None:
    """The C function listing a code object's dynamo cache entries. Reached as an attribute: on torch 2.4
    ``torch._C._dynamo.eval_frame`` is not registered in ``sys.modules``."""
    torch = sys.modules.get("torch")
    ef = getattr(getattr(getattr(torch, "_C", None), "_dynamo", None), "eval_frame", None)
    fn = getattr(ef, "_debug_get_cache_entry_list", None)
    return fn if callable(fn) else None


# -- config modules (torch.utils._config_module) ----------------------------------------------------------

# Per-module cache ContextVars (torch >= 2.12) and their defaults, as set by install_config_module.
CONFIG_CACHE_VARS = {
    "_hash_dirty_var": True,
    "_hash_cache_var": None,
    "_get_dict_dirty_keys_var": None,
    "_get_dict_cache_var": None,
}


def config_unset() -> Any:
    """``_UNSET_SENTINEL``: the value of an override that is not set."""
    return loaded(CONFIG_MODULE)._UNSET_SENTINEL


def config_entries(module: Any) -> dict[str, Any]:
    """``{name: _ConfigEntry}`` of a config module."""
    entries: dict[str, Any] = module.__dict__["_config"]
    return entries


def uses_context_vars() -> bool:
    """torch >= 2.12: each entry's user override is a ``ContextVar`` (per thread and context)."""
    entry_cls = getattr(loaded(CONFIG_MODULE), "_ConfigEntry", None)
    annotation = getattr(entry_cls, "__annotations__", {}).get("user_override")
    return annotation is ContextVar or "ContextVar" in str(annotation)


def reset_config_caches(module: Any) -> None:
    """Invalidate a config module's hash and ``_get_dict`` caches in every thread and context."""
    for attr, default in CONFIG_CACHE_VARS.items():
        old = module.__dict__.get(attr)
        if isinstance(old, ContextVar):  # one cache per context: a fresh variable resets them all
            module.__dict__[attr] = ContextVar(old.name, default=default)
    if "_is_dirty" in module.__dict__:  # <= 2.11: one process-wide cache
        module.__dict__["_is_dirty"] = True


# -- the program's own threads (H7: process-wide random-number state) --------------------------------------

# Threads that libraries start for their own work and that draw none of the program's random numbers:
# inductor's compile-worker pool reader and timer (started by the first inductor compile of any program),
# tqdm's monitor (transformers), execnet's (pytest-xdist workers). Counting them made every inductor program
# "threaded" (measured on the H200: PyTorch's test_cudagraph_trees.py then failed where it compares compiled
# random ops with eager in one thread).
HELPER_THREAD_MODULES = ("torch.", "tqdm.", "execnet.", "xdist.")


def _helper_thread(t: threading.Thread) -> bool:
    target = getattr(t, "_target", None)
    module = getattr(target, "__module__", None) or type(t).__module__ or ""
    return module.startswith(HELPER_THREAD_MODULES) or (module == "concurrent.futures.thread" and _compile_pool_worker(t))


# inductor's compile pool (``AsyncCompile.pool()``: a ``ThreadPoolExecutor`` of ``compile_threads`` workers,
# 2 or more on any machine of 2 cores or more), once seen: remembered so that its cached getter is called
# once, not on every check; weak, so a pool torch drops is not kept alive.
_compile_pool: list[weakref.ref[Any]] = []


def _compile_pool_worker(t: threading.Thread) -> bool:
    """A worker of inductor's compile pool. Its workers live on, idle, after the first inductor compile that
    used the pool, and run torch's compile jobs only; counted as the program's own, they made every
    single-threaded inductor program "threaded" (measured: PyTorch's test_cudagraph_trees.py on an H100,
    4 tests failed only with the package where earlier tests of the same process had compiled with inductor).
    A ``ThreadPoolExecutor`` of the program's own still counts."""
    args = getattr(t, "_args", None)  # concurrent.futures.thread._worker(executor_reference, ...)
    ref = args[0] if args else None
    executor = ref() if isinstance(ref, weakref.ref) else None
    if executor is None:
        return False
    known = _compile_pool[0]() if _compile_pool else None
    if known is None:
        known = _made_compile_pool()
        _compile_pool[:] = [weakref.ref(known)] if known is not None else []
    return executor is known


def _made_compile_pool() -> Any:
    """``AsyncCompile.pool()`` if inductor has made it, else None: never makes it (its cache says whether)."""
    ac = getattr(sys.modules.get("torch._inductor.async_compile"), "AsyncCompile", None)
    pool = getattr(ac, "pool", None)
    info = getattr(pool, "cache_info", None)
    if not callable(info) or getattr(info(), "currsize", 0) == 0:
        return None
    return pool()  # type: ignore[misc]


def program_threads_started() -> bool:
    """Whether the program has started a ``threading`` thread besides the main thread that is alive: then
    another thread may draw random numbers, or hold a lock, at any moment. torch's own C++ threads (autograd workers) are not
    ``threading`` threads; dummies (foreign threads that asked for ``current_thread()``) and library helper
    threads (HELPER_THREAD_MODULES) do not count. Reads ``threading._active`` without creating a dummy."""
    main, dummy = threading.main_thread(), threading._DummyThread  # type: ignore[attr-defined]
    threads = list(threading._active.values())  # type: ignore[attr-defined]
    return any(t is not main and not isinstance(t, dummy) and _alive(t) and not _helper_thread(t) for t in threads)


def _alive(t: threading.Thread) -> bool:
    """``t.is_alive()`` without taking a lock. On CPython 3.11/3.12 ``is_alive()`` tries the thread's state lock
    (non-blocking); under gevent that is a cooperative lock whose acquire can switch greenlets, and this runs
    inside dynamo's frame callback, in the middle of a compile: another greenlet's compiled call then ran under
    the compile's fake-tensor mode ("Please convert all Tensors to FakeTensors", the gevent test, once under
    load). A thread leaves ``threading._active`` before that lock is released, so the flags suffice here.
    3.13 reads the thread's handle, in C."""
    stopped = getattr(t, "_is_stopped", None)
    if stopped is None or not hasattr(t, "_tstate_lock"):
        return t.is_alive()
    return not stopped and t._started.is_set()  # type: ignore[attr-defined]


def program_threads_functions() -> tuple[Callable[..., Any], ...]:
    """:func:`program_threads_started` and the functions it calls, for a patch that calls it inside dynamo's
    frame callback and must mark their frames "run as it is" (``skip_code``)."""
    return (program_threads_started, _alive, _helper_thread, _compile_pool_worker, _made_compile_pool)


# -- torch.compiler's flags outside their module ----------------------------------------------------------

def compiler_flag_users(template: Callable[..., Any]) -> list[tuple[types.FunctionType, Callable[..., Any]]] | None:
    """``_rewrite.thread_local_global``'s ``held_by`` for a flag of ``torch.compiler``: the generator function
    of ``_compiling_state_context`` with the patch's ``template`` for it, when that context is the only code
    outside ``torch.compiler`` that uses the module's flags (a release of the range above); else None."""
    from torch_threadsafe_compile import _version_ranges

    version = _version_ranges.torch_version()
    if version is None or not _version_ranges.version_in(version, COMPILER_FLAG_USERS_KNOWN):
        return None
    utils = sys.modules.get("torch._export.utils")
    fn = getattr(getattr(utils, "_compiling_state_context", None), "__wrapped__", None)
    if not isinstance(fn, types.FunctionType) or not fn.__code__.co_flags & 0x20:  # CO_GENERATOR
        return None
    return [(fn, template)]
