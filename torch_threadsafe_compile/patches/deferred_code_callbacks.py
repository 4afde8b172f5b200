"""H13 (hang) — dynamo's weakref callbacks on code objects run no Python code while other threads exist.

torch's ``CapturedTraceback`` (``torch.utils._traceback.CapturedTraceback.extract()``: dynamo and FX keep them
for stack traces) holds the code objects of its frames. When one is freed, its code objects go on a free
list; ``torch::freeDeadCapturedTracebackFrames`` drops them later -- while it holds the list's mutex
(``to_free_frames_mutex``, torch/csrc/profiler/python/combined_traceback.cpp). When that drop is a code
object's last reference, the code object's weakref callbacks run under the mutex, and dynamo registers Python
ones on every code object it makes (``ExactWeakKeyDictionary`` -- ``CleanupManager.instance``,
``orig_code_map``, ``code_context`` and others -- and ``convert_frame.Tracker``, ``output_codes``). Python code
may hand the GIL to another thread; when that thread then frees or gathers a traceback, it waits for the
mutex while holding the GIL, and neither thread moves again (native stacks: ``freeDeadCapturedTracebackFrames``
→ ``code_dealloc`` → ``handle_callback`` → ``take_gil``, and ``PythonTraceback::release`` →
``pthread_mutex_lock``). Seen as the stall of ``dynamo/test_aot_autograd.py`` and ``dynamo/test_repros.py`` at 4
threads, in both modes. Reproducer: ``python -m ttc_testing.crash_scenarios captured_traceback_free_deadlock
callbacks=dynamo``.

Fix: while other threads exist, the callback such an entry gets is a C function, ``DEAD.append`` (a
deque's bound method: called with the dead weakref, it appends it; no bytecode, no tuple, nothing that could
start a garbage collection), so the GIL is never handed over under torch's mutex. The weakref is a ``_Ref``
that knows its owner and the id. What upstream's callback did (``_remove_id(idx)``: drop the entry, and for
``CleanupManager`` run its cleanup hooks; ``Tracker``: forget the id) is done by the next call of any method
of any such dictionary or tracker (each first runs every deferred callback, of every owner) -- so what a
reader sees is what upstream would show, a new object that reuses a dead one's id never meets a stale entry,
and ``torch._dynamo.reset()`` (which clears several of them after freeing the code caches) ends with none
deferred. The cost: a dead key's value (for ``CleanupManager``, the compiled function its hooks take out of
the module's globals) lives until that next call (every compile makes many). An exception raised by a
deferred callback goes to ``sys.unraisablehook``, as a weakref callback's does. Entries set while no thread of
the program's runs besides the main thread (``_torch.program_threads_started``: torch's and other libraries'
helper threads do not count) keep upstream's Python callback, so a single-threaded program is upstream's (the
cost is the check for threads); an entry set before the first thread started keeps that callback for its life.

Revert runs what is pending; entries made while the patch was applied keep its callback, whose records
nobody runs any more (their values, and for ``CleanupManager`` the hooks' globals, then live on).

Not covered: Python weakref callbacks on code objects that are not dynamo's (a program's own: the
scenario's ``callbacks=own`` hangs in both modes), and Python code that a code object's death reaches in other
ways (``__del__`` of objects it kept alive). The fix that covers everything belongs in torch: decref after
unlocking (move the list out under the mutex).
"""

from __future__ import annotations

import collections
import functools
import sys
import types
import weakref
from typing import Any, Callable

from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import program_threads_functions, program_threads_started, skip_code
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["deferred_code_callbacks"]

# The dead weakrefs whose callbacks are still to run, of every owner, in the order their keys died. Its
# bound ``append`` is the callback (C code; ``popleft`` takes them out, atomically).
DEAD: collections.deque[Any] = collections.deque()
# A Tracker keeps no id -> weakref map of its own (its ``seen`` is a list): its deferred entries', by id.
TRACKER_REFS = "_ttc_refs_by_id"
_stats = {"deferred": 0, "run": 0}
_DICT_METHODS = ("__getitem__", "get", "__contains__", "clear")
_TRACKER_METHODS = ("__contains__",)


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weakref that knows what its callback stands for: its owner (an ``ExactWeakKeyDictionary`` or a
    ``Tracker``), the key's id, and the function that does upstream's callback's work."""

    __slots__ = ("owner", "idx", "run")
    owner: Any
    idx: int
    run: Callable[[_Ref], bool]

    def __new__(cls, key: Any, owner: Any, idx: int, run: Callable[[_Ref], bool]) -> _Ref:
        self = super().__new__(cls, key, DEAD.append)
        self.owner, self.idx, self.run = owner, idx, run
        return self

    def __init__(self, key: Any, owner: Any, idx: int, run: Callable[[_Ref], bool]) -> None:
        pass  # __new__ did it all (weakref.ref's own __init__ only checks its two arguments)


