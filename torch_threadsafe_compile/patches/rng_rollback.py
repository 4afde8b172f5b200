"""H7 — a compile in one thread rolls back the random numbers that other threads drew meanwhile.

Dynamo saves the process-wide CPU and CUDA generator states before every frame it compiles and sets them
back afterwards (``convert_frame.preserve_global_state``, around ``trace_frame``/``transform``), and
``torch._dynamo.utils.preserve_rng_state`` does the same around AOTAutograd's tracing, inductor's code
generation and autotuning, and the first call of a CUDA-graphed function in a thread. Upstream does this so
that compiling does not move a single-threaded program's random stream. With threads it is a rollback:
every number another thread drew while the compile ran (seconds with inductor) is drawn *again* afterwards.
Silent repeats: a data loader's augmentations, dropout masks, sampled tokens. Measured on torch 2.13 (CPU):
one thread drawing ``torch.rand(4)`` while the main thread compiles six small functions with
``aot_eager`` drew ~500 tensors twice; on the H200 (torch 2.11, inductor, CUDA graphs) 23,667 of 47,619
draws of four threads were repeats while a fifth thread compiled and trained.

Up to torch 2.11 ``preserve_global_state`` also sets Python's ``random`` module back
(``random.setstate``): another thread's ``random.random()`` draws repeat the same way. From 2.12 torch's
C++ frame evaluation does that, out of this patch's reach (docs/hazards.md, H7).

The patch rewrites the restore calls of both functions (``torch.random.set_rng_state(...)``,
``torch.cuda.set_rng_state(...)``, ``torch.xpu.set_rng_state(...)``, ``random.setstate(...)``) to go through
one helper that restores only while the program has no threads of its own (``_torch.program_threads_started``). A single-threaded
program keeps upstream's behaviour exactly. In a threaded one, what the compile itself drew (inductor's
autotuning inputs; tracing uses fake tensors and draws nothing) stays drawn instead of being handed out a
second time. The function objects are kept (importers hold ``preserve_rng_state`` by name; dynamo's
``trace_frame`` is the decorated function): only their code changes, compiled from torch's own source
after proving that source is the running code. Up to torch 2.8 the decorated function is ``transform``,
defined inside ``_compile`` and decorated on every call: there the rewritten ``preserve_global_state`` is
all it takes.

Upstream: pytorch/pytorch#105943 (PT2 is not thread safe); no issue on the rollback itself was found.
"""

from __future__ import annotations

import ast
import inspect
import types
from typing import Any, Callable

from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._rewrite import rewrite_function
from torch_threadsafe_compile._torch import loaded, program_threads_started
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["rng_rollback"]

HELPER = "_ttc_restore_rng"
NESTED = "_fn"  # preserve_global_state's wrapper: the function its decorations return
RNG_MODULES = {"random", "cuda", "xpu"}  # torch.<these>.set_rng_state
UTILS = "torch._dynamo.utils"  # imported by convert_frame (so loaded whenever SPEC.modules are)

stats = {"restored": 0, "not_restored": 0}


def _restore_rng(setter: Callable[[Any], Any], state: Any) -> Any:
    """What the rewritten restore calls do: upstream's restore unless the program runs threads of its own."""
    if program_threads_started():
        stats["not_restored"] += 1
        return None
    stats["restored"] += 1
    return setter(state)


_restore_rng._ttc_injected = True  # type: ignore[attr-defined]  # Changes.inject may replace a lingering copy


def _is_restore(f: ast.expr) -> bool:
    """``torch.<random|cuda|xpu>.set_rng_state`` or ``random.setstate`` (Python's generator)."""
    if not isinstance(f, ast.Attribute):
        return False
    if f.attr == "setstate":
        return isinstance(f.value, ast.Name) and f.value.id == "random"
    return (f.attr == "set_rng_state" and isinstance(f.value, ast.Attribute) and f.value.attr in RNG_MODULES
            and isinstance(f.value.value, ast.Name) and f.value.value.id == "torch")


