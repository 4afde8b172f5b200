"""The conformance kit (dd-trace-py's PatchTestCase, for every patch of the table): each patch that applies
on this torch is checked by the same rules, from the journal, not from a hand-kept list of targets.

One fresh interpreter runs ``ttc_testing/conformance.py`` with the package active (every torch module some
patch waits for imported) and reports per patch; each patch of ``registry.PATCH_MODULES`` is one test
here, so a new patch is checked because it is in the table. The rules: applied edits are in place and
differ from upstream's; a second ``install()`` changes nothing; ``uninstall()`` puts upstream's objects
back, identity included, and the journal is empty; ``install()`` again edits the same attributes; a fork
while another thread holds one of the patch's module-level locks leaves a child that can take that lock
and compile. A patch that does not apply on this torch is skipped with its own reason (``status()``).
The hazard side (the scenario fails with ``TTC_DISABLE=1`` and passes active) is the hazard test each
row names (``PatchSpec.test``); :func:`test_patch_row_names_a_hazard_test_that_ci_runs` checks that the
test exists, runs the row's scenario, compares both modes, and is in CI's patch suite on every leg.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import sys

import pytest
from conftest import run_py

from torch_threadsafe_compile import registry

_cache: dict[str, dict] = {}


def _report() -> dict:
    """The probe's answer, made once per test process (one interpreter for every patch: ~20-40 s)."""
    if "r" not in _cache:
        p = run_py("import runpy, sys; sys.argv = ['conformance']; "
                   "runpy.run_module('ttc_testing.conformance', run_name='__main__')",
                   env={"TTC_DISABLE": "0"}, timeout=600)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("CONFORMANCE ")), None)
        assert p.returncode == 0 and line is not None, f"the probe failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
        _cache["r"] = json.loads(line[len("CONFORMANCE "):])
    return _cache["r"]


@pytest.mark.skipif(sys.platform == "win32", reason="the fork rule needs os.fork")
@pytest.mark.parametrize("patch_id", registry.PATCH_MODULES)
def test_patch_conforms(patch_id: str) -> None:
    rep = _report()["patches"].get(patch_id)
    assert rep is not None, f"{patch_id} is in the table but not in status()"
    assert not rep["problems"], f"{patch_id}:\n" + "\n".join(rep["problems"])
    if rep["state"] != "applied":
        # Its module-level locks were still checked above (a skipped patch's module is imported too).
        pytest.skip(f"{patch_id} is {rep['state']} on torch {_report()['torch']}: {rep['reason']}")
    # A patch may change nothing the journal can compare (entry_list_order turns a C switch, with an undo
    # action): then it must at least have something for revert to undo.
    assert rep["edits"] or rep["undo"], f"{patch_id} is applied but has nothing for uninstall() to undo"


@pytest.mark.skipif(sys.platform == "win32", reason="the fork rule needs os.fork")
def test_package_modules_locks_survive_a_fork() -> None:
    """The fork rule for the modules outside patches/ (_forksafe's rule: every module with locks resets them)."""
    core = _report()["core"]
    assert core["locks"], "no module-level lock found outside patches/: the probe looks in the wrong place"
    assert not core["problems"], "\n".join(core["problems"])


ROOT = pathlib.Path(__file__).resolve().parents[1]
# How a hazard test runs the unpatched side (TTC_DISABLE=1) beside the active one: tests/test_hazards.py's
# pair()/unpatched_until_shown(), the crash tests' crashes_unpatched(), or an explicit OFF/"1" environment.
BOTH_MODES = re.compile(r"\bpair\(|unpatched_until_shown|crashes_unpatched|hangs_unpatched|_stress\(|\bOFF\b|TTC_DISABLE|_mechanism\("
                        r"|GIL_OFF|_bench_rows\(|\bunpatched\(")


def _scenario_defined(name: str) -> bool:
    sources = [*(ROOT / "ttc_testing").rglob("*.py"), ROOT / "torch_threadsafe_compile" / "selftest.py",
               ROOT / "bench" / "stress.py"]
    return any(re.search(rf"^def {re.escape(name)}\(|^\s+\"{re.escape(name)}\":", p.read_text(), re.M) for p in sources)


@pytest.mark.parametrize("patch_id", registry.PATCH_MODULES)
def test_patch_row_names_a_hazard_test_that_ci_runs(patch_id: str) -> None:
    spec = registry.SPECS[patch_id]
    path, _, func = spec.test.partition("::")
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func), None)
    assert fn is not None, f"{patch_id}: its row names {spec.test}, which does not exist"
    body = ast.get_source_segment(source, fn) or ""
    assert BOTH_MODES.search(body), f"{spec.test} does not run the unpatched side beside the active one"
    if spec.scenario is not None:
        assert _scenario_defined(spec.scenario), f"{patch_id}: scenario {spec.scenario!r} is defined nowhere in ttc_testing"
        assert spec.scenario in source, f"{spec.test}'s file never runs scenario {spec.scenario!r}"
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import patch_suite
    finally:
        sys.path.remove(str(ROOT / ".ci"))
    assert path in patch_suite.suite(str(ROOT)), f"{path} is not in CI's patch suite"
