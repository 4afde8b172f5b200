"""What is measured: one row per hazard scenario of ``ttc_testing/scenarios/`` (and of
``ttc_testing/crash_scenarios.py`` for the hazards whose unpatched answer is a crash: ``module``).

Each row names the scenario and its arguments, the patch that addresses it (its hazard id comes from the
patch table), and how to read the scenario's JSON result: ``bad`` (does the result show the hazard?),
``show`` (the number in the cell),
``needs`` (keys a result must have to be read at all) and, optionally, ``control`` (given the unpatched and
the active result, what the package broke, or None). A ``control`` row (``is_control``) is the other way
round: the behaviour must be *kept* when active.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch_threadsafe_compile.registry import SPECS

Result = dict[str, Any]
SCENARIOS = "ttc_testing.scenarios"
CRASH = "ttc_testing.crash_scenarios"


@dataclass(frozen=True)
class Row:
    key: str
    title: str
    scenario: str
    kwargs: dict[str, Any]
    patch: str | None
    bad: Callable[[Result], bool]
    show: Callable[[Result], str]
    needs: tuple[str, ...]
    control: Callable[[Result, Result], str | None] | None = None
    is_control: bool = field(default=False)
    module: str = SCENARIOS

    @property
    def hazard(self) -> str:
        """The hazard id of the patch that addresses it: the patch table's (no copy kept here)."""
        return SPECS[self.patch].hazard if self.patch else ""

    @property
    def invocation(self) -> str:
        """The scenario as run: ``python -m <module> <invocation>`` (the module named when not the default)."""
        args = " ".join([self.scenario] + [f"{k}={v}" for k, v in self.kwargs.items()])
        return args if self.module == SCENARIOS else f"{self.module.rsplit('.', 1)[1]}: {args}"

    @property
    def args(self) -> list[str]:
        return [self.scenario] + [f"{k}={v}" for k, v in self.kwargs.items()]


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else str(x)


def _same_thread_bad(r: Result) -> bool:
    # export may be unavailable on old versions (a string): only a False counts as broken.
    return not (r.get("nested_raised") is True and r.get("symbolic_trace_ok") is True and r.get("make_fx_ok") is True
                and r.get("export_ok") is not False)


def _same_thread_show(r: Result) -> str:
    broken = [k for k in ("nested_raised", "symbolic_trace_ok", "make_fx_ok", "export_ok") if r.get(k) is False]
    text = "ok" if not broken else "broken: " + ", ".join(f"{k}=False" for k in broken)
    if isinstance(r.get("export_ok"), str):
        text += " (export n/a)"
    return text


def _stampede_bad(r: Result) -> bool:
    return r["graphs"] > 2 or r["uncompiled_frames"] > 0 or r["errors"] > 0 or r["wrong_results"] > 0


def _stampede_show(r: Result) -> str:
    s = f"{_n(r['graphs'])} graphs"
    if r["uncompiled_frames"]:
        s += f", {_n(r['uncompiled_frames'])} eager"
    if r["errors"]:
        s += f", {_n(r['errors'])} errors"
    if r["wrong_results"]:
        s += f", {_n(r['wrong_results'])} wrong"
    return s


def _config_bad(r: Result) -> bool:
    return r["new_thread_sees"] != 64 or r["backward_compile_sees"] != 64


def _config_show(r: Result) -> str:
    return f"{r['new_thread_sees']}/{r['backward_compile_sees']}"


def _compiling_bad(r: Result) -> bool:
    return r["true_in_eager_thread"] > 0


def _compiling_show(r: Result) -> str:
    return f"{_n(r['true_in_eager_thread'])} true polls"


def _compiling_control(u: Result, a: Result) -> str | None:
    # Before 2.13 is_compiling() is False inside a backend (only dynamo-traced code sees True): compare, not demand.
    if u["compiling_thread_saw_true"] and not a["compiling_thread_saw_true"]:
        return "the compiling thread's backend no longer sees is_compiling() == True"
    return None


def _errors_show(r: Result) -> str:
    return f"{_n(r['errors'])} errors"


def _calls_errors_show(r: Result) -> str:
    return f"{_n(r['calls'])} calls, {_n(r['errors'])} errors"


def _guard_sets_show(r: Result) -> str:
    return f"{_n(r['graphs'])} graphs" + (f", {_n(r['errors'])} errors" if r["errors"] else "")


def _lookup_race_bad(r: Result) -> bool:
    return r["extra_graphs"] > 0 or r["uncompiled_frames"] > 0 or r["errors"] > 0


def _lookup_race_show(r: Result) -> str:
    return f"{_n(r['extra_graphs'])} extra graphs, {_n(r['uncompiled_frames'])} eager"


def _export_flag_show(r: Result) -> str:
    return f"{_n(r['true'])} true polls, {_n(r['raw_returned'])} raw fns"


def _export_errors_show(r: Result) -> str:
    return f"{_n(r['compile_errors'] + r['export_errors'])} errors"


def _backward_wait_show(r: Result) -> str:
    how = "compiled with the forward" if r["backward_compiled_with_forward"] else "compiled lazily"
    return f"{'blocked' if r['backward_blocked'] else 'finished'} ({how})"


