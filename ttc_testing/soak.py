"""Concurrency soak and fault-injection harness for torch.compile under many threads.

Why a harness of its own: the hazards in docs/hazards.md (H1 tracing flag, H2 compile-session flag, H3 stampede,
H4 deadlock, H5/H6 process-global state) only show up when many kinds of compiled work overlap in one
process. This module builds such a workload, runs it for a fixed time, checks every compiled output
against the same function run eagerly on the same inputs, and reports plain numbers. It never decides
pass/fail: ``tests/soak/test_soak.py`` and ``bench/soak.py`` do. Lives in ``ttc_testing`` so that both can
import it without ``bench/`` depending on ``tests/``.

Every run happens in a fresh interpreter (:func:`run_subprocess`), so the package can be compared active
versus ``TTC_DISABLE=1`` and so dynamo's process-global counters start at zero. The child runs
``python -X faulthandler ttc_testing/soak.py '<json config>'`` and prints one ``RESULT {json}`` line.

Workload (``functions`` compiled callables, kinds cycled by index, each with its *own* code object so
that dynamo caches them separately):

* ``plain`` / ``plain_dyn``: a plain function, ``dynamic=False`` (one guard set per shape and dtype) and
  ``dynamic=True`` (one guard set per dtype);
* ``mod_compile`` / ``mod_method``: an ``nn.Module`` compiled with ``torch.compile(module)`` and with
  ``module.compile()``, per-thread copies, inference under ``torch.no_grad()``;
* ``nested``: a compiled function that calls another compiled function (dynamo inlines the inner one);
* ``gbreak`` / ``gprint``: a graph break (``torch._dynamo.graph_break()`` / a ``print``) → two graphs per
  guard set;
* ``train``: a training step (forward compiled, backward, SGD step) on a per-thread model copy;
* ``flex`` (opt-in, ``flex=True``): ``flex_attention`` forward with a score_mod.

Every function is called with two dtypes (float32, float64) and two sizes, so the expected number of
graphs is known from the design: ``graphs_per_guard_set(kind) * |guard sets exercised|``. Extra
``tracers`` threads run ``torch.fx.symbolic_trace``, ``make_fx`` and ``torch.export.export`` meanwhile.

Fault injection (``fault=...``) adds one *victim* function compiled with a misbehaving backend:
``raise_kth`` (RuntimeError on the k-th backend call), ``keyboard_interrupt``, ``system_exit`` (the
thread that compiles dies) and ``slow_compile`` (the backend sleeps). Errors are recorded per function so a
test can check that only the victim's callers were affected.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
import types
from typing import Any, Callable

# --------------------------------------------------------------------------------------------- config

KINDS = ("plain", "mod_compile", "nested", "gbreak", "train", "plain_dyn", "mod_method", "gprint")
FAULTS = ("raise_kth", "keyboard_interrupt", "system_exit", "slow_compile")
INJECTED = "ttc-soak injected fault"  # marker in injected error messages


@dataclasses.dataclass
class SoakConfig:
    """One run. Every field is JSON-serialisable so the config can be passed to the child process."""

    threads: int = 16
    functions: int = 20
    duration: float = 60.0
    backend: str = "aot_eager"
    tracers: int = 1  # extra threads doing fx.symbolic_trace / make_fx / torch.export
    flex: bool = False  # add flex_attention forward functions (slow to compile on CPU)
    seed: int = 0
    deadline: float | None = None  # seconds after start before the run counts as hung; default derived
    fault: str | None = None  # one of FAULTS
    fault_k: int = 2  # raise_kth: which backend call raises (1-based)
    slow_s: float = 4.0  # slow_compile: seconds the victim's backend sleeps
    import_dynamo_first: bool = False  # `import torch._dynamo` before any torch.compile (see docs)
    dim: int = 16  # feature size of the inputs
    device: str = "cpu"  # "cuda" on a GPU machine: inputs and module copies live there
    kinds: list[str] | None = None  # restrict the kinds cycled through (diagnosis); default KINDS
    # The torture variant: torch._dynamo.reset() every reset_every s (one more thread), and the recompile
    # limit assigned / config.patch'ed every config_every s (another); None: off. Resets force recompiles,
    # so the compile counts then say nothing about H3; errors, mismatches and hangs still count.
    reset_every: float | None = None
    config_every: float | None = None
    # H7's random-number hazard (issue: CUDA graphs while other threads draw): draw every input in the
    # worker threads from the device's default generator (the process-wide one that a CUDA graph capture
    # puts into capture mode) instead of a per-thread CPU generator; and the compile mode
    # ("reduce-overhead": CUDA graphs recorded from many threads). None: torch.compile's default.
    device_rand: bool = False
    mode: str | None = None

    def effective_deadline(self) -> float:
        """Generous: cold compiles on 2 CPU cores can take minutes in total, but a hang is still a hang."""
        if self.deadline is not None:
            return float(self.deadline)
        return self.duration * 2 + 120 + (120 if self.flex else 0) + (self.slow_s * 4 if self.fault == "slow_compile" else 0)


TOLERANCES = {"float32": (1e-4, 1e-4), "float64": (1e-9, 1e-9)}  # (atol, rtol); aot_eager
TOLERANCES_INDUCTOR = {"float32": (1e-3, 1e-3), "float64": (1e-7, 1e-7)}  # inductor reorders reductions


# --------------------------------------------------------------------------------------------- workload


def _fresh(fn: Callable[..., Any], name: str) -> types.FunctionType:
    """A copy of ``fn`` with its own code object.

    Why: dynamo keys its cache on the code object, so 20 closures made by one factory would share one
    cache (and its recompile limit). ``code.replace`` gives a distinct object with the same behaviour.
    """
    code = fn.__code__.replace(co_name=name, co_qualname=name) if sys.version_info >= (3, 11) else fn.__code__.replace(co_name=name)
    new = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


_PRINT_SINK = io.StringIO()  # `gprint` prints here: a graph break without flooding stdout


@dataclasses.dataclass
class Fn:
    """One compiled callable of the workload and how to check it."""

    name: str
    kind: str
    graphs_per_guard_set: int
    # run(thread_state, x) -> (compiled_out, eager_out); both tensors or lists of tensors
    run: Callable[[ThreadState, Any, str], tuple[Any, Any]]
    shapes: tuple[tuple[int, ...], ...]
    dynamic: bool = False
    victim: bool = False
    grad_modes: tuple[bool, ...] = (False,)

    def guard_key(self, dtype: str, shape: tuple[int, ...], grad: bool) -> tuple[Any, ...]:
        """The guard set a call lands in, by design (dynamic shapes: one per dtype)."""
        return (self.name, dtype, None if self.dynamic else shape, grad)


class ThreadState:
    """Per-thread model copies (training and compiled-module kinds), keyed by (function, dtype)."""

    def __init__(self) -> None:
        self.models: dict[tuple[str, str], Any] = {}


def _build_functions(cfg: SoakConfig, torch: Any) -> list[Fn]:
    backend = cfg.backend
    # Every torch.compile / Module.compile below takes these: the backend, and the mode when one is asked for.
    ckw: dict[str, Any] = {"backend": backend, **({"mode": cfg.mode} if cfg.mode else {})}
    d = cfg.dim
    shapes = ((4, d), (6, d))
    fns: list[Fn] = []

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(d, d)
            self.b = torch.nn.Linear(d, 4)

        def forward(self, x: Any) -> Any:
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(cfg.seed)
    base_block = Block()

    def module_class(i: int) -> type:
        """A distinct class (distinct forward code object) per function index."""
        fwd = _fresh(Block.forward, f"forward_{i}")
        return type(f"Block{i}", (Block,), {"forward": fwd})

    kinds = tuple(cfg.kinds or KINDS)
    for i in range(cfg.functions):
        kind = kinds[i % len(kinds)]
        name = f"{kind}_{i}"
        if kind in ("plain", "plain_dyn"):

            def body(x: Any, i: int = i) -> Any:
                return (x * (1 + i % 3)).sin() + x.cos() * x.sum(-1, keepdim=True) / x.shape[-1]

            py = _fresh(body, name)
            dyn = kind == "plain_dyn"
            comp = torch.compile(py, **ckw, dynamic=dyn)

            def run(ts: ThreadState, x: Any, dt: str, comp: Any = comp, py: Any = py) -> tuple[Any, Any]:
                with torch.no_grad():
                    return comp(x), py(x)

            fns.append(Fn(name, kind, 1, run, shapes, dynamic=dyn))
        elif kind in ("mod_compile", "mod_method"):
            cls = module_class(i)

            def run(ts: ThreadState, x: Any, dt: str, cls: type = cls, kind: str = kind, name: str = name) -> tuple[Any, Any]:
                key = (name, dt)
                if key not in ts.models:
                    m = cls()
                    m.load_state_dict(base_block.state_dict())
                    m = m.to(device=cfg.device, dtype=getattr(torch, dt))
                    if kind == "mod_compile":
                        ts.models[key] = (torch.compile(m, **ckw, dynamic=False), m)
                    else:
                        m.compile(**ckw, dynamic=False)
                        ts.models[key] = (m, m)
                compiled, plain = ts.models[key]
                with torch.no_grad():
                    return compiled(x), plain.forward(x)  # .forward bypasses the compiled __call__

            fns.append(Fn(name, kind, 1, run, shapes))
        elif kind == "nested":

            def inner_body(x: Any) -> Any:
                return torch.tanh(x) * 2

            inner_py = _fresh(inner_body, f"inner_{i}")
            inner = torch.compile(inner_py, **ckw, dynamic=False)
            # The outer function calls the *compiled* inner; its eager twin calls the plain inner.
            # Source text, not a closure: the name `inner` must resolve in each twin's own globals.
            src = f"def {name}(x):\n    return inner(x) + x.exp()\n"
            env_c: dict[str, Any] = {"inner": inner}
            env_e: dict[str, Any] = {"inner": inner_py}
            # Compiled with this file as its file name: dynamo (torch <= 2.11) wraps a function without a
            # source file in one shared frame (external_utils.wrap_inline's `inner`), so three such
            # functions x 4 guard sets exhaust that frame's recompile_limit (8) even in a single thread,
            # an upstream limit unrelated to threads.
            code = compile(src, __file__, "exec")
            exec(code, env_c)
            exec(code, env_e)
            outer_c, outer_e = env_c[name], env_e[name]
            comp = torch.compile(outer_c, **ckw, dynamic=False)

            def run(ts: ThreadState, x: Any, dt: str, comp: Any = comp, py: Any = outer_e) -> tuple[Any, Any]:
                with torch.no_grad():
                    return comp(x), py(x)

            fns.append(Fn(name, kind, 1, run, shapes))
        elif kind in ("gbreak", "gprint"):
            if kind == "gbreak":

                def body(x: Any) -> Any:
                    y = x.sin() * 3
                    torch._dynamo.graph_break()
                    return y.cos() + x

            else:

                def body(x: Any) -> Any:
                    y = x.sin() * 3
                    print("gprint", file=_PRINT_SINK)
                    return y.cos() + x

            py = _fresh(body, name)
            comp = torch.compile(py, **ckw, dynamic=False)

            def run(ts: ThreadState, x: Any, dt: str, comp: Any = comp, py: Any = py) -> tuple[Any, Any]:
                with torch.no_grad():
                    return comp(x), py(x)

            fns.append(Fn(name, kind, 2, run, shapes))
        elif kind == "train":
            cls = module_class(i)

            def run(ts: ThreadState, x: Any, dt: str, cls: type = cls, name: str = name) -> tuple[Any, Any]:
                key = (name, dt)
                if key not in ts.models:
                    m = cls()
                    m.load_state_dict(base_block.state_dict())
                    m = m.to(device=cfg.device, dtype=getattr(torch, dt))
                    ts.models[key] = (torch.compile(m, **ckw, dynamic=False), m, torch.optim.SGD(m.parameters(), lr=1e-3))
                compiled, plain, opt = ts.models[key]
                target = torch.ones(x.shape[0], 4, dtype=x.dtype, device=x.device)
                # Eager first, on the same parameters, then the compiled step that updates them.
                opt.zero_grad(set_to_none=True)
                loss_e = ((plain.forward(x) - target) ** 2).mean()
                loss_e.backward()
                grads_e = [p.grad.detach().clone() for p in plain.parameters()]
                opt.zero_grad(set_to_none=True)
                loss_c = ((compiled(x) - target) ** 2).mean()
                loss_c.backward()
                grads_c = [p.grad.detach().clone() for p in plain.parameters()]
                opt.step()
                return [loss_c.detach(), *grads_c], [loss_e.detach(), *grads_e]

            fns.append(Fn(name, kind, 1, run, shapes, grad_modes=(True,)))
    if cfg.flex:
        fns.extend(_flex_functions(cfg, torch))
    if cfg.fault:
        fns.append(_victim(cfg, torch))
    return fns


def _flex_functions(cfg: SoakConfig, torch: Any) -> list[Fn]:
    """flex_attention forward (B, H, S, D) = (1, 2, S, 8); float32 and float64, two sequence lengths."""
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + (q_idx - kv_idx) * 0.01

    def body(q: Any) -> Any:
        return flex_attention(q, q * 0.5, q.cos(), score_mod=score_mod)

    py = _fresh(body, "flex_0")
    comp = torch.compile(py, backend=cfg.backend, dynamic=False)

    def run(ts: ThreadState, x: Any, dt: str) -> tuple[Any, Any]:
        q = x.reshape(1, 2, x.shape[0] * x.shape[1] // 16, 8)
        with torch.no_grad():
            return comp(q), py(q)

    return [Fn("flex_0", "flex", 1, run, ((8, cfg.dim), (16, cfg.dim)))]


class _FaultBackend:
    """The victim's backend: ``aot_eager`` (or the configured one) plus one injected fault.

    Counts its calls so a test can tell how many compiles the victim actually had.
    """

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.calls = 0
        self.faults = 0
        self.lock = threading.Lock()

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        with self.lock:
            self.calls += 1
            n = self.calls
        fault = self.cfg.fault
        if fault == "raise_kth" and n == self.cfg.fault_k:
            self.faults += 1
            raise RuntimeError(f"{INJECTED}: backend call {n}")
        if fault == "keyboard_interrupt" and n == 1:
            self.faults += 1
            raise KeyboardInterrupt(f"{INJECTED}: KeyboardInterrupt in compile")
        if fault == "system_exit" and n == 1:
            self.faults += 1
            raise SystemExit(f"{INJECTED}: SystemExit in compile")
        if fault == "slow_compile":
            time.sleep(self.cfg.slow_s)
        return lookup_backend(self.cfg.backend)(gm, example_inputs)


_fault_backend: list[_FaultBackend] = []


def _victim(cfg: SoakConfig, torch: Any) -> Fn:
    backend = _FaultBackend(cfg)
    _fault_backend[:] = [backend]

    def body(x: Any) -> Any:
        return (x * 0.5).tanh() + x.abs().sqrt()

    py = _fresh(body, "victim")
    comp = torch.compile(py, backend=backend, dynamic=False)

    def run(ts: ThreadState, x: Any, dt: str) -> tuple[Any, Any]:
        with torch.no_grad():
            return comp(x), py(x)

    return Fn("victim", "victim", 1, run, ((4, cfg.dim), (6, cfg.dim)), victim=True)


# --------------------------------------------------------------------------------------------- tracers


def _tracer_ops(torch: Any) -> list[tuple[str, Callable[[], float]]]:
    """fx.symbolic_trace, make_fx and (non-strict) torch.export, each checked against eager.

    Non-strict export: strict export runs dynamo and would add graphs to the counters we compare.
    """
    import torch.fx
    from torch.fx.experimental.proxy_tensor import make_fx

    class Traced(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: Any) -> Any:
            return torch.relu(self.lin(x)) + 1

    mod = Traced()

    def sym() -> float:
        x = torch.randn(3, 8)
        gm = torch.fx.symbolic_trace(mod)
        return float((gm(x) - mod(x)).abs().max())

    def mfx() -> float:
        x = torch.randn(3, 8)
        g = make_fx(lambda t: t.sin() * 2 + t.cos())(x)
        return float((g(x) - (x.sin() * 2 + x.cos())).abs().max())

    def exp() -> float:
        x = torch.randn(3, 8)
        ep = torch.export.export(mod, (x,), strict=False)
        return float((ep.module()(x) - mod(x)).abs().max())

    return [("symbolic_trace", sym), ("make_fx", mfx), ("export", exp)]


# --------------------------------------------------------------------------------------------- run


class _Recorder:
    """Thread-safe counters of one run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.errors = 0
        self.error_msgs: list[str] = []
        self.errors_by_fn: dict[str, int] = {}
        self.error_types: dict[str, int] = {}
        self.mismatches = 0
        self.mismatch_msgs: list[str] = []
        self.max_diff: dict[str, float] = {}
        self.exercised: set[tuple[Any, ...]] = set()
        self.tracer_ops = 0
        self.calls_by_fn: dict[str, int] = {}
        self.dead_threads: list[str] = []
        self.victim_max_call_s = 0.0

    def error(self, where: str, e: BaseException) -> None:
        with self.lock:
            self.errors += 1
            self.errors_by_fn[where] = self.errors_by_fn.get(where, 0) + 1
            self.error_types[type(e).__name__] = self.error_types.get(type(e).__name__, 0) + 1
            if len(self.error_msgs) < 5:
                self.error_msgs.append(f"{where}: {type(e).__name__}: {str(e)[:300]}")


