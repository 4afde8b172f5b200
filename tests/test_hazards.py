"""Each hazard, unpatched vs active, in fresh interpreters (scenarios in ttc_testing/scenarios/).

A hazard test proves something only if the hazard shows with ``TTC_DISABLE=1``: each test asserts both
sides. Where a hazard does not exist on the installed torch, the test skips and says why.
Hazard ids are those of docs/hazards.md; the patch for each is named in the test's docstring.
"""

from __future__ import annotations

import os
import sysconfig

import pytest
from packaging.version import Version

from conftest import torch_version
from ttc_testing import scenarios

TV = torch_version()
# Free-threaded CPython with the GIL off: unpatched torch crashes in many of these scenarios (dynamo's C state
# is unsynchronized without the GIL; docs/hazards.md), and a crash is the hazard showing there.
NO_GIL = bool(sysconfig.get_config_var("Py_GIL_DISABLED")) and os.environ.get("PYTHON_GIL") == "0"
OFF = {"TTC_DISABLE": "1"}
ON = {"TTC_DISABLE": "0"}


def _run_unpatched(name: str, unpatched_may_crash: bool, **kwargs: object) -> dict:
    """One unpatched run of ``name``; a crash or hang that counts (see :func:`unpatched`) becomes
    ``{"crashed": signal or "hung"}``."""
    # GIL off, unpatched dynamo can also spin forever (fx_flag_leak: two threads at 200 % CPU for minutes):
    # there a hang of the unpatched side counts as the hazard showing, after a shorter wait.
    off = scenarios.run(name, env=OFF, **({"timeout": 120} if NO_GIL else {}), **kwargs)
    if (unpatched_may_crash or NO_GIL) and off.get("rc", 0) < 0:
        off = {"crashed": -off["rc"]}
    if NO_GIL and off.get("timeout"):
        off = {"crashed": "hung"}
    assert "timeout" not in off and "rc" not in off, f"{name} unpatched: {off}"
    return off


def unpatched(name: str, unpatched_may_crash: bool = False, **kwargs):  # noqa: ANN201
    """Run ``name`` unpatched (``TTC_DISABLE=1``). With ``unpatched_may_crash``, a crash (a signal, as on
    torch's CUDA builds without a GPU: H3, ``cuda_device_guard``) counts as the hazard showing; it is
    returned as ``{"crashed": signal}``. GIL off, unpatched torch may crash or hang in any scenario: a test
    that did not ask for that needs the unpatched run's numbers, so the run is repeated, up to 3 in all, and
    ``{"crashed": ...}`` comes back only if none completed (:func:`pair` then skips)."""
    off = _run_unpatched(name, unpatched_may_crash, **kwargs)
    for _ in range(2 if NO_GIL and not unpatched_may_crash else 0):
        if "crashed" not in off:
            break
        off = _run_unpatched(name, unpatched_may_crash, **kwargs)
    return off


def pair(name: str, unpatched_may_crash: bool = False, **kwargs):  # noqa: ANN201
    """Run ``name`` unpatched (see :func:`unpatched`) and active. The active run must always complete. A test
    that needs the unpatched run's numbers is skipped (after the active run was checked to complete) when,
    GIL off, unpatched torch crashed or hung in all 3 runs: there is nothing to compare."""
    off = unpatched(name, unpatched_may_crash, **kwargs)
    on = scenarios.run(name, env=ON, **kwargs)
    assert "timeout" not in on and "rc" not in on, f"{name} active: {on}"
    if "crashed" in off and not unpatched_may_crash:
        pytest.skip(f"{name}: unpatched torch crashed or hung GIL off in 3 runs ({off}); the active run completed")
    return off, on