class _RestoreCalls(ast.NodeTransformer):
    """``torch.cuda.set_rng_state(s)`` -> ``_ttc_restore_rng(torch.cuda.set_rng_state, s)`` (and random, xpu,
    and Python's ``random.setstate(s)``)."""

    def __init__(self) -> None:
        self.hits = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if _is_restore(f) and len(node.args) == 1 and not node.keywords:
            self.hits += 1
            return ast.copy_location(ast.Call(func=ast.Name(id=HELPER, ctx=ast.Load()), args=[f, node.args[0]], keywords=[]), node)
        return node


def _targets() -> tuple[types.FunctionType, types.FunctionType, list[types.FunctionType]]:
    """``preserve_global_state``, ``preserve_rng_state``'s generator function, and the functions that
    ``preserve_global_state`` already decorated (their code is its nested ``_fn``)."""
    convert_frame, utils = loaded(SPEC.modules[0]), loaded(UTILS)
    pgs = convert_frame.preserve_global_state
    prs = getattr(utils.preserve_rng_state, "__wrapped__", None)  # @contextmanager keeps the generator function
    if not isinstance(pgs, types.FunctionType) or not isinstance(prs, types.FunctionType):
        raise LookupError("preserve_global_state / preserve_rng_state is not a plain function")
    nested = [c for c in pgs.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == NESTED]
    decorated = [f for f in vars(convert_frame).values() if isinstance(f, types.FunctionType) and nested and f.__code__ is nested[0]]
    return pgs, prs, decorated


def _applied_on_each_compile(convert_frame: types.ModuleType) -> bool:
    """Whether a function of ``convert_frame`` applies ``preserve_global_state`` when it runs (torch ≤ 2.8:
    ``_compile`` decorates its nested ``transform`` on every call)."""
    return any("preserve_global_state" in _names(inspect.unwrap(f).__code__) for f in vars(convert_frame).values()
               if isinstance(f, types.FunctionType) and f.__module__ == convert_frame.__name__)


def check() -> str | None:
    try:
        pgs, prs, decorated = _targets()
    except (LookupError, AttributeError) as e:
        return str(e)
    if not decorated and not _applied_on_each_compile(loaded(SPEC.modules[0])):
        return "preserve_global_state is neither applied to a function nor called in torch._dynamo.convert_frame"
    for fn in (pgs, prs):
        if "set_rng_state" not in _names(fn.__code__):
            return f"{fn.__qualname__} restores no generator state"
    return None


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def apply(changes: Changes) -> dict[str, Any]:
    pgs, prs, decorated = _targets()
    new_pgs = rewrite_function(pgs, _RestoreCalls(), "torch.<random|cuda|xpu>.set_rng_state(...) restores")
    new_prs = rewrite_function(prs, _RestoreCalls(), "torch.<random|cuda|xpu>.set_rng_state(...) restores")
    new_nested = next(c for c in new_pgs.co_consts if isinstance(c, types.CodeType) and c.co_name == NESTED)
    # Both live in torch._dynamo modules that bind `torch`; the helper goes into each module's namespace.
    # linger: a compile in flight in another thread may resume in the rewritten code after uninstall().
    for fn in (pgs, prs):
        changes.inject(fn.__globals__, HELPER, _restore_rng, linger=True)
    changes.swap_code(pgs, new_pgs)
    changes.swap_code(prs, new_prs)
    for fn in decorated:
        changes.swap_code(fn, new_nested)
    return {"decorated": [f.__qualname__ for f in decorated]}


def verify() -> None:
    pgs, prs, decorated = _targets()
    for fn in (pgs, prs, *decorated):
        if HELPER not in _names(fn.__code__) or fn.__globals__.get(HELPER) is not _restore_rng:
            raise AssertionError(f"{fn.__qualname__} does not restore through {HELPER}")


def report() -> dict[str, int]:
    return dict(stats)
