"""The hazard scenarios ``doctor --selftest`` runs, each in a fresh interpreter, reporting one JSON line.

A scenario reports numbers, never a verdict; the caller compares the unpatched run (``TTC_DISABLE=1``) with
the active one. Only the four scenarios of the selftest ship in the wheel; the full set (hazard tests,
benches, the compatibility matrix) lives in ``ttc_testing/scenarios/`` of the source tree and registers
itself on top of these.

    python -m torch_threadsafe_compile.selftest NAME [key=value ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, NamedTuple

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}
MODULE = __name__ if __name__ != "__main__" else "torch_threadsafe_compile.selftest"


class Check(NamedTuple):
    """One row of ``doctor --selftest``: the hazard, the scenario that shows it, the number to compare, and
    that number when the hazard does not show (what the active run must report, on every torch)."""

    hazard: str
    scenario: str
    kwargs: dict[str, Any]
    metric: str
    safe: Any


# What --selftest runs (config_threads last: it leaves a config assignment behind in its interpreter).
PLAN = (
    Check("H1", "fx_flag_poll", {"seconds": 1.0}, "true_in_other_thread", 0),
    Check("H2", "is_compiling_leak", {"seconds": 1.0}, "true_in_eager_thread", 0),
    Check("H3", "stampede", {"threads": 8, "shapes": 1}, "graphs", 1),
    Check("H6", "config_threads", {}, "new_thread_sees", 64),
)


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
    saw = all(seen_in_compiler) and bool(seen_in_compiler)
    return {"polls": polls[0], "true_in_eager_thread": polls[1], "compiling_thread_saw_true": saw}


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


def run(name: str, env: dict[str, str] | None = None, timeout: float = 300, module: str = MODULE, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter; returns its JSON result (or rc/tail/timeout)."""
    args = [sys.executable, "-X", "faulthandler", "-m", module, name]
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
            res: dict[str, Any] = json.loads(line[7:])
            res["secs"] = round(time.time() - t0, 1)
            return res
    return {"rc": p.returncode, "tail": (p.stderr or p.stdout)[-600:], "secs": round(time.time() - t0, 1)}


def start_many(plan: list[tuple[str, dict[str, Any]]], env: dict[str, str] | None = None, module: str = MODULE) -> subprocess.Popen[str]:
    """Start one interpreter that runs several scenarios in turn (dynamo reset between them)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    args = [sys.executable, "-X", "faulthandler", "-m", module, "--many", json.dumps(plan)]
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


def _main(argv: list[str], module: str = MODULE) -> int:
    if argv[:1] == ["--many"] and len(argv) == 2:
        _run_many([(n, kw) for n, kw in json.loads(argv[1])])
        return 0
    if not argv or argv[0] not in SCENARIOS:
        print(f"usage: python -m {module} {{{'|'.join(SCENARIOS)}}} [key=value ...]")
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
