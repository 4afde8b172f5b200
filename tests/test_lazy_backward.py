"""H4: the compile-lock / autograd-engine deadlock (patches ``lazy_backward`` and ``compile_lock_watchdog``).

The deadlock itself needs a CUDA autograd worker thread; it is reproduced by ``test_h4_drafter_flex_cuda``
(marked ``cuda``, skipped elsewhere). On the CPU we test its two halves: a backward whose compile waits for
``compile_lock`` held by another thread (the hazard, unpatched), and a backward compiled with the forward
(active) that does not; that CPU graphs keep upstream's lazy backward; that no config value changes; and
that the watchdog reports a blocked compile lock within its bound.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from packaging.version import Version

from conftest import run_py, torch_version
from ttc_testing import scenarios

TV = torch_version()

H4_EXISTS = pytest.mark.skipif(TV < Version("2.6"), reason="before torch 2.6 the backward compiler does not take compile_lock: no H4")

def _mechanism(env: dict[str, str], worker: bool, threads_first: bool = True) -> dict:
    """``backward_lock_wait``: a compile whose backward compiler takes compile_lock, as inductor's does from
    torch 2.6 (aot_eager's does not; inductor itself would make each run compile C++ for tens of seconds on a
    CPU machine); another thread holds the lock while this thread's backward runs. ``worker``: the package
    treats the CPU as a device whose backward runs on an autograd worker thread (as CUDA's does).
    ``threads_first``: the program has a thread of its own running when the graph is compiled."""
    res = scenarios.run("backward_lock_wait", env=env, timeout=120, worker=int(worker), threads_first=int(threads_first))
    assert "backward_blocked" in res, res
    return res


@H4_EXISTS
def test_h4_backward_on_a_worker_device_is_compiled_with_the_forward() -> None:
    """patch lazy_backward: for a graph whose backward runs on an autograd worker thread, the backward is
    compiled with the forward, so a backward never waits for compile_lock held by another thread (the
    lock-order inversion of H4). Unpatched: compiled lazily, and the backward blocks on the lock."""
    off = _mechanism({"TTC_DISABLE": "1"}, worker=True)
    on = _mechanism({}, worker=True)
    assert off["backward_compiled_with_forward"] is False and off["backward_blocked"] is True  # the hazard
    assert on["backward_compiled_with_forward"] is True and on["backward_blocked"] is False
    assert on["grad_ok"] and off["grad_ok"]


@H4_EXISTS
def test_single_threaded_program_keeps_the_lazy_backward() -> None:
    """patch lazy_backward, do no harm: a graph compiled while the program runs no thread of its own keeps
    upstream's lazy backward, also on a device whose backward runs on an autograd worker thread (the
    inversion needs a second program thread). Compiling it with the forward changed upstream's counters:
    test_cudagraph_trees.py's ``test_cache_hit_forward_miss_backward`` and
    ``test_forward_with_skipped_cudagraphed_backward`` failed only with the package (GPU, torch 2.11)."""
    off = _mechanism({"TTC_DISABLE": "1"}, worker=True, threads_first=False)
    on = _mechanism({}, worker=True, threads_first=False)
    assert on["backward_compiled_with_forward"] is False == off["backward_compiled_with_forward"]
    assert on["grad_ok"] and off["grad_ok"]


@H4_EXISTS
def test_cpu_graphs_pay_nothing_and_config_is_untouched() -> None:
    """patch lazy_backward: a CPU backward runs in the calling thread (no inversion possible), so CPU graphs
    keep upstream's lazy backward; and no config value changes, in any thread."""
    off = _mechanism({"TTC_DISABLE": "1"}, worker=False)
    on = _mechanism({}, worker=False)
    assert on["backward_compiled_with_forward"] is False == off["backward_compiled_with_forward"]
    assert on["option_main"] == off["option_main"] and on["option_thread"] == off["option_thread"]


@pytest.mark.skipif(TV < Version("2.10"), reason="force_non_lazy_backward_lowering does not exist before torch 2.10")
def test_users_own_setting_wins() -> None:
    """A program that sets the option itself (here: False, explicitly) gets exactly that."""
    p = run_py("""
import torch, torch._functorch.config as fc, torch._dynamo, torch_threadsafe_compile as ttc
from torch_threadsafe_compile.patches import lazy_backward
lazy_backward.BACKWARD_IN_CALLING_THREAD = frozenset()
fc.force_non_lazy_backward_lowering = False   # the program decides
f = torch.compile(lambda x: x.sin().sum(), backend="aot_eager")
f(torch.randn(4, requires_grad=True))
print(fc.force_non_lazy_backward_lowering, lazy_backward.stats["eager_backward_graphs"])
""")
    assert p.stdout.strip() == "False 0", p.stderr[-2000:]


