"""The patch table: every patch, in order, and everything the rest of the package knows about it.

This is the one place a patch is declared (OpenTelemetry-instrumentor style: specs, not logic). Everything
else reads it: ``TTC_DISABLE``'s ids (``_env``), the modules the interpreter-start hook watches
(``_bootstrap``), the lifecycle and ``doctor``, the capabilities patches hand each other (``_journal``), the
conformance kit (``ttc_testing/conformance.py``, ``tests/test_conformance.py``) and CI's patch suite
(``.ci/patch_suite.py``). Data only, standard library only: it is imported at the first ``import torch``,
never at interpreter start, and never imports a patch module.

Each patch lives in its own module (``PatchSpec.module``, by default ``patches/<id>.py``), named after what
it fixes, and provides:

* ``SPEC``: its row here (``SPEC = SPECS["<id>"]``);
* ``check()``: why its target does not look as expected on this torch, or None;
* ``apply(changes)``: every edit through the :class:`~torch_threadsafe_compile._journal.Changes` journal,
  so that revert is exact; capabilities it offers (``changes.provide``) or reads (``changes.require``) are
  declared in its row (``provides``/``requires``), or the journal refuses them;
* ``verify()``: raises if the patch does not work (then everything it did is reverted);
* optionally ``report()``: statistics for ``status()``.

Adding a patch: one module under ``patches/``, one row in :data:`SPECS`, one scenario in ``ttc_testing`` and
its hazard test (named in the row). When each patch runs is decided by :mod:`torch_threadsafe_compile._lifecycle`.
"""

from __future__ import annotations

# No `typing` at run time: the table is read when the program first looks for a torch module, before
# torch itself has imported `typing` (annotations are strings here).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["Frozen", "PatchSpec", "SPECS", "PATCH_MODULES", "CORE_CAPABILITIES", "COMPILER_FLAG_USERS_KNOWN",
           "watched_modules", "capability_providers", "patch_test_files"]

PATCHES_PACKAGE = "torch_threadsafe_compile.patches"


class Frozen:
    """A value object: its ``__slots__`` set once by ``__init__`` (``_set``), never after. Plain classes, not
    dataclasses: these are built during ``import torch``, where a dataclass decorator alone costs about half
    a millisecond (docs/performance.md). ``PatchSpec`` here, ``_lifecycle``'s views."""

    __slots__ = ()

    def _set(self, *values: Any) -> None:
        names: tuple[str, ...] = type(self).__slots__
        for name, value in zip(names, values):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot set {name!r}")

    def __repr__(self) -> str:
        names: tuple[str, ...] = type(self).__slots__
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"


class PatchSpec(Frozen):
    """One row of the table: what a patch declares about itself. See any module in ``patches/``."""

    __slots__ = ("id", "hazard", "summary", "upstream", "torch_versions", "modules", "fixed_in", "after",
                 "provides", "requires", "free_threaded", "module", "scenario", "test")

    id: str  # also the name TTC_DISABLE takes and status() reports
    hazard: str  # H1 ... (docs/hazards.md)
    summary: str
    upstream: str  # the upstream issue / PR behind the hazard
    torch_versions: str  # a packaging specifier set, e.g. ">=2.4,<2.14"
    modules: tuple[str, ...]  # torch modules that must have been imported before it can apply (watched)
    fixed_in: str | None  # first torch release where upstream fixed the hazard
    after: tuple[str, ...]  # patches that must be settled (applied or skipped) first
    # Capabilities (by name) it offers other patches, and those it reads at call time (from whichever
    # patch provides them, applied in any order; without a provider it keeps upstream's behaviour). The
    # journal refuses undeclared ones (_journal.Changes.provide/require; "redirect:<module>" for a
    # module's shared redirect class).
    provides: tuple[str, ...]
    requires: tuple[str, ...]
    free_threaded: bool  # the hazard needs free-threaded CPython (GIL off): skipped on GIL builds
    module: str  # the module that implements it (imported only when it is about to be checked)
    scenario: str | None  # the ttc_testing scenario that shows its hazard (python -m ttc_testing.scenarios NAME)
    test: str  # its hazard test (path::function): the hazard with TTC_DISABLE=1, not active; in CI's patch suite

    def __init__(self, *, id: str, hazard: str, summary: str, upstream: str, torch_versions: str,
                 modules: tuple[str, ...], test: str, scenario: str | None = None, fixed_in: str | None = None,
                 after: tuple[str, ...] = (), provides: tuple[str, ...] = (), requires: tuple[str, ...] = (),
                 free_threaded: bool = False, module: str | None = None) -> None:
        self._set(id, hazard, summary, upstream, torch_versions, modules, fixed_in, after, provides, requires,
                  free_threaded, module or f"{PATCHES_PACKAGE}.{id}", scenario, test)

    @property
    def test_file(self) -> str:
        return self.test.split("::", 1)[0]


