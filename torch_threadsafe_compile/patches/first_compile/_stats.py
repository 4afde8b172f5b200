"""Per compiled code object: compiles, calls served by another thread's compile, lookup retries, waits.

Keyed weakly by code object, so the table shrinks when dynamo and the program drop a function.
"""

from __future__ import annotations

import os
import threading
import types
import weakref
from typing import Any

from torch_threadsafe_compile import _forksafe

FIELDS = ("compiles", "served_by_other_thread", "lookup_retries", "waits")

# One lock for every table (there is one per installed callback): a leaf lock, nothing is taken under it.
_lock = threading.Lock()


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it


class Stats:
    def __init__(self) -> None:
        self._by_code: weakref.WeakKeyDictionary[types.CodeType, dict[str, Any]] = weakref.WeakKeyDictionary()

    @staticmethod
    def label(code: types.CodeType) -> str:
        return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"

    def record(self, code: types.CodeType, what: str, waited: float = 0.0) -> None:
        with _lock:
            row = self._by_code.get(code)
            if row is None:
                row = self._by_code[code] = {**dict.fromkeys(FIELDS, 0), "wait_s_total": 0.0, "wait_s_max": 0.0}
            row[what] += 1
            if waited > 1e-3:
                row["waits"] += 1
                row["wait_s_total"] = round(row["wait_s_total"] + waited, 4)
                row["wait_s_max"] = round(max(row["wait_s_max"], waited), 4)

    def report(self) -> dict[str, dict[str, Any]]:
        with _lock:
            return {self.label(code): dict(row) for code, row in list(self._by_code.items())}

    def clear(self) -> None:
        with _lock:
            self._by_code.clear()

    def __len__(self) -> int:
        return len(self._by_code)
