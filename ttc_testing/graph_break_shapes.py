"""Single-threaded shapes of graph breaks and continuations, each compared with upstream (do no harm).

    python -m ttc_testing.graph_break_shapes            # one JSON line: {shape: {"result", "graphs"}}

Built from the upstream tests that failed only with the package (issue 37): ``dynamo/test_misc.py``'s
``test_assert``, ``test_default_dtype_change``, ``test_restore_graphstate``,
``test_super_calling_with_metaclass`` and ``dynamo/test_repros.py``'s ``test_with_on_graph_break_inst`` /
``_nested`` ended in ``RecursionError`` once a gate stood in front of graph-break continuations. Their
common shape: a graph break inside a function that dynamo inlines, with ``nested_graph_breaks`` on (as
torch's ``TestCase`` sets it, torch >= 2.13), so that the outer continuation calls the inner one from its
own body and dynamo traces that call when it compiles the outer one.

Each shape runs in this interpreter, one after another, with ``torch._dynamo.reset()`` between them, and
records whether it gave upstream's answer and how many graphs its backend compiled. The caller runs the
module once with ``TTC_DISABLE=1`` and once active and compares the two lines: results and graph counts
must be identical (``tests/test_graph_break_shapes.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch
import torch._dynamo

SHAPES: dict[str, Callable[[Callable[..., Any]], None]] = {}


def shape(fn: Callable[[Callable[..., Any]], None]) -> Callable[[Callable[..., Any]], None]:
    SHAPES[fn.__name__] = fn
    return fn


def inner_break(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


@shape
def nested_graph_break(compile: Callable[..., Any]) -> None:
    """A graph break inside an inlined call: the continuation of ``outer`` calls ``inner_break``'s."""
    outer = compile(lambda x: inner_break(x) - 1)
    x = torch.randn(4)
    assert torch.equal(outer(x), inner_break(x) - 1)


@shape
def deep_nesting(compile: Callable[..., Any]) -> None:
    """Three inlined levels above the break, called three times (the cached continuations run warm)."""
    def l3(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x + 3

    def l2(x: torch.Tensor) -> torch.Tensor:
        return l3(x) * 2

    def l1(x: torch.Tensor) -> torch.Tensor:
        return l2(x) - 1

    fn = compile(lambda x: l1(x) / 2)
    x = torch.randn(3)
    for _ in range(3):
        assert torch.equal(fn(x), l1(x) / 2)


@shape
def assert_in_inlined_call(compile: Callable[..., Any]) -> None:
    """An assertion that fails inside an inlined helper (``test_assert``): the AssertionError reaches the caller."""
    def check(x: torch.Tensor) -> None:
        if not (x.shape != x.shape):
            raise AssertionError(repr(x))

    fn = compile(lambda x: check(x))
    try:
        fn(torch.randn(10))
    except AssertionError:
        return
    raise RuntimeError("no AssertionError")


@shape
def with_block_broken(compile: Callable[..., Any]) -> None:
    """A ``with`` block broken by a graph break in a call inside it (``test_with_on_graph_break_inst``)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = inner_break(x)
        return y + 1

    x = torch.randn(3, requires_grad=True)
    out = compile(f)(x)
    assert torch.equal(out, f(x)) and not out.requires_grad


@shape
def with_nested_broken(compile: Callable[..., Any]) -> None:
    """Two nested ``with`` blocks, the inner one in an inlined call (``test_with_on_graph_break_nested``)."""
    def mid(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return inner_break(x) * 3

    def f(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return mid(x) + 1

    x = torch.randn(3, requires_grad=True)
    out = compile(f)(x)
    assert torch.equal(out, f(x)) and out.requires_grad == f(x).requires_grad


@shape
def super_through_metaclass(compile: Callable[..., Any]) -> None:
    """``super()`` calls through a metaclass's ``__call__`` with a break below (``test_super_calling_with_metaclass``)."""
    class Meta(type):
        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    class Base(metaclass=Meta):
        def f(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return x + 1

    class Child(Base):
        def f(self, x: torch.Tensor) -> torch.Tensor:
            return super().f(x) * 2

    x = torch.randn(3)
    assert torch.equal(compile(lambda x: Child().f(x))(x), (x + 1) * 2)


@shape
def default_dtype_change(compile: Callable[..., Any]) -> None:
    """The default dtype changes between two calls of a function with a break (``test_default_dtype_change``)."""
    def mk() -> torch.Tensor:
        torch._dynamo.graph_break()
        return torch.ones(2)

    fn = compile(lambda x: x + mk())
    old = torch.get_default_dtype()
    try:
        a = fn(torch.ones(2))
        torch.set_default_dtype(torch.float64)
        b = fn(torch.ones(2, dtype=torch.float64))
    finally:
        torch.set_default_dtype(old)
    assert (a.dtype, b.dtype) == (torch.float32, torch.float64), (a.dtype, b.dtype)


@shape
def reentrant_compiled_call(compile: Callable[..., Any]) -> None:
    """A compiled function calls another compiled function whose inlined callee breaks."""
    g = compile(lambda x: inner_break(x) + 2)
    f = compile(lambda x: g(x) * 2)
    x = torch.randn(3)
    assert torch.equal(f(x), (inner_break(x) + 2) * 2)


@shape
def generator_with_breaks(compile: Callable[..., Any]) -> None:
    """A generator that breaks on every item, consumed inside a compiled function."""
    def gen(x: torch.Tensor) -> Any:
        for i in range(3):
            torch._dynamo.graph_break()
            yield x + i

    x = torch.randn(3)
    assert torch.allclose(compile(lambda x: sum(gen(x)))(x), sum(gen(x)))


@shape
def closure_continuation(compile: Callable[..., Any]) -> None:
    """A break inside a closure that reads a cell of its maker (torch >= 2.12 builds its continuation with a factory)."""
    def make(k: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def inner(x: torch.Tensor) -> torch.Tensor:
            y = x * k
            torch._dynamo.graph_break()
            return y + k
        return inner

    inner = make(3.0)
    fn = compile(lambda x: inner(x) - 1)
    x = torch.randn(3)
    for _ in range(2):
        assert torch.equal(fn(x), inner(x) - 1)


def run() -> dict[str, dict[str, Any]]:
    """Every shape, in order: ``{"result": "ok" or the error, "graphs": graphs the backend compiled}``."""
    if hasattr(torch._dynamo.config, "nested_graph_breaks"):
        torch._dynamo.config.nested_graph_breaks = True  # what torch's own TestCase sets (2.13+)
    out: dict[str, dict[str, Any]] = {}
    for name, body in SHAPES.items():
        graphs = [0]

        def backend(gm: Any, example_inputs: Any, graphs: list[int] = graphs) -> Any:
            graphs[0] += 1
            return gm.forward

        try:
            body(lambda fn: torch.compile(fn, backend=backend))
            result = "ok"
        except BaseException as e:  # a RecursionError or anything else is the finding
            result = f"{type(e).__name__}: {str(e)[:120]}"
        out[name] = {"result": result, "graphs": graphs[0]}
        torch._dynamo.reset()
    return out


if __name__ == "__main__":
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 1000))
    print("SHAPES " + json.dumps(run()), flush=True)
