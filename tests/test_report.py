"""What ``status()`` and ``doctor`` say is the state as it is: no false alarm about the package's own patches, a
state of its own for patches the user switched off, "uninstalled" told from "the start-up hook never ran", and a
non-zero doctor exit whenever protection is missing, torch not importable included (issue 39)."""

from __future__ import annotations

import json
import sysconfig

from conftest import REPO, run_py

DOCTOR = "import sys; from torch_threadsafe_compile.__main__ import main; sys.exit(main({args!r}))"


def test_doctor_sees_no_other_patcher_where_the_package_built_on_its_own_edit() -> None:
    """``export_flag`` routes ``_compiling_state_context`` through a code that ``compile_session_flag`` routed
    already: the journal knows both edits are the package's. Before: ``compile_session_flag … applied  replaced by
    another patcher since: torch._export.utils._compiling_state_context.__code__`` on a clean install."""
    p = run_py(DOCTOR.format(args=["doctor"]))
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert "replaced by another patcher" not in p.stdout, p.stdout
    rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.split()[:1]}
    assert "applied" in rows["compile_session_flag"] and "applied" in rows["export_flag"], p.stdout


def test_a_replacement_by_somebody_else_is_still_reported_and_get_original_is_upstreams() -> None:
    """The layering is known edit by edit: code swapped by somebody else on top of both patches' edits is reported
    for both; ``get_original`` answers upstream's code (the bottom edit's original), which ``uninstall()`` restores."""
    p = run_py("""
import json, torch, torch._dynamo, torch.export, torch._export.utils as u, torch_threadsafe_compile as ttc
fn = u._compiling_state_context.__wrapped__
original = ttc.get_original(u, "_compiling_state_context").__code__
names_before = list(original.co_names)
def other(*a, **k):
    yield
ours, fn.__code__ = fn.__code__, other.__code__
rows = {p["id"]: p.get("replaced_by_others", []) for p in ttc.status()["patches"]}
fn.__code__ = ours
ttc.uninstall()
print("RESULT " + json.dumps({"replaced": {k: v for k, v in rows.items() if v},
                              "upstream_restored": fn.__code__ is original,
                              "ours_in_original": [n for n in names_before if n.startswith("_ttc")]}))
""")
    res = json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    assert set(res["replaced"]) == {"compile_session_flag", "export_flag"}, res
    assert res["ours_in_original"] == [] and res["upstream_restored"], res


def test_a_patch_named_in_ttc_disable_is_disabled_not_skipped() -> None:
    """README: ``disabled`` is a state of its own. Before: ``skipped`` with the reason "disabled by TTC_DISABLE=…"."""
    p = run_py("""
import json, torch, torch._dynamo, torch_threadsafe_compile as ttc
st = ttc.status()
print("RESULT " + json.dumps({q["id"]: [q["state"], q["reason"]] for q in st["patches"]}))
""", env={"TTC_DISABLE": "first_compile,lazy_backward"})
    rows = json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    expected = ["disabled", "disabled by TTC_DISABLE=first_compile,lazy_backward"]
    assert rows["first_compile"] == expected and rows["lazy_backward"] == expected, rows
    assert rows["fx_tracing_flag"][0] == "applied", rows


def test_uninstalled_at_run_time_is_not_the_hook_that_never_ran() -> None:
    """After ``uninstall()`` the activation reads ``uninstalled`` with its reason; ``install()`` activates again.
    Before: ``not activated``, which the README defines as "the start-up hook did not run"."""
    p = run_py("""
import json, torch, torch_threadsafe_compile as ttc
keys = lambda st: {k: st[k] for k in ("activation", "inactive_reason", "active")}
before = keys(ttc.status())
ttc.uninstall()
after = keys(ttc.status())
ttc.install()
again = keys(ttc.status())
print("RESULT " + json.dumps([before, after, again]))
""")
    before, after, again = json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    assert before == {"activation": "pth", "inactive_reason": None, "active": True}, before
    assert after["activation"] == "uninstalled" and not after["active"], after
    assert "uninstall()" in after["inactive_reason"], after
    assert again == {"activation": "explicit", "inactive_reason": None, "active": True}, again


def test_not_activated_has_a_reason_and_is_not_active() -> None:
    """``inactive_reason`` is None exactly when the package is active: readers that took "no reason" for active
    read a process the start-up hook missed (``python -S``: no .pth processed) as protected."""
    paths = [sysconfig.get_paths()["purelib"], str(REPO)]
    p = run_py(f"""
import sys; sys.path[:0] = {paths!r}
import json, torch_threadsafe_compile as ttc
st = ttc.status()
print("RESULT " + json.dumps({{k: st.get(k) for k in ("activation", "inactive_reason", "active", "protection_missing")}}))
""", args=["-S"])
    res = json.loads([line for line in p.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    assert res["activation"] == "not activated" and res["active"] is False and res["inactive_reason"], res
    assert res["protection_missing"][0] == "not activated", res


def test_doctor_fails_when_torch_is_not_importable(tmp_path) -> None:
    """Every patch then waits for torch and none ever applies: protection is missing, exit 1, and the doctor says
    why. Before: 21 rows ``pending  waits for torch`` and exit 0. Off on purpose (``TTC_DISABLE=1``) stays 0."""
    broken = tmp_path / "torch"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    p = run_py(DOCTOR.format(args=["doctor"]), env=env, cwd=str(tmp_path))
    assert p.returncode == 1, p.stdout + p.stderr[-2000:]
    assert "torch       not importable: ImportError: this torch is broken on purpose" in p.stdout, p.stdout
    missing = [line for line in p.stdout.splitlines() if line.startswith("protection missing: ")]
    assert missing and "torch not importable" in missing[0], p.stdout
    p = run_py(DOCTOR.format(args=["doctor", "--json"]), env=env, cwd=str(tmp_path))
    assert p.returncode == 1 and "torch not importable" in json.loads(p.stdout)["protection_missing"][0], p.stdout
    p = run_py(DOCTOR.format(args=["doctor"]), env={**env, "TTC_DISABLE": "1"}, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]


def test_doctor_documents_its_exit_codes() -> None:
    p = run_py(DOCTOR.format(args=["doctor", "--help"]))
    text = " ".join(p.stdout.split())
    assert "exit status: 0" in text and "1 protection is missing" in text and "2 usage" in text, p.stdout
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "exits 1 when protection is missing" in readme and "torch not importable" in readme