def _unraisable(exc: BaseException, ref: Any) -> None:
    hook = getattr(sys, "unraisablehook", None)
    if hook is not None:
        hook(types.SimpleNamespace(
            exc_type=type(exc), exc_value=exc, exc_traceback=exc.__traceback__, object=ref,
            err_msg="Exception ignored in a weakref callback deferred by torch-threadsafe-compile (H13)"))


def drain() -> None:
    """Run every deferred callback. Each dead weakref is taken with ``deque.popleft`` (atomic), so two threads
    never run one twice; a callback that raises is reported (``sys.unraisablehook``), never raised into the
    caller, as for a weakref callback."""
    while DEAD:
        try:
            ref = DEAD.popleft()
        except IndexError:  # another thread took the last one
            return
        try:
            if ref.run(ref):
                _stats["run"] += 1
        except Exception as e:
            _unraisable(e, ref)


def _run_dict_entry(ref: _Ref) -> bool:
    """Upstream's ``lambda ref: self._remove_id(idx)``, when ``ref`` is still the owner's weakref for the id
    (a ``clear()`` or a new key since would have replaced or dropped it)."""
    owner = ref.owner
    if owner.refs.get(ref.idx) is not ref:
        return False
    owner._remove_id(ref.idx)
    return True


def _run_tracker_entry(ref: _Ref) -> bool:
    """Upstream's ``lambda _: self.seen_ids.remove(idx)``, when ``ref`` is still the tracker's for the id."""
    refs = ref.owner.__dict__.get(TRACKER_REFS, {})
    if refs.get(ref.idx) is not ref:
        return False
    del refs[ref.idx]
    ref.owner.seen_ids.discard(ref.idx)
    return True


def _stale(ref: Any, key: Any) -> bool:
    """Whether ``ref`` (the weakref held for ``key``'s id) is for another object: one that died at this address
    and whose deferred callback has not run yet (another thread may hold it between ``popleft`` and running
    it). Upstream's callback runs before the address can be reused, so it never meets this."""
    return ref is None or ref() is not key


def _make_dict_setitem(original: Any) -> Any:
    def __setitem__(self: Any, key: Any, value: Any) -> None:
        if DEAD:
            drain()
        if not program_threads_started():  # no thread of the program's: upstream's entry, Python callback and all
            original(self, key, value)
            return
        idx = id(key)
        if _stale(self.refs.get(idx), key):  # upstream: `if idx not in self.refs`
            self.refs[idx] = _Ref(key, self, idx, _run_dict_entry)
            _stats["deferred"] += 1
        self.values[idx] = value

    return _transparent(__setitem__, original)


def _make_tracker_add(original: Any) -> Any:
    def add(self: Any, strong_obj: Any) -> None:
        if DEAD:
            drain()
        if not program_threads_started():
            original(self, strong_obj)
            return
        idx = id(strong_obj)
        refs = self.__dict__.setdefault(TRACKER_REFS, {})
        # Upstream: `if idx not in self.seen_ids`. An id seen through upstream's own callback (no entry in
        # `refs`) is live: that callback runs before the address can be reused.
        if idx not in self.seen_ids or (idx in refs and _stale(refs[idx], strong_obj)):
            ref = _Ref(strong_obj, self, idx, _run_tracker_entry)
            refs[idx] = ref
            self.seen.append(ref)
            self.seen_ids.add(idx)
            _stats["deferred"] += 1

    return _transparent(add, original)


def _make_tracker_clear(original: Any) -> Any:
    def clear(self: Any) -> None:
        if DEAD:
            drain()
        refs = self.__dict__.get(TRACKER_REFS)
        if refs is not None:
            refs.clear()
        original(self)

    return _transparent(clear, original)