def unpatched_until_shown(off: dict, name: str, shown, what: str, crash_shows: bool = False,  # noqa: ANN001
                          **kwargs: object) -> dict:
    """For hazards that need a timing: run the unpatched side of ``name`` again, up to 3 runs in all, until
    ``shown(result)``; skip (nothing to compare) if it never shows. Returns the run that showed it. A run that
    crashed or hung (``{"crashed": ...}``, see :func:`unpatched`) shows the hazard only with ``crash_shows``;
    otherwise it measured nothing and counts as a run that did not show it (``shown`` sees completed runs
    only)."""
    def seen(r: dict) -> bool:
        return crash_shows if "crashed" in r else bool(shown(r))

    for _ in range(2):
        if seen(off):
            return off
        off = _run_unpatched(name, crash_shows, **kwargs)
    if not seen(off):
        pytest.skip(f"{what} unpatched in 3 runs: {off}")
    return off


# -- H1: fx_tracing_flag ---------------------------------------------------------------------------
h1_exists = pytest.mark.skipif(TV >= Version("2.14"), reason="H1 fixed upstream in torch 2.14 (thread-local FX flag)")


@h1_exists
def test_h1_fx_flag_is_per_thread() -> None:
    """patch fx_tracing_flag: another thread's FX trace is invisible to is_fx_tracing()."""
    off, on = pair("fx_flag_poll", seconds=1.5)
    assert off["true_in_other_thread"] > 0
    assert on["true_in_other_thread"] == 0 and on["polls"] > 1000


@h1_exists
@pytest.mark.skipif(Version("2.13") <= TV, reason="on torch 2.13 the false error is masked by H2 (is_fx_symbolic_tracing "
                    "ANDs the FX flag with the process-global is_compiling()); test_h1_fx_flag_is_per_thread covers 2.13")
@pytest.mark.parametrize("late", [0, 1], ids=["activated-at-start", "install-after-compile"])
def test_h1_no_false_nested_trace_errors(late: int) -> None:
    """patch fx_tracing_flag: callers of a warm compiled fn get no 'symbolically trace a dynamo-optimized
    function' errors while another thread compiles with backward; also for fns compiled before install()."""
    off, on = pair("fx_flag_leak", compiles=3, late=late)
    if "crashed" not in off:  # GIL off: an unpatched crash is the hazard showing (pair)
        assert off["errors"] > 0 and "dynamo-optimized" in off["kinds"][0]
    assert on["errors"] == 0 and on["ok_calls"] > 0


def test_h1_same_thread_nesting_still_raises_and_tracing_works() -> None:
    """patch fx_tracing_flag keeps upstream behaviour in one thread: nested FX trace of a compiled fn raises;
    symbolic_trace, make_fx and export work."""
    off, on = pair("fx_same_thread")
    for res in (off, on):
        assert res["nested_raised"] is True
        assert res["symbolic_trace_ok"] is True and res["make_fx_ok"] is True
    assert on["export_ok"] == off["export_ok"]


# -- H2: compile_session_flag ----------------------------------------------------------------------
@pytest.mark.skipif(TV < Version("2.13"), reason="H2 needs torch >= 2.13 (compile sessions set the global flag)")
def test_h2_is_compiling_only_in_the_compiling_thread() -> None:
    """patch compile_session_flag."""
    off, on = pair("is_compiling_leak", seconds=1.5)
    assert off["true_in_eager_thread"] > 0
    assert on["true_in_eager_thread"] == 0 and on["polls"] > 1000
    assert on["compiling_thread_saw_true"] is True and off["compiling_thread_saw_true"] is True


# -- H6: config_overrides ----------------------------------------------------------------------------
@pytest.mark.skipif(TV < Version("2.12"), reason="H6 needs torch >= 2.12 (ContextVar config overrides)")
def test_h6_assignments_reach_every_thread_patches_stay_local() -> None:
    """patch config_overrides."""
    off, on = pair("config_threads")
    assert off["new_thread_sees"] == off["default"] != 64  # the hazard
    assert off["backward_compile_sees"] == off["default"]
    assert on["new_thread_sees"] == 64 and on["backward_compile_sees"] == 64
    assert on["other_thread_during_patch_sees"] == 64  # thread A's config.patch is invisible to B
    assert on["main_during_patch_sees"] == 64


