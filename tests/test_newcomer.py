"""A newcomer adds a patch: one module under ``patches/``, one row in the table, one scenario, its hazard test.
Nothing else is edited, and every part of the package picks the patch up: ``TTC_DISABLE``'s ids, the
interpreter-start hook (it watches a module no other patch waits for), the lifecycle and ``doctor``, the
capability a patch requires (handed over by the journal), the conformance kit and CI's patch suite.

The patch is added to a copy of the source tree (the package, ``ttc_testing``, ``.ci``); the checks run in
fresh interpreters with that copy first on ``PYTHONPATH``, so the interpreter start activates the copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH_ID = "dummy_probe"
# A torch module that `import torch` loads and that no real patch waits for: the hook must watch it
# because of the new row alone.
TARGET = "torch.nn.functional"

MODULE = f'''
"""A patch for tests only (H0): marks {TARGET} with a function that says whether the capability it
requires, compile_lock.priority, is provided. Shows what a patch module is: SPEC, check, apply, verify."""

from __future__ import annotations

from typing import Any

from torch_threadsafe_compile._journal import Changes
from torch_threadsafe_compile._torch import loaded
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["{PATCH_ID}"]


def check() -> str | None:
    return None if hasattr(loaded("{TARGET}"), "relu") else "relu not found"


def apply(changes: Changes) -> dict[str, Any]:
    priority = changes.require("compile_lock.priority")
    changes.setattr(loaded("{TARGET}"), "_ttc_dummy_probe", lambda: priority.get() is not None)
    return {{}}


def verify() -> None:
    assert callable(loaded("{TARGET}")._ttc_dummy_probe)
'''

ROW = f'''        PatchSpec(
            id="{PATCH_ID}",
            hazard="H0",
            summary="tests only: marks {TARGET}",
            upstream="none (tests/test_newcomer.py)",
            torch_versions=">=2.4",
            modules=("{TARGET}",),
            requires=("compile_lock.priority",),
            scenario="{PATCH_ID}",
            test="tests/test_{PATCH_ID}.py::test_h0_{PATCH_ID}",
        ),
'''

SCENARIO = f'''
"""H0 (tests only): whether {TARGET} carries the dummy patch's mark."""

from __future__ import annotations

from typing import Any

from torch_threadsafe_compile.selftest import scenario


@scenario
def {PATCH_ID}() -> dict[str, Any]:
    import torch._dynamo  # noqa: F401 - compile_lock_watchdog, the capability's provider, applies with it
    import torch.nn.functional as F

    probe = getattr(F, "_ttc_dummy_probe", None)
    return {{"marked": probe is not None, "priority": bool(probe is not None and probe())}}
'''

TEST = f'''
from ttc_testing import scenarios


def test_h0_{PATCH_ID}() -> None:
    off = scenarios.run("{PATCH_ID}", env={{"TTC_DISABLE": "1"}})
    on = scenarios.run("{PATCH_ID}", env={{"TTC_DISABLE": "0"}})
    assert off["marked"] is False and on["marked"] is True and on["priority"] is True
