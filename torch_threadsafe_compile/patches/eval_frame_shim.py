"""H10, free-threaded CPython (crash) — dynamo's frame-evaluation shim is installed and removed one thread at a time.

Every call of a compiled function sets the calling thread's dynamo callback on entry and clears it on return
(``set_eval_frame`` in ``torch/_dynamo/eval_frame.py``, a C function of ``torch._C._dynamo.eval_frame``). The C
side counts the threads that have a callback (``active_dynamo_threads``); when the count leaves 0 it installs
its shim as the interpreter's frame-evaluation function (``enable_eval_frame_shim``: read the current function,
save it in ``previous_eval_frame``, install ``custom_eval_frame_shim``), and when the count returns to 0 it puts
the saved function back. Neither the count nor that read-save-install sequence is synchronized. With the GIL
each ``set_eval_frame`` call runs whole, so nothing interleaves. Without it, two threads starting a compiled
call at once can both find the shim missing; the second then saves *the shim itself* as the previous
function, and every frame evaluation that falls through to "the previous function" calls the shim again:
the C stack overflows (gdb: ~19,780 alternating ``custom_eval_frame`` / ``dynamo__custom_eval_frame``
frames, then ``SIGSEGV``). Lost updates of the count can also remove the shim while other threads are inside
compiled calls (their frames then run uncompiled). Measured on CPython 3.13.15t, torch 2.12.0, ``PYTHON_GIL=0``,
5 threads making warm calls of one compiled function for 8 s (``python -m ttc_testing.freethreaded
warm_calls threads=5 seconds=8``, and the same loop without a start barrier): the process died (``SIGSEGV``,
or hung) in 5 of 16 runs unpatched and in 0 of 8 with this patch; with and without the rest of the package
alike (it is dynamo's own wrapper that makes the calls).

Fix: the names under which dynamo calls the C function (``set_eval_frame`` and ``_maybe_set_eval_frame`` of
``torch._dynamo.eval_frame``, ``set_eval_frame`` of ``torch._dynamo.decorators`` and of the C module itself)
become a function that makes the same C call holding one process-wide lock. Dynamo reads these module globals
at call time, so wrappers made before activation are covered. The lock is a leaf: nothing else is acquired
under it, and the C call runs no Python code. Its code object is registered with dynamo's ``skip_code`` so
that a call from inside compiled code (a compiled function called by another) is never traced.

Applies on free-threaded builds only (``Py_GIL_DISABLED``), whatever the GIL's state at run time; with the GIL
the C call is atomic and the patch is skipped. Upstream: the count and ``previous_eval_frame`` are
unsynchronized in every release up to 2.15 (``torch/csrc/dynamo/eval_frame.c``).
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from torch_threadsafe_compile import _env, _forksafe
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded, skip_code
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["eval_frame_shim"]

C_MODULE = "torch._C._dynamo.eval_frame"
# (module, attribute) pairs through which torch calls the C function; each is replaced only if it is it.
TARGETS = (
    ("torch._dynamo.eval_frame", "set_eval_frame"),
    ("torch._dynamo.eval_frame", "_maybe_set_eval_frame"),  # the same function where JustKnobs are off
    ("torch._dynamo.decorators", "set_eval_frame"),
)

_lock = threading.Lock()


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # a thread of the parent may have held it (the wrapper reads it per call)


def _c_module() -> Any:
    torch = loaded("torch")
    return getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)


def _serialized(original: Any) -> Any:
    @functools.wraps(original)
    def set_eval_frame(callback: Any) -> Any:
        with _lock:  # read per call: a forked child rebinds it (_after_fork)
            return original(callback)

    set_eval_frame.__wrapped__ = original  # type: ignore[attr-defined]
    return set_eval_frame


def check() -> str | None:
    if not _env.free_threaded_build():
        return "not a free-threaded build: set_eval_frame runs under the GIL"
    c_mod = _c_module()
    if not callable(getattr(c_mod, "set_eval_frame", None)):
        return "torch._C._dynamo.eval_frame.set_eval_frame not found"
    if getattr(c_mod.set_eval_frame, "__wrapped__", None) is not None:
        return "torch._C._dynamo.eval_frame.set_eval_frame is already wrapped"  # a second wrapper would self-deadlock
    if loaded("torch._dynamo.eval_frame").__dict__.get("set_eval_frame") is not c_mod.set_eval_frame:
        return "torch._dynamo.eval_frame.set_eval_frame is not the C function"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    c_mod = _c_module()
    original = c_mod.set_eval_frame
    wrapper = _serialized(original)
    if not skip_code(wrapper.__code__):
        raise AssertionError("torch._dynamo.eval_frame.skip_code not found")
    replaced = []
    for mod_name, attr in TARGETS:
        mod = sys.modules.get(mod_name)
        if mod is not None and mod.__dict__.get(attr) is original:
            changes.setattr(mod, attr, wrapper)
            replaced.append(f"{mod_name}.{attr}")
    changes.setattr(c_mod, "set_eval_frame", wrapper)
    replaced.append(f"{C_MODULE}.set_eval_frame")
    return {"replaced": replaced}


def verify() -> None:
    ef = loaded("torch._dynamo.eval_frame")
    fn = ef.set_eval_frame
    if getattr(fn, "__wrapped__", None) is None:
        raise AssertionError("torch._dynamo.eval_frame.set_eval_frame is not serialized")
    prior = fn(None)  # this thread's callback, unchanged: set None, then put back what was there
    fn(prior)
