"""Every hazard scenario, each run in its own interpreter and reporting one JSON line.

Shared by the tests (``tests/test_hazards.py`` …), the benches and the compatibility matrix, so that all of
them measure the same thing. The four scenarios that ``doctor --selftest`` needs ship in the wheel
(``torch_threadsafe_compile/selftest.py``); this module registers the rest on top of them. Not installed:
it is imported from the source tree (the repository root on ``sys.path``).

    python -m ttc_testing.scenarios NAME [key=value ...]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import types
from typing import Any

from torch_threadsafe_compile import selftest
from torch_threadsafe_compile.selftest import SCENARIOS, _start_join, _uncompiled_frames, scenario

MODULE = "ttc_testing.scenarios"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
__all__ = ["SCENARIOS", "run", "start_many", "collect_many"]


def _run_for(ts: list[threading.Thread], seconds: float, stop: threading.Event) -> None:
    """Start ``ts``, let them run for ``seconds``, then set ``stop`` and join them."""
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()


def _reset_every(seconds: float, stop: threading.Event, counts: dict[str, Any]) -> None:
    """``torch._dynamo.reset()`` every ``seconds`` until ``stop``, counted in ``counts["resets"]``."""
    import torch._dynamo

    while not stop.wait(seconds):
        torch._dynamo.reset()
        counts["resets"] += 1


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
def lookup_race(threads: int = 16, seconds: float = 6.0, graph_break: int = 0, closure: int = 0, backend: str = "aot_eager") -> dict[str, Any]:
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
def dynamic_flag_poll(seconds: float = 2.0) -> dict[str, Any]:
    """H5: one thread calls a function compiled with ``dynamic=True``; another polls dynamo's
    ``assume_static_by_default`` (True by default), which upstream (< 2.12) every such call flips process-wide."""
    import torch
    import torch._dynamo.config as config

    f = torch.compile(lambda t: t * 2 + 1, backend="eager", dynamic=True)
    x = torch.randn(8)
    f(x)
    default = config.assume_static_by_default
    stop = time.monotonic() + seconds
    seen = {"default": default, "polls": 0, "flipped": 0, "calls": 0}

    def caller() -> None:
        while time.monotonic() < stop:
            f(x)
            seen["calls"] += 1

    def poller() -> None:
        while time.monotonic() < stop:
            seen["polls"] += 1
            if config.assume_static_by_default != default:
                seen["flipped"] += 1

    _start_join([threading.Thread(target=caller), threading.Thread(target=poller)])
    seen["after"] = config.assume_static_by_default
    return seen


@scenario
def export_flag_poll(seconds: float = 3.0, handshakes: int = 5) -> dict[str, Any]:
    """H7 (export flag): one thread runs torch.export in a loop; another polls torch.compiler.is_exporting()
    and calls torch.compile(fn), which upstream returns ``fn`` itself (uncompiled) while any thread exports.

    Free polling alone depends on the scheduler (on a loaded 2-core machine a 3 s run can miss every
    export), so the first ``handshakes`` exports also stop inside ``forward`` (non-strict export runs it with
    the flag set) until the poller has polled once: the overlap is certain, the answer is not forced."""
    import queue

    import torch

    requests: queue.Queue[threading.Event] = queue.Queue()
    seen = {"polls": 0, "true": 0, "raw_returned": 0, "exports": 0, "handshakes": 0}
    exporting_thread: list[threading.Thread] = []

    class M(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            if exporting_thread and threading.current_thread() is exporting_thread[0] and seen["handshakes"] < handshakes:
                seen["handshakes"] += 1
                done = threading.Event()
                requests.put(done)
                done.wait(5.0)
            return x.relu() + 1

    m, x = M(), torch.randn(3, 8)
    torch.export.export(m, (x,), strict=False)  # warm: imports and first-time registrations
    stop = time.monotonic() + seconds
    deadline = stop + 30.0  # the handshakes may outlast ``seconds`` on a slow machine, never by much
    answered = [0]

    def more() -> bool:
        now = time.monotonic()
        return now < stop or (answered[0] < handshakes and now < deadline)

    def exporter() -> None:
        exporting_thread.append(threading.current_thread())
        while more():
            torch.export.export(m, (x,), strict=False)
            seen["exports"] += 1

    def poller() -> None:
        fn = lambda t: t * 2  # noqa: E731
        while more():
            try:
                asked: threading.Event | None = requests.get_nowait()
            except queue.Empty:
                asked = None
            seen["polls"] += 1
            if torch.compiler.is_exporting():
                seen["true"] += 1
            if (asked is not None or seen["polls"] % 50 == 0) and torch.compile(fn, backend="eager") is fn:
                seen["raw_returned"] += 1
            if asked is not None:
                answered[0] += 1
                asked.set()
        seen["answered"] = answered[0]

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _start_join([threading.Thread(target=exporter), threading.Thread(target=poller)])
    return seen


@scenario
def export_vs_compile(seconds: float = 8.0, compilers: int = 3) -> dict[str, Any]:
    """H7 (export overrides): one thread runs torch.export in a loop while ``compilers`` threads compile new
    functions; export's process-wide operator overrides make those compiles fail upstream."""
    import torch

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return torch.relu(self.lin(x)) + 1

    m = M()
    torch.export.export(m, (torch.randn(3, 8),), strict=False)
    torch.compile(lambda t: t + 1, backend="aot_eager")(torch.randn(2))
    stop = time.monotonic() + seconds
    out = {"exports": 0, "compiles": 0, "compile_errors": 0, "export_errors": 0, "first_error": ""}

    def exporter() -> None:
        while time.monotonic() < stop:
            try:
                torch.export.export(m, (torch.randn(3, 8),), strict=False)
                out["exports"] += 1
            except Exception as e:
                out["export_errors"] += 1
                out["first_error"] = out["first_error"] or f"export: {type(e).__name__}: {str(e)[:120]}"

    def compiler(i: int) -> None:
        k = 0
        while time.monotonic() < stop:
            k += 1

            def body(x: Any, k: int = k) -> Any:
                return (x * k).sin() + x.cos()

            body.__code__ = body.__code__.replace(co_name=f"exp_{i}_{k}")
            try:
                torch.compile(body, backend="aot_eager")(torch.randn(4, 8))
                out["compiles"] += 1
            except Exception as e:
                out["compile_errors"] += 1
                out["first_error"] = out["first_error"] or f"compile: {type(e).__name__}: {str(e)[:120]}"

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _start_join([threading.Thread(target=exporter)] + [threading.Thread(target=compiler, args=(i,)) for i in range(compilers)])
    return out


