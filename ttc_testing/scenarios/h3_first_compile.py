"""H3, the first-compile stampede: one compile per guard set, dynamo's cache lookup under
threads, a failing neighbour's compiles, and upstream's #118260 crash reproducer."""

from __future__ import annotations

import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, _uncompiled_frames, scenario
from ttc_testing.scenarios._common import _run_for


@scenario
def module_stampede(threads: int = 8, how: str = "torch.compile", backend: str = "aot_eager") -> dict[str, Any]:
    """H3 for modules: ``torch.compile(module)`` or ``module.compile()``, first call from ``threads`` at once."""
    import torch
    import torch._dynamo.utils as du

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).relu()

    if how == "torch.compile":
        m = torch.compile(M(), backend=backend)
    else:
        m = M()
        m.compile(backend=backend)
    bar = threading.Barrier(threads)
    errors: list[str] = []

    def w() -> None:
        x = torch.randn(4, 8)
        bar.wait()
        try:
            with torch.no_grad():
                m(x)
        except Exception as e:
            errors.append(str(e)[:80])

    ts = [threading.Thread(target=w) for _ in range(threads)]
    _start_join(ts)
    return {"threads": threads, "how": how, "graphs": int(du.counters["stats"]["unique_graphs"]),
            "uncompiled_frames": _uncompiled_frames(), "errors": len(errors)}


@scenario
def guard_sets(threads: int = 6, backend: str = "aot_eager") -> dict[str, Any]:
    """H3: threads needing two different guard sets (two dtypes) → one compile per guard set."""
    import torch
    import torch._dynamo.utils as du

    f = torch.compile(lambda x: (x * 2).cos(), backend=backend)
    bar = threading.Barrier(threads)
    errors: list[str] = []

    def w(i: int) -> None:
        x = torch.randn(32, dtype=torch.float32 if i % 2 == 0 else torch.float64)
        bar.wait()
        try:
            f(x)
        except Exception as e:
            errors.append(str(e)[:80])

    ts = [threading.Thread(target=w, args=(i,)) for i in range(threads)]
    _start_join(ts)
    return {"threads": threads, "guard_sets": 2, "graphs": int(du.counters["stats"]["unique_graphs"]), "errors": len(errors)}


@scenario
def guard_fail_fn_threads(threads: int = 4, concurrent: int = 1) -> dict[str, Any]:
    """H3, the deliberate deviation seen in ``test_misc.py``'s ``test_guard_failure_fn`` run in N threads: each
    thread wraps one shared function with ``torch._dynamo.optimize(..., guard_fail_fn=<its own>)``, calls it
    with a 2-element tensor, then with a 3-element one (a guard failure, a recompile). Counts compiles and
    the threads whose ``guard_fail_fn`` was called. ``concurrent=0``: the threads run one after another
    (what upstream does for calls that do not overlap: the reference the package's rule follows)."""
    import torch
    import torch._dynamo

    def fn(x: Any) -> Any:
        return (x + 1) * 2

    lock = threading.Lock()
    compiles = [0]

    def backend(gm: Any, example_inputs: Any) -> Any:
        with lock:
            compiles[0] += 1
        return gm.forward

    called = [False] * threads
    errors: list[str] = []
    bar = threading.Barrier(threads) if concurrent else None

    def w(i: int) -> None:
        def mine(failure: Any) -> None:
            called[i] = True

        opt = torch._dynamo.optimize(backend, nopython=True, guard_fail_fn=mine)(fn)
        if bar is not None:
            bar.wait()
        try:
            opt(torch.ones(2))
            opt(torch.ones(3))
        except Exception as e:
            errors.append(f"{type(e).__name__}: {str(e)[:80]}")

    if concurrent:
        _start_join([threading.Thread(target=w, args=(i,)) for i in range(threads)])
    else:
        for i in range(threads):
            _start_join([threading.Thread(target=w, args=(i,))])
    return {"threads": threads, "compiles": compiles[0], "called": sum(called), "errors": len(errors),
            "first_error": errors[0] if errors else ""}


