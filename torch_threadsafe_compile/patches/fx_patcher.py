"""H7 (pytorch/pytorch#187589) — FX symbolic tracing patches functions for its own thread only.

While ``torch.fx.symbolic_trace`` runs, its ``_Patcher`` replaces functions *process-wide* — among them
``torch.nn.Module.__call__``/``__getattr__`` and every function registered with ``torch.fx.wrap`` — and a
module global, ``CURRENT_PATCHER``, holds the active patcher. Any other thread that runs a module or a
wrapped function meanwhile goes through the tracer of a trace that is not its own: measured in the soak
suite as ``NameError: module is not installed as a submodule``, ``TypeError: float() argument must be ...
not 'Proxy'``, and ``AssertionError: CURRENT_PATCHER is None in finally block`` when two threads trace.

After this patch:

* ``CURRENT_PATCHER`` is per-thread (same mechanism as H1: the functions that use it keep their objects,
  their code reads a thread-local; ``module.CURRENT_PATCHER`` goes through a property);
* each patched slot holds one *dispatcher* that gives the replacement of the thread that is tracing and
  the original in every other thread. Several threads may trace at once, each with its own replacement.
  When the last tracing thread is done, the original object is put back, so nothing stays in the hot path
  of ``Module.__call__`` outside traces;
* a patching trace holds dynamo's ``compile_lock`` (when dynamo is loaded), so dynamo never compiles
  while a slot holds a dispatcher: it would trace through it (a graph break at every module call) and its
  restarts would see ``Module.__call__`` change (``SpeculationLogDivergence``). A dispatcher that dynamo
  could see through was tried: dynamo reads class attributes raw while it traces, and compiles beside
  traces then broke apart (measured in the soak). The trace takes the lock ahead of compiles that do not
  hold it yet (``_compile_lock.InstrumentedRLock.priority``), so a stream of compiles delays a trace by at most
  the compile in progress. Inside a compile the lock is already held (it is re-entrant), and an FX trace
  runs on proxies, never on the autograd engine, so this adds no lock-order inversion.

Inside one thread everything is upstream's, including how patches are de-duplicated (upstream sets the
name-mangled ``_Patcher__fx_already_patched`` and reads the unmangled ``__fx_already_patched``).
"""

from __future__ import annotations

import builtins
import contextlib
import threading
from typing import Any, Callable, Iterator

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes, TargetBusy, run_in_thread
from torch_threadsafe_compile._rewrite import thread_local_global
from torch_threadsafe_compile._torch import compile_lock_first, loaded, skip_code
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["fx_patcher"]

_MISSING = object()
# Upstream's ``_Patcher.patch`` writes ``new_fn.__fx_already_patched`` inside ``class _Patcher``, where Python
# mangles the name, and reads it back with ``getattr(..., "__fx_already_patched")``, a string it does not
# mangle. Bug for bug: the copies below write and read exactly those two names.
ALREADY_PATCHED_SET = "_Patcher__fx_already_patched"
ALREADY_PATCHED_GET = "__fx_already_patched"
_slots_lock = threading.Lock()


@_forksafe.in_child
def _after_fork() -> None:
    global _slots_lock
    _slots_lock = threading.Lock()  # a thread of the parent may have held it


class _Dispatcher:
    """Stands in a patched slot: the tracing thread's replacement there, the original elsewhere."""

    def __init__(self, orig: Any, had_slot: bool) -> None:
        self.orig = orig
        self.had_slot = had_slot
        self.owners: dict[int, list[Callable[..., Any]]] = {}
        self.fn: Callable[..., Any] = self._make()

    def _make(self) -> Callable[..., Any]:
        owners, orig, get_ident = self.owners, self.orig, threading.get_ident

        def fx_patch_dispatch(*args: Any, **kwargs: Any) -> Any:
            stack = owners.get(get_ident())
            return (stack[-1] if stack else orig)(*args, **kwargs)

        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(fx_patch_dispatch, attr, getattr(orig, attr))
            except (AttributeError, TypeError):
                pass
        fx_patch_dispatch._ttc_dispatcher = self  # type: ignore[attr-defined]
        fx_patch_dispatch.__wrapped__ = orig  # type: ignore[attr-defined]
        return fx_patch_dispatch


# The dispatcher's code object: dynamo is told to skip it, and first_compile (H3) counts it as call
# plumbing between a compiled module's ``compile_wrapper`` and its ``forward``.
DISPATCH_CODE = next(c for c in _Dispatcher._make.__code__.co_consts if getattr(c, "co_name", None) == "fx_patch_dispatch")

def _get(container: Any, name: str, is_dict: bool) -> Any:
    if is_dict:
        return container.get(name, _MISSING)
    return container.__dict__.get(name, _MISSING) if name in getattr(container, "__dict__", {}) else getattr(container, name, _MISSING)


def _put(container: Any, name: str, value: Any, is_dict: bool) -> None:
    if is_dict:
        container[name] = value
    else:
        setattr(container, name, value)


def _remove(container: Any, name: str, is_dict: bool) -> None:
    if is_dict:
        container.pop(name, None)
    else:
        try:
            delattr(container, name)
        except AttributeError:
            pass


_hidden = False


def _hide_from_dynamo() -> None:
    """Tell dynamo never to compile the dispatcher's own frame.

    While a compile's ``make_fx`` has ``Module.__call__`` patched, other threads running modules enter the
    dispatcher; with their eval-frame callback active, dynamo would compile the dispatcher as a frame of
    its own (an extra graph each time). It is plumbing: skip it, as upstream skips its own files.
    """
    global _hidden
    if not _hidden:
        _hidden = skip_code(DISPATCH_CODE)