def _max_diff(torch: Any, a: Any, b: Any) -> float:
    if isinstance(a, (list, tuple)):
        return max(_max_diff(torch, x, y) for x, y in zip(a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def _within(torch: Any, a: Any, b: Any, atol: float, rtol: float) -> bool:
    if isinstance(a, (list, tuple)):
        return all(_within(torch, x, y, atol, rtol) for x, y in zip(a, b))
    return a.shape == b.shape and bool(torch.allclose(a.detach(), b.detach(), atol=atol, rtol=rtol))


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the workload in this process (normally the child of :func:`run_subprocess`)."""
    t_start = time.monotonic()
    import torch

    if cfg.import_dynamo_first:
        import torch._dynamo
    fns = _build_functions(cfg, torch)
    import torch._dynamo.utils as du

    tol = TOLERANCES_INDUCTOR if cfg.backend == "inductor" else TOLERANCES
    rec = _Recorder()
    stop = threading.Event()
    barrier = threading.Barrier(cfg.threads + cfg.tracers + bool(cfg.reset_every) + bool(cfg.config_every))
    dtypes = ("float32", "float64")

    # Every (function, dtype, shape, grad) combination, in one fixed order for the first pass: all threads
    # then want the same first compile at the same moment (the H3 stampede), later passes are shuffled.
    combos = [(f, dt, s, g) for f in fns for dt in dtypes for s in f.shapes for g in f.grad_modes]

    def worker(idx: int) -> None:
        ts = ThreadState()
        rng = random.Random(cfg.seed * 1000 + idx)
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + idx)
        order = list(combos)
        barrier.wait()
        first = True
        while not stop.is_set():
            if not first:
                rng.shuffle(order)
            first = False
            for f, dt, shape, grad in order:
                if stop.is_set():
                    break
                if cfg.device_rand:
                    x = torch.randn(*shape, dtype=getattr(torch, dt), device=cfg.device)
                else:
                    x = torch.randn(*shape, generator=gen, dtype=getattr(torch, dt)).to(cfg.device)
                t0 = time.monotonic()
                try:
                    out_c, out_e = f.run(ts, x, dt)
                except Exception as e:
                    rec.error(f.name, e)
                    continue
                except KeyboardInterrupt as e:  # raised by an interrupted compile; a defined error for this caller
                    rec.error(f.name, e)
                    continue
                except SystemExit as e:  # the thread dies, as an unhandled SystemExit does in a thread
                    with rec.lock:
                        rec.dead_threads.append(f"worker-{idx} in {f.name}: {e}")
                    raise
                dt_s = time.monotonic() - t0
                atol, rtol = tol[dt]
                diff = _max_diff(torch, out_c, out_e)
                with rec.lock:
                    rec.calls += 1
                    rec.calls_by_fn[f.name] = rec.calls_by_fn.get(f.name, 0) + 1
                    rec.exercised.add(f.guard_key(dt, shape, grad))
                    rec.max_diff[dt] = max(rec.max_diff.get(dt, 0.0), diff)
                    if f.victim:
                        rec.victim_max_call_s = max(rec.victim_max_call_s, dt_s)
                if not _within(torch, out_c, out_e, atol, rtol):
                    with rec.lock:
                        rec.mismatches += 1
                        if len(rec.mismatch_msgs) < 5:
                            rec.mismatch_msgs.append(f"{f.name} {dt} {shape}: max|diff|={diff:.3g}")

    def tracer(idx: int) -> None:
        ops = _tracer_ops(torch)
        barrier.wait()
        while not stop.is_set():
            for name, op in ops:
                if stop.is_set():
                    break
                try:
                    diff = op()
                except Exception as e:
                    rec.error(f"tracer:{name}", e)
                    continue
                with rec.lock:
                    rec.tracer_ops += 1
                    if diff > 1e-5:
                        rec.mismatches += 1
                        if len(rec.mismatch_msgs) < 5:
                            rec.mismatch_msgs.append(f"tracer:{name}: max|diff|={diff:.3g}")

    churn = {"resets": 0, "config_changes": 0}

    def resetter(every: float) -> None:
        barrier.wait()
        while not stop.wait(every):
            try:
                torch._dynamo.reset()
                churn["resets"] += 1
            except Exception as e:
                rec.error("reset", e)

    def configurer(every: float) -> None:
        config = torch._dynamo.config
        name = "recompile_limit" if "recompile_limit" in config._config else "cache_size_limit"
        barrier.wait()
        k = 0
        while not stop.wait(every):
            k += 1
            try:
                if k % 2:
                    setattr(config, name, 8 + k % 3)
                else:
                    with config.patch(**{name: 16}):
                        time.sleep(every / 2)
                churn["config_changes"] += 1
            except Exception as e:
                rec.error("config", e)

    threads = [threading.Thread(target=worker, args=(i,), name=f"worker-{i}", daemon=True) for i in range(cfg.threads)]
    threads += [threading.Thread(target=tracer, args=(i,), name=f"tracer-{i}", daemon=True) for i in range(cfg.tracers)]
    if cfg.reset_every:
        threads.append(threading.Thread(target=resetter, args=(cfg.reset_every,), name="resetter", daemon=True))
    if cfg.config_every:
        threads.append(threading.Thread(target=configurer, args=(cfg.config_every,), name="configurer", daemon=True))
    t_run = time.monotonic()
    for t in threads:
        t.start()
    deadline = t_start + cfg.effective_deadline()
    stop_at = t_run + cfg.duration
    while time.monotonic() < stop_at and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        # Never block: dump every stack (the evidence) and report; the daemon threads die with the process.
        sys.stderr.write(f"soak watchdog: {len(hung)} thread(s) still running {cfg.effective_deadline():.0f} s after start: {hung}\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    wall = time.monotonic() - t_run

    with rec.lock:
        frames = du.counters["frames"]
        unimpl = du.counters.get("unimplemented", {})
        recompile_limit_breaks = sum(v for k, v in unimpl.items() if "recompile" in str(k).lower() or "cache_size" in str(k).lower())
        by_kind = {f.name: f.graphs_per_guard_set for f in fns}
        exercised = sorted(rec.exercised, key=repr)
        expected_graphs = sum(by_kind[k[0]] for k in exercised)
        result: dict[str, Any] = {
            "torch": torch.__version__,
            "device": cfg.device,
            "device_rand": cfg.device_rand,
            "mode": cfg.mode,
            "ttc": _ttc_state(),
            "threads": cfg.threads,
            "functions": len(fns),
            "tracers": cfg.tracers,
            "duration": cfg.duration,
            "backend": cfg.backend,
            "fault": cfg.fault,
            "import_dynamo_first": cfg.import_dynamo_first,
            "wall_s": round(wall, 1),
            "calls": rec.calls,
            "calls_by_fn": rec.calls_by_fn,
            "tracer_ops": rec.tracer_ops,
            "errors": rec.errors,
            "error_msgs": rec.error_msgs,
            "errors_by_fn": rec.errors_by_fn,
            "error_types": rec.error_types,
            "dead_threads": rec.dead_threads,
            "hangs": len(hung),
            "hung_threads": hung,
            "mismatches": rec.mismatches,
            "mismatch_msgs": rec.mismatch_msgs,
            "max_diff": rec.max_diff,
            "uncompiled_frames": int(frames.get("total", 0) - frames.get("ok", 0)),
            "recompile_limit_breaks": int(recompile_limit_breaks),
            "compiles": int(du.counters["stats"]["unique_graphs"]),
            "guard_sets": len(exercised),
            "expected_graphs": expected_graphs,
            "guard_sets_designed": len({f.guard_key(dt, s, g) for f, dt, s, g in combos}),
            "graphs_designed": sum(f.graphs_per_guard_set
                                   for f, dt, s, g in {f.guard_key(dt, s, g): (f, dt, s, g) for f, dt, s, g in combos}.values()),
            "victim_backend_calls": _fault_backend[0].calls if _fault_backend else None,
            "victim_faults": _fault_backend[0].faults if _fault_backend else None,
            "victim_max_call_s": round(rec.victim_max_call_s, 2),
            "victim_guard_sets": sum(1 for k in exercised if k[0] == "victim"),
            "resets": churn["resets"],
            "config_changes": churn["config_changes"],
            "first_compile": _first_compile_totals(),
        }
    result["uncompiled_calls"] = result["uncompiled_frames"] + result["recompile_limit_breaks"]
    return result


def _ttc_state() -> dict[str, Any]:
    """Whether the package is active here, and the state of each patch (a failed patch is a finding)."""
    try:
        import torch_threadsafe_compile as ttc

        st = ttc.status()
        return {
            "active": bool(st.get("active")),
            "inactive_reason": st.get("inactive_reason"),
            "patches": {p["id"]: p["state"] for p in st.get("patches", [])},
            "failed": {p["id"]: p.get("reason") for p in st.get("patches", []) if p.get("state") == "failed"},
        }
    except Exception as e:  # the package is optional for the harness
        return {"active": False, "inactive_reason": f"{type(e).__name__}: {e}"}


def _first_compile_totals() -> dict[str, int] | None:
    """Totals of the H3 patch's per-code-object stats (None when the patch is not loaded)."""
    mod = sys.modules.get("torch_threadsafe_compile.patches.first_compile")
    if mod is None:
        return None
    rep = mod.report()
    return {
        "code_objects": len(rep),
        "compiles": sum(r["compiles"] for r in rep.values()),
        "served_by_other_thread": sum(r["served_by_other_thread"] for r in rep.values()),
        "by_code": {k: (r["compiles"], r["served_by_other_thread"]) for k, r in rep.items()},
    }


# --------------------------------------------------------------------------------------------- parent side


def run_subprocess(cfg: SoakConfig, disable: bool = False, timeout: float | None = None) -> dict[str, Any]:
    """Run ``cfg`` in a fresh interpreter; ``disable`` sets ``TTC_DISABLE=1``.

    The child has its own deadline (``cfg.effective_deadline()``); ``timeout`` (default: that + 60 s) is
    the parent's last resort for a child that cannot even report (e.g. a deadlock holding the GIL), which
    is then reported as ``hangs = -1`` with the stderr tail (it contains the faulthandler dump if any).
    """
    env = {k: v for k, v in os.environ.items() if k != "TTC_DISABLE"}
    if disable:
        env["TTC_DISABLE"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")
    args = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), json.dumps(dataclasses.asdict(cfg))]
    limit = timeout if timeout is not None else cfg.effective_deadline() + 60
    t0 = time.monotonic()
    try:
        p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"hangs": -1, "timeout": True, "disable": disable, "secs": round(time.monotonic() - t0, 1), "stderr_tail": err[-4000:]}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            res = json.loads(line[7:])
            res["disable"] = disable
            res["secs"] = round(time.monotonic() - t0, 1)
            res["stderr_tail"] = p.stderr[-4000:] if res.get("hangs") else ""
            return res
    return {"rc": p.returncode, "disable": disable, "no_result": True, "secs": round(time.monotonic() - t0, 1),
            "stderr_tail": (p.stderr or p.stdout)[-4000:]}


def _child(argv: list[str]) -> int:
    cfg = SoakConfig(**json.loads(argv[0]))
    try:
        res = run_soak(cfg)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(2)
    print("RESULT " + json.dumps(res), flush=True)
    # Hung daemon threads (or stuck interpreter shutdown) must not keep the process alive.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