@pytest.mark.skipif(TV >= Version("2.6"), reason="the backward compiler takes compile_lock on this torch")
def test_skipped_with_reason_before_2_6() -> None:
    p = run_py("import json, torch, torch._functorch.aot_autograd, torch_threadsafe_compile as t; "
               "print(json.dumps(next(r for r in t.status()['patches'] if r['id'] == 'lazy_backward')))")
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["state"] == "skipped" and "outside" in row["reason"]


def test_watchdog_reports_a_blocked_compile_lock() -> None:
    """A thread that holds compile_lock forever: the watchdog fires within its bound and names H4."""
    p = run_py("""
import threading, time, json, torch, torch._dynamo
import torch._dynamo.convert_frame as cf
from torch_threadsafe_compile import watchdog
fired = []
watchdog.start(1.0, on_hang=fired.append)
hold = threading.Event(); release = threading.Event()
def holder():
    with cf.compile_lock:
        hold.set(); release.wait(30)
def waiter():
    with cf.compile_lock:
        pass
a = threading.Thread(target=holder, daemon=True); a.start(); hold.wait()
b = threading.Thread(target=waiter, daemon=True); t0 = time.time(); b.start()
while not fired and time.time() - t0 < 15:
    time.sleep(0.1)
release.set(); b.join(5)
print("RESULT " + json.dumps(dict(fired=len(fired), after_s=round(time.time() - t0, 1), msg=fired[0] if fired else "")))
""", timeout=60)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-2000:]
    res = json.loads(line[0][7:])
    assert res["fired"] == 1 and res["after_s"] < 5
    assert "H4" in res["msg"] and "compile_lock" in res["msg"]
    assert "Thread" in p.stderr  # every thread's stack was dumped


_HELD_LOCK = """
import threading, time, torch, torch._dynamo
import torch._dynamo.convert_frame as cf
hold = threading.Event()
def holder():
    with cf.compile_lock:
        hold.set(); time.sleep(4)
threading.Thread(target=holder, daemon=True).start(); hold.wait()
t0 = time.time()
with cf.compile_lock:  # a compile of this thread would wait here, silently upstream
    pass
print("WAITED %.1f" % (time.time() - t0))
"""


def test_h4_a_blocked_compile_lock_is_reported_only_with_the_package() -> None:
    """patch compile_lock_watchdog: with ``TTC_WATCHDOG=1``, a thread that waits for dynamo's compile_lock
    longer than the bound gets every thread's stack and an H4 line on stderr; upstream (``TTC_DISABLE=1``)
    the same wait is silent: a hang of H4's kind shows nothing to debug it with."""
    out = {}
    for mode in ("1", "0"):
        p = run_py(_HELD_LOCK, env={"TTC_DISABLE": mode, "TTC_WATCHDOG": "1"}, timeout=120)
        assert p.returncode == 0 and "WAITED" in p.stdout, p.stderr[-2000:]
        out[mode] = p.stderr
    assert "H4" not in out["1"] and "compile_lock" not in out["1"], out["1"][-2000:]  # the hazard: silence
    assert "H4" in out["0"] and "compile_lock" in out["0"] and "Thread" in out["0"], out["0"][-2000:]


def test_watchdog_from_environment() -> None:
    p = run_py("import torch, torch._dynamo; from torch_threadsafe_compile import watchdog; print(watchdog.running())",
               env={"TTC_WATCHDOG": "30"})
    assert p.stdout.strip() == "True", p.stderr[-2000:]


@pytest.mark.cuda
def test_h4_drafter_flex_cuda() -> None:
    """The seed layout on a GPU with a cold inductor cache: hangs unpatched, completes active.
    A hang is caught by the subprocess timeout (the watchdog of this test)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    limit = float(os.environ.get("TTC_H4_TIMEOUT", "240"))
    results = {}
    for label, env in (("unpatched", {"TTC_DISABLE": "1"}), ("active", {})):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(env, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            results[label] = scenarios.run("drafter_flex", env=env, timeout=limit)
    print(json.dumps(results))
    assert results["active"].get("errors") == 0 and "timeout" not in results["active"], results
    assert results["active"]["done"]["drafter_steps"] == 12
