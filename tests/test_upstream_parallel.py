"""PyTorch's own tests with every test body in 4 threads at once (pytest-run-parallel): no crash with the
package active, and no test that fails only with the package active.

A subset of ``bench/upstream_tests.py --parallel-threads 4`` (docs/upstream-tests.md, "PyTorch's tests, N
threads at once"), sized for CI: the project's own upstream files, plus the small thread-related files of
``../shared/pytorch-tests/test`` when that folder exists. The crashes the full files found without the
package are reproduced, without pytest, by ``tests/test_crash_hazards.py`` (H8, H9).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest

from test_upstream_subset import OWN_FILES, SHARED, _bench_module, _run_script

# fx/test_fx_split.py: one of the files added to the shared corpus later (2 of its 3 tests fail at 4 threads
# unpatched, none active: docs/upstream-tests.md, the union plan).
SHARED_FILES = ["fx/test_fx_traceback_tls.py", "dynamo/test_skip_guard_eval_unsafe.py", "fx/test_fx_split.py"]
THREADS = 4
FILE_TIMEOUT_S = 240


@pytest.mark.slow
def test_upstream_parallel_subset_active_no_crash_no_active_only_failure(tmp_path: Path) -> None:
    missing = [m for m in ("pytest_timeout", "expecttest", "pytest_run_parallel") if importlib.util.find_spec(m) is None]
    assert not missing, f"upstream tests need {missing}: pip install -e '.[test]'"

    files = list(OWN_FILES)
    base = ["--parallel-threads", str(THREADS), "--timeout", str(FILE_TIMEOUT_S)]
    if SHARED.is_dir():
        base += ["--tests-dir", str(SHARED)]
        files += [f for f in SHARED_FILES if (SHARED / f).is_file()]
    else:
        base += ["--no-shared"]

    def command(json_name: str, which: list[str], rerun: int = 0) -> list[str]:
        return [*base, "--rerun", str(rerun), "--json", str(tmp_path / json_name),
                *(a for f in which for a in ("--files", f))]

    p = _run_script(command("r.json", files))
    report = p.stdout + "\n" + p.stderr[-3000:]
    assert (tmp_path / "r.json").is_file(), f"no results (exit {p.returncode}):\n{report}"
    data = json.loads((tmp_path / "r.json").read_text())
    act = data["probes"]["active"]
    assert act.get("imported") and not act.get("inactive_reason"), f"the package is not active: {act}"

    assert {r["file"] for r in data["files"]} == set(files), report
    for r in data["files"]:
        run = r["runs"]["active"]
        assert not run["crashed"], f"{r['file']} [active] did not complete: {run['crashed']}"
        assert run["statuses"], f"{r['file']}: no result active"
    # fx/test_fx_traceback_tls.py's 2 tests fail in 4 threads in both modes (process-global node-meta state
    # in 2.13; one fails single-threaded too): the subset as a whole must pass something.
    passed = sum(1 for r in data["files"] for s in r["runs"]["active"]["statuses"].values() if s == "passed")
    assert passed > 0, f"nothing passed active:\n{report}"
    active_only = {nid: r["runs"]["active"]["messages"].get(nid, "") for r in data["files"] for nid in r["active_only"]}
    if active_only:
        # Tests that race with themselves in N threads fail now in one mode, now in the other (mock.patch of a
        # module attribute; test_recompiles.py's automatic-dynamic tests, whose threads share one code
        # location's state: "Expected 2 but got 1" in either mode, twice in a row active once). Only a failure
        # that is active-only again in a second run of its files, and then alone (the bench's --rerun, each
        # test in a fresh interpreter per mode) fails active and passes with TTC_DISABLE=1, counts: the rule
        # of test_upstream_subset.py's concurrent stage.
        p2 = _run_script(command("again.json", sorted({r["file"] for r in data["files"] if r["active_only"]}), 8))
        report += "\n--- second run ---\n" + p2.stdout + "\n" + p2.stderr[-2000:]
        second = json.loads((tmp_path / "again.json").read_text())
        # The second run's "held": active-only in it and kept by the bench's rule after the run alone.
        held = set(second["held"])
        alone = {nid: a for r in second["files"] for nid, a in r.get("rerun", {}).items()}
        active_only = {nid: f"{msg} (alone: {alone.get(nid)})" for nid, msg in active_only.items() if nid in held}
    listed = [f"{nid}: {msg}" for nid, msg in active_only.items()]
    assert not listed, "tests failing only with the package active, twice:\n" + "\n".join(listed) + "\n\n" + report


def test_thread_plan_sees_listed_classes_imported_by_name() -> None:
    """The bench's thread plan runs in one thread a test whose own code uses a listed object through a bare
    global name, classes included (pytest-run-parallel 0.10 resolves bare names of functions only: a test's
    ``with profile(...)`` ran in 4 threads and died in the profiler), and is not fooled by an attribute of
    the same name (``config.patch`` is not ``unittest.mock.patch``)."""
    import unittest.mock

    plan = _bench_module("pytest_plugins", "ttc_parallel_plan")

    class Profile:  # stands in for torch.profiler.profile (a class)
        def __enter__(self) -> "Profile":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

    listed_mod = types.ModuleType("listed_for_test")
    listed_mod.profile = Profile  # type: ignore[attr-defined]
    sys.modules["listed_for_test"] = listed_mod
    listed = frozenset({("listed_for_test", "profile"), ("unittest.mock", "patch")})
    glb = {"profile": Profile, "patch": unittest.mock.patch, "config": types.SimpleNamespace(patch=lambda *a: None)}
    src = (
        "def uses_class():\n    with profile():\n        pass\n"
        "def nested():\n    def inner():\n        return patch.object\n    return inner\n"
        "def attribute_only():\n    config.patch('x')\n"
    )
    try:
        exec(compile(src, "<test>", "exec"), glb)  # noqa: S102 - the functions' globals are the point
        assert plan._listed_object_used(glb["uses_class"], listed) == "listed_for_test.profile"
        assert plan._listed_object_used(glb["nested"], listed) == "unittest.mock.patch"
        assert plan._listed_object_used(glb["attribute_only"], listed) is None
    finally:
        del sys.modules["listed_for_test"]


def test_a_failure_counts_against_the_package_only_if_alone_it_fails_active_and_passes_unpatched() -> None:
    """The one rule both CI subsets apply to an active-only failure after its run alone (the bench's ``--rerun``)."""
    held = _bench_module(".", "upstream_tests").still_active_only
    assert held(None)  # not re-run: nothing clears it
    assert held({"active": "failed", "disabled": "passed"})
    assert held({"active": "error", "disabled": "passed"})
    assert not held({"active": "passed", "disabled": "passed"})  # passes alone: its file's schedule
    assert not held({"active": "failed", "disabled": "failed"})  # fails alone in both modes
    assert held({"active": "crashed", "disabled": "passed"})  # a crash alone is the package's
    assert held({"active": "not run", "disabled": "passed"})


def test_the_report_and_exit_status_hold_at_n_threads_only_what_the_rule_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """At N threads the bench's report and exit status count the failures the rule keeps; in one thread every
    active-only failure (do no harm is exact there)."""
    ub = _bench_module(".", "upstream_tests")
    runs = {m: ub.Run(m, 1, 1.0) for m in ub.MODES}
    r = ub.FileResult("f.py", "s", runs, active_only=["f.py::a", "f.py::b", "f.py::c"],
                      rerun={"f.py::a": {"active": "failed", "disabled": "passed"},
                             "f.py::b": {"active": "passed", "disabled": "passed"}})
    monkeypatch.setattr(ub, "PARALLEL_THREADS", 4)
    assert ub.held_against_the_package([r]) == ["f.py::a", "f.py::c"]  # c was not re-run: nothing clears it
    lines = ub._failure_lines([r], md=False)
    assert [x.endswith("held against the package") for x in lines] == [True, False, True], lines
    assert "held against the package after the run alone: 2" in ub._failures_heading([r], md=False)
    assert ub.to_json([r], {})["held"] == ["f.py::a", "f.py::c"]  # what the CI subsets read
    monkeypatch.setattr(ub, "PARALLEL_THREADS", 1)
    assert ub.held_against_the_package([r]) == ["f.py::a", "f.py::b", "f.py::c"]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="the CPU reading needs Linux /proc")
