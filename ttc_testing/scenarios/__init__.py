"""Every hazard scenario, each run in its own interpreter and reporting one JSON line.

Shared by the tests (``tests/test_hazards.py`` …), the benches and the compatibility matrix, so that all of
them measure the same thing. The four scenarios that ``doctor --selftest`` needs ship in the wheel
(``torch_threadsafe_compile/selftest.py``); this package registers the rest on top of them, one module per
hazard group (``h1_fx``, ``h3_first_compile``, … ``no_harm``; docs/hazards.md names the hazards). Every module
of the package whose name does not start with ``_`` is imported here, so a new module's ``@scenario``
functions register with no other file changed. Not installed: it is imported from the source tree (the
repository root on ``sys.path``).

    python -m ttc_testing.scenarios NAME [key=value ...]
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from torch_threadsafe_compile import selftest
from torch_threadsafe_compile.selftest import SCENARIOS
from torch_threadsafe_compile.selftest import scenario as scenario  # re-exported: ttc_testing.freethreaded registers with it
from ttc_testing.scenarios._common import _env
from ttc_testing.scenarios._common import _run_for as _run_for  # re-exported: the scenarios of other modules use it

MODULE = "ttc_testing.scenarios"
__all__ = ["SCENARIOS", "run", "start_many", "collect_many"]


def _load_modules() -> list[str]:
    """Import every scenario module of this package (name order); each scenario it registers becomes an
    attribute of the package too (``from ttc_testing.scenarios import drafter_flex``)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        globals().update({k: v for k, v in vars(module).items() if SCENARIOS.get(k) is v})
    return names


MODULES = _load_modules()


def run(name: str, env: dict[str, str] | None = None, timeout: float = 300, **kwargs: Any) -> dict[str, Any]:
    """Run scenario ``name`` in a fresh interpreter; returns its JSON result (or rc/tail/timeout)."""
    return selftest.run(name, env=_env(env), timeout=timeout, module=MODULE, **kwargs)


def start_many(plan: list[tuple[str, dict[str, Any]]], env: dict[str, str] | None = None) -> Any:
    return selftest.start_many(plan, env=_env(env), module=MODULE)


collect_many = selftest.collect_many
