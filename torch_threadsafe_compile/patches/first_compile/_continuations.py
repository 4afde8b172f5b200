"""Gates in front of graph-break continuations (torch 2.4 → 2.15), and the 2.12+ closure factories.

A graph-break continuation is called from compiled code, so the gate of the call that contains it cannot
retry it. Dynamo stores each continuation as a global of the compiled function's module
(``__resume_at_<offset>``) and the compiled code loads it by name when it calls it. A gate put in that
global's place makes the continuation frame the first frame of a gated call: a spurious cache miss there
is retried instead of compiled again. From torch 2.12 a continuation that needs a closure is built at call
time by a factory stored as that global, which gets a gated factory instead. (Before 2.12 the compiled code
builds it itself from a code constant: see ``_continuations_pre212``.)

The gates are kept in a weak set, so they cost nothing once their module drops them; ``restore`` puts the
originals back on revert.
"""

from __future__ import annotations

import functools
import os
import threading
import types
import weakref
from typing import Any, Callable

from torch_threadsafe_compile.patches.first_compile._gate import inline_as, make_resume_gate

_OUTPUT_GRAPH_FILE = os.path.join("torch", "_dynamo", "output_graph.py")
PREFIX = "__resume_at_"


def make_gated_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    """torch >= 2.12 builds a continuation that needs a closure with a factory stored as the global."""

    def ttc_resume_factory(*args: Any, **kwargs: Any) -> Any:
        return make_resume_gate(factory(*args, **kwargs), wraps=False)

    functools.update_wrapper(ttc_resume_factory, factory)
    inline_as(ttc_resume_factory, factory)  # traced, it is upstream's factory (see inline_as)
    ttc_resume_factory._ttc_gate = True  # type: ignore[attr-defined]
    return ttc_resume_factory


FACTORY_CODE = next(
    c for c in make_gated_factory.__code__.co_consts if getattr(c, "co_name", None) == "ttc_resume_factory"
)


class ContinuationGates:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._gates: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
        self._lock = threading.Lock()  # a leaf lock: without the GIL a WeakSet is not safe to share

    def install(self, frame_globals: dict[str, Any], result: Any) -> None:
        """Put a gate in front of the continuations that the code just compiled for a frame calls."""
        if not self.enabled:
            return
        code = getattr(getattr(result, "guarded_code", result), "code", None)
        if not isinstance(code, types.CodeType):
            return
        for name in code.co_names:
            if not name.startswith(PREFIX):
                continue
            fn = frame_globals.get(name)
            if type(fn) is not types.FunctionType or getattr(fn, "_ttc_gate", False):
                continue
            fn_code = fn.__code__
            if not fn_code.co_freevars:
                gate = make_resume_gate(fn)
            elif fn_code.co_name == "_make_fn" and fn_code.co_filename.endswith(_OUTPUT_GRAPH_FILE):
                gate = make_gated_factory(fn)
            else:
                continue
            gate._ttc_restore = (frame_globals, name, fn)  # type: ignore[attr-defined]
            frame_globals[name] = gate
            with self._lock:
                self._gates.add(gate)

    def restore(self) -> None:
        with self._lock:
            gates = list(self._gates)
        for gate in gates:
            scope, name, fn = gate._ttc_restore  # type: ignore[attr-defined]
            if scope.get(name) is gate:
                scope[name] = fn
        self._gates.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._gates)
