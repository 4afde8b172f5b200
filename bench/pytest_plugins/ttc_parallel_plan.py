"""pytest plugin of ``bench/upstream_tests.py --parallel-threads``: both modes run the same tests in one thread.

pytest-run-parallel decides per test whether it is thread-unsafe by reading the test's source and, two calls
deep, the source of what it calls, resolving names through each function's globals. With the package active
some of torch's entry points are transparent wrappers (``functools.wraps``) whose globals are the package's,
so the same test can be judged thread-unsafe with ``TTC_DISABLE=1`` (one thread) and safe when active (N
threads): the two modes would not run the same thing. The bench therefore decides once, in collection passes
(``BENCH_PARALLEL_PLAN_MODE=write``: the plugin's verdicts go to the JSON file ``BENCH_PARALLEL_PLAN``) with
``TTC_DISABLE=1`` and, for the default union plan, active too; both runs read the merged plan (``read``).
Loaded with ``-p ttc_parallel_plan``; written for pytest-run-parallel 0.10 (``_run-parallel`` plugin,
``_is_thread_unsafe``, ``thread_unsafe``).

The collection pass also reads the test's own function. torch's ``TestCase.__init__`` replaces each test
method by a ``functools.wraps`` wrapper defined in ``torch.testing._internal.common_utils``, and the plugin
resolves names through the wrapper's globals: a test module's ``from unittest.mock import patch`` is not
among them, so ``with patch("...config.e_bool", False)`` in 4 threads passed as thread-safe (one thread's
``mock`` exit deletes the attribute, which hides it from every thread of the process: ``ConfigModule``'s
``hide`` flag is process-global). When the wrapper is judged safe, the function under ``__wrapped__`` is
judged too, with the same settings. And a listed object that the test's own code reaches through a bare
global name counts whatever its type: the plugin resolves bare names of functions only, so ``with
profile(...)`` (``torch.profiler.profile``, a class) ran in N threads. A listed function the test imports
inside its own body (``from .utils import install_guard_manager_testing_hook``; the bench's
``THREAD_UNSAFE_IMPORTED``, given in ``BENCH_THREAD_UNSAFE_IMPORTS``) is matched by its module's last name and
its own name, since judging imports nothing. A test under a ``mock.patch`` decorator runs in one thread
(``_mock_decorated``).
"""

from __future__ import annotations

import dis
import inspect
import json
import os
import sys
import types
from typing import Any

import pytest

PLAN = os.environ.get("BENCH_PARALLEL_PLAN", "")
MODE = os.environ.get("BENCH_PARALLEL_PLAN_MODE", "")
# "module.name" entries, comma-separated: functions a test may import inside its body (see the docstring).
IMPORTED = frozenset(tuple(n.rsplit(".", 1)) for n in os.environ.get("BENCH_THREAD_UNSAFE_IMPORTS", "").split(",")
                     if "." in n)


def _plugin(config: Any) -> Any:
    return config.pluginmanager.get_plugin("_run-parallel")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: Any) -> None:
    plugin = _plugin(config)
    if plugin is None or not PLAN:
        return
    if MODE == "write":
        _judge_own_function_too(plugin)
        return
    if MODE != "read":
        return
    with open(PLAN, encoding="utf-8") as f:
        plan: dict[str, str] = json.load(f)

    def _is_thread_unsafe(self: Any, item: Any) -> tuple[bool, Any]:
        reason = plan.get(item.nodeid)
        return (reason is not None, reason and f"{reason} (the bench's thread plan)")

    plugin._is_thread_unsafe = types.MethodType(_is_thread_unsafe, plugin)


