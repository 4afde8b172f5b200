"""pytest plugin of ``bench/upstream_tests.py``: run the stored upstream test files on other torch releases.

The files in the shared test tree import against torch 2.13, whose ``import torch`` also imports
``torch._opaque_base``; ``fx/test_opaque_infrastructure.py`` (imported by ``test_fx.py``) reads
``torch._opaque_base.OpaqueBase`` without importing it. torch 2.15 ships the module but no longer imports it
with ``torch``, so ``test_fx.py`` fails to collect there, in both modes alike. This plugin imports such
modules before collection when the running torch has them but did not import them: the test files stay as
upstream wrote them, and both modes get the same shim. The bench loads it with ``-p ttc_torch_compat`` in
every pytest child, one thread or N.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

# Submodules that torch 2.13's ``import torch`` imported and that the stored test files use as attributes.
IMPORTED_BY_TORCH_2_13 = ("torch._opaque_base",)


def pytest_configure(config: Any) -> None:
    import torch

    for name in IMPORTED_BY_TORCH_2_13:
        if name in sys.modules or hasattr(torch, name.rpartition(".")[2]):
            continue
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
