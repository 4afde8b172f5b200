"""H10, free-threaded CPython (crash, hang, spurious recompiles) — dynamo's cache-entry lists are not reordered on hits.

Dynamo keeps each code object's cache entries in a ``std::list`` (``ExtraState::cache_entry_list``). Its C
``lookup()`` walks that list on every call of a compiled function and, on a hit, moves the entry it found to
the front (``move_to_front``, a splice: dynamo's LRU order, on by default). Nothing synchronizes the list.
With the GIL, the splices happen at well-defined points and a splice keeps other threads' iterators valid, so
a thread walking the list only *misses* an entry that moved behind it (H3's spurious miss, which
``first_compile`` retries). Without the GIL, threads splice the same list at the same moment from different
cores: the links get corrupted. Measured on CPython 3.13.15t, torch 2.12.0, ``PYTHON_GIL=0``,
``python -m ttc_testing.scenarios lookup_race`` (every guard set compiled first, then 16 threads calling):
unpatched, 16–17 graphs compiled after the warm-up and ~100,000 errors in 6 s (recompiles whose reason is a
``BACKEND_MATCH`` failure against an entry's backend, i.e. a torn read; ``UnboundLocalError`` inside generated
code; H1's errors from the recompiles) in 2 of 2 runs; with the package active, one run of the hazard tests
hung (13 threads waiting for guard-manager mutexes under ``lookup``). With the reordering off, unpatched: 0
extra graphs and 0 errors in 2 of 2 runs.

Fix: on free-threaded builds, switch dynamo's LRU reordering off once, with its own switch
(``torch._C._dynamo.eval_frame._set_lru_cache(False)``, documented in ``torch/utils/checkpoint.py``). A hit
then changes nothing; a new entry is appended at the end instead of the front, so a lookup tries the entries
in the order they were compiled. What is left unsynchronized upstream: inserting a new entry (after a compile,
outside ``compile_lock``) while other threads walk the list, and invalidation (``move_to_back``, see
``guard_invalidation``); compiles are serialized by ``compile_lock``, so two insertions into one list at once
need two compiles of one code object finishing within microseconds. Cost: a code object with many entries
checks the older ones first on every call (guards fail fast; measured in docs/performance.md).

Applies on free-threaded builds only (``Py_GIL_DISABLED``); with the GIL, upstream's order is kept and
``first_compile`` retries the spurious misses. Revert switches reordering back on (upstream's default; there is
no getter for a value the program set itself). Upstream: pytorch/pytorch#195355 (a lock per ``ExtraState``),
after 2.15.
"""

from __future__ import annotations

from typing import Any

from torch_threadsafe_compile import _env
from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["entry_list_order"]

SWITCH = "_set_lru_cache"


def _c_module() -> Any:
    torch = loaded("torch")
    return getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)


def check() -> str | None:
    if not _env.free_threaded_build():
        return "not a free-threaded build: first_compile retries the spurious misses of the reordering"
    if not callable(getattr(_c_module(), SWITCH, None)):
        return f"torch._C._dynamo.eval_frame.{SWITCH} not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    switch = getattr(_c_module(), SWITCH)
    switch(False)
    changes.on_revert(lambda: switch(True))
    return {"lru_reordering": False}


def verify() -> None:
    if not callable(getattr(_c_module(), SWITCH, None)):
        raise AssertionError(f"torch._C._dynamo.eval_frame.{SWITCH} disappeared")