ROWS: list[Row] = [
    Row("fx_flag_leak", "FX tracing flag leaks to other threads", "fx_flag_leak", {}, "fx_tracing_flag",
        lambda r: r["errors"] > 0, _errors_show, ("errors",)),
    Row("fx_flag_leak_late", "same, package installed after the fn was compiled", "fx_flag_leak", {"late": 1},
        "fx_tracing_flag", lambda r: r["errors"] > 0, _errors_show, ("errors",)),
    Row("fx_same_thread", "control: same-thread nested-trace error kept, FX/make_fx/export work",
        "fx_same_thread", {}, "fx_tracing_flag", _same_thread_bad, _same_thread_show, ("nested_raised",),
        is_control=True),
    Row("is_compiling_leak", "is_compiling() True in an eager thread", "is_compiling_leak", {"seconds": 2},
        "compile_session_flag", _compiling_bad, _compiling_show, ("true_in_eager_thread", "compiling_thread_saw_true"),
        _compiling_control),
    Row("config_threads", "main thread sets recompile_limit=64: value seen by a new thread / a backward compile",
        "config_threads", {}, "config_overrides", _config_bad, _config_show,
        ("new_thread_sees", "backward_compile_sees")),
    Row("stampede", "first-call stampede: one compile per thread (2 shapes, expect 2 graphs)", "stampede",
        {"threads": 8}, "first_compile", _stampede_bad, _stampede_show,
        ("graphs", "uncompiled_frames", "errors", "wrong_results")),
    Row("guard_sets", "two guard sets from 6 threads (expect 2 graphs)", "guard_sets", {}, "first_compile",
        lambda r: r["graphs"] > 2 or r["errors"] > 0, _guard_sets_show, ("graphs", "errors")),
    Row("lookup_race", "spurious cache misses: graphs compiled after every guard set was (graph break, 16 threads)",
        "lookup_race", {"graph_break": 1, "seconds": 5}, "first_compile", _lookup_race_bad, _lookup_race_show,
        ("extra_graphs", "uncompiled_frames", "errors")),
    Row("dynamic_flag_poll", "dynamic=True calls flip assume_static_by_default for other threads",
        "dynamic_flag_poll", {"seconds": 2}, "dynamic_flags", lambda r: r["flipped"] > 0,
        lambda r: f"{_n(r['flipped'])} flipped polls", ("flipped",)),
    Row("export_flag_poll", "is_exporting() True in other threads while one exports", "export_flag_poll",
        {"seconds": 3}, "export_flag", lambda r: r["true"] > 0 or r["raw_returned"] > 0, _export_flag_show,
        ("true", "raw_returned")),
    Row("export_vs_compile", "compiles in 3 threads while one exports (errors)", "export_vs_compile",
        {"seconds": 6}, "export_lock", lambda r: r["compile_errors"] + r["export_errors"] > 0, _export_errors_show,
        ("compile_errors", "export_errors")),
    Row("backward_lock_wait", "a backward on a worker device waits for compile_lock held by another thread "
        "(mechanism of the deadlock, CPU)", "backward_lock_wait", {}, "lazy_backward",
        lambda r: r["backward_blocked"] or not r["grad_ok"], _backward_wait_show, ("backward_blocked",)),
]
ROWS += [
    Row("guard_invalidation_race", "guard trees freed by weakref finalizers while other threads evaluate them "
        "(8 threads, 12 s; unpatched: a crash)", "guard_invalidation_race", {"threads": 8, "seconds": 12}, "guard_invalidation",
        lambda r: r["errors"] > 0, _calls_errors_show, ("calls", "errors"), module=CRASH),
    Row("export_beside_calls", "torch._dynamo.export's reset_code while other threads call the function "
        "(6 s; unpatched: a crash)", "export_beside_calls", {"seconds": 6}, "code_reset",
        lambda r: r["errors"] > 0, _calls_errors_show, ("calls", "errors"), module=CRASH),
    Row("compile_rng_rollback", "compiles set the generators back over another thread's draws (repeated numbers)",
        "compile_rng_rollback", {"compiles": 6}, "rng_rollback", lambda r: r["repeats"] > 0,
        lambda r: f"{_n(r['repeats'])} repeats in {_n(r['draws'])} draws", ("repeats", "draws")),
    Row("compile_rng_rollback_python", "compiles set Python's random back over another thread's draws "
        "(repeated numbers)", "compile_rng_rollback", {"compiles": 6, "source": "python"}, "rng_rollback",
        lambda r: r["repeats"] > 0, lambda r: f"{_n(r['repeats'])} repeats in {_n(r['draws'])} draws", ("repeats", "draws")),
    Row("lazy_recompile_race", "first calls of one lazily compiled GraphModule from 8 threads (broken code)",
        "lazy_recompile_race", {"rounds": 40, "threads": 8}, "lazy_recompile",
        lambda r: r["errors"] + r["wrong"] > 0, lambda r: f"{_n(r['errors'] + r['wrong'])} failed of {_n(r['calls'])}",
        ("errors", "wrong", "calls")),
]
ROW_KEYS = [r.key for r in ROWS]
