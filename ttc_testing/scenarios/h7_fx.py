"""H7, FX's process-global state: the FX patcher of ``symbolic_trace``, and the lazy code generation of
one ``_LazyGraphModule`` from several threads."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, scenario


@scenario
def fx_patcher_leak(seconds: float = 2.0, tracers: int = 2, min_traces: int = 12, min_eager: int = 120,
                    max_seconds: float = 30.0) -> dict[str, Any]:
    """H7 (FX patcher): ``tracers`` threads run fx.symbolic_trace in a loop while another thread runs the same
    kind of module eagerly; errors and wrong results in either are counted.

    Runs ``seconds``, and longer (up to ``max_seconds``) until ``min_traces`` traces and ``min_eager`` eager
    calls were made: on a busy machine (or with the GIL off, where the threads contend for the cores) a fixed
    time gave too few of either for the result to mean anything (4 traces in 2.5 s once)."""
    import torch
    import torch.fx

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)) + 1

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.Sequential(*[Block() for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

    # Switch threads far more often than the default 5 ms, so that the eager thread runs while a trace has
    # its patches in place in every run, not only in some.
    sys.setswitchinterval(1e-5)
    stop = threading.Event()
    errors: dict[str, int] = {}
    counts = {"traces": 0, "eager_calls": 0, "wrong": 0}
    tries = {"eager": 0, "trace": 0}
    lock = threading.Lock()

    def note(e: BaseException) -> None:
        key = f"{type(e).__name__}: {str(e)[:60]}"
        with lock:
            errors[key] = errors.get(key, 0) + 1

    def tracer() -> None:
        m = M()
        x = torch.randn(2, 8)
        t0 = time.time()

        def more() -> bool:
            now = time.time() - t0
            if now < seconds:
                return True
            if errors:  # the hazard showed: nothing more to learn from a longer run
                return False
            # Attempts, not successes: unpatched, every eager call may fail, and the run must still end.
            return now < max_seconds and (tries["trace"] < min_traces or tries["eager"] < min_eager)

        try:
            while more():
                with lock:
                    tries["trace"] += 1
                try:
                    gm = torch.fx.symbolic_trace(m)
                    ok = torch.allclose(gm(x), m(x))
                    with lock:  # counted under the lock: with the GIL off, += from two threads loses updates
                        counts["wrong"] += not ok
                        counts["traces"] += 1
                except Exception as e:
                    note(e)
        finally:
            stop.set()

    def runner() -> None:
        m = M()
        x = torch.randn(2, 8)
        with torch.no_grad():
            ref = m(x)
            while not stop.is_set():
                tries["eager"] += 1  # this thread's own counter: no lock needed
                try:
                    ok = torch.allclose(m(x), ref)
                    with lock:
                        counts["wrong"] += not ok
                        counts["eager_calls"] += 1
                except Exception as e:
                    note(e)

    ts = [threading.Thread(target=tracer) for _ in range(tracers)] + [threading.Thread(target=runner)]
    _start_join(ts)
    return {**counts, "errors": sum(errors.values()), "kinds": list(errors)[:3]}


@scenario
def lazy_recompile_race(rounds: int = 40, threads: int = 8, steps: int = 60) -> dict[str, Any]:
    """H7 (patch lazy_recompile): ``threads`` threads make the first call of one ``_LazyGraphModule`` at the
    same moment, ``rounds`` times with a fresh module. Each first call generates the module's code from the
    shared graph; ``override_node_repr`` swaps the graph's node naming functions meanwhile, so concurrent
    code generation yields code that reads names it never set (unpatched: errors). A 1 µs switch interval
    makes the threads interleave inside code generation, as they do without the GIL."""
    import sys

    import torch
    from torch.fx._lazy_graph_module import _LazyGraphModule

    def f(x: Any) -> Any:
        for i in range(steps):
            x = torch.sin(x) + i * torch.cos(x)
        return x

    x = torch.randn(4)
    ref = f(x)
    counts = {"calls": 0, "errors": 0, "wrong": 0}
    kinds: dict[str, int] = {}
    lock = threading.Lock()  # the counts are shared: with the GIL off, unlocked += loses updates
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(rounds):
            traced = torch.fx.symbolic_trace(f)
            gm = _LazyGraphModule(traced, traced.graph)
            bar = threading.Barrier(threads)

            def first_call(gm: Any = gm, bar: Any = bar) -> None:
                bar.wait()
                try:
                    out = gm(x)
                    right = bool(torch.allclose(out, ref))
                    with lock:
                        counts["calls"] += 1
                        counts["wrong"] += not right
                except Exception as e:
                    with lock:
                        counts["errors"] += 1
                        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1

            _start_join([threading.Thread(target=first_call) for _ in range(threads)])
    finally:
        sys.setswitchinterval(old)
    return dict(counts, kinds=kinds)
