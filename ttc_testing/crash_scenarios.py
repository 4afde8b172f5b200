"""Crash scenarios found by running PyTorch's own tests with pytest-run-parallel (H8, H9, H11, H12), each
small enough to run in a few seconds without pytest, in its own interpreter, reporting one JSON line (or dying); beside them
the causes found not to be the package's (a deadlock in torch, a test that races with itself), reproduced the
same way so that both modes can be measured.

    python -m ttc_testing.crash_scenarios NAME [key=value ...]

A scenario that crashes the interpreter leaves no JSON line: :func:`run` reports the signal and the first
frames faulthandler printed, so a crash counts as the hazard showing.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from torch_threadsafe_compile.selftest import _main, scenario
from ttc_testing.scenarios._common import _run_for

MODULE = "ttc_testing.crash_scenarios"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
__all__ = ["run"]


class _Errors:
    """Exceptions of a scenario's threads, counted by kind (type and first 80 characters of the message): the
    question these scenarios ask is whether the process survives, so an error is counted, not raised."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, e: BaseException) -> None:
        key = f"{type(e).__name__}: {str(e)[:80]}"
        with self._lock:
            self.by_kind[key] = self.by_kind.get(key, 0) + 1

    def total(self) -> int:
        return sum(self.by_kind.values())

    def kinds(self) -> list[str]:
        return list(self.by_kind)[:3]