# Explicit order (gevent.monkey style): a patch may only rely on the ones before it. The tracing flags come
# before the compile gate, whose verification reads them; the compile-lock instrumentation comes before
# everything that takes the lock.
# Every spec, in that order: the table is data, read without importing any patch module (the registry
# imports a patch only when its torch modules are there and it is about to be checked). Each patch
# module binds its own entry: ``SPEC = SPECS["<id>"]``.
SPECS: dict[str, PatchSpec] = {
    spec.id: spec
    for spec in (
        PatchSpec(
            id="fx_tracing_flag",
            hazard="H1",
            summary="FX tracing flag per thread: no false 'symbolically trace a dynamo-optimized function' errors",
            upstream="pytorch/pytorch#118260 (dynamo is not thread safe); the flag became thread-local (_is_fx_tracing_tls) in 2.14",
            torch_versions=">=2.4,<2.14",
            fixed_in="2.14",
            modules=("torch.fx._symbolic_trace",),
            requires=("redirect:torch.fx._symbolic_trace",),
            scenario="fx_flag_leak",
            test="tests/test_hazards.py::test_h1_no_false_nested_trace_errors",
        ),
        PatchSpec(
            id="fx_patcher",
            hazard="H7",
            summary="fx.symbolic_trace's function patches and CURRENT_PATCHER apply to the tracing thread only",
            upstream="pytorch/pytorch#187589 (FX patcher CURRENT_PATCHER is process-global)",
            torch_versions=">=2.4",
            modules=("torch.fx._symbolic_trace",),
            after=("fx_tracing_flag",),
            provides=("call_plumbing",),
            requires=("redirect:torch.fx._symbolic_trace", "compile_lock.priority"),
            scenario="fx_patcher_leak",
            test="tests/test_hazards.py::test_h7_fx_symbolic_trace_patches_only_its_own_thread",
        ),
        PatchSpec(
            id="compile_session_flag",
            hazard="H2",
            summary="torch.compiler.is_compiling() is True only in the thread that compiles",
            upstream="pytorch/pytorch#184614 (held for the whole compile session, fixes #184547); flag is process-global",
            torch_versions=">=2.13",
            # Only dynamo's compile session and export (which imports dynamo) ever set the flag: applied when
            # torch._dynamo is imported, not during `import torch` (docs/performance.md).
            modules=("torch.compiler", "torch._dynamo"),
            requires=("redirect:torch.compiler",),
            scenario="is_compiling_leak",
            test="tests/test_hazards.py::test_h2_is_compiling_only_in_the_compiling_thread",
        ),
        PatchSpec(
            id="export_flag",
            hazard="H7",
            summary="torch.compiler.is_exporting() is True only in the thread that exports",
            upstream="pytorch/pytorch#105943 (PT2 is not thread safe); _is_exporting_flag is process-global",
            torch_versions=">=2.7",  # the flag exists from 2.7 (docs/compat.md: it leaks on 2.7 and 2.8 too)
            modules=("torch.compiler", "torch._dynamo"),  # set only by export and dynamo, as above
            after=("compile_session_flag",),
            requires=("redirect:torch.compiler",),
            scenario="export_flag_poll",
            test="tests/test_hazards.py::test_h7_is_exporting_only_in_the_exporting_thread",
        ),
        PatchSpec(
            id="config_overrides",
            hazard="H6",
            summary="config assigned in the main thread is the default of every thread; other assignments and config.patch stay per thread",
            upstream="pytorch/pytorch#118260 (config patching across threads); ContextVar overrides since 2.12",
            torch_versions=">=2.12",
            modules=("torch.utils._config_module",),
            scenario="config_threads",
            test="tests/test_hazards.py::test_h6_assignments_reach_every_thread_patches_stay_local",
        ),
        PatchSpec(
            id="dynamic_flags",
            hazard="H5",
            summary="torch.compile(dynamic=...) shape flags apply to the calling thread only",
            upstream="pytorch/pytorch#118260 (config patching via the dynamic kwarg is not thread safe); per-thread from 2.12",
            torch_versions=">=2.4,<2.12",
            modules=("torch.utils._config_module", "torch._dynamo"),  # verify reads dynamo's config
            fixed_in="2.12",
            scenario="dynamic_flag_poll",
            test="tests/test_hazards.py::test_h5_dynamic_flags_stay_in_the_calling_thread",
        ),
        PatchSpec(
            id="compile_import_lock",
            hazard="H7",
            summary="the first torch.compile() calls import dynamo one thread at a time (no import _DeadlockError)",
            upstream="Python's per-module import locks and torch._dynamo's import cycles; torch.compile imports dynamo lazily",
            torch_versions=">=2.4",
            modules=("torch",),
            scenario="first_import",
            test="tests/test_stress.py::test_h7_first_calls_from_many_threads_import_dynamo_safely",
        ),
        PatchSpec(
            id="compile_lock_watchdog",
            hazard="H4",
            summary="record waits on dynamo's compile_lock; TTC_WATCHDOG=<s> dumps stacks when one exceeds the bound",
            upstream="compile_fx_backward takes compile_lock (torch 2.6+); see lazy_backward",
            torch_versions=">=2.4",
            modules=("torch._dynamo.convert_frame",),
            provides=("compile_lock.priority", "compile_lock.waiters"),
            test="tests/test_lazy_backward.py::test_h4_a_blocked_compile_lock_is_reported_only_with_the_package",
        ),
        PatchSpec(
            id="export_lock",
            hazard="H7",
            summary="torch.export's global kernel overrides hold dynamo's compile_lock, so compiles never see them",
            upstream="pytorch/pytorch#105943 (PT2 is not thread safe); export patches op.py_kernels process-wide",
            torch_versions=">=2.4",
            modules=("torch.export._trace", "torch._dynamo.convert_frame"),
            requires=("compile_lock.priority",),
            scenario="export_vs_compile",
            test="tests/test_hazards.py::test_h7_export_does_not_break_other_threads_compiles",
        ),
        PatchSpec(
            id="export_serial",
            hazard="H7",
            summary="torch.export calls from several threads take turns (per-call state in torch.export._trace globals)",
            upstream="pytorch/pytorch#105943 (PT2 is not thread safe); _EXPORT_MODULE_HIERARCHY/_EXPORT_FLAGS are module globals",
            torch_versions=">=2.4",
            modules=("torch.export._trace",),
            scenario="concurrent_exports",
            test="tests/test_hazards.py::test_h7_exports_from_two_threads_take_turns",
        ),
        PatchSpec(
            id="lazy_backward",
            hazard="H4",
            summary=("compile the backward with the forward for graphs on an accelerator compiled while the program "
                     "runs threads, so the autograd engine never waits for compile_lock"),
            upstream=("lazy backward since pytorch/pytorch#83367; the backward compiler takes compile_lock (2.6+); "
                      "switch force_non_lazy_backward_lowering (2.9+)"),
            torch_versions=">=2.6",
            modules=("torch._functorch.aot_autograd",),
            scenario="backward_lock_wait",
            test="tests/test_lazy_backward.py::test_h4_backward_on_a_worker_device_is_compiled_with_the_forward",
        ),
        PatchSpec(
            id="cuda_device_guard",
            hazard="H3",
            summary=("torch._C._ensureCUDADeviceGuardSet runs once per process (the first compile), not while other "
                     "threads run compiled code"),
            upstream=("pytorch/pytorch#118260 (reproducer segfaults on CUDA builds without a GPU); "
                      "FakeTensorMode.__enter__ calls _ensureCUDADeviceGuardSet"),
            # 2.10 and 2.11 crash in nearly every unpatched run of its scenario; 2.12.1, 2.14.1 and 2.15.0
            # (CUDA builds, no GPU) in none (docs/hazards.md, H3): the call still happens there, but no longer
            # crashes, so the patch stays out of those releases.
            torch_versions=">=2.10,<2.12",
            fixed_in="2.12",
            modules=("torch._subclasses.fake_tensor",),
            test="tests/test_stress.py::test_h3_cuda_build_without_gpu_does_not_crash",
        ),
        PatchSpec(
            id="guard_invalidation",
            hazard="H8",
            summary="guard trees released by cache-entry invalidation (weakref finalizers) or diff-guard rebuilds are "
                "kept until no thread that could be evaluating them is left",
            upstream=("pytorch/pytorch#195355 (ExtraState lock, queued invalidations; after 2.15); "
                "CheckFunctionManager.invalidate frees the RootGuardManager that lookup() may be evaluating"),
            torch_versions=">=2.6",
            modules=("torch._dynamo",),  # its import completes after guards.py (no new post-import hook)
            scenario="guard_invalidation_race",
            test="tests/test_crash_hazards.py::test_h8_guard_invalidation_during_lookups_does_not_crash",
        ),
        PatchSpec(
            id="code_reset",
            hazard="H9",
            summary="remove_from_cache / reset_code (torch._dynamo.export), and reset_code_caches in a reset that could "
                "not drain other threads (H11), invalidate a code object's entries instead of freeing them while "
                "other threads run",
            upstream=("pytorch/pytorch#195355 (ExtraState lock; after 2.15); reset_code frees the ExtraState that "
                "other threads' lookup() and compiles hold"),
            torch_versions=">=2.6",
            modules=("torch._dynamo",),  # its import completes after eval_frame, convert_frame and guards
            scenario="export_beside_calls",
            test="tests/test_crash_hazards.py::test_h9_export_beside_compiled_calls_does_not_crash",
        ),
        PatchSpec(
            id="deferred_code_callbacks",
            hazard="H13",
            summary="dynamo's weakref callbacks on code objects run no Python code under torch's traceback free-list "
                    "mutex while other threads exist (no deadlock with the GIL)",
            upstream=("torch/csrc/profiler/python/combined_traceback.cpp: freeDeadCapturedTracebackFrames decrefs "
                      "code objects while holding to_free_frames_mutex (pytorch/pytorch#118260, thread safety)"),
            torch_versions=">=2.4",
            modules=("torch._dynamo",),  # its import completes after utils and convert_frame
            scenario="captured_traceback_free_deadlock",
            test="tests/test_crash_hazards.py::test_h13_dynamo_code_callbacks_never_deadlock_with_the_traceback_free_list",
        ),
        PatchSpec(
            id="eval_frame_shim",
            hazard="H10",
            summary="free-threaded builds: dynamo's set_eval_frame runs one thread at a time (no shim recursion, "
                    "no C stack overflow when threads start compiled calls at once)",
            upstream=("torch/csrc/dynamo/eval_frame.c: active_dynamo_threads and previous_eval_frame are read and "
                      "written without synchronization (pytorch/pytorch#118260; free-threading support #149549)"),
            torch_versions=">=2.4",
            modules=("torch._dynamo.eval_frame",),
            free_threaded=True,
            scenario="warm_calls",
            test="tests/test_freethreaded.py::test_warm_calls_without_gil",
        ),
        PatchSpec(
            id="entry_list_order",
            hazard="H10",
            summary="free-threaded builds: dynamo's cache-entry lists are not reordered on hits (no concurrent splices "
                    "of one std::list: no corrupted list, no spurious recompiles)",
            upstream="torch/csrc/dynamo/extra_state.cpp: lookup() moves hits to the front unsynchronized; "
                     "pytorch/pytorch#195355 adds a lock per ExtraState (after 2.15)",
            torch_versions=">=2.4",
            modules=("torch._dynamo.eval_frame",),
            free_threaded=True,
            scenario="lookup_race",
            test="tests/test_freethreaded.py::test_lookup_race_without_gil",
        ),
        PatchSpec(
            id="first_compile",
            hazard="H3",
            summary="threads that need the same graph wait for one compile instead of compiling it again",
            upstream="pytorch/pytorch#118260, #136833 (thread safety of torch.compile); compile_lock only queues compiles",
            torch_versions=">=2.4",
            modules=("torch._dynamo", "torch._dynamo.eval_frame", "torch._dynamo.convert_frame"),
            after=("compile_lock_watchdog",),
            requires=("call_plumbing", "compile_lock.waiters"),
            scenario="stampede",
            test="tests/test_hazards.py::test_h3_one_compile_per_stampede",
        ),
        PatchSpec(
            id="cudagraph_trees_per_thread",
            hazard="H7",
            summary="CUDA graph trees per thread: reduce-overhead functions (and their backward) work from any thread",
            upstream="pytorch/pytorch#123177 (torch.compile+cudagraphs asserts in multithreaded context); "
                "per-thread TLS upstream from 2.13 (pytorch#184357)",
            torch_versions=">=2.4,<2.13",
            fixed_in="2.13",
            modules=("torch._inductor.cudagraph_trees", "torch._dynamo.eval_frame"),
            test="tests/test_cudagraph_threads.py::test_h7_cudagraph_layouts_cuda",
        ),
        PatchSpec(
            id="cudagraph_rng",
            hazard="H7",
            summary="CUDA graph recordings neither break nor repeat other threads' random numbers",
            upstream="pytorch/pytorch#123177 layout with random inputs; generator capture state per device up to 2.11 "
                "(per capture from 2.12, pytorch#176752); preserve_rng_state around tree recordings (all versions)",
            torch_versions=">=2.4",
            modules=("torch._inductor.cudagraph_trees",),
            after=("cudagraph_trees_per_thread",),
            test="tests/test_cudagraph_rng.py::test_h7_rng_rollback_repeats_other_threads_numbers_and_patch_stops_it",
        ),
        PatchSpec(
            id="lazy_recompile",
            hazard="H7",
            summary="the first calls of a shared lazily compiled FX GraphModule generate its code one thread at a time",
            upstream="pytorch/pytorch#105943 (PT2 is not thread safe); Graph.python_code's override_node_repr "
                "rewrites the shared graph's node repr functions while it generates code",
            torch_versions=">=2.4",
            modules=("torch.fx._lazy_graph_module",),
            scenario="lazy_recompile_race",
            test="tests/test_hazards.py::test_h7_first_calls_of_a_shared_lazy_graph_module_generate_working_code",
        ),
        PatchSpec(
            id="rng_rollback",
            hazard="H7",
            summary="a compile no longer sets the generators back over random numbers that other threads drew meanwhile",
            upstream="pytorch/pytorch#105943 (PT2 is not thread safe); preserve_global_state / preserve_rng_state "
                "restore the process-wide generator states after every compile",
            torch_versions=">=2.4",
            modules=("torch._dynamo.convert_frame",),
            scenario="compile_rng_rollback",
            test="tests/test_hazards.py::test_h7_compiles_do_not_roll_back_other_threads_random_numbers",
        ),
    )
}
PATCH_MODULES: tuple[str, ...] = tuple(SPECS)