def _make_entry(base: type) -> type:
    """A ``_PatchedFn`` whose patch/revert register/unregister the calling thread in the slot's dispatcher."""

    class _ThreadPatchedFn(base):  # type: ignore[misc, valid-type]
        def patch(self) -> None:
            container, name, _, new_fn = self
            is_dict = isinstance(container, dict)
            me = threading.get_ident()
            with _slots_lock:
                current = _get(container, name, is_dict)
                disp = getattr(current, "_ttc_dispatcher", None)
                if disp is None:
                    _hide_from_dynamo()
                    had = current is not _MISSING
                    disp = _Dispatcher(current if had else getattr(builtins, name), had)
                    _put(container, name, disp.fn, is_dict)
                disp.owners.setdefault(me, []).append(new_fn)

        def revert(self) -> None:
            container, name, _, new_fn = self
            is_dict = isinstance(container, dict)
            me = threading.get_ident()
            with _slots_lock:
                disp = getattr(_get(container, name, is_dict), "_ttc_dispatcher", None)
                if disp is None:
                    return
                _drop(disp, me, new_fn)
                if not disp.owners:  # nobody traces through this slot any more: the original goes back
                    _restore(container, name, disp, is_dict)

    _ThreadPatchedFn.__name__ = f"_ThreadPatchedFn[{base.__name__}]"
    return _ThreadPatchedFn


def _restore(container: Any, name: str, disp: _Dispatcher, is_dict: bool) -> None:
    """Nobody traces through this slot any more: the original goes back (if the slot is still ours)."""
    if getattr(_get(container, name, is_dict), "_ttc_dispatcher", None) is not disp:
        return
    if disp.had_slot:
        _put(container, name, disp.orig, is_dict)
    else:
        _remove(container, name, is_dict)


def _drop(disp: Any, me: int, new_fn: Callable[..., Any]) -> None:
    """Remove this thread's latest registration of ``new_fn`` (patches are undone in reverse order)."""
    stack = disp.owners.get(me, [])
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is new_fn:
            del stack[i]
            break
    if not stack:
        disp.owners.pop(me, None)


def _module() -> Any:
    return loaded(SPEC.modules[0])


def check() -> str | None:
    mod = _module()
    for name in ("_Patcher", "_PatchedFn", "_new_patcher", "_maybe_revert_all_patches", "CURRENT_PATCHER"):
        if not hasattr(mod, name):
            return f"torch.fx._symbolic_trace.{name} not found"
    for meth in ("patch", "patch_method"):
        if meth not in mod._Patcher.__dict__:
            return f"_Patcher.{meth} not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    mod = _module()
    users = []
    for name in ("_new_patcher", "_maybe_revert_all_patches"):
        fn = getattr(mod, name)
        users.append(getattr(fn, "__wrapped__", fn))
    if mod.__dict__["CURRENT_PATCHER"] is not None:
        raise TargetBusy("a symbolic trace is in progress")
    thread_local_global(changes, mod, "CURRENT_PATCHER", users)
    changes.provide("call_plumbing", DISPATCH_CODE)  # first_compile: no program code between wrapper and forward
    priority = changes.require("compile_lock.priority")

    original_new_patcher = mod.__dict__["_new_patcher"]

    @contextlib.contextmanager
    def _new_patcher() -> Iterator[Any]:
        with compile_lock_first(priority):  # see the module docstring: no compile sees a patched slot
            with original_new_patcher() as patcher:
                yield patcher

    _new_patcher.__wrapped__ = original_new_patcher  # type: ignore[attr-defined]
    changes.setattr(mod, "_new_patcher", _new_patcher)
    entry = _make_entry(mod._PatchedFn)

    def patch(self: Any, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        """Replace ``frame_dict[name]`` by ``new_fn`` for this thread until the patcher exits."""
        setattr(new_fn, ALREADY_PATCHED_SET, deduplicate)
        current = frame_dict.get(name, _MISSING)
        if current is _MISSING and not hasattr(builtins, name):
            raise KeyError(name)
        if _already_patched_here(current):
            return
        self.patches_made.append(entry(frame_dict, name, None, new_fn))
        self.patches_made[-1].patch()

    def patch_method(self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        """Replace ``cls.name`` by ``new_fn`` for this thread until the patcher exits."""
        setattr(new_fn, ALREADY_PATCHED_SET, deduplicate)
        if _already_patched_here(getattr(cls, name)):
            return
        self.patches_made.append(entry(cls, name, None, new_fn))
        self.patches_made[-1].patch()

    changes.setattr(mod._Patcher, "patch", patch)
    changes.setattr(mod._Patcher, "patch_method", patch_method)
    return {}


def _already_patched_here(current: Any) -> bool:
    """Upstream's de-duplication (``__fx_already_patched``), seen from the calling thread."""
    disp = getattr(current, "_ttc_dispatcher", None)
    if disp is None:
        return bool(getattr(current, ALREADY_PATCHED_GET, False))
    stack = disp.owners.get(threading.get_ident())
    return bool(stack) and bool(getattr(stack[-1], ALREADY_PATCHED_GET, False))


def verify() -> None:
    mod = _module()
    ns: dict[str, Any] = {"f": lambda: "orig"}
    with mod._new_patcher() as patcher:
        patcher.patch(ns, "f", lambda: "traced")
        seen, other_patcher = run_in_thread(lambda: (ns["f"](), mod.CURRENT_PATCHER))  # one probe thread: import torch pays each
        if ns["f"]() != "traced" or seen != "orig":
            raise AssertionError("patched function is not per-thread")
        if mod.CURRENT_PATCHER is not patcher or other_patcher is not None:
            raise AssertionError("CURRENT_PATCHER is not per-thread")
    if ns["f"]() != "orig" or getattr(ns["f"], "_ttc_dispatcher", None) is not None:
        raise AssertionError("the original was not put back")
