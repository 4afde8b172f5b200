"""H9 (crash) — ``remove_from_cache`` (every ``torch._dynamo.export`` call, twice) no longer frees a code
object's cache while other threads may be looking it up or compiling it.

``torch._dynamo.export(f)`` calls ``torch._dynamo.eval_frame.remove_from_cache(f)`` before and after it
traces, which calls the C ``reset_code(f.__code__)``: it replaces the code object's ``ExtraState`` by
nothing, and CPython frees the old one with every cache entry and guard tree in it — without
``compile_lock`` and without regard for other threads. A thread inside dynamo's C ``lookup()`` on that code
iterates the freed entry list (each guard check drops the GIL); a thread compiling that code read the
``ExtraState`` pointer before its frame callback and inserts its result into the freed object when the
callback returns, so the heap is corrupt and the process dies later anywhere: ``SIGSEGV`` in
``ExtraState::invalidate`` from a weakref finalizer, in ``lookup``, in ``convert_frame._compile``, or
``SIGFPE``. Reproducer: ``python -m ttc_testing.crash_scenarios export_beside_calls`` (2 threads export a
function while 2 call it compiled: unpatched torch 2.13 dies in a few seconds; so does pytest-run-parallel
on ``dynamo/test_misc.py::MiscTests::test_cond_export``, whose 4 threads export one nested function).

Fix: while other threads exist, ``reset_code(code)`` *invalidates* each entry of the code object, as
dynamo does when an object its guards match by identity dies (``ExtraState.invalidate`` with a deleted
guard manager: the entry's guards fail from now on, its compiled code is dropped), instead of freeing the
list; the guard trees are kept until no thread that was alive then is left (``_graveyard``, as in H8).
What a reset promises stays: the next call compiles afresh. Such entries do not count towards
``recompile_limit`` (``compute_cache_size`` skips them; upstream would have deleted them). In a
single-threaded process ``reset_code`` is upstream's. Not kept from upstream's reset while threads run: the
code object's automatic-dynamic memory (``frame_state``) and its skip/run-only marks, which upstream's reset
forgets; export compiles with ``automatic_dynamic_shapes=False``, so its graphs are unaffected. The
invalidated entries stay in the list (a failed check costs a pointer test) until ``torch._dynamo.reset()``.
``torch._dynamo.reset()`` and ``reset_code_caches()`` themselves are serialised against gated calls by
``first_compile`` (H3).

The compile count restarts, as after upstream's reset: dynamo numbers a code object's compiles per frame id
(``frame_state["_id"]``, kept in the code's ``ExtraState``) and refuses a compile once that number reaches
``accumulated_recompile_limit`` (256), even when the cache does not grow. Upstream's reset drops the frame
state, so the next compile takes a new frame id counted from 0; the soft reset keeps it, and a function
exported ~128 times beside threads calling it (export and the next call compile it once each) failed
(``FailOnRecompileLimitHit``, measured on 2.13 and 2.15: 125–564 failed exports and calls in 6 s of
``export_beside_calls``). So the frame ids of the reset entries are noted, and dynamo's ``get_compile_id``
gives such a frame a new id on its next compile (where that function exists, torch 2.9 on); before 2.9,
where the id is computed inline, the frame's count is set back to 0 instead (compile ids then repeat).

H11 — the same C ``reset_code`` under another name. ``torch._dynamo`` imports it by name, and
``reset_code_caches()`` (every ``torch._dynamo.reset()``) calls it for every code object dynamo has seen: a
replacement of ``eval_frame.reset_code`` alone never reaches it. A strict ``torch.export.export`` resets
dynamo (torch 2.13's ``_dynamo_graph_capture_for_export``) while it holds ``compile_lock`` (``export_lock``,
H7), so threads whose frames wait in dynamo's callback for that lock -- each holding its code's
``ExtraState`` pointer -- had that state freed under them and inserted their entry into freed memory
(``SIGSEGV`` in ``create_cache_entry``; ``python -m ttc_testing.crash_scenarios export_unflatten_compile``).
So both names get the same function, which frees only when that is safe (``_graveyard.may_free``: no
other thread, or a reset whose barrier has seen nobody inside dynamo, H3's ``first_compile``), and resets
softly otherwise. A reset that could not drain is thus a soft one: entries invalidated, state kept.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

from torch_threadsafe_compile import _graveyard
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import cache_entry_lister, loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["code_reset"]

_stats = {"soft_resets": 0, "entries_invalidated": 0, "fresh_frame_ids": 0}
# Frame ids of soft-reset code objects whose next compile must start a new count (see the docstring).
_fresh_ids: set[int] = set()
_marker: list[type] = []  # the DeletedGuardManagerWrapper subclass that marks our invalidations


def _is_ours(entry: Any) -> bool:
    return bool(_marker) and isinstance(getattr(entry, "guard_manager", None), _marker[0])


def _soft_reset(code: Any, lister: Any) -> None:
    marker = _marker[0]
    others = _graveyard.others()
    for entry in lister(code):
        gm = getattr(entry, "guard_manager", None)
        extra = getattr(gm, "extra_state", None)
        if gm is None or extra is None or getattr(gm, "cache_entry", None) is None:
            continue  # invalidated already
        _graveyard.keep((gm,), others)
        extra.invalidate(entry, marker("Cache line invalidated by reset_code while other threads ran"))
        _stats["entries_invalidated"] += 1
        _restart_count(getattr(getattr(entry, "compile_id", None), "frame_id", None))
    _stats["soft_resets"] += 1


def _restart_count(frame_id: Any) -> None:
    if not isinstance(frame_id, int):
        return
    cf = sys.modules.get("torch._dynamo.convert_frame")
    if cf is not None and isinstance(getattr(cf, "get_compile_id", None), _FreshIds):
        _fresh_ids.add(frame_id)
    elif cf is not None and hasattr(getattr(cf, "FRAME_COMPILE_COUNTER", None), "__setitem__"):
        cf.FRAME_COMPILE_COUNTER[frame_id] = 0


class _FreshIds:
    """``convert_frame.get_compile_id`` that gives a soft-reset frame a new frame id, as upstream's reset does
    by dropping the frame state (upstream then assigns ``_id`` afresh)."""

    def __init__(self, original: Any) -> None:
        self.__wrapped__ = original
        self.__name__ = getattr(original, "__name__", "get_compile_id")
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, frame_state: Any, *args: Any, **kwargs: Any) -> Any:
        if _fresh_ids and isinstance(frame_state, dict) and frame_state.get("_id") in _fresh_ids:
            _fresh_ids.discard(frame_state.pop("_id"))
            _stats["fresh_frame_ids"] += 1
        return self.__wrapped__(frame_state, *args, **kwargs)


def _make_reset_code(original: Any, lister: Any) -> Any:
    def reset_code(code: Any) -> Any:
        if _graveyard.may_free():  # no other thread, or a reset that drained them (H3's barrier)
            return original(code)
        _graveyard.release()
        _soft_reset(code, lister)
        return None

    reset_code.__wrapped__ = original  # type: ignore[attr-defined]
    reset_code.__name__ = "reset_code"
    reset_code.__doc__ = original.__doc__
    return reset_code


def _without_ours(frame: Any, head: Any, result: Any) -> Any:
    """torch <= 2.12 passes the head of dynamo's linked entry list (walked with ``.next``), not a list:
    take the invalidated entries out of the counts that ``original`` returned instead."""
    same = getattr(sys.modules.get("torch._dynamo.cache_size"), "_has_same_id_matched_objs", None)
    total = matched = 0
    entry = head
    while entry:
        if _is_ours(entry):
            total += 1
            matched += bool(same is not None and same(frame, entry))
        entry = entry.next
    if not total or not dataclasses.is_dataclass(result) or isinstance(result, type):
        return result
    entries: int = result.num_cache_entries  # type: ignore[attr-defined]  # CacheSizeRelevantForFrame
    same_ids: int = result.num_cache_entries_with_same_id_matched_objs  # type: ignore[attr-defined]
    return dataclasses.replace(result, num_cache_entries=max(0, entries - total),
                               num_cache_entries_with_same_id_matched_objs=max(0, same_ids - matched))


def _make_cache_size(original: Any, lister: Any) -> Any:
    def compute_cache_size(frame: Any, cache_entries: Any, *args: Any, **kwargs: Any) -> Any:
        if _stats["entries_invalidated"]:
            ours = sum(1 for e in lister(frame.f_code) if _is_ours(e))
            if ours and not isinstance(cache_entries, (list, tuple)):
                return _without_ours(frame, cache_entries, original(frame, cache_entries, *args, **kwargs))
            if ours:
                cache_entries = [e for e in cache_entries if not _is_ours(e)]
                if args and isinstance(args[0], int):
                    args = (max(0, args[0] - ours), *args[1:])
                elif isinstance(kwargs.get("total_cache_entries_all_regions"), int):
                    kwargs["total_cache_entries_all_regions"] = max(0, kwargs["total_cache_entries_all_regions"] - ours)
        return original(frame, cache_entries, *args, **kwargs)

    compute_cache_size.__wrapped__ = original  # type: ignore[attr-defined]
    compute_cache_size.__name__ = "compute_cache_size"
    compute_cache_size.__doc__ = original.__doc__
    return compute_cache_size


def _reset_code_caches_binding() -> bool:
    """Whether ``torch._dynamo`` holds the C ``reset_code`` under its own name and ``reset_code_caches``
    calls it by that name (H11: every ``torch._dynamo.reset()`` frees code caches through it)."""
    dynamo = loaded("torch._dynamo")
    rcc = inspect.unwrap(getattr(dynamo, "reset_code_caches", None) or (lambda: None))
    ef = loaded("torch._dynamo.eval_frame")
    return (dynamo.__dict__.get("reset_code") is getattr(ef, "reset_code", None)
            and "reset_code" in getattr(getattr(rcc, "__code__", None), "co_names", ()))


def check() -> str | None:
    ef = loaded("torch._dynamo.eval_frame")
    rfc = getattr(ef, "remove_from_cache", None)
    if rfc is None or "reset_code" not in getattr(getattr(rfc, "__code__", None), "co_names", ()):
        return "torch._dynamo.eval_frame.remove_from_cache no longer calls reset_code"
    if not callable(getattr(ef, "reset_code", None)):
        return "torch._dynamo.eval_frame.reset_code not found"
    if not callable(getattr(loaded("torch._dynamo.convert_frame"), "compute_cache_size", None)):
        return "torch._dynamo.convert_frame.compute_cache_size not found"
    if getattr(loaded("torch._dynamo.guards"), "DeletedGuardManagerWrapper", None) is None:
        return "torch._dynamo.guards.DeletedGuardManagerWrapper not found"
    if cache_entry_lister() is None:
        return "torch._C._dynamo.eval_frame._debug_get_cache_entry_list not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    lister = cache_entry_lister()
    deleted = loaded("torch._dynamo.guards").DeletedGuardManagerWrapper
    if not _marker:
        _marker.append(type("ResetCodeGuardManager", (deleted,), {
            "__doc__": "An entry invalidated by reset_code while other threads ran (torch-threadsafe-compile, H9).",
            "__module__": __name__}))
    ef = loaded("torch._dynamo.eval_frame")
    ours = _make_reset_code(ef.reset_code, lister)
    # Before eval_frame's name is replaced: the test compares torch._dynamo's name with it.
    dynamo_too = _reset_code_caches_binding()
    changes.setattr(ef, "reset_code", ours)
    if dynamo_too:  # the name reset_code_caches() (torch._dynamo.reset()) calls: H11
        changes.setattr(loaded("torch._dynamo"), "reset_code", ours)
    cf = loaded("torch._dynamo.convert_frame")
    changes.setattr(cf, "compute_cache_size", _make_cache_size(cf.compute_cache_size, lister))
    if callable(getattr(cf, "get_compile_id", None)):
        changes.setattr(cf, "get_compile_id", _FreshIds(cf.get_compile_id))
    return {"reset_code_caches": dynamo_too}


def verify() -> None:
    ef = loaded("torch._dynamo.eval_frame")
    if getattr(ef.reset_code, "__wrapped__", None) is None:
        raise AssertionError("torch._dynamo.eval_frame.reset_code is not replaced")
    dynamo_name = loaded("torch._dynamo").__dict__.get("reset_code")
    if dynamo_name is getattr(ef.reset_code, "__wrapped__", None):
        raise AssertionError("torch._dynamo.reset_code (what reset_code_caches calls) is still the C function")
    if getattr(loaded("torch._dynamo.convert_frame").compute_cache_size, "__wrapped__", None) is None:
        raise AssertionError("torch._dynamo.convert_frame.compute_cache_size is not replaced")


def report() -> dict[str, Any]:
    return dict(_stats)
