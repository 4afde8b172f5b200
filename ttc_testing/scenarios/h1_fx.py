"""H1, the FX tracing flag: callers of compiled code while another thread compiles, and FX tracing in one thread."""

from __future__ import annotations

import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, scenario


def _maybe_late_install(late: bool) -> None:
    """For ``late=1``: undo start-up activation now, and re-install after the caller compiled."""
    if late:
        import torch_threadsafe_compile as ttc

        ttc.uninstall()


@scenario
def fx_flag_leak(compiles: int = 4, callers: int = 3, late: int = 0, backend: str = "aot_eager") -> dict[str, Any]:
    """H1: callers hammer a warm compiled fn while one thread compiles new fns with backward."""
    _maybe_late_install(bool(late))
    import torch

    hot = torch.compile(lambda x: (x * 2).sin(), backend=backend)
    x0 = torch.randn(16)
    hot(x0)
    if late:
        import torch_threadsafe_compile as ttc

        ttc.install()  # `hot` was compiled before this call
    errors: dict[str, int] = {}
    calls = [0]
    stop = threading.Event()

    def caller() -> None:
        while not stop.is_set():
            try:
                hot(x0)
                calls[0] += 1
            except Exception as e:
                key = str(e)[:80]
                errors[key] = errors.get(key, 0) + 1

    def compiler() -> None:
        try:
            for j in range(compiles):
                f = torch.compile(lambda x, j=j: (x + j).cos().sum(), backend=backend)
                x = torch.randn(16, requires_grad=True)
                f(x).backward()
        finally:
            stop.set()

    ts = [threading.Thread(target=caller) for _ in range(callers)] + [threading.Thread(target=compiler)]
    t0 = time.time()
    _start_join(ts)
    return {"ok_calls": calls[0], "errors": sum(errors.values()), "kinds": list(errors)[:3], "wall_s": round(time.time() - t0, 2)}


@scenario
def fx_same_thread(backend: str = "aot_eager") -> dict[str, Any]:
    """H1 control: FX-tracing a module that calls a compiled fn must still raise, in the same thread;
    plain symbolic_trace / make_fx / export must still work."""
    import torch
    import torch.fx
    from torch.fx.experimental.proxy_tensor import make_fx

    inner = torch.compile(lambda x: x + 1, backend=backend)

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return inner(x) * 2

    out: dict[str, Any] = {}
    try:
        torch.fx.symbolic_trace(M())
        out["nested_raised"] = False
    except RuntimeError as e:
        out["nested_raised"] = "dynamo-optimized" in str(e)

    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) + 1

    x = torch.randn(4)
    gm = torch.fx.symbolic_trace(Plain())
    out["symbolic_trace_ok"] = bool(torch.equal(gm(x), Plain()(x)))
    g = make_fx(lambda t: t.sin() * 2)(x)
    out["make_fx_ok"] = bool(torch.allclose(g(x), x.sin() * 2))
    try:
        ep = torch.export.export(Plain(), (x,))
        out["export_ok"] = bool(torch.equal(ep.module()(x), Plain()(x)))
    except Exception as e:  # export availability differs by version; report it
        out["export_ok"] = f"{type(e).__name__}: {str(e)[:60]}"
    return out