def test_stall_detector_tells_a_computing_child_from_a_blocked_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A silent child that computes is left to run until --busy-stall-s; one whose threads all wait is a hang
    at --stall-s (test_aot_autograd's 4 serial compiles in one test ran 3 minutes without output and were
    counted as a hang before)."""
    ub = _bench_module(".", "upstream_tests")
    monkeypatch.setattr(ub, "_POLL_S", 0.5)
    # A waiting child uses no CPU at all; a spinning one gets far more than 5 % of a core even when the tests
    # beside this one keep both cores busy (the bench's own 25 % assumes a machine running only the bench).
    monkeypatch.setattr(ub, "BUSY_SHARE", 0.05)
    say = "import sys, time, threading; print('started', flush=True); "
    spin = "t = time.monotonic()\nwhile time.monotonic() - t < {s}: pass\nprint('done', flush=True)"

    rc, text, _, timed_out, hang = ub._run([sys.executable, "-c", say + "\n" + spin.format(s=9)], tmp_path,
                                           dict(os.environ), timeout=120, stall_s=3, busy_stall_s=60)
    assert (rc, timed_out, hang) == (0, False, ""), text
    assert "done" in text and "computing, not blocked" in text, text

    t0 = time.monotonic()
    rc, text, _, timed_out, hang = ub._run([sys.executable, "-c", say + "threading.Event().wait(120)"],
                                           tmp_path, dict(os.environ), timeout=120, stall_s=3, busy_stall_s=60)
    assert hang == "blocked" and not timed_out, text
    assert "its threads all wait" in text and time.monotonic() - t0 < 100, text

    rc, text, _, timed_out, hang = ub._run([sys.executable, "-c", say + "\n" + spin.format(s=120)], tmp_path,
                                           dict(os.environ), timeout=120, stall_s=3, busy_stall_s=8)
    assert hang == "busy" and not timed_out and "still computing" in text, text


def test_a_test_that_sets_the_default_dtype_runs_in_one_thread() -> None:
    """torch's default dtype is process-global: a test that sets and restores it in N threads at once can
    leave float64 set for the next test (torch 2.15's ``test_skip_size_stride_guards_on_static_tensors``
    failed so, in one mode or the other at random). The race is the test's own, shown here with
    ``TTC_DISABLE=1`` (no package) in the leaking order, forced step by step (a random schedule's rate depends
    on the machine's load); the bench's thread plan runs such a test in one thread in both modes."""
    from ttc_testing import crash_scenarios

    off = crash_scenarios.run(
        "default_dtype_restore_race", env={**os.environ, "TTC_DISABLE": "1"}, rounds=20, ordered=1
    )
    assert off.get("leaked") == 20 and off["victim_float64"] == 20 and off["errors"] == 0, off

    import torch
    import torch.testing._internal.common_utils as cu

    ub = _bench_module(".", "upstream_tests")
    plan = _bench_module("pytest_plugins", "ttc_parallel_plan")
    listed = frozenset(tuple(name.rsplit(".", 1)) for name, _ in ub.THREAD_UNSAFE)
    glb = {"set_default_dtype": cu.set_default_dtype, "torch": torch}
    exec(compile("def body():\n    with set_default_dtype(torch.double):\n        pass\n", "<test>", "exec"), glb)
    assert plan._listed_object_used(glb["body"], listed) == "torch.testing._internal.common_utils.set_default_dtype"


def test_a_test_that_installs_the_guard_manager_hook_runs_in_one_thread() -> None:
    """PyTorch's ``test/dynamo/utils.py install_guard_manager_testing_hook`` puts a test's hook in the
    process-global ``torch._dynamo.guards.guard_manager_testing_hook_fn``, which every thread's compile calls,
    and restores the hook it saw: in N threads a thread's hook is called for another thread's compile, and the
    last thread to restore leaves another's hook installed (torch 2.13's ``test_diff_guard_manager`` failed at
    2 threads, in either mode at random). Shown with ``TTC_DISABLE=1`` (no package); the tests import the helper
    inside their body, where no judge resolves it, so the bench's plan matches the import by name."""
    from ttc_testing import crash_scenarios

    off = crash_scenarios.run("guard_hook_race", env={**os.environ, "TTC_DISABLE": "1"}, rounds=20)
    assert off.get("foreign_hook_calls", 0) > 0 and off["hook_left_installed"] > 0, off

    verdicts = _import_verdicts(
        "def body(self):\n"
        "    try:\n        from .utils import install_guard_manager_testing_hook\n"
        "    except ImportError:\n        from utils import install_guard_manager_testing_hook\n"
        "    with install_guard_manager_testing_hook(None):\n        pass\n"
        "def other(self):\n    from .utils import make_dynamo_test\n    return make_dynamo_test\n"
    )
    assert verdicts == {"body": "utils.install_guard_manager_testing_hook", "other": None}
    # The environment the bench gives its children carries the entries to the plugin.
    env = _bench_module(".", "upstream_tests").plan_env({}, Path("plan.json"), "write")
    assert "utils.install_guard_manager_testing_hook" in env["BENCH_THREAD_UNSAFE_IMPORTS"].split(",")


