"""The package's own helper for a child's environment (``torch_threadsafe_compile._env.child_environ``),
loaded from this checkout by path: the compatibility matrix runs under an interpreter that need not have the
package installed, and ``_env`` is standard library only."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_ttc_env_for_bench", Path(__file__).resolve().parents[2] / "torch_threadsafe_compile" / "_env.py")
assert _spec is not None and _spec.loader is not None
_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_env)
child_environ = _env.child_environ

__all__ = ["child_environ"]