def _judge_own_function_too(plugin: Any) -> None:
    """Write mode: a test the plugin judges safe through a wrapper is judged again through the function it wraps."""
    from pytest_run_parallel.thread_unsafe_detection import identify_thread_unsafe_nodes

    judge = plugin._is_thread_unsafe

    def _is_thread_unsafe(self: Any, item: Any) -> tuple[bool, Any]:
        unsafe, reason = judge(item)
        if unsafe:
            return unsafe, reason
        obj = getattr(item, "obj", None)  # read once: pytest resolves it on the item
        patched = _mock_decorated(obj)
        if patched:
            return True, f"decorated with {patched} (one patcher object shared by the threads)"
        own = inspect.unwrap(obj) if obj is not None else None
        if own is None:
            return unsafe, reason
        if own is not obj:
            unsafe, reason = identify_thread_unsafe_nodes(
                own, self.skipped_functions, self.mark_warnings_as_unsafe, self.mark_ctypes_as_unsafe,
                self.mark_hypothesis_as_unsafe)
            if unsafe:
                return unsafe, reason and f"{reason} (in the test's own function)"
        name = _listed_object_used(own, self.skipped_functions, IMPORTED)
        if name:
            return True, f"uses thread-unsafe {name} (imported by name; in the test's own function)"
        return unsafe, reason

    plugin._is_thread_unsafe = types.MethodType(_is_thread_unsafe, plugin)


def _mock_decorated(fn: Any) -> str | None:
    """``"mock.patch"`` when a function on ``fn``'s ``__wrapped__`` chain is a ``unittest.mock.patch``
    decorator's wrapper (it carries ``patchings``), else None. The decorator is one ``_patch`` object for every
    call: in N threads one thread's exit deletes the state (``target``, ``temp_original``, ``is_local``) another
    thread's exit still needs, so that exit raises half done: on a ``ConfigModule`` after its ``delattr`` and
    before its ``setattr``, which leaves the key hidden from every thread (``hide`` is process-global) for the
    rest of the file (``test_misc.py::test_foreach_tensor_scalar``, ``@patch.object(torch._dynamo.config,
    "capture_scalar_outputs", True)``: 230 later tests of the file failed with ``capture_scalar_outputs does
    not exist``, active in one run, unpatched in another). pytest-run-parallel 0.10 reads the test's code,
    where a decorator does not appear."""
    seen = 0
    while fn is not None and seen < 100:  # a bounded walk: a __wrapped__ cycle must not hang collection
        if getattr(fn, "patchings", None):
            return "mock.patch"
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def _listed_object_used(fn: Any, listed: frozenset[tuple[str, str]],
                        imported: frozenset[tuple[str, str]] = frozenset()) -> str | None:
    """The listed entry (``module.name`` of ``thread_unsafe_functions``) that ``fn``'s code reaches through one
    of its global names, or None. pytest-run-parallel 0.10 resolves a bare name (``profile(...)`` after ``from
    torch.profiler import profile``) only when it is bound to a *function*: a class such as
    ``torch.profiler.profile`` slipped through (``test_aot_autograd.py::test_eager_sequence_nr`` ran its
    profiler in 4 threads and died of SIGSEGV in ``profiler.py __exit__``). Matched by identity with the
    listed object, which is looked up only in modules already imported (judging imports nothing). An
    ``imported`` entry counts when the test's code runs ``from <module> import <name>`` with the entry's name
    and a module whose last name is the entry module's last name."""
    wanted: dict[int, str] = {}
    for mod, attr in listed:  # the plugin's (module, name) pairs
        obj = getattr(sys.modules.get(mod), attr, None)
        if obj is not None:
            wanted[id(obj)] = f"{mod}.{attr}"
    # ``from <module> import <name>`` run by the test itself: (last name of the module, name) -> entry.
    by_name = {(mod.rsplit(".", 1)[-1], attr): f"{mod}.{attr}" for mod, attr in imported}
    code = getattr(fn, "__code__", None)
    glb = getattr(fn, "__globals__", None)
    if code is None or not isinstance(glb, dict) or not (wanted or by_name):
        return None
    stack = [code]
    while stack:
        c = stack.pop()
        module = None
        # Global loads only: co_names also holds attribute names (``config.patch`` is not ``mock.patch``).
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in glb:
                hit = wanted.get(id(glb[ins.argval]))
                if hit:
                    return hit
            elif ins.opname == "IMPORT_NAME":
                module = str(ins.argval).rsplit(".", 1)[-1]
            elif ins.opname == "IMPORT_FROM" and module is not None:
                hit = by_name.get((module, ins.argval))
                if hit:
                    return hit
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: Any) -> None:
    plugin = _plugin(session.config)
    if plugin is None or not PLAN or MODE != "write":
        return
    with open(PLAN, "w", encoding="utf-8") as f:
        json.dump(dict(plugin.thread_unsafe), f)