@scenario
def lookup_race(threads: int = 16, seconds: float = 6.0, graph_break: int = 0, closure: int = 0,
                backend: str = "aot_eager") -> dict[str, Any]:
    """H3 (spurious cache misses): every guard set is compiled first, in one thread; then ``threads``
    threads call the function with those same inputs. Any graph compiled after the warm-up is a cache
    entry dynamo's lookup missed (it walks the entry list while other threads move entries to its front).
    ``graph_break=1`` puts a graph break in the middle (the continuation is looked up too);
    ``closure=1`` makes the continuation need a closure."""
    import torch
    import torch._dynamo.utils as du

    scale = 3.0

    def body(x: Any) -> Any:
        y = x.sin() * 3
        if graph_break:
            torch._dynamo.graph_break()
        return y.cos() + x * (scale if closure else 3.0)

    f = torch.compile(body, backend=backend, dynamic=False)
    inputs = [torch.randn(n, 16, dtype=dt) for dt in (torch.float32, torch.float64) for n in (4, 6)]
    with torch.no_grad():
        for x in inputs:
            f(x)
    warm = int(du.counters["stats"]["unique_graphs"])
    errors: list[str] = []
    wrong: list[int] = []
    calls = [0] * threads
    stop = time.monotonic() + seconds

    def w(i: int) -> None:
        k = i
        with torch.no_grad():
            while time.monotonic() < stop:
                x = inputs[k % len(inputs)]
                k += 1
                try:
                    if not torch.allclose(f(x), body(x)):
                        wrong.append(k)
                except Exception as e:
                    errors.append(str(e)[:80])
                calls[i] += 1

    _start_join([threading.Thread(target=w, args=(i,)) for i in range(threads)])
    return {
        "graphs_after_warmup": warm,
        "graphs_after_threads": int(du.counters["stats"]["unique_graphs"]),
        "extra_graphs": int(du.counters["stats"]["unique_graphs"]) - warm,
        "uncompiled_frames": _uncompiled_frames(),
        "calls": sum(calls),
        "errors": len(errors),
        "wrong_results": len(wrong),
    }


@scenario
def failing_neighbour(seconds: float = 8.0, targets: int = 4, fail_s: float = 1.0, backend: str = "aot_eager") -> dict[str, Any]:
    """H3 flights vs a neighbour whose compiles keep failing: one thread compiles a function whose backend
    holds ``compile_lock`` for ``fail_s`` and then raises, again and again; ``targets`` threads call a warm
    compiled function (whose callee dynamo compiles as a frame of its own), and each compiles one new shape
    of it along the way. Upstream, warm calls never wait for anything; the package must not make them wait
    for a compile stuck behind the failing one."""
    import torch

    def failing(gm: Any, ex: Any) -> Any:
        time.sleep(fail_s)
        raise RuntimeError("the neighbour's compile fails")

    bad = torch.compile(lambda x: x.cos() * 3, backend=failing)

    def inner(y: Any) -> Any:  # compiled as a frame of its own: called from code dynamo does not trace
        return y.sin()

    @torch.compiler.disable(recursive=False)
    def helper(y: Any) -> Any:
        return inner(y)

    def outer(x: Any) -> Any:
        return helper(x * 2) + 1

    good = torch.compile(outer, backend=backend, dynamic=False)
    good(torch.randn(16))  # warm
    stop = threading.Event()
    counts = {"target_calls": 0, "neighbour_failures": 0, "errors": 0, "wrong": 0}
    max_gap = [0.0]

    def neighbour() -> None:
        while not stop.is_set():
            try:
                bad(torch.randn(8))
            except Exception:
                counts["neighbour_failures"] += 1

    def target(i: int) -> None:
        x, new = torch.randn(16), torch.randn(24 + 8 * i)
        t_new = time.time() + 1.0 + 0.5 * i  # one new shape each, staggered
        last = time.time()
        while not stop.is_set():
            arg = new if t_new and time.time() > t_new else x
            if arg is new:
                t_new = 0.0
            try:
                if not torch.allclose(good(arg), (arg * 2).sin() + 1):
                    counts["wrong"] += 1
                counts["target_calls"] += 1
            except Exception:
                counts["errors"] += 1
            now = time.time()
            if arg is x:  # a warm call: how long did the slowest take
                max_gap[0] = max(max_gap[0], now - last)
            last = now

    ts = [threading.Thread(target=neighbour)] + [threading.Thread(target=target, args=(i,)) for i in range(targets)]
    _run_for(ts, seconds, stop)
    return dict(counts, max_warm_call_s=round(max_gap[0], 3), seconds=seconds)


@scenario
def guard_race(seconds: float = 2.0, min_calls: int = 20) -> dict[str, Any]:
    """H3 (crash), upstream's pytorch/pytorch#118260 reproducer: two threads call a function compiled with
    ``dynamic=False`` with a new shape each time, so one compiles while the other runs compiled code. On
    torch's CUDA builds on a machine without a GPU the process can die (``bench/cuda_guard_crash.py``)."""
    import torch
    import torch._dynamo  # before the threads: they race on compiles, not on first imports

    f = torch.compile(lambda x: x.sin() + 1, dynamic=False, backend="aot_eager")
    calls = [0, 0]
    errors: dict[str, int] = {}
    t0 = time.monotonic()

    def run(offset: int) -> None:
        i = 0
        while i < min_calls or time.monotonic() - t0 < seconds:
            try:
                f(torch.randn(i * 2 + offset))
                calls[offset] += 1
            except Exception as e:  # counted: the question is whether the process survives
                key = f"{type(e).__name__}: {str(e)[:80]}"
                errors[key] = errors.get(key, 0) + 1
            i += 1

    _start_join([threading.Thread(target=run, args=(k,)) for k in (0, 1)])
    return {"calls": sum(calls), "errors": sum(errors.values()), "kinds": list(errors)[:3],
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}
