"""Short-mode concurrency soak and fault injection (CI): a few minutes on two CPU cores in total.

Each test runs the harness (``ttc_testing/soak.py``) in a fresh interpreter with the package active and
its own deadline, so a hang fails the test instead of blocking the suite. The long mode, and the comparison
with ``TTC_DISABLE=1``, is ``bench/soak.py`` (results in docs/reliability.md).

No check here is relaxed to fit the package: if one fails, the failure is a finding.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ttc_testing import soak as harness  # noqa: E402

# Runs start like a plain user program (`import torch`, then torch.compile); `import torch._dynamo` first
# is a variant of bench/soak.py.
IMPORT_DYNAMO_FIRST = False

# Every kind of the workload (plain, dynamic, compiled modules both ways, nested compiled functions, graph
# breaks with and without a closure, training steps), plus one thread doing FX symbolic tracing, make_fx
# and torch.export meanwhile. The long mode (bench/soak.py) runs the same with more threads and functions.
SHORT_KINDS = list(harness.KINDS)


def show(res: dict[str, Any]) -> str:
    """Everything a failing assertion needs, minus the bulky parts."""
    slim = {k: v for k, v in res.items() if k not in ("stderr_tail",)}
    return json.dumps(slim, indent=1)[:6000] + ("\nSTDERR TAIL:\n" + res["stderr_tail"] if res.get("stderr_tail") else "")


def run(**kw: Any) -> dict[str, Any]:
    cfg = harness.SoakConfig(**kw)
    res = harness.run_subprocess(cfg, disable=False)
    assert "calls" in res, f"run produced no result:\n{show(res)}"
    return res


def test_patches_applied() -> None:
    """Every patch must be applied in a plain user program (`import torch`, then torch.compile): a patch
    that silently fails leaves its hazard open while the package looks active."""
    res = run(threads=1, functions=1, duration=0.5, tracers=0, kinds=["plain"])
    ttc = res["ttc"]
    assert ttc["active"], show(res)
    assert not ttc.get("failed"), f"patches failed: {ttc.get('failed')}"


def test_soak_short() -> None:
    """8 threads x 8 functions (+1 tracer thread) for ~20 s: zero errors, hangs and uncompiled calls,
    outputs within tolerance of eager, and one compile per guard set (graphs = expected from the design)."""
    res = run(threads=8, functions=8, duration=20, tracers=1, deadline=300, kinds=SHORT_KINDS,
              import_dynamo_first=IMPORT_DYNAMO_FIRST)
    assert res["hangs"] == 0, show(res)
    assert res["errors"] == 0, show(res)
    assert res["mismatches"] == 0, show(res)
    assert res["uncompiled_calls"] == 0, show(res)
    assert res["guard_sets"] == res["guard_sets_designed"], f"not every guard set was exercised:\n{show(res)}"
    assert res["compiles"] == res["expected_graphs"], show(res)


# Fault injection: a victim function with a misbehaving backend joins 6 threads x 3 healthy functions.
# Kinds without graph breaks or compiled user modules, so that the fault is the only thing under test.
FAULT_KINDS = ["plain", "plain_dyn", "nested"]


def run_fault(fault: str, **kw: Any) -> dict[str, Any]:
    params: dict[str, Any] = dict(threads=6, functions=3, duration=8, tracers=0, kinds=FAULT_KINDS, fault=fault, deadline=150,
                                  import_dynamo_first=IMPORT_DYNAMO_FIRST)
    params.update(kw)
    res = run(**params)
    assert res["hangs"] == 0, show(res)
    assert res["mismatches"] == 0, show(res)
    assert res["recompile_limit_breaks"] == 0, show(res)
    # Healthy functions: every call correct, every one compiled, one compile per guard set.
    healthy = {k: v for k, v in res["errors_by_fn"].items() if k != "victim"}
    assert not healthy, f"errors outside the victim:\n{show(res)}"
    for name, n in res["calls_by_fn"].items():
        assert n > 0, name
    assert set(res["calls_by_fn"]) >= {"victim"}, f"the victim never succeeded after the fault:\n{show(res)}"
    assert res["uncompiled_frames"] == res["victim_faults"], show(res)
    return res


def test_fault_backend_raises_on_kth_compile() -> None:
    res = run_fault("raise_kth", fault_k=2)
    assert res["victim_faults"] == 1, show(res)
    assert res["errors"] == 1 and res["errors_by_fn"] == {"victim": 1}, show(res)
    assert harness.INJECTED in res["error_msgs"][0] and "BackendCompilerFailed" in res["error_msgs"][0], show(res)
    assert res["dead_threads"] == [], show(res)


def test_fault_keyboard_interrupt_in_compile() -> None:
    res = run_fault("keyboard_interrupt")
    assert res["victim_faults"] == 1, show(res)
    assert res["errors"] == 1 and res["error_types"] == {"KeyboardInterrupt": 1}, show(res)
    assert res["dead_threads"] == [], show(res)


def test_fault_thread_dies_mid_compile() -> None:
    res = run_fault("system_exit")
    assert res["victim_faults"] == 1, show(res)
    assert len(res["dead_threads"]) == 1 and harness.INJECTED in res["dead_threads"][0], show(res)
    assert res["errors"] == 0, show(res)


def test_fault_slow_compile() -> None:
    """The victim's backend sleeps 2 s per compile; compile_lock is global, so others may wait, but none
    may fail, hang or compile the victim again."""
    res = run_fault("slow_compile", slow_s=2.0, duration=14)
    assert res["errors"] == 0, show(res)
    assert res["victim_max_call_s"] >= 2.0, show(res)
    assert res["victim_backend_calls"] == res["victim_guard_sets"], f"victim compiled more than once per guard set:\n{show(res)}"