@scenario
def drafter_flex(drafters: int = 3, targets: int = 2, steps: int = 4, seq: int = 1024, target_mode: str = "default") -> dict[str, Any]:
    """H4 (CUDA): drafter threads train with compiled flex_attention (fwd+bwd, block-sparse causal
    document mask) while target threads run a compiled MLP forward. Run with a cold inductor cache
    (TORCHINDUCTOR_CACHE_DIR pointing at an empty directory) and a timeout: unpatched it can hang.
    ``target_mode``: the targets' ``torch.compile`` mode (``reduce-overhead``: CUDA graph trees, H7)."""
    import collections

    import torch
    import torch._dynamo.utils as du
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA (flex_attention backward is not implemented on CPU)"}
    d = "cuda"
    errs: collections.Counter[str] = collections.Counter()
    done: collections.Counter[str] = collections.Counter()
    flex = torch.compile(flex_attention)
    B, H, S, D = 2, 8, seq, 64

    def doc_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (q // 256 == kv // 256)

    bm = create_block_mask(doc_causal, B, H, S, S, device=d)

    def randn(*shape: int, **kw: Any) -> Any:
        # With CUDA graphs (reduce-overhead) in some thread, no other thread may draw from the device's
        # CUDA generator while a graph is recorded: its capture state is device-wide (docs/hazards.md, H7).
        if target_mode == "default":
            return torch.randn(*shape, device=d, **kw)
        return torch.randn(*shape, **kw).to(d)
    target = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(d)
    target_c = torch.compile(target, mode=None if target_mode == "default" else target_mode)

    def drafter(i: int) -> None:
        w = randn(D, D, dtype=torch.bfloat16).requires_grad_()
        for _ in range(steps):
            try:
                q, k, v = (randn(B, H, S, D, dtype=torch.bfloat16) @ w for _ in range(3))
                flex(q, k, v, block_mask=bm).float().sum().backward()
                done["drafter_steps"] += 1
            except Exception as e:
                errs[type(e).__name__ + ": " + str(e)[:70]] += 1

    def tgt(i: int) -> None:
        for _ in range(steps * 4):
            try:
                with torch.no_grad():
                    target_c(randn(64, 1024))
                done["target_steps"] += 1
            except Exception as e:
                errs[type(e).__name__ + ": " + str(e)[:70]] += 1

    ts = [threading.Thread(target=drafter, args=(i,)) for i in range(drafters)]
    ts += [threading.Thread(target=tgt, args=(i,)) for i in range(targets)]
    t0 = time.time()
    _start_join(ts)
    return {
        "done": dict(done),
        "errors": sum(errs.values()),
        "kinds": list(errs)[:3],
        "graphs": int(du.counters["stats"]["unique_graphs"]),
        "uncompiled_frames": _uncompiled_frames(),
        "wall_s": round(time.time() - t0, 1),
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


def _wait_child(pid: int, timeout: float) -> int | None:
    """The exit code of forked child ``pid``, or None when it had not ended after ``timeout`` s (then it is
    killed): a hung child fails the scenario instead of hanging it."""
    import signal

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


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


@scenario
def concurrent_exports(seconds: float = 5.0, threads: int = 2, min_each: int = 0, cap_s: float = 90.0) -> dict[str, Any]:
    """H7: ``threads`` threads run ``torch.export.export`` in a loop for ``seconds`` (and on, up to ``cap_s``,
    until each has exported ``min_each`` times: a count, not a rate, for a loaded machine). Upstream keeps an
    export's module hierarchy and flags in module globals of ``torch.export._trace`` that each export sets at
    its start and clears at its end, so another thread's export fails (``_EXPORT_MODULE_HIERARCHY must not be
    None``)."""
    import torch
    import torch.export

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return self.lin(x).relu()

    stop = threading.Event()
    counts = {"exports": 0, "errors": 0, "wrong": 0}
    per_thread = [0] * threads
    first_error: list[str] = []
    cap = time.monotonic() + cap_s

    def exporter(i: int) -> None:
        m = M()
        x = torch.randn(2, 4)
        while (not stop.is_set() or per_thread[i] < min_each) and time.monotonic() < cap:
            try:
                ep = torch.export.export(m, (x,))
                if not torch.allclose(ep.module()(x), m(x)):
                    counts["wrong"] += 1
                counts["exports"] += 1
                per_thread[i] += 1
            except Exception as e:
                counts["errors"] += 1
                first_error[:] = first_error or [f"{type(e).__name__}: {str(e)[:160]}"]

    _run_for([threading.Thread(target=exporter, args=(i,)) for i in range(threads)], seconds, stop)
    return dict(counts, per_thread=per_thread, first_error=first_error[0] if first_error else "")


@scenario
def compile_rng_rollback(compiles: int = 6, backend: str = "aot_eager", source: str = "torch") -> dict[str, Any]:
    """H7 (patch rng_rollback): one thread draws ``torch.rand(4)`` without pause while the main thread compiles
    ``compiles`` small functions. Dynamo sets the process-wide generator back after every compile, so the
    numbers drawn meanwhile are drawn again: ``repeats`` counts tensors seen twice (unpatched > 0).
    ``source="python"``: the thread draws four ``random.random()`` instead (Python's generator, which dynamo
    sets back too: in Python up to torch 2.11, in C++ from 2.12)."""
    import random

    import torch

    seen: dict[tuple[float, ...], int] = {}
    stop = threading.Event()

    def draw() -> tuple[float, ...]:
        if source == "python":
            return (random.random(), random.random(), random.random(), random.random())
        return tuple(torch.rand(4).tolist())

    def drawer() -> None:
        while not stop.is_set():
            key = draw()
            seen[key] = seen.get(key, 0) + 1

    t = threading.Thread(target=drawer)
    t.start()
    try:
        for i in range(compiles):
            f = torch.compile(lambda x, i=i: (x * (i + 1)).sin() + x.cos(), backend=backend)
            f(torch.randn(8))
    finally:
        stop.set()
        t.join()
    out: dict[str, Any] = {"draws": sum(seen.values()), "repeats": sum(n - 1 for n in seen.values() if n > 1)}
    if source == "python":
        import inspect

        import torch._dynamo.convert_frame as cf

        # Where torch sets Python's generator back: in preserve_global_state (Python, up to 2.11) or in the
        # C++ frame evaluation (2.12 on), which the package does not reach.
        out["restored_in_python"] = "random.setstate" in inspect.getsource(cf.preserve_global_state)
    return out


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


@scenario
def export_beside_make_fx(seconds: float = 5.0) -> dict[str, Any]:
    """H7: one thread exports in a loop while another traces with ``make_fx``. Upstream keeps the
    pre-dispatch infra modes (an export's proxy and functional modes) in one module global of ``torch._ops``,
    while the PreDispatch key is per thread: the tracer finds the exporter's modes ("Can't have active infra
    mode on both pre and post dispatch mode stack", "Trying to pop empty mode stack"). Open: with the
    package active this pair of threads also hung in some runs (both threads inside an operator call in C++);
    not yet root-caused, and no patch covers it (README, limitations)."""
    import torch
    import torch.export
    from torch.fx.experimental.proxy_tensor import make_fx

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    stop = threading.Event()
    counts = {"exports": 0, "traces": 0, "errors": 0, "wrong": 0}
    first_error: list[str] = []

    def attempt(kind: str, fn: Any) -> None:
        while not stop.is_set():
            try:
                if not fn():
                    counts["wrong"] += 1
                counts[kind] += 1
            except Exception as e:
                counts["errors"] += 1
                first_error[:] = first_error or [f"{kind}: {type(e).__name__}: {str(e)[:160]}"]

    def export() -> bool:
        return bool(torch.allclose(torch.export.export(lin, (x,)).module()(x), lin(x)))

    def trace() -> bool:
        return bool(torch.allclose(make_fx(lambda t: lin(t).relu())(x)(x), lin(x).relu()))

    export(), trace()  # first uses import their modules (the first-import race is another check's)
    ts = [threading.Thread(target=attempt, args=("exports", export)), threading.Thread(target=attempt, args=("traces", trace))]
    _run_for(ts, seconds, stop)
    return dict(counts, first_error=first_error[0] if first_error else "")


@scenario
def first_import(threads: int = 16) -> dict[str, Any]:
    """H7 (imports): ``threads`` threads make the first ``torch.compile`` / ``torch.export.export`` calls of a
    fresh interpreter at once (half compile and call a function, half export a module). Upstream they enter
    dynamo's import cycles at different modules: ``_DeadlockError`` and partially-initialized-module errors."""
    import torch

    class M(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x.relu() + 1

    errors: list[str] = []
    bar = threading.Barrier(threads)

    def work(i: int) -> None:
        bar.wait()
        try:
            if i % 2:
                torch.compile(lambda x: x + i, backend="aot_eager")(torch.randn(4))
            else:
                torch.export.export(M(), (torch.randn(4),))
        except BaseException as e:  # noqa: BLE001 - the import errors are the point
            errors.append(f"{type(e).__name__}: {str(e)[:100]}")

    _start_join([threading.Thread(target=work, args=(i,)) for i in range(threads)])
    import_errors = [e for e in errors if e.startswith(("ImportError", "_DeadlockError", "ModuleNotFoundError"))
                     or "partially initialized module" in e]
    return {"threads": threads, "errors": len(errors), "import_errors": len(import_errors),
            "kinds": sorted(set(e.split(":")[0] for e in errors)), "first_error": (import_errors or errors or [""])[0]}


@scenario
def config_after_fork_from_thread(child_timeout: float = 60.0) -> dict[str, Any]:
    """H6 in a child that a worker thread forked. The parent's main thread set ``recompile_limit = 64``
    first: the forking thread reads it in the child as it did before the fork (``child_main_sees``). The
    forking thread is the child's main thread, so its ``recompile_limit = 32`` is the program's configuration
    there and must reach a thread the child starts (``child_thread_sees``; None: the child failed or hung)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if "recompile_limit" in cfg._config else "cache_size_limit"
    out: dict[str, Any] = {"default": getattr(cfg, name), "child_main_sees": None, "child_thread_sees": None}
    setattr(cfg, name, 64)  # the program's configuration, in the parent's main thread
    rfd, wfd = os.pipe()

    def forker() -> None:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                before = getattr(cfg, name)
                setattr(cfg, name, 32)  # in the child's main thread, as its program would
                box: list[Any] = []
                t = threading.Thread(target=lambda: box.append(getattr(cfg, name)))
                t.start()
                t.join(30)
                os.write(wfd, json.dumps([before, box[0] if box else None]).encode())
                code = 0
            finally:
                os._exit(code)
        out["child_exit"] = _wait_child(pid, child_timeout)

    t = threading.Thread(target=forker)
    t.start()
    t.join()
    os.close(wfd)
    data = os.read(rfd, 100)
    os.close(rfd)
    if data:
        out["child_main_sees"], out["child_thread_sees"] = json.loads(data)
    return out


@scenario
def config_patch_isolation(seconds: float = 2.0) -> dict[str, Any]:
    """H6 (torch >= 2.12): thread A reads ``recompile_limit`` inside ``config.patch(recompile_limit=16)`` while
    the main thread assigns it over and over; after A's patch ends, A must follow the main thread's value.
    Also: the alias ``cache_size_limit`` assigned in the main thread, read by a new thread; a child thread's
    assignment must not change the main thread's ``get_hash()`` (upstream's per-thread isolation)."""
    import torch
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if "recompile_limit" in cfg._config else "cache_size_limit"
    inside = threading.Event()
    stop = threading.Event()
    out: dict[str, Any] = {"reads": 0, "foreign_reads": 0}

    def patched() -> None:
        with cfg.patch(**{name: 16}):
            inside.set()
            while not stop.is_set():
                out["reads"] += 1
                if getattr(cfg, name) != 16:
                    out["foreign_reads"] += 1
        out["after_patch_sees"] = getattr(cfg, name)

    t = threading.Thread(target=patched)
    t.start()
    inside.wait(10)
    t_end = time.time() + seconds
    k = 0
    while time.time() < t_end:
        k += 1
        setattr(cfg, name, 64 + k % 2)
    setattr(cfg, name, 64)
    stop.set()
    t.join()
    out["main_value"] = getattr(cfg, name)
    box: list[Any] = []
    if "cache_size_limit" in cfg._config and name != "cache_size_limit":
        cfg.cache_size_limit = 40
        th = threading.Thread(target=lambda: box.append(getattr(cfg, name)))
        th.start()
        th.join()
    out["alias_seen_by_new_thread"] = box[0] if box else None
    before = cfg.get_hash()
    th = threading.Thread(target=lambda: setattr(cfg, "capture_scalar_outputs", not cfg.capture_scalar_outputs))
    th.start()
    th.join()
    out["main_hash_unchanged_by_child"] = cfg.get_hash() == before
    return out


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


@scenario
def backward_lock_wait(worker: int = 1, hold_s: float = 5.0, threads_first: int = 1) -> dict[str, Any]:
    """H4's two halves on a CPU: a compiled graph whose backward compiler takes ``compile_lock`` (as inductor's
    does from torch 2.6); another thread holds that lock (as a thread tracing flex_attention's backward does
    while it waits for the autograd engine). Does this thread's backward finish within ``hold_s``?

    ``worker=1`` makes the package treat the CPU as a device whose backward runs on an autograd worker thread
    (as CUDA's does), so that ``lazy_backward`` acts as it would on a GPU; unpatched it changes nothing.
    ``threads_first=1``: the program has started a thread of its own before the compile (the lock holder
    below starts after it), as a multi-threaded program has; 0: the compile runs in a single-threaded
    program."""
    import torch
    import torch._dynamo
    import torch._dynamo.convert_frame as cf
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    import torch_threadsafe_compile as ttc

    if worker and ttc.is_patched("lazy_backward"):
        from torch_threadsafe_compile.patches import lazy_backward

        lazy_backward.BACKWARD_IN_CALLING_THREAD = frozenset()
    events: list[str] = []

    def fw(gm: Any, ex: Any) -> Any:
        events.append("fw")
        return make_boxed_func(gm.forward)

    # Inductor's backward compiler takes compile_lock from torch 2.6 on; before, it does not (and H4 cannot occur).
    takes_lock = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 6)

    def bw(gm: Any, ex: Any) -> Any:
        with cf.compile_lock if takes_lock else contextlib.nullcontext():
            events.append("bw")
            return make_boxed_func(gm.forward)

    f = torch.compile(lambda x: (x * 3).sin().sum(), backend=aot_autograd(fw_compiler=fw, bw_compiler=bw))
    x = torch.randn(8, requires_grad=True)
    idle = threading.Event()
    if threads_first:
        threading.Thread(target=idle.wait, args=(120,), daemon=True).start()
    y = f(x)
    idle.set()
    compiled_with_forward = "bw" in events
    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with cf.compile_lock:
            held.set()
            release.wait(60)

    threading.Thread(target=holder, daemon=True).start()
    held.wait(30)
    t0 = time.monotonic()
    threading.Thread(target=lambda: (y.backward(), done.set()), daemon=True).start()
    finished = done.wait(hold_s)
    release.set()
    done.wait(60)
    # The package changes no config value for this (main thread, and a new thread).
    cfg = torch._functorch.config
    option: list[Any] = []
    reader = threading.Thread(target=lambda: option.append(getattr(cfg, "force_non_lazy_backward_lowering", None)))
    reader.start()
    reader.join()
    return {"backward_compiled_with_forward": compiled_with_forward, "backward_blocked": not finished,
            "backward_s": round(time.monotonic() - t0, 2),
            "grad_ok": bool(x.grad is not None and torch.allclose(x.grad, 3 * torch.cos(3 * x))),
            "option_main": getattr(cfg, "force_non_lazy_backward_lowering", None), "option_thread": option[0]}


# -- issue 38: what a compile in one thread may hold up in the others (first_compile's waits) ---------------


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


def _env(env: dict[str, str] | None) -> dict[str, str]:
    """The repository root goes on the child's ``PYTHONPATH`` so that ``-m ttc_testing.scenarios`` resolves."""
    out = dict(env or {})
    base = out.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, base) if p)
    return out


def run(name: str, env: dict[str, str] | None = None, timeout: float = 300, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter; returns its JSON result (or rc/tail/timeout)."""
    return selftest.run(name, env=_env(env), timeout=timeout, module=MODULE, **kwargs)


def start_many(plan: list[tuple[str, dict[str, Any]]], env: dict[str, str] | None = None) -> Any:
    return selftest.start_many(plan, env=_env(env), module=MODULE)


collect_many = selftest.collect_many


if __name__ == "__main__":
    sys.exit(selftest._main(sys.argv[1:], module=MODULE))