def test_a_test_that_sets_the_default_device_runs_in_one_thread() -> None:
    """``torch.set_default_device`` keeps its context per thread, but the device dynamo's ``DEFAULT_DEVICE``
    guard reads is the module global ``torch.utils._device.CURRENT_DEVICE``: in N threads one thread's reset
    ends another's device before its guard check (torch 2.13's ``test_default_device_guard`` failed at 2
    threads, in either mode at random). Shown with ``TTC_DISABLE=1`` in the failing order, forced step by step
    (the random schedule showed it in 0 of 200 rounds once on a loaded machine); the bench's plan lists it."""
    from ttc_testing import crash_scenarios

    off = crash_scenarios.run(
        "default_device_restore_race", env={**os.environ, "TTC_DISABLE": "1"}, rounds=20, ordered=1
    )
    assert off.get("wrong_checks") == 20 and off["left_set"] == 20 and off["errors"] == 0, off
    ub = _bench_module(".", "upstream_tests")
    assert "torch.set_default_device" in {name for name, _ in ub.THREAD_UNSAFE}


def test_a_test_under_a_mock_patch_decorator_runs_in_one_thread() -> None:
    """A ``mock.patch`` decorator is one patcher object for every call: in N threads one thread's exit
    deletes the state another thread's exit needs, and an exit that raises between its ``delattr`` and its
    ``setattr`` on a ``ConfigModule`` hides the key from the whole process (torch 2.13's
    ``test_misc.py::test_foreach_tensor_scalar`` at 4 threads; 230 later tests failed, in one mode or the other
    at random). Shown with ``TTC_DISABLE=1`` in the failing order (B's exit raises every round); the plan
    plugin finds the decorator, which pytest-run-parallel's reading of the test's code does not see."""
    import functools
    from unittest.mock import patch

    from ttc_testing import crash_scenarios

    off = crash_scenarios.run(
        "mock_decorator_shared_patcher", env={**os.environ, "TTC_DISABLE": "1"}, rounds=20, ordered=1
    )
    assert off.get("errors") == 20, off
    assert all("'_patch' object has no attribute" in k for k in off["error_kinds"]), off

    plan = _bench_module("pytest_plugins", "ttc_parallel_plan")

    class Holder:
        value = 1

    @patch.object(Holder, "value", 2)
    def decorated() -> None:
        pass

    @functools.wraps(decorated)  # as torch's TestCase wraps each test method
    def wrapper() -> None:
        decorated()

    def plain() -> None:
        with patch.object(Holder, "value", 2):
            pass

    assert plan._mock_decorated(decorated) == "mock.patch"
    assert plan._mock_decorated(wrapper) == "mock.patch"
    assert plan._mock_decorated(plain) is None  # found by pytest-run-parallel itself (mock.patch in the code)


