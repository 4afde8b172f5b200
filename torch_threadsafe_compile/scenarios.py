"""Hazard scenarios, each run in its own interpreter and reporting one JSON line.

Shared by the tests (``tests/test_hazards_*.py``), ``doctor --selftest`` and the compatibility matrix, so
that all three measure the same thing. A scenario reports numbers, never a verdict; the caller compares
the unpatched run (``TTC_DISABLE=1``) with the active one.

    python -m torch_threadsafe_compile.scenarios NAME [key=value ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}


def scenario(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _start_join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _uncompiled_frames() -> int:
    """Cache misses that produced no graph (e.g. the recompile limit was hit): frames that ran uncompiled."""
    import torch._dynamo.utils as du

    frames = du.counters["frames"]
    return int(frames["total"] - frames["ok"])


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
def fx_flag_poll(seconds: float = 2.0) -> dict[str, Any]:
    """H1, seen directly: one thread FX-traces in a loop; another polls the FX tracing flag.

    Shows the leak on every version where the flag is a global, including 2.12/2.13 where the compile
    error of ``fx_flag_leak`` is masked by H2."""
    import logging

    import torch
    import torch.fx
    import torch.fx._symbolic_trace as st

    logging.getLogger(st.__name__).setLevel(logging.ERROR)  # is_fx_tracing() warns once upstream

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(20):
                x = torch.relu(x) + 1
            return x

    stop = threading.Event()
    polls = [0, 0]

    def tracer() -> None:
        t_end = time.time() + seconds
        try:
            while time.time() < t_end:
                torch.fx.symbolic_trace(M())
        finally:
            stop.set()

    def poller() -> None:
        while not stop.is_set():
            polls[0] += 1
            if st.is_fx_tracing():
                polls[1] += 1

    ts = [threading.Thread(target=tracer), threading.Thread(target=poller)]
    _start_join(ts)
    return {"polls": polls[0], "true_in_other_thread": polls[1]}


@scenario
def fx_patcher_leak(seconds: float = 2.0, tracers: int = 2) -> dict[str, Any]:
    """H7 (FX patcher): ``tracers`` threads run fx.symbolic_trace in a loop while another thread runs the same
    kind of module eagerly; errors and wrong results in either are counted."""
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
    lock = threading.Lock()

    def note(e: BaseException) -> None:
        key = f"{type(e).__name__}: {str(e)[:60]}"
        with lock:
            errors[key] = errors.get(key, 0) + 1

    def tracer() -> None:
        m = M()
        x = torch.randn(2, 8)
        t_end = time.time() + seconds
        try:
            while time.time() < t_end:
                try:
                    gm = torch.fx.symbolic_trace(m)
                    if not torch.allclose(gm(x), m(x)):
                        counts["wrong"] += 1
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
                try:
                    if not torch.allclose(m(x), ref):
                        counts["wrong"] += 1
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
def is_compiling_leak(seconds: float = 3.0, backend: str = "aot_eager") -> dict[str, Any]:
    """H2: an eager thread polls torch.compiler.is_compiling() while another thread compiles."""
    import torch

    seen_in_compiler: list[bool] = []

    def recording_backend(gm: Any, example_inputs: Any) -> Any:
        seen_in_compiler.append(bool(torch.compiler.is_compiling()))
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    stop = threading.Event()
    polls = [0, 0]

    def poller() -> None:
        is_compiling = torch.compiler.is_compiling
        while not stop.is_set():
            polls[0] += 1
            if is_compiling():
                polls[1] += 1

    def compiler() -> None:
        t_end = time.time() + seconds
        j = 0
        try:
            while time.time() < t_end or j == 0:
                f = torch.compile(lambda x, j=j: (x + j).cos().sum(), backend=recording_backend)
                f(torch.randn(8, requires_grad=True)).backward()
                j += 1
        finally:
            stop.set()

    ts = [threading.Thread(target=poller), threading.Thread(target=compiler)]
    _start_join(ts)
    return {"polls": polls[0], "true_in_eager_thread": polls[1], "compiling_thread_saw_true": all(seen_in_compiler) and bool(seen_in_compiler)}


@scenario
def config_threads() -> dict[str, Any]:
    """H6: an assignment in the main thread is seen by a new thread and inside a backward compile run
    from another thread; a config.patch in one thread is invisible to another."""
    import torch
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    name = "recompile_limit" if "recompile_limit" in torch._dynamo.config._config else "cache_size_limit"
    default = getattr(torch._dynamo.config, name)
    setattr(torch._dynamo.config, name, 64)  # as a user program would, in the main thread
    out: dict[str, Any] = {"option": name, "default": default}
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(getattr(torch._dynamo.config, name)))
    t.start()
    t.join()
    out["new_thread_sees"] = box[0]

    seen_in_bw: list[Any] = []

    def fw(gm: Any, ex: Any) -> Any:
        return make_boxed_func(gm.forward)

    def bw(gm: Any, ex: Any) -> Any:
        seen_in_bw.append(getattr(torch._dynamo.config, name))
        return make_boxed_func(gm.forward)

    f = torch.compile(lambda x: (x * 3).sin().sum(), backend=aot_autograd(fw_compiler=fw, bw_compiler=bw))

    def worker() -> None:
        f(torch.randn(8, requires_grad=True)).backward()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    out["backward_compile_sees"] = seen_in_bw[0] if seen_in_bw else None

    inside = threading.Event()
    release = threading.Event()

    def patcher() -> None:
        with torch._dynamo.config.patch(**{name: 3}):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=patcher)
    t.start()
    inside.wait(10)
    box.clear()
    t2 = threading.Thread(target=lambda: box.append(getattr(torch._dynamo.config, name)))
    t2.start()
    t2.join()
    out["other_thread_during_patch_sees"] = box[0]
    out["main_during_patch_sees"] = getattr(torch._dynamo.config, name)
    release.set()
    t.join()
    return out


@scenario
def stampede(threads: int = 8, backend: str = "aot_eager", shapes: int = 2) -> dict[str, Any]:
    """H3: ``threads`` threads make the same first call at once, then all move to a new shape at once."""
    import torch
    import torch._dynamo.utils as du

    f = torch.compile(lambda x: (x * 2).sin() + 1, backend=backend)
    frame_counts: list[int] = []
    errors: list[str] = []
    wrong: list[int] = []
    bar = threading.Barrier(threads)

    def w() -> None:
        for s in range(shapes):
            x = torch.randn(16 + 8 * s)
            bar.wait()
            try:
                y = f(x)
                if not torch.allclose(y, (x * 2).sin() + 1):
                    wrong.append(s)
            except Exception as e:
                errors.append(str(e)[:80])
            bar.wait()
            if threading.current_thread() is ts[0]:
                frame_counts.append(int(du.counters["stats"]["unique_graphs"]))

    ts = [threading.Thread(target=w) for _ in range(threads)]
    t0 = time.time()
    _start_join(ts)
    return {
        "threads": threads,
        "graphs_after_each_stampede": frame_counts,
        "graphs": int(du.counters["stats"]["unique_graphs"]),
        "uncompiled_frames": _uncompiled_frames(),
        "errors": len(errors),
        "wrong_results": len(wrong),
        "wall_s": round(time.time() - t0, 2),
    }


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
def export_flag_poll(seconds: float = 3.0) -> dict[str, Any]:
    """H7 (export flag): one thread runs torch.export in a loop; another polls torch.compiler.is_exporting()
    and calls torch.compile(fn), which upstream returns ``fn`` itself (uncompiled) while any thread exports."""
    import torch

    class M(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return x.relu() + 1

    m, x = M(), torch.randn(3, 8)
    torch.export.export(m, (x,), strict=False)  # warm: imports and first-time registrations
    stop = time.monotonic() + seconds
    seen = {"polls": 0, "true": 0, "raw_returned": 0, "exports": 0}

    def exporter() -> None:
        while time.monotonic() < stop:
            torch.export.export(m, (x,), strict=False)
            seen["exports"] += 1

    def poller() -> None:
        fn = lambda t: t * 2  # noqa: E731
        while time.monotonic() < stop:
            seen["polls"] += 1
            if torch.compiler.is_exporting():
                seen["true"] += 1
            if seen["polls"] % 50 == 0 and torch.compile(fn, backend="eager") is fn:
                seen["raw_returned"] += 1

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
def drafter_flex(drafters: int = 3, targets: int = 2, steps: int = 4, seq: int = 1024) -> dict[str, Any]:
    """H4 (CUDA): drafter threads train with compiled flex_attention (fwd+bwd, block-sparse causal
    document mask) while target threads run a compiled MLP forward. Run with a cold inductor cache
    (TORCHINDUCTOR_CACHE_DIR pointing at an empty directory) and a timeout: unpatched it can hang."""
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
    target = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(d)
    target_c = torch.compile(target)

    def drafter(i: int) -> None:
        w = torch.randn(D, D, device=d, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(steps):
            try:
                q, k, v = (torch.randn(B, H, S, D, device=d, dtype=torch.bfloat16) @ w for _ in range(3))
                flex(q, k, v, block_mask=bm).float().sum().backward()
                done["drafter_steps"] += 1
            except Exception as e:
                errs[type(e).__name__ + ": " + str(e)[:70]] += 1

    def tgt(i: int) -> None:
        for _ in range(steps * 4):
            try:
                with torch.no_grad():
                    target_c(torch.randn(64, 1024, device=d))
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


def run(name: str, env: dict[str, str] | None = None, timeout: float = 300, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter; returns its JSON result (or rc/tail/timeout)."""
    args = [sys.executable, "-X", "faulthandler", "-m", "torch_threadsafe_compile.scenarios", name]
    args += [f"{k}={v}" for k, v in kwargs.items()]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    t0 = time.time()
    try:
        p = subprocess.run(args, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": True, "secs": round(time.time() - t0, 1)}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["secs"] = round(time.time() - t0, 1)
            return res
    return {"rc": p.returncode, "tail": (p.stderr or p.stdout)[-600:], "secs": round(time.time() - t0, 1)}


def start_many(plan: list[tuple[str, dict[str, Any]]], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start one interpreter that runs several scenarios in turn (dynamo reset between them)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    args = [sys.executable, "-X", "faulthandler", "-m", "torch_threadsafe_compile.scenarios", "--many", json.dumps(plan)]
    return subprocess.Popen(args, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect_many(proc: subprocess.Popen[str], timeout: float) -> dict[str, dict[str, Any]]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"_error": {"timeout": True}}
    res = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[7:])
            res[item.pop("_scenario")] = item
    if proc.returncode:
        res["_error"] = {"rc": proc.returncode, "tail": err[-600:]}
    return res


def _run_many(plan: list[tuple[str, dict[str, Any]]]) -> None:
    for name, kwargs in plan:
        if "torch._dynamo" in sys.modules:
            import torch._dynamo
            import torch._dynamo.utils

            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        res = SCENARIOS[name](**kwargs)
        res["_scenario"] = name
        print("RESULT " + json.dumps(res), flush=True)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--many"] and len(argv) == 2:
        _run_many([(n, kw) for n, kw in json.loads(argv[1])])
        return 0
    if not argv or argv[0] not in SCENARIOS:
        print(f"usage: python -m torch_threadsafe_compile.scenarios {{{'|'.join(SCENARIOS)}}} [key=value ...]")
        return 2
    kwargs: dict[str, Any] = {}
    for kv in argv[1:]:
        k, _, v = kv.partition("=")
        kwargs[k] = int(v) if v.lstrip("-").isdigit() else (float(v) if v.replace(".", "", 1).isdigit() else v)
    res = SCENARIOS[argv[0]](**kwargs)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