# Capabilities the package's core offers every patch that declares them: the shared redirect class of each
# module whose globals patches make per-thread (``_journal.Changes.redirect_module``).
CORE_CAPABILITIES: tuple[str, ...] = ("redirect:torch.compiler", "redirect:torch.fx._symbolic_trace")

# The torch releases whose sources were read for code outside ``torch.compiler`` that reads or writes
# ``torch.compiler._is_compiling_flag`` / ``_is_exporting_flag``: 2.11, 2.13 and 2.15 (2.12 and 2.14 lie
# between with the same code). The writer is ``torch._export.utils._compiling_state_context``, the context
# of an export; the only other reader, dynamo's tracing of ``is_exporting()`` (``_dynamo/variables/torch.py``),
# runs inside it when it matters. Outside this range nothing is assumed: the flags stay redirected for good
# (``_torch.compiler_flag_users``). A new torch release: read its sources, then widen this.
COMPILER_FLAG_USERS_KNOWN = ">=2.11,<2.16"


def watched_modules(specs: list[PatchSpec] | None = None) -> frozenset[str]:
    """Every torch module whose completed import can make a patch ready (what the bootstrap must watch)."""
    return frozenset({"torch", *(m for s in (list(SPECS.values()) if specs is None else specs) for m in s.modules)})


def capability_providers() -> dict[str, tuple[str, ...]]:
    """``{capability: ids of the patches that provide it}`` (``()`` for the core's)."""
    out: dict[str, tuple[str, ...]] = dict.fromkeys(CORE_CAPABILITIES, ())
    for spec in SPECS.values():
        for name in spec.provides:
            out[name] = out.get(name, ()) + (spec.id,)
    return out


def patch_test_files() -> list[str]:
    """The hazard-test files the rows name, in table order without repeats (CI's patch suite reads them)."""
    return list(dict.fromkeys(spec.test_file for spec in SPECS.values()))
