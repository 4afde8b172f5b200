"""H7 — the first calls of a lazily compiled FX ``GraphModule`` from several threads generate broken code.

AOTAutograd and inductor build ``_LazyGraphModule`` objects: their Python code is generated on the first
call (``_lazy_forward`` → ``real_recompile`` → ``GraphModule.recompile`` → ``Graph.python_code``). Code
generation names the graph's values through ``override_node_repr``, which sets ``node._repr_fn`` on every
node of the *shared* graph to a function of its own naming scope and sets them back afterwards. Two threads
generating code from one graph at once overwrite each other's naming functions: a thread's ``forward`` then
reads names the other scope gave (``UnboundLocalError: cannot access local variable 'sin_12'``,
``NameError: name 'addmm_1' is not defined``, ``TypeError: ... 'NoneType'``). Upstream, each thread that
compiles a function gets graph modules of its own, so only programs that share one (a module called from a
thread pool) meet it; the package's H3 fix shares one compile among all threads, and their simultaneous
first calls meet it every time the timing allows. Measured: with the GIL, 8 threads' first calls of one
``_LazyGraphModule`` (60 ``sin``/``cos`` steps, 1 µs switch interval): ~47 failed calls of 320 in each of 3
runs; free-threaded CPython 3.13t, ``module_stampede`` (8 threads, ``torch.compile(module)``): 2 runs of 12
with 1 and 7 failed first calls.

Fix: ``_LazyGraphModule.real_recompile`` takes one process-wide lock when the module still needs its code
(upstream's own check, repeated under the lock); once the code exists a call costs that check only, as
upstream. Code generation is short and happens once per graph module.

Upstream: pytorch/pytorch#105943 (PT2 is not thread safe); ``override_node_repr`` mutates the graph's
nodes for the duration of ``python_code``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["lazy_recompile"]

CLASS = "_LazyGraphModule"
METHOD = "real_recompile"

# Re-entrant: code generation may build (and recompile) other graph modules.
_lock = threading.RLock()
stats = {"recompiles": 0}


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()  # a thread of the parent may have held it


def _class() -> Any:
    return getattr(loaded(SPEC.modules[0]), CLASS)


def _serialized(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def real_recompile(self: Any) -> None:
        if not self._needs_recompile():  # the code exists: upstream's check, no lock
            return
        with _lock:
            if self._needs_recompile():  # another thread may have generated it while this one waited
                stats["recompiles"] += 1
                original(self)

    return real_recompile


def check() -> str | None:
    cls = getattr(loaded(SPEC.modules[0]), CLASS, None)
    if cls is None:
        return f"torch.fx._lazy_graph_module.{CLASS} not found"
    if not callable(cls.__dict__.get(METHOD)) or not callable(getattr(cls, "_needs_recompile", None)):
        return f"{CLASS}.{METHOD} / _needs_recompile not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    cls = _class()
    changes.setattr(cls, METHOD, _serialized(cls.__dict__[METHOD]))
    return {}


def verify() -> None:
    if getattr(_class().__dict__[METHOD], "__wrapped__", None) is None:
        raise AssertionError(f"{CLASS}.{METHOD} is not serialized")


def report() -> dict[str, int]:
    return dict(stats)
