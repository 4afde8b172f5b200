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
* each patched slot holds one *dispatcher* that calls the replacement of the thread that is tracing and
  the original function in every other thread. Several threads may trace at once, each with its own
  replacement. When the last tracing thread is done, the original object is put back, so nothing stays in
  the hot path of ``Module.__call__`` outside traces;
* a patching trace holds dynamo's ``compile_lock`` (when dynamo is loaded), so dynamo never traces
  ``Module.__call__`` while its slot is being swapped by another thread's FX trace (that made dynamo's
  restarts see different bytecode: ``SpeculationLogDivergence``). Inside a compile the lock is already
  held (it is re-entrant), and an FX trace runs on proxies, never on the autograd engine, so this adds
  no lock-order inversion.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
import threading
from typing import Any, Callable, Iterator

from torch_threadsafe_compile._patching import Changes, TargetMismatch, run_in_thread, thread_local_global
from torch_threadsafe_compile.registry import PatchSpec

SPEC = PatchSpec(
    id="fx_patcher",
    hazard="H7",
    summary="fx.symbolic_trace's function patches and CURRENT_PATCHER apply to the tracing thread only",
    upstream="pytorch/pytorch#187589 (FX patcher CURRENT_PATCHER is process-global)",
    torch_versions=">=2.4",
    modules=("torch.fx._symbolic_trace",),
    after=("fx_tracing_flag",),
    tested="2.11.0, 2.13.0",
)

_MISSING = object()
_slots_lock = threading.Lock()


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
    if _hidden or "torch._dynamo.eval_frame" not in sys.modules:
        return
    ef = sys.modules["torch._dynamo.eval_frame"]
    skip = getattr(ef, "skip_code", None) or getattr(getattr(ef, "torch", None) and ef.torch._C._dynamo.eval_frame, "skip_code", None)
    if skip is None:
        return
    skip(DISPATCH_CODE)
    _hidden = True


def _make_entry(base: type) -> type:
    """A ``_PatchedFn`` whose patch/revert register/unregister the calling thread in the slot's dispatcher."""

    class _ThreadPatchedFn(base):  # type: ignore[misc, valid-type]
        def patch(self) -> None:
            container, name, _, new_fn = self
            is_dict = isinstance(container, dict)
            with _slots_lock:
                current = _get(container, name, is_dict)
                disp = getattr(current, "_ttc_dispatcher", None)
                if disp is None:
                    _hide_from_dynamo()
                    had = current is not _MISSING
                    orig = current if had else getattr(builtins, name)
                    disp = _Dispatcher(orig, had)
                    _put(container, name, disp.fn, is_dict)
                disp.owners.setdefault(threading.get_ident(), []).append(new_fn)

        def revert(self) -> None:
            container, name, _, new_fn = self
            is_dict = isinstance(container, dict)
            with _slots_lock:
                disp = getattr(_get(container, name, is_dict), "_ttc_dispatcher", None)
                if disp is None:
                    return
                stack = disp.owners.get(threading.get_ident(), [])
                if new_fn in stack:
                    stack.reverse()
                    stack.remove(new_fn)
                    stack.reverse()
                if not stack:
                    disp.owners.pop(threading.get_ident(), None)
                if not disp.owners:  # nobody traces through this slot any more: the original goes back
                    if disp.had_slot:
                        _put(container, name, disp.orig, is_dict)
                    else:
                        _remove(container, name, is_dict)

    _ThreadPatchedFn.__name__ = f"_ThreadPatchedFn[{base.__name__}]"
    return _ThreadPatchedFn


def _module() -> Any:
    return sys.modules["torch.fx._symbolic_trace"]


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
        raise TargetMismatch("a symbolic trace is in progress; install() again when idle")
    thread_local_global(changes, mod, "CURRENT_PATCHER", users)

    original_new_patcher = mod.__dict__["_new_patcher"]

    @contextlib.contextmanager
    def _new_patcher() -> Iterator[Any]:
        cf = sys.modules.get("torch._dynamo.convert_frame")
        lock = getattr(cf, "compile_lock", None) if cf is not None else None
        with lock if lock is not None else contextlib.nullcontext():
            with original_new_patcher() as patcher:
                yield patcher

    _new_patcher.__wrapped__ = original_new_patcher  # type: ignore[attr-defined]
    changes.setattr(mod, "_new_patcher", _new_patcher)

    entry = _make_entry(mod._PatchedFn)

    def patch(self: Any, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        """Replace ``frame_dict[name]`` by ``new_fn`` for this thread until the patcher exits."""
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
        current = frame_dict.get(name, _MISSING)
        if current is _MISSING and not hasattr(builtins, name):
            raise KeyError(name)
        if _already_patched_here(current):
            return
        self.patches_made.append(entry(frame_dict, name, None, new_fn))
        self.patches_made[-1].patch()

    def patch_method(self: Any, cls: type, name: str, new_fn: Callable[..., Any], deduplicate: bool = True) -> None:
        """Replace ``cls.name`` by ``new_fn`` for this thread until the patcher exits."""
        new_fn.__fx_already_patched = deduplicate  # type: ignore[attr-defined]
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
        return bool(getattr(current, "__fx_already_patched", False))
    stack = disp.owners.get(threading.get_ident())
    return bool(stack) and bool(getattr(stack[-1], "__fx_already_patched", False))


def verify() -> None:
    mod = _module()
    ns: dict[str, Any] = {"f": lambda: "orig"}
    with mod._new_patcher() as patcher:
        patcher.patch(ns, "f", lambda: "traced")
        if ns["f"]() != "traced" or run_in_thread(ns["f"]) != "orig":
            raise AssertionError("patched function is not per-thread")
        if mod.CURRENT_PATCHER is not patcher or run_in_thread(lambda: mod.CURRENT_PATCHER) is not None:
            raise AssertionError("CURRENT_PATCHER is not per-thread")
    if ns["f"]() != "orig" or getattr(ns["f"], "_ttc_dispatcher", None) is not None:
        raise AssertionError("the original was not put back")
