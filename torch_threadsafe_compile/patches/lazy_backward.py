"""H4 — no deadlock between dynamo's compile lock and the autograd engine: lower the backward with the forward.

AOTAutograd compiles the backward graph lazily, on the first ``.backward()``, inside the autograd engine.
For tensors on an accelerator (CUDA, XPU, ...) that runs on the engine's per-device worker thread, and
``compile_fx_backward`` takes dynamo's global ``compile_lock``. Meanwhile another thread that holds
``compile_lock`` while dynamo traces ``flex_attention``'s backward calls ``torch.autograd.grad``, which needs
that same worker thread. Each waits for the other: the seed trainer hung in 3 of 3 cold-cache runs on an H200.

Fix: compile the backward inside the forward compile, in the thread that already holds the lock, so the
autograd worker never needs the lock (0 of 5 runs hung). This patch does it **per compile, and only where
the hazard can happen**:

* an input of the compiled graph lives on a device whose backward runs on an autograd worker thread
  (anything but the CPU). A CPU backward runs in the thread that called ``backward()``, which never holds
  the lock while it waits for the engine, so CPU programs pay nothing (an inference server whose model is
  in ``eval()`` without ``no_grad`` would otherwise compile backwards it never runs);
* and the program has started threads of its own (``_torch.program_threads_started``) when the graph is
  compiled. The inversion needs a second program thread that holds the lock; a single-threaded program
  keeps upstream's lazy backward exactly (its compile counters, FX-graph-cache hits and misses and
  CUDA-graph ids: upstream's ``test_cudagraph_trees.py`` counts them).

Limit: a graph compiled before the program started its threads keeps the lazy backward; if its first
backward runs later, while another thread holds ``compile_lock`` and waits for the same device's autograd
worker, the inversion can still happen (``compile_lock_watchdog`` reports it). Run one forward and backward
before starting the threads, or compile in the threads. No config value changes anywhere.

Per version (kept apart, gevent style):

* torch >= 2.9 has a switch for it, ``force_non_lazy_backward_lowering``, taken by
  ``prepare_aot_module_simplified`` (the start of ``aot_module_simplified``, the entry of dynamo's AOT
  backends; from 2.10 it passes the config option of that name). That function is wrapped to pass the
  switch as True for such graphs; ``torch._functorch.config.force_non_lazy_backward_lowering`` still reads
  as upstream ships it, and a value the program sets itself wins, either way.
* torch 2.6 → 2.8 have the lock inversion (``compile_fx``'s backward compiler takes ``compile_lock``) but no
  switch. ``aot_dispatch_autograd`` already compiles the backward eagerly when it saves symbolic sizes for
  it (``if num_symints_saved_for_bw > 0:``); its code is rewritten so that condition also holds for such
  graphs (``... or _ttc_eager_backward(flat_args)``), taking the same, upstream-tested path.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import threading
from contextvars import ContextVar
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._rewrite import rewrite_function
from torch_threadsafe_compile._torch import config_entries, config_unset, loaded, program_threads_started
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["lazy_backward"]

OPTION = "force_non_lazy_backward_lowering"
TARGET = "prepare_aot_module_simplified"  # >= 2.9
# < 2.9: where aot_dispatch_autograd lives, and the helper its rewritten condition calls.
DISPATCH_MODULES = ("torch._functorch._aot_autograd.graph_compile", "torch._functorch._aot_autograd.jit_compile_runtime_wrappers")
HELPER = "_ttc_eager_backward"

# Device types whose backward the autograd engine runs on a worker thread of its own. Everything but the CPU
# (and "meta", which computes nothing); tests may replace it to exercise the mechanism on a CPU machine.
BACKWARD_IN_CALLING_THREAD = frozenset({"cpu", "meta"})

stats = {"eager_backward_graphs": 0}
# Compiles run in several threads at once: `+=` on a dict entry is a read and a write, not one step.
_stats_lock = threading.Lock()


@_forksafe.in_child
def _after_fork() -> None:
    global _stats_lock
    _stats_lock = threading.Lock()  # a compiling thread of the parent may have held it


def _count_eager_backward() -> None:
    with _stats_lock:
        stats["eager_backward_graphs"] += 1


def _program_setting() -> bool:
    """Whether the program (or the environment) set the option itself: then its value is used as is."""
    cfg = sys.modules.get("torch._functorch.config")  # imported by aot_autograd itself
    entry = config_entries(cfg).get(OPTION) if cfg is not None else None
    if entry is None:  # torch 2.9: the switch exists, the option does not
        return False
    unset = config_unset()
    override = entry.user_override
    value = override.get() if isinstance(override, ContextVar) or hasattr(override, "var") else override
    env = (getattr(entry, "env_value_force", unset), getattr(entry, "env_value_default", unset))
    return value is not unset or any(v is not unset for v in env)


def on_worker_device(values: Any) -> bool:
    """Whether any tensor among ``values`` lives on a device whose backward runs on an autograd worker thread."""
    torch = loaded("torch")
    return any(isinstance(v, torch.Tensor) and v.device.type not in BACKWARD_IN_CALLING_THREAD for v in values)


def needs_eager_backward(values: Any) -> bool:
    """Whether a graph with these inputs compiled now could meet H4: a backward on an autograd worker
    thread, and other program threads that may hold ``compile_lock`` meanwhile."""
    return on_worker_device(values) and program_threads_started()


def _has_switch() -> bool:
    """torch >= 2.9: ``prepare_aot_module_simplified`` takes the switch (its config option exists from 2.10)."""
    fn = getattr(loaded(SPEC.modules[0]), TARGET, None)
    return callable(fn) and OPTION in inspect.signature(fn).parameters


# -- torch >= 2.9: the switch, per compile ----------------------------------------------------------------


def _apply_switch(changes: Changes) -> None:
    aot = loaded(SPEC.modules[0])
    original: Callable[..., Any] = getattr(aot, TARGET)

    @functools.wraps(original)
    def prepare_aot_module_simplified(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get(OPTION) and len(args) > 1 and not _program_setting() and needs_eager_backward(args[1]):
            kwargs[OPTION] = True
            _count_eager_backward()
        return original(*args, **kwargs)

    changes.setattr(aot, TARGET, prepare_aot_module_simplified)


# -- torch 2.6 -> 2.8: the eager path of aot_dispatch_autograd, taken for these graphs too -------------------


class _EagerCondition(ast.NodeTransformer):
    """``if num_symints_saved_for_bw > 0:`` -> ``if num_symints_saved_for_bw > 0 or _ttc_eager_backward(flat_args):``"""

    def __init__(self) -> None:
        self.hits = 0

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        test = node.test
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "num_symints_saved_for_bw"
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Gt)
        ):
            call = ast.Call(func=ast.Name(id=HELPER, ctx=ast.Load()), args=[ast.Name(id="flat_args", ctx=ast.Load())], keywords=[])
            node.test = ast.copy_location(ast.BoolOp(op=ast.Or(), values=[test, call]), test)
            self.hits += 1
        return node


def _dispatch_function() -> tuple[Any, Any] | None:
    for name in DISPATCH_MODULES:
        mod = sys.modules.get(name)
        fn = getattr(mod, "aot_dispatch_autograd", None) if mod is not None else None
        if callable(fn):
            return mod, fn
    return None


def _check_rewrite() -> str | None:
    found = _dispatch_function()
    if found is None:
        return "aot_dispatch_autograd not found"
    if "flat_args" not in inspect.signature(found[1]).parameters:
        return "aot_dispatch_autograd takes no flat_args"
    return None


def _eager_backward(flat_args: Any) -> bool:
    if needs_eager_backward(flat_args):
        _count_eager_backward()
        return True
    return False


def _apply_rewrite(changes: Changes) -> None:
    found = _dispatch_function()
    if found is None:
        raise AssertionError("aot_dispatch_autograd disappeared since check()")
    mod, fn = found
    code = rewrite_function(fn, _EagerCondition(), "the eager backward condition (num_symints_saved_for_bw > 0)")
    changes.inject(mod.__dict__, HELPER, _eager_backward)
    changes.swap_code(fn, code)


# -- the patch -------------------------------------------------------------------------------------------


def check() -> str | None:
    return None if _has_switch() else _check_rewrite()


def apply(changes: Changes) -> dict[str, Any]:
    if _has_switch():
        _apply_switch(changes)
        return {"mechanism": f"{TARGET}({OPTION}=True) per compile"}
    _apply_rewrite(changes)
    return {"mechanism": "aot_dispatch_autograd's eager backward path per compile"}


def verify() -> None:
    if _has_switch():
        if getattr(getattr(loaded(SPEC.modules[0]), TARGET), "__wrapped__", None) is None:
            raise AssertionError(f"{TARGET} is not wrapped")
        return
    found = _dispatch_function()
    if found is None or HELPER not in found[1].__code__.co_names:
        raise AssertionError("aot_dispatch_autograd does not call the eager-backward condition")


def report() -> dict[str, Any]:
    with _stats_lock:
        return dict(stats)