@pytest.mark.skipif(TV < Version("2.12"), reason="H6 needs torch >= 2.12 (ContextVar config overrides)")
def test_h6_patches_stay_in_their_thread_and_follow_the_main_thread_after() -> None:
    """patch config_overrides: no other thread's assignment reaches into a config.patch; after the patch the
    thread follows the main thread's value (not a stale copy); aliases assigned in the main thread reach new
    threads; a child thread's assignment does not change the main thread's get_hash() (upstream's rule)."""
    off, on = pair("config_patch_isolation", seconds=1.5)
    assert off["after_patch_sees"] != off["main_value"] == 64  # the hazard: the main thread's value is not seen
    assert on["foreign_reads"] == 0 and on["reads"] > 1000
    assert on["after_patch_sees"] == on["main_value"] == 64
    assert on["alias_seen_by_new_thread"] in (40, None) and off["main_hash_unchanged_by_child"] and on["main_hash_unchanged_by_child"]


@pytest.mark.skipif(TV < Version("2.12"), reason="H6 needs torch >= 2.12 (ContextVar config overrides)")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_h6_in_a_child_forked_from_a_worker_thread() -> None:
    """patch config_overrides: in a child forked by a worker thread, that thread still reads the parent
    program's configuration, and, being the child's main thread, its own assignment reaches the threads the
    child starts."""
    off, on = pair("config_after_fork_from_thread")
    assert off["child_exit"] == 0 and off["default"] not in (32, 64)
    assert off["child_main_sees"] == off["default"] and off["child_thread_sees"] == off["default"]  # the hazard
    assert on["child_exit"] == 0 and on["child_main_sees"] == 64 and on["child_thread_sees"] == 32


@pytest.mark.skipif(TV >= Version("2.12"), reason="H5 (dynamic flags) fixed upstream in torch 2.12 (config patches are per-thread)")
def test_h5_dynamic_flags_stay_in_the_calling_thread() -> None:
    """patch dynamic_flags: calls of a dynamic=True function do not change the shape flags other threads see."""
    off, on = pair("dynamic_flag_poll", seconds=2)
    assert off["flipped"] > 0
    assert on["flipped"] == 0 and on["polls"] > 1000 and on["calls"] > 100 and on["after"] == on["default"]


# -- H3: first_compile ---------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [8, 10])
def test_h3_one_compile_per_stampede(threads: int) -> None:
    """patch first_compile: N simultaneous first calls -> 1 compile; a new-shape stampede -> 1 more."""
    off, on = pair("stampede", unpatched_may_crash=True, threads=threads, shapes=2)
    if "crashed" not in off:
        # Upstream compiles ~once per thread and then hits the recompile limit: calls ran eager. How many
        # threads overlap is timing (one run with the GIL off compiled fewer and ran none eager): up to 3 runs.
        off = unpatched_until_shown(off, "stampede", lambda r: r.get("uncompiled_frames", 0) > 0,
                                    "no call ran uncompiled", crash_shows=True, threads=threads, shapes=2)
        if "graphs_after_each_stampede" in off:
            assert off["graphs_after_each_stampede"][0] >= min(threads, 8) - 1
    assert on["graphs_after_each_stampede"] == [1, 2]
    assert on["uncompiled_frames"] == 0 and on["errors"] == 0 and on["wrong_results"] == 0


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_h3_modules_compile_once(how: str) -> None:
    """patch first_compile: torch.compile(module) and module.compile(), 8 simultaneous first calls -> 1 compile."""
    off, on = pair("module_stampede", unpatched_may_crash=True, threads=8, how=how)
    assert "crashed" in off or off["graphs"] > 1
    assert on["graphs"] == 1 and on["errors"] == 0 and on["uncompiled_frames"] == 0