'''


def _tree(tmp: Path) -> Path:
    """A copy of the source tree with the new patch: exactly four files added or changed."""
    root = tmp / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("torch_threadsafe_compile", "ttc_testing", ".ci", "tests"):
        shutil.copytree(REPO / part, root / part, ignore=ignore)
    (root / "torch_threadsafe_compile" / "patches" / f"{PATCH_ID}.py").write_text(MODULE)
    table = root / "torch_threadsafe_compile" / "registry.py"
    text = table.read_text()
    end = text.index("    )\n}\nPATCH_MODULES")  # the end of the rows
    table.write_text(text[:end] + ROW + text[end:])
    scenarios = root / "ttc_testing" / "scenarios"
    assert scenarios.is_dir(), "ttc_testing.scenarios must be a package whose modules are found on their own"
    (scenarios / f"{PATCH_ID}.py").write_text(SCENARIO)
    (root / "tests" / f"test_{PATCH_ID}.py").write_text(TEST)
    return root


def _changed(root: Path) -> list[str]:
    """The files of the copy that differ from the repository's or are new (what the newcomer touched)."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and "__pycache__" not in rel.parts:
            orig = REPO / rel
            if not orig.is_file() or orig.read_bytes() != path.read_bytes():
                out.append(rel.as_posix())
    return out


def _run(root: Path, code: str, env: dict[str, str] | None = None, args: list[str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TTC_")}
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join([str(root), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, *(args or ["-c", textwrap.dedent(code)])], env=full, cwd=str(root),
                          capture_output=True, text=True, timeout=timeout)


def _out(p: subprocess.CompletedProcess[str], tag: str = "OUT ") -> dict:
    line = next((x for x in p.stdout.splitlines() if x.startswith(tag)), None)
    assert p.returncode == 0 and line is not None, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return json.loads(line[len(tag):])


@pytest.mark.skipif(sys.platform == "win32", reason="the conformance kit forks")
def test_a_new_patch_is_picked_up_everywhere_from_its_row(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert _changed(root) == sorted([
        f"tests/test_{PATCH_ID}.py", "torch_threadsafe_compile/registry.py",
        f"torch_threadsafe_compile/patches/{PATCH_ID}.py", f"ttc_testing/scenarios/{PATCH_ID}.py"])

    # TTC_DISABLE knows the id; the interpreter-start hook watches its module and the lifecycle applies it
    # when `import torch` imports that module; the capability it requires is handed over by the journal.
    p = _run(root, f"""
        import json, sys
        import torch_threadsafe_compile as ttc
        from torch_threadsafe_compile import _bootstrap, _env
        import torch, torch._dynamo
        import torch.nn.functional as F
        state = {{p["id"]: p for p in ttc.status()["patches"]}}["{PATCH_ID}"]
        print("OUT " + json.dumps({{
            "package": ttc.__file__, "known": "{PATCH_ID}" in _env.known_patches(),
            "problems": _env.read_settings({{"TTC_DISABLE": "{PATCH_ID}"}}).problems,
            "watched": "{TARGET}" in (_bootstrap._finder.watched or ()),
            "state": state["state"], "reason": state.get("reason", ""), "priority": F._ttc_dummy_probe()}}))
    """)
    out = _out(p)
    assert out["package"].startswith(str(root)), out  # the copy, activated at interpreter start
    assert out["known"] and not out["problems"], out
    assert out["watched"], out
    assert out["state"] == "applied" and out["priority"] is True, out

    # Switched off by its id, like any other patch.
    off = _out(_run(root, f"""
        import json, torch_threadsafe_compile as ttc, torch
        print("OUT " + json.dumps({{p["id"]: p["state"] for p in ttc.status()["patches"]}}["{PATCH_ID}"]))
    """, env={"TTC_DISABLE": PATCH_ID}))
    assert off == "disabled", off

    # doctor lists it with its hazard.
    doctor = _run(root, "", args=["-m", "torch_threadsafe_compile", "doctor"])
    row = next((x for x in doctor.stdout.splitlines() if x.startswith(PATCH_ID)), "")
    assert "H0" in row and "applied" in row, doctor.stdout[-3000:] + doctor.stderr[-2000:]

    # The conformance kit checks it like every other patch.
    kit = _out(_run(root, "", args=["-m", "ttc_testing.conformance"], timeout=600), "CONFORMANCE ")
    rep = kit["patches"][PATCH_ID]
    assert rep["state"] == "applied" and not rep["problems"], rep
    assert any("_ttc_dummy_probe" in e for e in rep["edits"]), rep

    # CI's patch suite runs its hazard test, on every leg.
    for leg in ("gil", "ft"):
        suite = _run(root, "", args=[".ci/patch_suite.py", "--leg", leg]).stdout.split()
        assert f"tests/test_{PATCH_ID}.py" in suite, (leg, suite)

    # Its scenario shows the hazard with TTC_DISABLE=1 and not active (what its hazard test asserts).
    test = _run(root, "", args=["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                f"tests/test_{PATCH_ID}.py"])
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-2000:]
