"""H3, what a compile in one thread may hold up in the others (first_compile's waits, issue 38): warm
calls beside a recompile, a rendezvous inside a compiled step, blocking I/O inside one."""

from __future__ import annotations

import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _start_join, _uncompiled_frames, scenario


def _slow_first_backend(first_s: float) -> Any:
    """aot_eager whose first compile in the process takes ``first_s`` longer: a cold compile (inductor's
    first one) followed by warm ones (inductor's caches), without depending on the machine's compiler."""
    from functorch.compile import nop
    from torch._dynamo.backends.common import aot_autograd

    done: list[bool] = []
    inner = aot_autograd(fw_compiler=nop)

    def backend(gm: Any, example_inputs: Any) -> Any:
        if not done:
            done.append(True)
            time.sleep(first_s)
        return inner(gm, example_inputs)

    return backend


@scenario
def warm_beside_recompile(warm: int = 7, seconds: float = 3.0, compile_s: float = 1.5) -> dict[str, Any]:
    """Warm calls while another thread recompiles the same function (issue 38, shape 1): ``warm`` threads
    call a compiled function whose graph matches their inputs; one more thread sends a float64 input (a new
    guard set; its compile takes ``compile_s`` more). Reports warm calls per second before and during that
    recompile and the longest warm call during it."""
    import torch

    slow = {"on": False}
    base = _slow_first_backend(0.0)

    def backend(gm: Any, example_inputs: Any) -> Any:
        if slow["on"]:
            time.sleep(compile_s)
        return base(gm, example_inputs)

    f = torch.compile(lambda x: (x * 2).sin() + 1, backend=backend)
    x32 = torch.randn(64)
    f(x32)  # the warm threads' graph, compiled before they start
    stop = threading.Event()
    spans: dict[str, float] = {}
    calls: list[list[tuple[float, float]]] = [[] for _ in range(warm)]
    errors: list[str] = []

    def warm_loop(i: int) -> None:
        mine = calls[i]
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                f(x32)
            except Exception as e:  # reported, not raised
                errors.append(repr(e)[:120])
                return
            mine.append((t0, time.monotonic()))

    def recompile() -> None:
        time.sleep(seconds / 3)
        slow["on"] = True
        spans["start"] = time.monotonic()
        f(torch.randn(64, dtype=torch.float64))
        spans["end"] = time.monotonic()

    ts = [threading.Thread(target=warm_loop, args=(i,)) for i in range(warm)]
    r = threading.Thread(target=recompile)
    for t in [*ts, r]:
        t.start()
    r.join()
    time.sleep(0.2)
    stop.set()
    for t in ts:
        t.join()
    start, end = spans["start"], spans["end"]
    during = [(a, b) for c in calls for (a, b) in c if a >= start and b <= end]
    # A call that began before the recompile and ended during it waited for it too: the longest is over
    # every call that overlaps the recompile.
    overlapping = [b - a for c in calls for (a, b) in c if b > start and a < end]
    before = [(a, b) for c in calls for (a, b) in c if b <= start]
    first = min((a for c in calls for (a, b) in c), default=start)
    return {"recompile_s": round(end - start, 3), "warm_per_s_during": round(len(during) / max(end - start, 1e-9), 1),
            "warm_per_s_before": round(len(before) / max(start - first, 1e-9), 1),
            "longest_warm_call_s": round(max(overlapping, default=0.0), 4), "errors": errors[:3]}


@scenario
def rendezvous_step(ranks: int = 8, timeout_s: float = 4.0, compile_s: float = 3.0) -> dict[str, Any]:
    """A rendezvous inside a compiled step (issue 38, shape 2): ``ranks`` threads call one compiled step
    whose middle is a ``threading.Barrier(ranks, timeout=timeout_s)`` in a ``torch.compiler.disable``d
    helper (a trainer's collective), first call from all at once; the first compile takes ``compile_s``
    more (a cold compile), later ones do not (warm caches). Reports how many ranks saw the barrier broken."""
    import torch

    bar = threading.Barrier(ranks, timeout=timeout_s)

    @torch.compiler.disable
    def rendezvous() -> None:
        bar.wait()

    def step(x: Any) -> Any:
        y = (x * 2).sin()
        rendezvous()
        return y.cos() + 1

    f = torch.compile(step, backend=_slow_first_backend(compile_s))
    start = threading.Barrier(ranks)
    broken: list[str] = []
    wrong: list[int] = []

    def rank(i: int) -> None:
        x = torch.randn(16)
        start.wait()
        try:
            out = f(x)
            if not torch.allclose(out, (x * 2).sin().cos() + 1):
                wrong.append(i)
        except threading.BrokenBarrierError:
            broken.append(f"rank {i}")
        except Exception as e:  # reported, not raised
            errors.append(repr(e)[:120])

    errors: list[str] = []
    t0 = time.monotonic()
    _start_join([threading.Thread(target=rank, args=(i,)) for i in range(ranks)])
    return {"ranks": ranks, "broken": len(broken), "wrong": len(wrong), "first_step_s": round(time.monotonic() - t0, 2),
            "errors": errors[:3]}


@scenario
def blocking_io_step(threads: int = 8, io_s: float = 2.0) -> dict[str, Any]:
    """Blocking I/O inside a compiled function (issue 38, shape 3): a ``torch.compiler.disable``d helper
    sleeps ``io_s`` between two graphs; ``threads`` make their first call at once. Reports the cold round
    (until every thread's call returned) and the graphs compiled."""
    import torch
    import torch._dynamo.utils as du

    @torch.compiler.disable
    def read_something() -> None:
        time.sleep(io_s)

    def step(x: Any) -> Any:
        y = (x * 2).sin()
        read_something()
        return y.cos() + 1

    f = torch.compile(step, backend="aot_eager")
    start = threading.Barrier(threads)
    errors: list[str] = []

    def w() -> None:
        x = torch.randn(16)
        start.wait()
        try:
            f(x)
        except Exception as e:  # reported, not raised
            errors.append(repr(e)[:120])

    t0 = time.monotonic()
    _start_join([threading.Thread(target=w) for _ in range(threads)])
    return {"cold_round_s": round(time.monotonic() - t0, 3), "graphs": int(du.counters["stats"]["unique_graphs"]),
            "uncompiled_frames": _uncompiled_frames(), "errors": errors[:3]}
