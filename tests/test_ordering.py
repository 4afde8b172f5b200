"""Every patch in every order a program can activate it (issue 31): at interpreter start, installed after
its torch modules were imported, installed twice, uninstalled then installed. In each, the patch ends in
the same state as at start, and an applied patch passes its own check again (``verify()``), so it works,
not only says so. One fresh interpreter per order; the matrix is per patch.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_py
from torch_threadsafe_compile import registry

TARGETS = "import torch, torch._dynamo, torch._functorch.aot_autograd, torch.export._trace, torch._inductor.cudagraph_trees"
REPORT = """
import importlib, json
from torch_threadsafe_compile import _lifecycle
rows = {}
for pid, ps in _lifecycle.states().items():
    verified = None
    if ps.state.value == "applied":
        try:
            ps.impl.verify(); verified = True
        except Exception as e:
            verified = f"{type(e).__name__}: {e}"
    rows[pid] = [ps.state.value, verified]
print("MATRIX " + json.dumps(rows))
"""

ORDERS = {
    "at start": TARGETS,
    "installed after import": "import torch_threadsafe_compile as ttc\nttc.uninstall()\n" + TARGETS + "\nttc.install()",
    "installed twice": TARGETS + "\nimport torch_threadsafe_compile as ttc\nttc.install()\nttc.install()",
    "uninstalled then installed": TARGETS + "\nimport torch_threadsafe_compile as ttc\nttc.uninstall()\nttc.install()",
}


@pytest.fixture(scope="module")
def matrix() -> dict[str, dict[str, list]]:
    out = {}
    for order, code in ORDERS.items():
        p = run_py(code + "\n" + REPORT, timeout=300)
        line = [x for x in p.stdout.splitlines() if x.startswith("MATRIX ")]
        assert line, f"{order}: rc={p.returncode}\n{p.stderr[-3000:]}"
        out[order] = json.loads(line[-1][7:])
    return out


@pytest.mark.parametrize("patch", registry.PATCH_MODULES)
def test_patch_settles_alike_in_every_order(patch: str, matrix: dict[str, dict[str, list]]) -> None:
    reference = matrix["at start"][patch]
    assert reference[0] in ("applied", "skipped"), reference  # settled: nothing left pending once imported
    for order, rows in matrix.items():
        state, verified = rows[patch]
        assert state == reference[0], f"{patch} {order}: {state} (at start: {reference[0]})"
        assert verified in (None, True), f"{patch} {order}: verify() raised {verified}"