def test_h3_one_compile_per_guard_set() -> None:
    """patch first_compile: threads needing two guard sets (float32/float64) -> 2 compiles."""
    off, on = pair("guard_sets", unpatched_may_crash=True, threads=6)
    assert "crashed" in off or off["graphs"] > 2
    assert on["graphs"] == 2 and on["errors"] == 0


def test_h3_deviation_guard_fail_fn_of_a_served_thread_follows_the_sequential_rule() -> None:
    """patch first_compile, its deliberate deviation (docs/upstream-tests.md, "Deliberate deviations"): N
    threads wrap one function with their own ``guard_fail_fn`` and make the same first call at once.
    Unpatched, every thread compiles an entry of its own, so every thread's ``guard_fail_fn`` sees the later
    guard failure. Active, one thread compiles and the others are served by that entry, so only its
    ``guard_fail_fn`` is called: exactly what upstream does when the same calls do not overlap (the rule the
    package follows; ``test_misc.py``'s ``test_guard_failure_fn`` fails in N threads because of it)."""
    sequential = scenarios.run("guard_fail_fn_threads", env=OFF, threads=4, concurrent=0)
    off, on = pair("guard_fail_fn_threads", unpatched_may_crash=True, threads=4, concurrent=1)
    assert sequential["errors"] == 0 and sequential["called"] == 1, sequential
    assert on["errors"] == 0, on
    assert (on["compiles"], on["called"]) == (sequential["compiles"], sequential["called"]), (on, sequential)
    # Unpatched, the threads' first calls must overlap for each to compile its own entry, and then more than
    # one guard_fail_fn sees the guard failure (GIL off, once: 5 compiles and still 1 called, so both are
    # asked of the same run, up to 3 runs).
    off = unpatched_until_shown(off, "guard_fail_fn_threads",
                                lambda r: r["compiles"] > sequential["compiles"] and r["called"] > 1,
                                "the threads' first calls did not overlap", crash_shows=True, threads=4, concurrent=1)
    assert "crashed" in off or off["called"] > 1, off


@pytest.mark.parametrize(
    "graph_break,closure", [(0, 0), (1, 0), (1, 1)], ids=["plain", "graph-break", "graph-break-closure"]
)
def test_h3_no_recompile_after_warmup(graph_break: int, closure: int) -> None:
    """patch first_compile: after every guard set is compiled, 16 threads calling with those inputs compile
    nothing more. Upstream, dynamo's lookup misses entries that other threads move to the front of the
    entry list, recompiles, and past the recompile limit runs calls uncompiled."""
    off, on = pair("lookup_race", unpatched_may_crash=True, threads=16, seconds=6, graph_break=graph_break, closure=closure)
    if "crashed" not in off:
        assert off["extra_graphs"] > 0 or off["uncompiled_frames"] > 0
    assert on["extra_graphs"] == 0 and on["uncompiled_frames"] == 0
    assert on["errors"] == 0 and on["wrong_results"] == 0 and on["calls"] > 100


# -- H7: fx_patcher ------------------------------------------------------------------------------------
@pytest.mark.skipif(TV < Version("2.6"), reason="torch < 2.6 has no _new_patcher: fx_patcher skips itself there (docs/compat.md)")
def test_h7_fx_symbolic_trace_patches_only_its_own_thread() -> None:
    """patch fx_patcher: two threads FX-trace while a third runs the same kind of module eagerly."""
    off, on = pair("fx_patcher_leak", seconds=2.5, tracers=2)
    assert off["errors"] > 0  # e.g. NameError: module is not installed as a submodule
    assert on["errors"] == 0 and on["wrong"] == 0
    assert on["traces"] > 10 and on["eager_calls"] > 100


