"""H3, ``torch._dynamo.reset()`` while other threads run compiled code: under load, in a pipeline of
compiled calls, across a fork, beside lazy backward compiles."""

from __future__ import annotations

import os
import threading
import time
import types
from typing import Any

from torch_threadsafe_compile.selftest import scenario
from ttc_testing.scenarios._common import _run_for, _wait_child


def _reset_every(seconds: float, stop: threading.Event, counts: dict[str, Any]) -> None:
    """``torch._dynamo.reset()`` every ``seconds`` until ``stop``, counted in ``counts["resets"]``."""
    import torch._dynamo

    while not stop.wait(seconds):
        torch._dynamo.reset()
        counts["resets"] += 1


@scenario
def reset_under_load(seconds: float = 10.0, threads: int = 6, reset_every: float = 2.0, backend: str = "aot_eager") -> dict[str, Any]:
    """``torch._dynamo.reset()`` every ``reset_every`` s while ``threads`` threads call compiled functions (a
    module, a dynamic-batch function, a graph break) and another thread changes ``cache_size_limit`` by
    assignment and inside ``config.patch``. Every output is compared with eager. Upstream, the process can
    die: the reset frees cache entries that other threads' lookups are walking."""
    import torch
    import torch._dynamo

    name = "recompile_limit" if "recompile_limit" in torch._dynamo.config._config else "cache_size_limit"
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    mod = torch.compile(lin, backend=backend)
    dyn = torch.compile(lambda x: (x * 2).tanh().sum(0), backend=backend, dynamic=True)

    def gb(x: Any) -> Any:
        y = x.cos()
        torch._dynamo.graph_break()
        return y + 1

    brk = torch.compile(gb, backend=backend)
    work = [(lambda b: mod(torch.randn(4, 16)), lambda x: lin(x)), (dyn, lambda x: (x * 2).tanh().sum(0)), (brk, lambda x: x.cos() + 1)]
    stop = threading.Event()
    counts = {"calls": 0, "errors": 0, "wrong": 0, "resets": 0, "config_changes": 0}
    first_error: list[str] = []

    def caller(i: int) -> None:
        k = 0
        while not stop.is_set():
            fn, ref = work[(i + k) % len(work)]
            x = torch.randn(4 + (k % 3), 16)
            k += 1
            try:
                with torch.no_grad():
                    if fn is work[0][0]:
                        out, want = mod(x), lin(x)
                    else:
                        out, want = fn(x), ref(x)
                if not torch.allclose(out, want, atol=1e-5):
                    counts["wrong"] += 1
                counts["calls"] += 1
            except Exception as e:
                counts["errors"] += 1
                first_error[:] = first_error or [f"{type(e).__name__}: {str(e)[:160]}"]

    def resetter() -> None:
        _reset_every(reset_every, stop, counts)

    def configurer() -> None:
        k = 0
        while not stop.wait(0.05):
            k += 1
            if k % 2:
                setattr(torch._dynamo.config, name, 8 + k % 3)
            else:
                with torch._dynamo.config.patch(**{name: 16}):
                    time.sleep(0.02)
            counts["config_changes"] += 1

    ts = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    ts += [threading.Thread(target=resetter), threading.Thread(target=configurer)]
    _run_for(ts, seconds, stop)
    return dict(counts, first_error=first_error[0] if first_error else "")


@scenario
def reset_pipeline(steps: int = 3, backend: str = "aot_eager") -> dict[str, Any]:
    """A compiled consumer waits (inside its compiled call) on a queue that another compiled function feeds,
    and the main thread resets after the first step. A reset that waited for every compiled call to end,
    while holding new calls at their gate, would wait for the consumer, which waits for the producer, which
    waits for the reset (issue 28: 120 s, then "resetting anyway"). Reports the seconds for all steps."""
    import queue

    import torch
    import torch._dynamo

    q: queue.Queue[Any] = queue.Queue()

    def consume(x: Any) -> Any:
        y = x * 2
        torch._dynamo.graph_break()
        return y + q.get(timeout=60)

    def produce(x: Any) -> Any:
        y = x + 1
        torch._dynamo.graph_break()
        q.put(y)
        return y

    consumer, producer = torch.compile(consume, backend=backend), torch.compile(produce, backend=backend)
    res: dict[str, Any] = {"errors": 0, "wrong": 0, "first_error": "", "resets": 0}
    started = threading.Event()

    def consumer_loop() -> None:
        for k in range(steps):
            x = torch.full((4,), float(k))
            started.set()
            try:
                if not torch.equal(consumer(x), x * 2 + (x + 1)):
                    res["wrong"] += 1
            except Exception as e:
                res["errors"] += 1
                res["first_error"] = res["first_error"] or f"{type(e).__name__}: {str(e)[:160]}"

    def producer_loop() -> None:
        for k in range(steps):
            time.sleep(0.5)  # the consumer is inside its call, waiting
            producer(torch.full((4,), float(k)))

    t0 = time.monotonic()
    ts = [threading.Thread(target=consumer_loop, daemon=True), threading.Thread(target=producer_loop, daemon=True)]
    for t in ts:
        t.start()
    started.wait(60)
    time.sleep(0.2)
    torch._dynamo.reset()
    res["resets"] += 1
    for t in ts:
        t.join(300)
    res["hung"] = sum(t.is_alive() for t in ts)
    res["seconds"] = round(time.monotonic() - t0, 2)
    return res


