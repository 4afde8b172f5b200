"""H4: the compile-lock / autograd-engine deadlock (patches ``lazy_backward`` and ``compile_lock_watchdog``).

The deadlock itself needs a CUDA autograd worker thread; it is reproduced by ``test_h4_drafter_flex_cuda``
(marked ``cuda``, skipped elsewhere). On the CPU we test the logic: the option is forced on the right
versions and reaches every thread, it stays out elsewhere with its reason, and the watchdog reports a
blocked compile lock within its bound.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from packaging.version import Version

from conftest import run_py, torch_version
from torch_threadsafe_compile import scenarios

TV = torch_version()

PROBE = """
import json, threading, torch, torch._functorch.config as fc, torch_threadsafe_compile as ttc
row = next(p for p in ttc.status()["patches"] if p["id"] == "lazy_backward")
box = []
t = threading.Thread(target=lambda: box.append(getattr(fc, "force_non_lazy_backward_lowering", None))); t.start(); t.join()
print("RESULT " + json.dumps(dict(state=row["state"], reason=row["reason"], main=getattr(fc, "force_non_lazy_backward_lowering", None), thread=box[0])))
"""


def _probe(env: dict[str, str]) -> dict:
    p = run_py(PROBE, env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stderr[-2000:]
    return json.loads(line[0][7:])


@pytest.mark.skipif(TV < Version("2.10"), reason="force_non_lazy_backward_lowering does not exist before torch 2.10")
def test_eager_backward_lowering_forced_in_every_thread() -> None:
    off = _probe({"TTC_DISABLE": "1"})
    on = _probe({})
    assert off["main"] is False and off["thread"] is False  # upstream default: lazy
    assert on["state"] == "applied" and on["main"] is True and on["thread"] is True


@pytest.mark.skipif(TV < Version("2.10"), reason="force_non_lazy_backward_lowering does not exist before torch 2.10")
def test_users_own_setting_wins() -> None:
    p = run_py("""
import torch, torch._functorch.config as fc, torch_threadsafe_compile as ttc
fc.force_non_lazy_backward_lowering = False   # the program decides after import
print(fc.force_non_lazy_backward_lowering)
""")
    assert p.stdout.strip() == "False", p.stderr[-2000:]


@pytest.mark.skipif(TV >= Version("2.10"), reason="the option exists on this torch")
def test_skipped_with_reason_before_2_10() -> None:
    on = _probe({})
    assert on["state"] == "skipped" and "outside" in on["reason"]


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