def test_a_test_that_loads_or_resets_precompile_entries_runs_in_one_thread() -> None:
    """``test_misc.py::test_fail_on_recompile_error_message`` loads and resets the precompile entries of its
    nested function's code object, which the N threads share: one thread's reset frees the entry another
    thread's frame evaluation reads (``SIGSEGV`` in both modes; ``ttc_testing.crash_scenarios
    precompile_entries_shared_code``). The tests import both functions inside their body."""
    load = "torch._C._dynamo.eval_frame._load_precompile_entry"
    assert _import_verdicts(
        "def both(self):\n    from torch._C._dynamo.eval_frame import (\n        _load_precompile_entry,\n"
        "        _reset_precompile_entries,\n    )\n"
        "def load_only(self):\n    from torch._C._dynamo.eval_frame import _load_precompile_entry\n"
        "def neither(self):\n    from torch._C._dynamo.eval_frame import set_eval_frame\n"
    ) == {"both": load, "load_only": load, "neither": None}


def _import_verdicts(src: str) -> dict[str, str | None]:
    """The plan plugin's verdict on each function ``src`` defines, with the bench's ``THREAD_UNSAFE_IMPORTED``
    (the functions are compiled, never called)."""
    ub = _bench_module(".", "upstream_tests")
    plan = _bench_module("pytest_plugins", "ttc_parallel_plan")
    imported = frozenset(tuple(name.rsplit(".", 1)) for name, _ in ub.THREAD_UNSAFE_IMPORTED)
    glb: dict[str, object] = {}
    exec(compile(src, "<test>", "exec"), glb)  # only defines the functions
    return {k: plan._listed_object_used(v, frozenset(), imported) for k, v in glb.items() if k != "__builtins__"}
