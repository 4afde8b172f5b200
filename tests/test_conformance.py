"""The conformance kit (dd-trace-py's PatchTestCase, for every patch of the table): each patch that applies
on this torch is checked by the same rules, from the journal, not from a hand-kept list of targets.

One fresh interpreter runs ``ttc_testing/conformance.py`` with the package active (every torch module some
patch waits for imported) and reports per patch; each patch of ``registry.PATCH_MODULES`` is one test
here, so a new patch is checked because it is in the table. The rules: applied edits are in place and
differ from upstream's; a second ``install()`` changes nothing; ``uninstall()`` puts upstream's objects
back, identity included, and the journal is empty; ``install()`` again edits the same attributes; a fork
while another thread holds one of the patch's module-level locks leaves a child that can take that lock
and compile. A patch that does not apply on this torch is skipped with its own reason (``status()``).
The hazard side (the scenario fails with ``TTC_DISABLE=1`` and passes active) is each hazard's own test:
tests/test_hazards.py, test_crash_hazards.py, test_cudagraph_*.py.
"""

from __future__ import annotations

import json
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
