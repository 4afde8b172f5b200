"""No hazard: what the package costs where no hazard needs it (``bench/no_harm.py``'s rows besides
``failing_neighbour``): an inference server's first requests, tracing and exporting beside
compiles, ``aot_compile`` in the main thread."""

from __future__ import annotations

import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, scenario
from ttc_testing.scenarios._common import _run_for


@scenario
def server_first_request(workers: int = 8, backend: str = "inductor") -> dict[str, Any]:
    """An inference server: ``workers`` threads, each with its own copy of a model in ``eval()`` mode (its
    parameters still require grad; no ``torch.no_grad()``), compiled with ``torch.compile(model)``; every
    worker answers its first request at once. Reports when the last first answer came (compile included)."""
    import copy

    import torch

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    models = [torch.compile(copy.deepcopy(base), backend=backend) for _ in range(workers)]
    x = torch.randn(8, 64)
    want = base(x)
    bar = threading.Barrier(workers)
    done: list[float] = []
    wrong = [0]

    def worker(i: int) -> None:
        bar.wait()
        y = models[i](x)
        done.append(time.perf_counter())
        if not torch.allclose(y, want, atol=1e-4):
            wrong[0] += 1

    t0 = time.perf_counter()
    _start_join([threading.Thread(target=worker, args=(i,)) for i in range(workers)])
    return {"first_answers_s": round(max(done) - t0, 3), "wrong": wrong[0],
            "graphs": int(__import__("torch")._dynamo.utils.counters["stats"]["unique_graphs"])}


@scenario
def trace_beside_compiles(seconds: float = 10.0, compilers: int = 2) -> dict[str, Any]:
    """How many ``fx.symbolic_trace`` calls and ``torch.export.export`` calls complete in ``seconds`` while
    ``compilers`` threads compile new functions back to back (each compile holds dynamo's compile lock)."""
    import torch
    import torch.fx

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return self.lin(x).relu() + 1

    stop = threading.Event()
    counts = {"traces": 0, "exports": 0, "compiles": 0, "errors": 0}

    def compiler(i: int) -> None:
        j = 0
        while not stop.is_set():
            j += 1
            try:
                torch.compile(lambda x, j=j: (x * j).sin() + i, backend="aot_eager")(torch.randn(8, requires_grad=True)).sum().backward()
                counts["compiles"] += 1
            except Exception:
                counts["errors"] += 1

    def tracer() -> None:
        while not stop.is_set():
            try:
                torch.fx.symbolic_trace(M())
                counts["traces"] += 1
            except Exception:
                counts["errors"] += 1

    def exporter() -> None:
        while not stop.is_set():
            try:
                torch.export.export(M(), (torch.randn(2, 8),))
                counts["exports"] += 1
            except Exception:
                counts["errors"] += 1

    torch.export.export(M(), (torch.randn(2, 8),))  # first imports outside the measurement
    torch.compile(lambda x: x + 1, backend="aot_eager")(torch.randn(2))
    ts = [threading.Thread(target=compiler, args=(i,)) for i in range(compilers)]
    ts += [threading.Thread(target=tracer), threading.Thread(target=exporter)]
    _run_for(ts, seconds, stop)
    return dict(counts, seconds=seconds)


@scenario
def aot_compile_main() -> dict[str, Any]:
    """``torch.compile(f, fullgraph=True).aot_compile(...)`` in the main thread (it refuses to work when
    compile caches are force-disabled)."""
    import torch

    def f(x: Any) -> Any:
        return x.sin() + 1

    x = torch.randn(8)
    compiled = torch.compile(f, fullgraph=True)
    if not hasattr(compiled, "aot_compile"):
        return {"available": False}
    try:
        fn = compiled.aot_compile(((x,), {}))
        return {"available": True, "ok": bool(torch.allclose(fn(x), f(x))), "error": ""}
    except Exception as e:
        return {"available": True, "ok": False, "error": f"{type(e).__name__}: {str(e)[:160]}"}