# -- H7: export_flag, export_lock ------------------------------------------------------------------------
@pytest.mark.skipif(TV < Version("2.9"), reason="torch < 2.9 has no torch.compiler._is_exporting_flag")
def test_h7_is_exporting_only_in_the_exporting_thread() -> None:
    """patch export_flag: while a thread exports, another thread's is_exporting() is False and its
    torch.compile(fn) compiles (upstream returns fn itself)."""
    off, on = pair("export_flag_poll", seconds=3, handshakes=5)
    assert off["true"] > 0 and off["raw_returned"] > 0, off
    # answered: the poller polled while the exporter stood inside forward (flag set): the overlap happened
    assert on["answered"] == 5, on
    assert on["true"] == 0 and on["raw_returned"] == 0 and on["polls"] > 1000 and on["exports"] > 0


def test_h7_exports_from_two_threads_take_turns() -> None:
    """patch export_serial: two threads export in a loop; each export's module hierarchy and flags live in
    module globals that the other one clears (unpatched: most exports fail)."""
    # Active, each thread exports at least 3 times (a count, not a rate: the 5 s window may be extended,
    # up to 90 s, on a loaded machine); they take turns, so both get there.
    # Unpatched, most exports fail: that side runs the 5 s only.
    off = unpatched("concurrent_exports", unpatched_may_crash=True, seconds=5, threads=2)
    on = scenarios.run("concurrent_exports", env=ON, seconds=5, threads=2, min_each=3)
    assert "timeout" not in on and "rc" not in on, on
    assert "crashed" in off or off["errors"] > 0
    assert on["errors"] == 0 and on["wrong"] == 0, on["first_error"]
    assert min(on["per_thread"]) >= 3, on


def test_h7_compiles_do_not_roll_back_other_threads_random_numbers() -> None:
    """patch rng_rollback: dynamo sets the generators back after each compile; numbers another thread drew
    during the compile came out again (unpatched: repeats)."""
    off, on = pair("compile_rng_rollback", compiles=6)
    # Timing: the drawer must draw during a compile (once, GIL off: 0 repeats in 2.8 M draws).
    unpatched_until_shown(off, "compile_rng_rollback", lambda r: r["repeats"] > 0, "the rollback did not show",
                          compiles=6)
    assert on["repeats"] == 0 and on["draws"] > 100, on


def test_h7_compiles_do_not_roll_back_other_threads_python_random_numbers() -> None:
    """patch rng_rollback: dynamo also sets Python's ``random`` back after each compile; another thread's
    ``random.random()`` draws during the compile came out again (unpatched: repeats). From torch 2.12 that
    restore happens in torch's C++ frame evaluation, which the package does not reach: skipped there."""
    off, on = pair("compile_rng_rollback", compiles=6, source="python")
    if not on["restored_in_python"]:
        pytest.skip(f"torch {TV}: Python's random state is set back in torch's C++ (not covered; docs/hazards.md H7)")
    off = unpatched_until_shown(off, "compile_rng_rollback", lambda r: r["repeats"] > 0, "the rollback did not show",
                                compiles=6, source="python")
    assert on["repeats"] == 0 and on["draws"] > 100, on


def test_h7_first_calls_of_a_shared_lazy_graph_module_generate_working_code() -> None:
    """patch lazy_recompile: 8 threads' first calls of one _LazyGraphModule generate its code from the shared
    graph at once; FX swaps the graph's node naming functions meanwhile (unpatched: broken code)."""
    off, on = pair("lazy_recompile_race", rounds=40, threads=8)
    assert off["errors"] + off["wrong"] > 0, off
    assert on["errors"] == 0 and on["wrong"] == 0 and on["calls"] == 320, on


def test_h7_export_does_not_break_other_threads_compiles() -> None:
    """patch export_lock: compiles in other threads while one thread exports in a loop all succeed."""
    off, on = pair("export_vs_compile", unpatched_may_crash=True, seconds=8, compilers=3)
    assert "crashed" in off or off["compile_errors"] + off["export_errors"] > 0
    assert on["compile_errors"] == 0 and on["export_errors"] == 0, on["first_error"]
    assert on["compiles"] > 0 and on["exports"] > 0