def _rounds(rounds: int, make_round: Any, errors: _Errors, after: Any = None) -> None:
    """``rounds`` rounds; each runs the callables ``make_round()`` returns, one thread each, and joins them.
    Exceptions are counted in ``errors`` (the question is whether the process survives); ``after()`` runs
    between rounds."""

    def worker(fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # counted, not raised
            errors.add(e)

    for _ in range(rounds):
        ts = [threading.Thread(target=worker, args=(fn,)) for fn in make_round()]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if after is not None:
            after()


def _barrier_rounds(threads: int, rounds: int, body: Any, errors: _Errors, after: Any = None) -> None:
    """``rounds`` rounds of ``threads`` threads that start ``body`` together (a barrier), as pytest-run-parallel
    runs a test body; exceptions are counted in ``errors``; ``after()`` runs between rounds."""

    def make_round() -> list[Any]:
        barrier = threading.Barrier(threads)

        def start_together() -> None:
            barrier.wait(timeout=60)
            body()

        return [start_together] * threads

    _rounds(rounds, make_round, errors, after)


class _Steps:
    """Numbered steps that two threads hand each other, to run a race's calls in one chosen order."""

    def __init__(self) -> None:
        self._events: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def _event(self, k: int) -> threading.Event:
        with self._lock:
            return self._events.setdefault(k, threading.Event())

    def set(self, k: int) -> None:
        self._event(k).set()

    def wait(self, k: int, timeout: float = 30) -> None:
        # Bounded: a step that never comes fails the round instead of hanging the scenario.
        if not self._event(k).wait(timeout):
            raise TimeoutError(f"step {k} never came")


def _ordered_rounds(rounds: int, thread_a: Any, thread_b: Any, errors: _Errors, after: Any = None) -> None:
    """``rounds`` rounds of two threads that run ``thread_a(steps)`` and ``thread_b(steps)`` with fresh
    :class:`_Steps`; exceptions are counted in ``errors``; ``after()`` runs between rounds."""

    def make_round() -> list[Any]:
        steps = _Steps()
        return [functools.partial(thread_a, steps), functools.partial(thread_b, steps)]

    _rounds(rounds, make_round, errors, after)


def _make_instance(k: float) -> Any:
    """An instance of a class made at run time: dynamo guards its type by identity (``TYPE_MATCH`` keeps a
    ``weakref.finalize`` on the class), and the class dies only when the garbage collector finds its cycle —
    what every test body that defines a class does."""

    class Scale:
        def __init__(self) -> None:
            self.k = k

        def f(self, y: Any) -> Any:
            return y * self.k

    return Scale()


@scenario
def guard_invalidation_race(threads: int = 4, seconds: float = 6.0, backend: str = "eager") -> dict[str, Any]:
    """H8: ``threads`` threads call one compiled function, each with instances of classes it makes as it goes;
    once ``recompile_limit`` entries exist every call walks them all (each guard check drops the GIL), while
    the garbage collector, in any thread, frees classes whose entries dynamo then invalidates."""
    import torch

    def fn(x: Any, f: Any) -> Any:
        return f(x) + 1

    opt = torch.compile(fn, backend=backend)
    stop = threading.Event()
    calls = [0] * threads
    errors = _Errors()

    def worker(i: int) -> None:
        x = torch.randn(4)
        while not stop.is_set():
            try:
                opt(x, _make_instance(float(i)).f)
                calls[i] += 1
            except Exception as e:  # counted: the question is whether the process survives
                errors.add(e)
            if calls[i] % 3 == 0:
                gc.collect()

    _run_for([threading.Thread(target=worker, args=(i,)) for i in range(threads)], seconds, stop)
    entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
    return {"calls": sum(calls), "errors": errors.total(), "kinds": errors.kinds(), "entries": len(entries)}


@scenario
def export_beside_calls(exporters: int = 2, callers: int = 2, seconds: float = 6.0, backend: str = "eager") -> dict[str, Any]:
    """H9: ``exporters`` threads run ``torch._dynamo.export(f)`` (which calls ``reset_code(f.__code__)`` twice)
    while ``callers`` threads call ``torch.compile(f)``. One export and one call first, in this thread (the
    first calls' imports are another hazard, H7)."""
    import torch

    def f(x: Any) -> Any:
        return x.sin() + 1

    x0 = torch.randn(3)
    torch._dynamo.export(f)(x0)
    torch.compile(f, backend=backend)(x0)
    stop = threading.Event()
    counts = {"exports": 0, "calls": 0}
    errors = _Errors()

    def loop(kind: str) -> None:
        x = torch.randn(3)
        opt = torch.compile(f, backend=backend)
        while not stop.is_set():
            try:
                if kind == "exports":
                    torch._dynamo.export(f)(x)
                else:
                    opt(x)
                counts[kind] += 1
            except Exception as e:  # counted: the question is whether the process survives
                errors.add(e)

    ts = [threading.Thread(target=loop, args=("exports",)) for _ in range(exporters)]
    ts += [threading.Thread(target=loop, args=("calls",)) for _ in range(callers)]
    _run_for(ts, seconds, stop)
    return {**counts, "errors": errors.total(), "kinds": errors.kinds(), "by_kind": dict(list(errors.by_kind.items())[:20])}


def _inductor(gm: Any, example_inputs: Any) -> Any:
    """A backend that calls inductor's ``compile_fx`` (a compile long enough for other threads to pile up)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _export_unflatten_round(backend: Any) -> None:
    """One round of a test shape of PyTorch's export tests. The classes are made here, so every thread's
    ``forward`` shares one code object; ``unf.sub.compile()`` compiles ``nn.Module._call_impl``, whose code
    every module shares."""
    import torch
    import torch.export

    class Sub(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return torch.relu(self.lin(x)) * 2

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub = Sub()
            self.other = torch.nn.Linear(4, 4)

        def forward(self, x: Any) -> Any:
            return self.other(self.sub(x)) + 1

    m = M()
    x = torch.randn(2, 4)
    ep = torch.export.export(m, (x,), strict=True)
    unf = torch.export.unflatten(ep)
    unf.sub.compile(backend=backend, fullgraph=True)
    torch.testing.assert_close(unf(x), m(x))


@scenario
def export_unflatten_compile(threads: int = 4, rounds: int = 3, backend: str = "inductor") -> dict[str, Any]:
    """H11: ``threads`` threads each run ``rounds`` times: strict ``torch.export.export`` of a module, then
    ``torch.export.unflatten``, then compile the unflattened submodule and call it. A strict export calls
    ``torch._dynamo.reset()`` (torch 2.13: ``_dynamo_graph_capture_for_export``) while it holds
    ``compile_lock`` (``export_lock``), and the reset frees every code object's cache, also those of frames
    other threads are compiling (``_call_impl``, the shared ``forward``s) and waiting for that lock."""
    import torch  # noqa: F401

    chosen: Any = _inductor if backend == "inductor" else backend
    counts = {"done": 0}
    errors = _Errors()
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(rounds):
            try:
                _export_unflatten_round(chosen)
                with lock:
                    counts["done"] += 1
            except Exception as e:  # counted: the question is whether the process survives
                errors.add(e)

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {**counts, "errors": errors.total(), "kinds": errors.kinds(),
            "seconds": round(time.monotonic() - t0, 1)}


@scenario
def precompile_entries_shared_code(threads: int = 4, rounds: int = 20) -> dict[str, Any]:
    """Not a package hazard: upstream's own race, in both modes (docs/upstream-tests.md, the union plan). The
    body of ``dynamo/test_misc.py::test_fail_on_recompile_error_message`` in ``threads`` threads at once,
    ``rounds`` times: each thread loads a precompile entry into the *same* code object (``fn`` is defined in
    the body, but its code object is a constant shared by every call) with the private
    ``torch._C._dynamo.eval_frame._load_precompile_entry``, calls the compiled function under
    ``set_stance("fail_on_recompile")``, and resets that code object's precompile entries, which frees the entry
    another thread's C frame evaluation is reading (``SIGSEGV`` in ``compile_wrapper``)."""
    import torch
    from torch._C._dynamo.eval_frame import _load_precompile_entry, _reset_precompile_entries

    errors = _Errors()

    def body() -> None:
        def fn(x: Any) -> Any:
            return x + 1

        gm = torch._dynamo.guards.RootGuardManager()
        gm.add_lambda_guard(lambda f_locals: isinstance(f_locals["x"], bool), ["isinstance(L['x'], bool)"], None)

        def injected_bool(x: bool) -> Any:
            return x + 102

        compiled = torch.compile(fn, backend="eager")
        _load_precompile_entry(fn.__code__, torch._dynamo.guards.GuardManagerWrapper(gm), injected_bool.__code__)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                compiled(torch.randn(3, 2))
        except RuntimeError as e:
            if "Failed on the following precompiled guards" not in str(e):
                raise
        finally:
            _reset_precompile_entries(fn.__code__)

    _barrier_rounds(threads, rounds, body, errors, after=gc.collect)
    return {"rounds": rounds, "errors": errors.total(), "kinds": errors.kinds()}


@scenario
def captured_traceback_free_deadlock(threads: int = 4, seconds: float = 5.0, callbacks: str = "own") -> dict[str, Any]:
    """Not a package hazard: a deadlock in torch itself, in both modes (the hang of ``dynamo/test_repros.py`` and
    ``dynamo/test_aot_autograd.py`` at 4 threads; docs/upstream-tests.md). torch's ``CapturedTraceback`` keeps
    its frames' code objects and frees them in ``freeDeadCapturedTracebackFrames`` while it holds its
    ``to_free_frames_mutex``. When such a decref is a code object's last, the code object's weakref callbacks
    run (dynamo keeps Python ones on code objects: ``ExactWeakKeyDictionary``), Python code that may hand the
    GIL to another thread; if that thread then gathers or frees a traceback (``PythonTraceback::gather`` or
    ``release``), it waits for the mutex while holding the GIL, and neither moves again. Here each thread makes
    fresh functions (code objects with a Python weakref callback), captures a traceback inside one and drops both.
    A hang leaves no result: :func:`run` reports ``timed_out``.

    ``callbacks="own"``: the scenario's own Python weakref callback on each code object (torch's hazard as
    such: the package does not prevent it). ``callbacks="dynamo"``: instead, each code object is recorded as
    ``convert_frame`` records every code object it makes (``CleanupManager.instance[code] = cleanups``,
    ``output_codes.add(code)``), so the callbacks are dynamo's own: the hang of ``dynamo/test_aot_autograd.py``
    (H13, which the package prevents)."""
    import weakref

    from torch.utils._traceback import CapturedTraceback

    if callbacks not in ("own", "dynamo"):
        raise ValueError(f"callbacks={callbacks!r}: expected 'own' or 'dynamo'")
    if callbacks == "dynamo":
        from torch._dynamo.convert_frame import output_codes
        from torch._dynamo.utils import CleanupManager

    sys.setswitchinterval(1e-5)  # hand the GIL over often, so the window is hit within seconds
    alive: dict[int, Any] = {}
    counts = {"tracebacks": 0, "callbacks": 0}  # callbacks: of callbacks="own" only

    def callback(ref: Any) -> None:  # a little Python, like dynamo's _remove_id
        alive.pop(id(ref), None)
        counts["callbacks"] += 1

    def one(i: int) -> None:
        ns: dict[str, Any] = {}
        exec(compile(f"def f{i}():\n    return CapturedTraceback.extract()\n", f"<gen{i}>", "exec"),
             {"CapturedTraceback": CapturedTraceback}, ns)
        f = ns.pop(f"f{i}")
        if callbacks == "dynamo":
            CleanupManager.instance[f.__code__] = []  # no hooks: the loop over them is Python enough
            output_codes.add(f.__code__)
        else:
            ref = weakref.ref(f.__code__, callback)
            alive[id(ref)] = ref
        tb = f()
        del f, tb  # the traceback holds the code object's last reference: freed under torch's mutex
        counts["tracebacks"] += 1

    stop = time.monotonic() + seconds

    def loop(k: int) -> None:
        i = k * 10**9
        while time.monotonic() < stop:
            one(i)
            i += 1

    ts = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if callbacks == "dynamo":
        gc.collect()
        CapturedTraceback.extract()  # frees what torch's free list still holds
        _ = None in CleanupManager.instance  # a read (with the package, deferred callbacks run first)
        counts["left"] = len(CleanupManager.instance.values)  # entries whose code objects died and stayed
    return dict(counts)


def _closed_int_round(counter: Any) -> int:
    """The body of ``dynamo/test_recompiles.py::test_automatic_dynamic_on_closed_ints``: ``h``'s code object is
    a constant of this function, so every thread and every round compiles the same code object, as the
    test's threads do."""
    import torch

    def f(x: Any) -> Any:
        def g(y: Any) -> Any:
            return y + x

        return g

    @torch.compile(backend=counter)
    def h(x: Any, g: Any) -> Any:
        return g(x)

    for i in range(10):
        h(torch.randn(5), f(i))
    return int(counter.frame_count)


@scenario
def closed_int_recompile_race(threads: int = 4, rounds: int = 20, resets: int = 1) -> dict[str, Any]:
    """Not a package hazard: a test that races with itself
    (``dynamo/test_recompiles.py::test_automatic_dynamic_on_closed_ints`` failed once at 4 threads in the
    union-plan run, active; alone it passed in 4 threads in both modes). Its threads compile one shared code
    object, and dynamo keeps that code object's automatic-dynamic memory (``frame_state``: "this int changed,
    compile it dynamic") and its cache per code object, not per thread; dynamo's test case resets dynamo in
    every thread's ``setUp`` and ``tearDown`` (``resets=1``: one ``torch._dynamo.reset()`` before and after
    the body, as there). A thread's reset mid-way through another thread's ten calls takes that memory and
    that cache away: the other thread compiles a third frame (``frame_count == 3`` where the test expects 2);
    a thread that starts after another has marked the int dynamic compiles 1. Each round: ``threads`` threads
    (a barrier, then the body); reports the frame counts seen and how many differ from 2. Measured (torch
    2.13, 20 rounds): active, 62 of 80 bodies counted something else than 2 (1 to 9 frames); ``TTC_DISABLE=1``
    died of ``SIGSEGV`` in ``compile_wrapper`` (a reset while other threads run compiled code: H3's crash,
    which the package prevents). ``resets=0`` (no reset at all): most bodies count 0 in both modes (the
    cache of an earlier round or thread serves them)."""
    import torch
    import torch._dynamo
    import torch._dynamo.testing

    counts: dict[int, int] = {}
    lock = threading.Lock()
    errors = _Errors()

    def body() -> None:
        for _ in range(resets):
            torch._dynamo.reset()
        n = _closed_int_round(torch._dynamo.testing.CompileCounter())
        for _ in range(resets):
            torch._dynamo.reset()
        with lock:
            counts[n] = counts.get(n, 0) + 1

    _barrier_rounds(threads, rounds, body, errors)
    return {"frame_counts": {str(k): v for k, v in sorted(counts.items())},
            "not_two": sum(v for k, v in counts.items() if k != 2), "bodies": sum(counts.values()),
            "errors": errors.total(), "error_kinds": errors.kinds()}


@scenario
def shared_log_capture_race(threads: int = 8, rounds: int = 30) -> dict[str, Any]:
    """Not a package hazard: tests that assert on what every thread shares
    (``dynamo/test_reorder_logs.py::test_ignore_logger_*`` at 8 threads, failing in either mode from run to
    run). Each test body captures one module-level logger with ``self.assertLogs(logger)``, which *replaces*
    that logger's handlers by its own capture for the duration and puts the old ones back on exit. In N
    threads at once, the captures overwrite each other: a thread's capture holds another thread's records
    (the test's ``'moo' unexpectedly found``), or misses its own (``no logs of level ... triggered``). Here,
    each round: ``threads`` threads (a barrier), each inside ``assertLogs`` waits a moment (the test compiles
    there), logs its own message, waits again, and checks what its capture holds; half of them also log
    ``"moo"``, as an eager call does in the test. No torch at all: the same in both modes by construction (it
    measures the test, not the package)."""
    import logging
    import unittest

    logger = logging.getLogger("ttc_testing.shared_log_capture_race")
    case = unittest.TestCase()
    found = {"foreign": 0, "missing": 0, "bodies": 0}
    lock = threading.Lock()
    errors = _Errors()
    names = iter(range(10**9))

    def body() -> None:
        with lock:
            me = next(names)
        foreign = missing = False
        try:
            with case.assertLogs(logger, level="INFO") as cm:
                time.sleep(0.001)  # the test compiles here: other threads enter and leave meanwhile
                logger.info("mine %d", me)
                if me % 2:
                    logger.info("moo")
                time.sleep(0.001)
            mine = [r for r in cm.output if r.endswith(f"mine {me}")]
            foreign = any("mine" in r and r not in mine for r in cm.output) or (not me % 2 and any("moo" in r for r in cm.output))
            missing = not mine
        except AssertionError:  # assertLogs: "no logs of level INFO or higher triggered"
            missing = True
        with lock:
            found["foreign"] += foreign
            found["missing"] += missing
            found["bodies"] += 1

    _barrier_rounds(threads, rounds, body, errors)
    return {**found, "errors": errors.total(), "error_kinds": errors.kinds()}


@scenario
def default_dtype_restore_race(threads: int = 4, rounds: int = 300, ordered: int = 0) -> dict[str, Any]:
    """Not a package hazard: a test that races with itself, and the next test pays (torch 2.15's
    ``dynamo/test_guard_manager.py::test_skip_size_stride_guards_on_static_tensors`` failed at 4 threads in
    one active run of three, ``True is not false``, while its victim check passed alone). The test before it,
    ``test_global_state_guard``, runs ``with set_default_dtype(torch.double)`` (torch.testing's helper: save
    the default dtype, set it, restore the saved one) in every thread at once; the default dtype is
    process-global, so a thread that enters after another has set double saves double and restores it last:
    the process keeps float64, and the next test's ``torch.randn(4, 4)`` is float64 -- so its guard, built
    from that tensor, accepts the float64 input the test expects it to reject. Each round here: ``threads``
    threads (a barrier, then the helper around a GLOBAL_STATE guard check, as in the test); after the round,
    is the default dtype still float32? Reports how many rounds leaked (then reset, for the next round).
    ``ordered=1``: two threads run the helper in the one order that leaks, each step handed over by an event (A
    enters, B enters and saves float64, A leaves, B leaves and restores float64), so every round leaks whatever
    the machine's load; the random schedule's rate depends on it."""
    import torch
    from torch.testing._internal.common_utils import set_default_dtype

    guard: Any = None
    try:  # the test's body; the guard's constructor is internal, so without it the helper alone
        from torch._C._dynamo import guards

        guard = guards.GLOBAL_STATE(guards.RootGuardManager(), ["global_state_check"], None)
    except Exception:  # an internal constructor that changes between releases
        guard = None
    torch.set_default_dtype(torch.float32)
    leaked = victim_float64 = 0
    errors = _Errors()

    def body() -> None:
        with set_default_dtype(torch.double):
            if guard is not None:
                guard(None)
                str(guard.check_verbose(None))
            torch.ones(2).sum()

    def after_round() -> None:
        nonlocal leaked, victim_float64
        if torch.get_default_dtype() != torch.float32:
            leaked += 1
            victim_float64 += torch.randn(4, 4).dtype == torch.float64
            torch.set_default_dtype(torch.float32)

    def thread_a(steps: _Steps) -> None:
        with set_default_dtype(torch.double):
            steps.set(0)
            steps.wait(1)
        steps.set(2)

    def thread_b(steps: _Steps) -> None:
        steps.wait(0)
        with set_default_dtype(torch.double):
            steps.set(1)
            steps.wait(2)

    if ordered:
        _ordered_rounds(rounds, thread_a, thread_b, errors, after=after_round)
    else:
        _barrier_rounds(threads, rounds, body, errors, after=after_round)
    return {"rounds": rounds, "leaked": leaked, "victim_float64": victim_float64, "guard_body": guard is not None,
            "errors": errors.total(), "error_kinds": errors.kinds()}


@scenario
def guard_hook_race(threads: int = 2, rounds: int = 150) -> dict[str, Any]:
    """Not a package hazard: a test that races with itself (torch 2.13's
    ``dynamo/test_guard_manager.py::test_diff_guard_manager`` failed at 2 threads, in one mode or the other at
    random: ``True is not false``). The test installs its hook in the process-global
    ``torch._dynamo.guards.guard_manager_testing_hook_fn`` (its ``install_guard_manager_testing_hook`` saves the
    old value, sets its own, restores the saved one); the hook counts its calls and expects its first call to
    come from the first compile of ``fn`` (no recompile yet, so the diff guard tree has no ``foo`` guard). In N
    threads every thread's compile calls whichever hook was installed last -- another thread's, whose count does
    not match -- and the thread that restores last puts back another thread's hook, which stays installed after
    the test (the file's later compiles call it). Each round here: a fresh dynamo cache
    (``torch._dynamo.reset()``, no other thread running), ``threads`` threads (a barrier) run the test's body.
    Reports the rounds in which a thread failed, the hook calls made for another thread's compile, and the
    rounds after which a hook stayed installed."""
    import contextlib

    import torch
    import torch._dynamo.guards as dynamo_guards

    errors = _Errors()
    counts = {"failed_rounds": 0, "foreign_hook_calls": 0, "hook_left_installed": 0, "hook_calls": 0}
    lock = threading.Lock()

    @contextlib.contextmanager
    def install(hook: Any) -> Any:  # the test's helper (test/dynamo/utils.py), as upstream writes it
        old = dynamo_guards.guard_manager_testing_hook_fn
        try:
            dynamo_guards.guard_manager_testing_hook_fn = hook
            yield
        finally:
            dynamo_guards.guard_manager_testing_hook_fn = old

    def body() -> None:
        counter = 0
        owner = threading.get_ident()

        def hook(guard_wrapper: Any, f_locals: Any, builder: Any) -> None:
            nonlocal counter
            with lock:
                counts["hook_calls"] += 1
                counts["foreign_hook_calls"] += threading.get_ident() != owner
            root, diff = guard_wrapper.root, guard_wrapper.diff_guard_root
            f_locals["foo"] = [3, 3]
            if root.check(f_locals):
                raise AssertionError("root passed a changed foo")
            if counter == 0 and not diff.check(f_locals):
                raise AssertionError("first hook call: the diff guard tree has a foo guard (a recompile)")
            if counter > 0 and diff.check(f_locals):
                raise AssertionError("later hook call: the diff guard tree has no foo guard")
            counter += 1

        class Bar:
            def __init__(self) -> None:
                self.x = 4
                self.y = torch.randn(4)

        bar = Bar()

        def fn(x: Any, foo: Any, bar: Any) -> Any:
            return x + foo[0] + bar.x * bar.y

        x = torch.randn(4)
        opt_fn = torch.compile(fn, backend="eager", fullgraph=True)
        with install(hook):
            opt_fn(x, (12.0, 13), bar)
            opt_fn(x, (10.0, 11), bar)

    for _ in range(rounds):
        torch._dynamo.reset()
        dynamo_guards.guard_manager_testing_hook_fn = None
        before = errors.total()
        _barrier_rounds(threads, 1, body, errors)
        counts["failed_rounds"] += errors.total() > before
        counts["hook_left_installed"] += dynamo_guards.guard_manager_testing_hook_fn is not None
    dynamo_guards.guard_manager_testing_hook_fn = None
    return {"rounds": rounds, **counts, "errors": errors.total(), "error_kinds": errors.kinds()}


@scenario
def default_device_restore_race(
    threads: int = 4, rounds: int = 300, switch_s: float = 1e-6, ordered: int = 0
) -> dict[str, Any]:
    """Not a package hazard: a test that races with itself (torch 2.13's
    ``dynamo/test_guard_manager.py::test_default_device_guard`` failed at 2 threads in one mode or the other at
    random). ``torch.set_default_device`` keeps its context per thread, but the device that dynamo's
    ``DEFAULT_DEVICE`` guard reads, ``torch.utils._device.CURRENT_DEVICE``, is a module global: one thread's
    ``set_default_device(None)`` ends another thread's ``"cuda"`` before that thread's guard check, and the
    thread that restores last can put back ``"cuda"`` for the rest of the process. Reports the guard checks that
    passed where the test expects a failure, and the rounds after which ``CURRENT_DEVICE`` was left set (then
    cleared).

    ``ordered=0``: each round ``threads`` threads (a barrier) run the test's body as it is, and the GIL is
    handed over every ``switch_s`` seconds (``sys.setswitchinterval``) to show the window; how often it shows
    depends on the machine's load (0 of 200 rounds once on a loaded 2-core machine). ``ordered=1``: two
    threads run the same calls in the one order that fails the test, each step handed over by an event (B makes
    its guard, A sets ``"cuda"``, B sets ``"cuda"``, A sets ``None``, B checks, B sets ``None``), so every round shows both
    effects whatever the load: the proof that the race is real, not a rate."""
    import torch
    import torch.utils._device as device_mod
    from torch._C._dynamo import guards

    errors = _Errors()
    counts = {"wrong_checks": 0, "left_set": 0}
    lock = threading.Lock()

    def new_guard() -> Any:
        guard = guards.DEFAULT_DEVICE(guards.RootGuardManager(), ["cpu device"], None)
        if not guard(1):
            raise AssertionError("the guard failed before the default device was set")
        return guard

    def check(guard: Any) -> None:
        if guard(1):  # the test's assertFalse
            with lock:
                counts["wrong_checks"] += 1

    def body() -> None:
        guard = new_guard()
        try:
            torch.set_default_device("cuda")
            check(guard)
        finally:
            torch.set_default_device(None)

    def after_round() -> None:
        if device_mod.CURRENT_DEVICE is not None:
            counts["left_set"] += 1
            device_mod.CURRENT_DEVICE = None

    if not ordered:
        sys.setswitchinterval(switch_s)
        _barrier_rounds(threads, rounds, body, errors, after=after_round)
        return {"rounds": rounds, **counts, "errors": errors.total(), "error_kinds": errors.kinds()}

    def thread_a(steps: _Steps) -> None:
        steps.wait(0)
        try:
            torch.set_default_device("cuda")
            steps.set(1)
            steps.wait(2)
        finally:
            torch.set_default_device(None)
            steps.set(3)

    def thread_b(steps: _Steps) -> None:
        # The guard keeps the device it saw when it was made (the test makes it before its
        # set_default_device), so it is made before A sets "cuda".
        guard = new_guard()
        steps.set(0)
        steps.wait(1)
        try:
            torch.set_default_device("cuda")
            steps.set(2)
            steps.wait(3)
            check(guard)
        finally:
            torch.set_default_device(None)

    _ordered_rounds(rounds, thread_a, thread_b, errors, after=after_round)
    return {"rounds": rounds, "ordered": True, **counts, "errors": errors.total(), "error_kinds": errors.kinds()}


@scenario
def mock_decorator_shared_patcher(threads: int = 4, rounds: int = 50, ordered: int = 0,
                                  switch_s: float = 1e-6) -> dict[str, Any]:
    """Not a package hazard: a test under ``@patch.object(torch._dynamo.config, "capture_scalar_outputs",
    True)`` run in N threads (torch 2.13's ``dynamo/test_misc.py::test_foreach_tensor_scalar`` at 4 threads,
    where pytest-run-parallel 0.10 does not see the decorator). The decorator is one ``_patch`` object for every
    call, and its ``__exit__`` deletes the state it saved on entry (``target``, ``temp_original``,
    ``is_local``): another thread's exit then raises ``AttributeError`` half done. When that happens after its
    ``delattr`` on a ``ConfigModule`` and before its ``setattr``, the key stays hidden from every thread
    (``_ConfigEntry.hide`` is process-global): every later compile that reads it fails with
    ``torch._dynamo.config.capture_scalar_outputs does not exist`` (230 tests of the file after it, in one run).

    ``ordered=0``: each round ``threads`` threads (a barrier) call the decorated function 20 times, the GIL
    handed over every ``switch_s`` seconds; reports the exits that raised and the rounds that left the key
    hidden (then shown again). ``ordered=1``: two threads, A enters, B enters, A leaves, B leaves (each step
    handed over by an event): B's exit raises every round."""
    from unittest.mock import patch

    import torch._dynamo

    entry = torch._dynamo.config._config["capture_scalar_outputs"]
    errors = _Errors()
    counts = {"rounds_left_hidden": 0}

    @patch.object(torch._dynamo.config, "capture_scalar_outputs", True)
    def decorated(during: Any = None) -> None:
        if not torch._dynamo.config.capture_scalar_outputs:
            raise AssertionError("the patch is not in effect inside the decorated function")
        if during is not None:
            during()

    def after_round() -> None:
        if entry.hide:
            counts["rounds_left_hidden"] += 1
            entry.hide = False

    if not ordered:
        sys.setswitchinterval(switch_s)

        def body() -> None:
            for _ in range(20):
                decorated()

        _barrier_rounds(threads, rounds, body, errors, after=after_round)
    else:

        def thread_a(steps: _Steps) -> None:
            def during() -> None:
                steps.set(0)
                steps.wait(1)

            decorated(during)
            steps.set(2)

        def thread_b(steps: _Steps) -> None:
            steps.wait(0)
            decorated(lambda: (steps.set(1), steps.wait(2)))

        _ordered_rounds(rounds, thread_a, thread_b, errors, after=after_round)
    return {"rounds": rounds, "ordered": bool(ordered), **counts, "errors": errors.total(),
            "error_kinds": errors.kinds()}


@scenario
def fx_annotate_global_race(threads: int = 4, rounds: int = 20, calls: int = 500) -> dict[str, Any]:
    """Not a package hazard: torch's ``torch.fx.traceback.current_meta`` is one module global, and
    ``fx_traceback.annotate`` (which ``torch._dynamo``'s ``_fn`` enters around every call of a function it
    disabled, ``torch._dynamo.export``'s capture among them) reads ``"custom"``, sets it, and deletes or restores
    it on exit, with no lock. In N threads one thread's exit deletes or restores the entry under another's:
    a ``KeyError: 'custom'`` on exit, or an entry left behind (or lost) that later traces copy into their
    nodes' metadata. Seen as ``fx/test_source_matcher_utils.py::test_module_partitioner_functional_linear_relu_linear``
    (run by ``test_fx.py``) at 4 threads: ``KeyError: 'custom'`` active, alone; unpatched the test dies first
    (H9). The package does not touch ``torch.fx.traceback``. Each round: ``threads`` threads (a barrier) enter
    and leave ``annotate`` ``calls`` times, yielding the GIL inside; reports the errors and the rounds after which
    ``current_meta`` kept a ``"custom"`` entry (with no thread inside, there should be none)."""
    import torch.fx.traceback as fx_traceback

    errors = _Errors()
    left = {"rounds_with_custom_left": 0}

    def body() -> None:
        for _ in range(calls):
            with fx_traceback.annotate({"_torchdynamo_disable": True}):
                time.sleep(0)

    def after() -> None:
        if "custom" in fx_traceback.current_meta:
            left["rounds_with_custom_left"] += 1
            del fx_traceback.current_meta["custom"]

    _barrier_rounds(threads, rounds, body, errors, after=after)
    return {"rounds": rounds, **left, "errors": errors.total(), "error_kinds": errors.kinds()}


class _PythonFinder:
    """A meta-path finder written in Python that finds nothing (as setuptools' ``_distutils_hack`` does for
    most names): importlib calls it holding the global import lock."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        return None


@scenario
def finder_under_import_lock_deadlock(threads: int = 4, rounds: int = 30, others: str = "keep") -> dict[str, Any]:
    """H12: a deadlock between Python's global import lock and dynamo's ``compile_lock`` (the stall of
    ``dynamo/test_misc.py`` at 4 threads, torch 2.13, in
    ``test_raises_importerror1``). The test's body, in ``threads`` threads: a compiled function that imports a
    module that does not exist. One thread compiles it; dynamo's tracing of ``IMPORT_NAME`` imports, which needs
    the import lock. Another thread runs the function's frame as it is with dynamo's callback still set (the
    frame was skipped), and its import calls each meta-path finder's ``find_spec`` while importlib's
    ``_find_spec`` holds the import lock; a finder written in Python (setuptools' ``_distutils_hack``,
    pytest's assertion rewriter, an editable install's finder; the package's own finder before dynamo was told
    to skip it) is a frame dynamo's callback does not skip, so upstream's callback waits for ``compile_lock``
    -- held by the compiling thread, which waits for the import lock. Prevented by first_compile's frame
    callback (``_callback.under_import_lock``). Each round: ``threads`` threads (a barrier) call a fresh compiled
    function, then ``torch._dynamo.reset()``. A hang leaves no result: :func:`run` reports ``timed_out``.
    ``others="drop"`` first removes from ``sys.meta_path`` every finder but importlib's own and the package's,
    as in an environment without such finders; ``others="python"`` then adds one finder written in Python
    (:class:`_PythonFinder`, a third party's as far as dynamo can tell), so that the hazard does not depend on
    what the environment installed."""
    import torch

    if others not in ("keep", "drop", "python"):
        raise ValueError(f"others must be keep, drop or python, not {others!r}")
    if others in ("drop", "python"):
        sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__module__", "") in (
            "_frozen_importlib", "_frozen_importlib_external", "torch_threadsafe_compile._bootstrap")]
    if others == "python":
        sys.meta_path.insert(0, _PythonFinder())
    errors = _Errors()
    finders = [type(f).__name__ if not isinstance(f, type) else f.__name__ for f in sys.meta_path]

    def body() -> None:
        @torch.compile(backend="eager")
        def fn(x: Any) -> Any:
            try:
                import some_module_that_surely_does_not_exist  # noqa: F401
            except ImportError:
                pass
            return x.sin()

        x = torch.randn(8)
        if not torch.equal(fn(x), x.sin()):
            raise AssertionError("wrong result")

    _barrier_rounds(threads, rounds, body, errors, after=torch._dynamo.reset)
    return {"rounds": rounds, "errors": errors.total(), "error_kinds": errors.kinds(), "meta_path": finders}


def run(name: str, env: dict[str, str] | None = None, timeout: float = 120, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter with faulthandler on. Returns its JSON result, or
    ``{"crashed": True, "signal": NAME, "frames": [...]}`` when it died of a signal."""
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-X", "faulthandler", "-m", MODULE, name, *(f"{k}={v}" for k, v in kwargs.items())]
    try:
        p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"crashed": False, "timed_out": True}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"crashed": False, "rc": p.returncode, **json.loads(line[len("RESULT "):])}
    out: dict[str, Any] = {"crashed": p.returncode < 0, "rc": p.returncode, "frames": _first_frames(p.stderr)}
    if p.returncode < 0:
        out["signal"] = signal.Signals(-p.returncode).name
    else:
        out["tail"] = p.stderr.strip().splitlines()[-5:]
    return out


def _first_frames(text: str, n: int = 4) -> list[str]:
    """The crashing thread's first frames from faulthandler's dump."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Current thread"):
            return [x.strip() for x in lines[i + 1:i + 1 + n]]
    return []


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:], module=MODULE))