@scenario
def fork_during_reset(child_timeout: float = 30.0) -> dict[str, Any]:
    """A reset waits for a thread inside a compiled call, and the process forks meanwhile. The child has only
    the forking thread: its compiled calls and a reset of its own must go through (issue 28: the child used
    to wait forever at the package's closed reset barrier). ``child_exit`` None: the child hung and was killed."""
    import torch
    import torch._dynamo
    import torch._dynamo.convert_frame as cf

    f = torch.compile(lambda x: x * 3, backend="aot_eager")
    inside, release = threading.Event(), threading.Event()

    def held(x: Any) -> Any:
        y = x + 1
        torch._dynamo.graph_break()
        inside.set()
        release.wait(60)  # inside a compiled call while the reset waits for it
        return y

    h = torch.compile(held, backend="aot_eager")
    f(torch.ones(2))
    worker = threading.Thread(target=h, args=(torch.ones(2),), daemon=True)
    worker.start()
    inside.wait(60)
    resetter = threading.Thread(target=torch._dynamo.reset, daemon=True)
    resetter.start()
    # Fork once the worker waits in its eager code, not while it compiles (a child forked while another
    # thread holds compile_lock cannot compile, with or without the package), while the reset waits for it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if cf.compile_lock.acquire(False):
            cf.compile_lock.release()
            break
    reset_waiting = resetter.is_alive()
    pid = os.fork()
    if pid == 0:
        want = torch.full((2,), 3.0)
        ok = bool(torch.equal(f(torch.ones(2)), want))
        torch._dynamo.reset()
        ok = ok and bool(torch.equal(f(torch.ones(2)), want))
        os._exit(0 if ok else 3)
    child = _wait_child(pid, child_timeout)
    release.set()
    worker.join(30)
    resetter.join(30)
    return {"reset_waiting_at_fork": reset_waiting, "child_exit": child,
            "parent_ok": bool(torch.equal(f(torch.ones(2)), torch.full((2,), 3.0))), "hung": int(worker.is_alive() or resetter.is_alive())}


@scenario
def backward_resets(seconds: float = 20.0, threads: int = 8, reset_every: float = 2.0, backend: str = "aot_eager") -> dict[str, Any]:
    """``threads`` threads compile fresh functions whose ``.backward()`` runs after a graph break (a lazy
    backward compile under dynamo's active callback), while ``torch._dynamo.reset()`` runs every
    ``reset_every`` s. Issue 28: with the package, a lock-order inversion (torch's callback lock vs
    ``compile_lock``) deadlocked 2 of 2 runs within 45 s; upstream can crash. ``hung``: threads still alive
    30 s after the end."""
    import torch
    import torch._dynamo

    stop = threading.Event()
    counts = {"calls": 0, "errors": 0, "wrong": 0, "resets": 0}
    first_error: list[str] = []

    def caller(i: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            scale = float(i * 1000 + k)

            def step(x: Any, scale: float = scale) -> Any:
                y = (x.sin() * scale).sum()
                torch._dynamo.graph_break()
                y.backward()
                return y.detach()

            # A fresh code object each time: every call compiles (dynamo's caches hang off code objects).
            x = torch.randn(8, requires_grad=True)
            try:
                fresh = types.FunctionType(step.__code__.replace(), step.__globals__, "step", step.__defaults__, step.__closure__)
                torch.compile(fresh, backend=backend)(x)
                if not torch.allclose(x.grad, scale * x.detach().cos(), rtol=1e-4, atol=1e-4):
                    counts["wrong"] += 1
                counts["calls"] += 1
            except Exception as e:
                counts["errors"] += 1
                first_error[:] = first_error or [f"{type(e).__name__}: {str(e)[:160]}"]

    def resetter() -> None:
        _reset_every(reset_every, stop, counts)

    ts = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(threads)]
    ts.append(threading.Thread(target=resetter, daemon=True))
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    deadline = time.monotonic() + 30
    for t in ts:
        t.join(max(0.0, deadline - time.monotonic()))
    return dict(counts, hung=sum(t.is_alive() for t in ts), first_error=first_error[0] if first_error else "")
