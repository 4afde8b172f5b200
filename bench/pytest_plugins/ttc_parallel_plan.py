"""pytest plugin of ``bench/upstream_tests.py --parallel-threads``: both modes run the same tests in one thread.

pytest-run-parallel decides per test whether it is thread-unsafe by reading the test's source and, two calls
deep, the source of what it calls, resolving names through each function's globals. With the package active
some of torch's entry points are transparent wrappers (``functools.wraps``) whose globals are the package's,
so the same test can be judged thread-unsafe with ``TTC_DISABLE=1`` (one thread) and safe when active (N
threads): the two modes would not run the same thing. The bench therefore decides once, in a collection pass
with ``TTC_DISABLE=1`` (``BENCH_PARALLEL_PLAN_MODE=write``: the plugin's verdicts go to the JSON file
``BENCH_PARALLEL_PLAN``), and both runs use that verdict (``read``). Loaded with ``-p ttc_parallel_plan``;
written for pytest-run-parallel 0.10 (``_run-parallel`` plugin, ``_is_thread_unsafe``, ``thread_unsafe``).
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

import pytest

PLAN = os.environ.get("BENCH_PARALLEL_PLAN", "")
MODE = os.environ.get("BENCH_PARALLEL_PLAN_MODE", "")


def _plugin(config: Any) -> Any:
    return config.pluginmanager.get_plugin("_run-parallel")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: Any) -> None:
    plugin = _plugin(config)
    if plugin is None or not PLAN or MODE != "read":
        return
    with open(PLAN, encoding="utf-8") as f:
        plan: dict[str, str] = json.load(f)

    def _is_thread_unsafe(self: Any, item: Any) -> tuple[bool, Any]:
        reason = plan.get(item.nodeid)
        return (reason is not None, reason and f"{reason} (decided with TTC_DISABLE=1)")

    plugin._is_thread_unsafe = types.MethodType(_is_thread_unsafe, plugin)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: Any) -> None:
    plugin = _plugin(session.config)
    if plugin is None or not PLAN or MODE != "write":
        return
    with open(PLAN, "w", encoding="utf-8") as f:
        json.dump(dict(plugin.thread_unsafe), f)
