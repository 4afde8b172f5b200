"""H7 — the first ``torch.compile`` / ``torch.export.export`` calls import dynamo one thread at a time.

``torch.compile()`` and ``torch.export.export()`` import ``torch._dynamo`` and many inductor and export
modules on first use, and these import each other in cycles. When several threads make their first calls
at once, each enters that cycle at a different module and holds that module's import lock while it waits
for another's: Python detects the cycle and raises in one of them ``_frozen_importlib._DeadlockError:
deadlock detected by _ModuleLock('torch._dynamo')``, and the others fail with ``ImportError: cannot import
name ... from partially initialized module``. Measured on torch 2.13 CPU: 16 threads, half compiling and
half exporting for the first time: 16 of 16 failed in 4 of 4 runs. Importing ``torch._dynamo`` at
``import torch`` would avoid it but costs every program that never compiles about a second, and the
package never imports torch modules early.

Fix: until such a call has completed with ``torch._dynamo`` imported, calls of these entry points take one
process-wide lock; the first does the imports while the others wait for it holding no import lock, so no
cycle can form. Afterwards the lock is never taken again: one flag test per call. The wrappers are
transparent (``functools.wraps``: name, signature, docs, ``__wrapped__``). Limit: threads that import
torch's internal modules directly (``import torch._inductor.config``) still race as upstream; import those
before starting threads. ``torch._dynamo.export`` is not an entry point here on purpose: reaching it at all
imports ``torch._dynamo`` (the attribute access does, before any wrapper could run), so its race is that
import's, under the same limit.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded, present_callables
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["compile_import_lock"]

_lock = threading.RLock()  # re-entrant: torch.compile may call itself (its decorator form)


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()  # a thread of the parent may have held it
_imported: list[bool] = []  # [True] once a torch.compile() call completed with dynamo imported


def _dynamo_imported() -> bool:
    mod = sys.modules.get("torch._dynamo")
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


# The public entry points that import dynamo on first use: (module, attribute).
ENTRY_POINTS = (("torch", "compile"), ("torch.export", "export"))


def _entry_points() -> list[tuple[Any, str]]:
    return present_callables(ENTRY_POINTS)


def _serialized(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def first_calls_serialized(*args: Any, **kwargs: Any) -> Any:
        if _imported:
            return original(*args, **kwargs)
        with _lock:
            result = original(*args, **kwargs)
            if _dynamo_imported():
                _imported[:] = [True]
            return result

    return first_calls_serialized


def check() -> str | None:
    if not callable(getattr(loaded("torch"), "compile", None)):
        return "torch.compile not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    if _dynamo_imported():
        _imported[:] = [True]
    wrapped = []
    for mod, attr in _entry_points():  # torch.export is imported by `import torch` itself
        changes.setattr(mod, attr, _serialized(getattr(mod, attr)))
        wrapped.append(f"{mod.__name__}.{attr}")
    return {"wrapped": wrapped}


def verify() -> None:
    for mod, attr in _entry_points():
        if getattr(getattr(mod, attr), "__wrapped__", None) is None:
            raise AssertionError(f"{mod.__name__}.{attr} is not wrapped")


def report() -> dict[str, Any]:
    return {"dynamo_imported": bool(_imported)}
