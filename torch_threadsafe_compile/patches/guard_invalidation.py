"""H8 (crash) — a guard manager that another thread may be evaluating is not freed when its cache entry is
invalidated; it is kept until no thread that was alive at the invalidation is left, or the next reset.

Dynamo guards objects by identity (``ID_MATCH``, the ``TYPE_MATCH`` of a class made at run time, …) with a
``weakref.finalize`` per object; when such an object dies, ``CheckFunctionManager.invalidate`` runs from the
finalizer — in whichever thread the last reference dropped or the garbage collector ran — and tells the C
side to invalidate the cache entry (``ExtraState::invalidate`` → ``CacheEntry::invalidate``). That drops the
entry's reference to its ``GuardManagerWrapper``, and the ``CheckFunctionManager`` drops the other one, so the
wrapper's ``RootGuardManager`` (the C++ guard tree) is freed at once. But dynamo's C ``lookup()`` reads the
entry's raw ``root_mgr`` pointer and evaluates that tree *without holding the GIL all the way*:
``RootGuardManager::check_nopybind`` releases the GIL to take its mutex, and guards that run Python code
(``__eq__``, lambda guards) let other threads run. A thread that was inside that check when another thread
invalidated the entry carries on in freed memory: ``SIGSEGV`` in
``RootGuardManager::check_nopybind_template`` under ``lookup`` (or ``SIGFPE``/``SIGABRT`` on a destroyed
mutex or hash table). Reproducer: ``python -m ttc_testing.crash_scenarios guard_invalidation_race`` (crashes
unpatched torch 2.13 in a few seconds, 4 threads); pytest-run-parallel on ``dynamo/test_misc.py`` dies the
same way (docs/upstream-tests.md). The same holds for the skip-guard-eval stance's diff guard tree:
``GuardManagerWrapper.populate_diff_guard_manager`` — run on *every* existing entry of a code object at each
recompile, by ``update_diff_guard_managers_for_existing_cache_entries`` — replaces ``diff_guard_root`` before
it repoints the entry's raw ``diff_guard_root_mgr``, freeing the tree that pointer still names.

Fix, from Python: the patched ``invalidate`` and ``populate_diff_guard_manager`` do what upstream does, but
first put the tree they are about to release (the wrapper, the old diff root) on a *graveyard*, with the
threads alive at that moment other than the current one. A kept tree stays valid, so a thread still inside
its check finishes on valid memory (and then finds the entry invalidated: its code is ``None``, which dynamo
treats as a miss, as upstream). New lookups cannot reach a kept tree (the entry's pointer is cleared or
repointed first). A kept tree is released when none of the threads recorded with it is alive any more
(checked at each invalidation), or at ``torch._dynamo.reset()`` (which frees every entry anyway; a thread
inside a lookup there would crash upstream as well, see H3's reset barrier) -- at a reset only when no other
thread exists or the barrier saw nobody inside dynamo (``_graveyard.may_free``, H11). With no other thread alive the
patch does nothing but call upstream (a single-threaded program behaves, and frees, exactly as upstream).
Cost: kept guard trees of long-lived threads stay until the next reset (``status()`` reports how many).
Upstream's fix is pytorch/pytorch#195355 (a lock per ``ExtraState``; invalidations that arrive during a
lookup are queued and applied after it), after 2.15.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from torch_threadsafe_compile import _graveyard
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["guard_invalidation"]

_stats = {"immediate": 0}


def _release_all() -> None:
    _graveyard.release(everything=True)


def _make_invalidate(original: Any) -> Any:
    def invalidate(self: Any, obj_str: str) -> Any:
        _graveyard.release()
        others = _graveyard.others()
        if others:
            gm = self.__dict__.get("guard_manager")
            if gm is not None:
                _graveyard.keep((gm,), others)
        else:
            _stats["immediate"] += 1
        return original(self, obj_str)

    functools.update_wrapper(invalidate, original)  # name, qualname, doc, module, __wrapped__
    return invalidate


def _make_populate(original: Any) -> Any:
    def populate_diff_guard_manager(self: Any) -> Any:
        old = self.__dict__.get("diff_guard_root")
        if old is not None:
            others = _graveyard.others()
            if others:
                _graveyard.keep((old,), others)
        return original(self)

    functools.update_wrapper(populate_diff_guard_manager, original)  # name, qualname, doc, module, __wrapped__
    return populate_diff_guard_manager


def _make_reset_hook(original: Any) -> Any:
    def reset_code_state(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            # Everything only when no other thread can be inside dynamo: a reset that could not drain
            # them (H11: one that holds compile_lock while they wait for it) keeps what they may evaluate.
            _graveyard.release(everything=_graveyard.may_free())

    reset_code_state.__wrapped__ = original  # type: ignore[attr-defined]
    reset_code_state.__name__ = getattr(original, "__name__", "reset_code_state")
    reset_code_state.__doc__ = getattr(original, "__doc__", None)
    return reset_code_state


def check() -> str | None:
    guards = loaded("torch._dynamo.guards")
    cfm = getattr(guards, "CheckFunctionManager", None)
    inv = getattr(cfm, "__dict__", {}).get("invalidate")
    if inv is None or not hasattr(inv, "__code__"):
        return "CheckFunctionManager.invalidate not found"
    names = set(inv.__code__.co_names)
    if not {"guard_manager", "invalidate"} <= names:
        return "CheckFunctionManager.invalidate no longer hands the cache entry to ExtraState.invalidate"
    if not callable(getattr(loaded("torch._dynamo"), "reset_code_state", None)):
        return "torch._dynamo.reset_code_state not found (the release point at reset)"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    guards = loaded("torch._dynamo.guards")
    cfm = guards.CheckFunctionManager
    changes.setattr(cfm, "invalidate", _make_invalidate(cfm.__dict__["invalidate"]))
    gmw = getattr(guards, "GuardManagerWrapper", None)
    pop = getattr(gmw, "__dict__", {}).get("populate_diff_guard_manager")
    if pop is not None and hasattr(pop, "__code__") and "diff_guard_root" in pop.__code__.co_names:
        changes.setattr(gmw, "populate_diff_guard_manager", _make_populate(pop))
    dynamo = loaded("torch._dynamo")
    changes.setattr(dynamo, "reset_code_state", _make_reset_hook(dynamo.reset_code_state))
    changes.on_revert(_release_all)
    return {}


def verify() -> None:
    guards = loaded("torch._dynamo.guards")
    inv = guards.CheckFunctionManager.__dict__["invalidate"]
    if getattr(inv, "__wrapped__", None) is None:
        raise AssertionError("CheckFunctionManager.invalidate is not replaced")

    # The kept tree must be held while another thread that was alive at the invalidation lives, and dropped
    # after it ended.
    class _Probe:  # stands for a CheckFunctionManager whose guard manager has no cache entry (upstream no-op)
        pass

    class _Tree:
        cache_entry = None
        extra_state = None

    probe = _Probe()
    tree = _Tree()
    probe.guard_manager = tree  # type: ignore[attr-defined]
    started, finish = threading.Event(), threading.Event()
    def other() -> None:
        started.set()
        finish.wait(10)

    t = threading.Thread(target=other, name="ttc-h8-verify", daemon=True)
    t.start()
    started.wait(10)
    try:
        inv(probe, "probe")
        held = _graveyard.held(tree)
    finally:
        finish.set()
        t.join(10)
    if not held:
        raise AssertionError("an invalidated guard tree was not kept while another thread was alive")
    _graveyard.release()
    # Every thread alive at the invalidation keeps the tree: the probe thread, and whatever threads the
    # program runs already (a late install(), a library's monitor thread). Only the probe thread has ended.
    if _graveyard.held(tree) and (t.ident in _graveyard.waits_for(tree) or not _graveyard.waits_for(tree)):
        raise AssertionError("a kept guard tree was not released after its threads ended")
    _graveyard.forget(tree)


def report() -> dict[str, Any]:
    return {"kept_now": _graveyard.count(), **_graveyard.stats, **_stats}