def _make_drained(original: Any) -> Any:
    """``original`` (a reader, or ``clear``), after every deferred callback has run: what it sees is what
    upstream's callbacks would have left."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if DEAD:
            drain()
        return original(self, *args, **kwargs)

    return _transparent(method, original)


def _transparent(wrapper: Any, original: Any) -> Any:
    functools.update_wrapper(wrapper, original)  # name, doc, __wrapped__ (what verify and revert look for)
    return wrapper


def _targets() -> tuple[type | None, type | None]:
    ewkd = getattr(sys.modules.get("torch._dynamo.utils"), "ExactWeakKeyDictionary", None)
    tracker = getattr(sys.modules.get("torch._dynamo.convert_frame"), "Tracker", None)
    return ewkd, tracker


def _names(func: Any) -> set[str]:
    return set(getattr(getattr(func, "__code__", None), "co_names", ()))


def _tracker_shape_ok(tracker: Any) -> bool:
    return ({"ref", "seen", "seen_ids"} <= _names(tracker.__dict__.get("add"))
            and all(callable(tracker.__dict__.get(n)) for n in (*_TRACKER_METHODS, "clear")))


def check() -> str | None:
    ewkd, _ = _targets()
    if ewkd is None:
        return "torch._dynamo.utils.ExactWeakKeyDictionary not found"
    if not {"ref", "refs", "values"} <= _names(ewkd.__dict__.get("__setitem__")):
        return "ExactWeakKeyDictionary.__setitem__ no longer sets refs[id] = weakref.ref(key, callback)"
    if not callable(ewkd.__dict__.get("_remove_id")) or not callable(ewkd.__dict__.get("clear")):
        return "ExactWeakKeyDictionary._remove_id / clear not found"
    return None


def _with_nested(codes: list[types.CodeType]) -> list[types.CodeType]:
    """``codes`` and every code object nested in them (generator expressions, inner functions)."""
    out, todo = [], list(codes)
    while todo:
        code = todo.pop()
        out.append(code)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


def _hide_from_dynamo(wrappers: list[Any]) -> bool:
    """Dynamo's own methods live in its files, whose frames its callback never compiles. Ours run in their
    place, inside dynamo's frame callback, where a frame of a file dynamo does not skip is one more frame to
    compile (measured: greenlets switching inside compiled calls, gevent patched after torch, got
    ``cannot release un-acquired lock`` from a compile re-entered at ``code in output_codes``). So every
    frame of ours on those paths is marked "run as it is" (``skip_code``), what the helpers they call
    included."""
    helpers = [drain, _run_dict_entry, _run_tracker_entry, _stale, _unraisable, _Ref.__new__, _Ref.__init__,
               *program_threads_functions()]
    codes = _with_nested([f.__code__ for f in (*wrappers, *helpers)])
    return all([skip_code(code) for code in codes])  # noqa: C419 - every one of them, no short-circuit


def apply(changes: Changes) -> dict[str, Any]:
    ewkd, tracker = _targets()
    assert ewkd is not None
    wrappers = [_make_dict_setitem(ewkd.__dict__["__setitem__"])]
    changes.setattr(ewkd, "__setitem__", wrappers[-1])
    methods = [n for n in _DICT_METHODS if callable(ewkd.__dict__.get(n))]
    for name in methods:
        wrappers.append(_make_drained(ewkd.__dict__[name]))
        changes.setattr(ewkd, name, wrappers[-1])
    # Dynamo's Tracker (input_codes / output_codes) keeps the same kind of callback on the same code objects.
    tracker_done = tracker is not None and _tracker_shape_ok(tracker)
    if tracker is not None and tracker_done:
        wrappers += [_make_tracker_add(tracker.__dict__["add"]), _make_tracker_clear(tracker.__dict__["clear"])]
        changes.setattr(tracker, "add", wrappers[-2])
        changes.setattr(tracker, "clear", wrappers[-1])
        for name in _TRACKER_METHODS:
            wrappers.append(_make_drained(tracker.__dict__[name]))
            changes.setattr(tracker, name, wrappers[-1])
    changes.on_revert(drain)  # entries made meanwhile keep their deferred callbacks: run what is pending
    hidden = _hide_from_dynamo(wrappers)
    return {"dict_methods": ["__setitem__", *methods], "tracker": tracker_done, "hidden_from_dynamo": hidden}


def verify() -> None:
    ewkd, _ = _targets()
    assert ewkd is not None
    if getattr(ewkd.__dict__["__setitem__"], "__wrapped__", None) is None:
        raise AssertionError("ExactWeakKeyDictionary.__setitem__ is not replaced")
    # The callback must be C code: a deque's bound append, no Python function in between.
    if not isinstance(DEAD.append, types.BuiltinMethodType):
        raise AssertionError("the deferred callback is not a C function")
    key = type("_Probe", (), {})()
    owner = types.SimpleNamespace(seen_ids={id(key)})
    ref = _Ref(key, owner, id(key), _run_tracker_entry)
    owner.__dict__[TRACKER_REFS] = {id(key): ref}
    del key
    if ref not in DEAD:
        raise AssertionError("a dead key's callback was not deferred")
    drain()
    if owner.seen_ids:
        raise AssertionError("a deferred callback did not run")


def report() -> dict[str, Any]:
    return {**_stats, "pending": len(DEAD)}
