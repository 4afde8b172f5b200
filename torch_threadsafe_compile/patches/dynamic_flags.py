"""H5 — ``torch.compile(dynamic=...)`` sets its shape flags for the calling thread only (torch < 2.12).

Before torch 2.12 dynamo config values are process-global. ``torch.compile(fn, dynamic=True/False)``
applies its choice on *every call* of ``fn`` through ``config._make_closure_patcher`` (an enter/exit hook
of dynamo's ``compile_wrapper``): ``assume_static_by_default`` and ``automatic_dynamic_shapes`` are
written process-wide on entry and the prior values written back on exit. Two threads calling functions
compiled with different ``dynamic=`` interleave those writes, so a compile in one thread uses the other
thread's flags, and an unlucky exit order leaves the wrong values behind for good. Measured on torch 2.11
(soak suite, ``plain``/``plain_dyn`` kinds): a ``dynamic=True`` function compiled 3 graphs instead of 2;
on an H200, ``dynamic=False`` functions compiled fewer graphs than guard sets (one compiled dynamic).
This is the reproducer of pytorch/pytorch#118260; from 2.12 config patches are ContextVars (per thread).

The patch keeps ``_make_closure_patcher``'s interface and makes the values it sets an overlay for the
calling thread: ``ConfigModule.__getattr__`` looks at that thread's overlay first. Plain assignments and
``config.patch`` are unchanged (``config.patch`` values can enter cache keys that read the global table;
the dynamic flags shape what dynamo traces, which the graph itself records).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch_threadsafe_compile._journal import Changes, run_in_thread
from torch_threadsafe_compile._torch import CONFIG_MODULE, loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["dynamic_flags"]

_MISSING = object()
_overlays = threading.local()  # .by_module: {id(config module): {name: value}}


def _module() -> Any:
    return loaded(CONFIG_MODULE)


def check() -> str | None:
    cm = getattr(_module(), "ConfigModule", None)
    if not isinstance(cm, type):
        return "torch.utils._config_module.ConfigModule not found"
    for name in ("__getattr__", "_make_closure_patcher"):
        if name not in cm.__dict__:
            return f"ConfigModule.{name} not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    cm = _module().ConfigModule
    orig_getattr = cm.__dict__["__getattr__"]

    def _make_closure_patcher(self: Any, **patch: Any) -> Callable[[], Callable[[], None]]:
        """Like upstream (a low-overhead patcher for the hot path), but the values hold in this thread only."""
        for name in patch:
            if name not in self._config:
                raise AttributeError(f"{self.__name__}.{name} does not exist")
        key = id(self)

        def change() -> Callable[[], None]:
            by_module = getattr(_overlays, "by_module", None)
            if by_module is None:
                by_module = _overlays.by_module = {}
            overlay = by_module.setdefault(key, {})
            prior = {name: overlay.get(name, _MISSING) for name in patch}
            overlay.update(patch)

            def revert() -> None:
                for name, value in prior.items():
                    if value is _MISSING:
                        overlay.pop(name, None)
                    else:
                        overlay[name] = value

            return revert

        return change

    def __getattr__(self: Any, name: str) -> Any:
        by_module = getattr(_overlays, "by_module", None)
        if by_module:
            overlay = by_module.get(id(self))
            if overlay and name in overlay:
                return overlay[name]
        return orig_getattr(self, name)

    __getattr__.__wrapped__ = orig_getattr  # type: ignore[attr-defined]
    _make_closure_patcher.__wrapped__ = cm.__dict__["_make_closure_patcher"]  # type: ignore[attr-defined]
    changes.setattr(cm, "__getattr__", __getattr__)
    changes.setattr(cm, "_make_closure_patcher", _make_closure_patcher)
    return {}


def verify() -> None:
    """A patcher's value is seen in its thread only, and revert restores what the thread saw before."""
    config = loaded("torch._dynamo.config")

    before = config.assume_static_by_default
    revert = config._make_closure_patcher(assume_static_by_default=not before)()
    try:
        if config.assume_static_by_default is before:
            raise AssertionError("the closure patcher's value is not seen by its own thread")
        if run_in_thread(lambda: config.assume_static_by_default) is not before:
            raise AssertionError("another thread sees this thread's closure patcher value")
    finally:
        revert()
    if config.assume_static_by_default is not before:
        raise AssertionError("revert did not restore the value")
