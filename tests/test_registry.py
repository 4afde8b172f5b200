"""The registry: specs are complete, ordered, watched; install/uninstall restore identity exactly."""

from __future__ import annotations

import json

from conftest import run_py

import importlib

from torch_threadsafe_compile import _bootstrap, _env, _version_ranges, registry
from torch_threadsafe_compile.registry import PatchSpec


def _specs() -> list[PatchSpec]:
    specs = [importlib.import_module(registry.SPECS[name].module).SPEC for name in registry.PATCH_MODULES]
    # each module binds its own entry of the registry's table (the table is read without importing them)
    assert [s is registry.SPECS[s.id] for s in specs] == [True] * len(specs)
    return specs


def test_every_patch_declares_its_spec() -> None:
    from packaging.specifiers import SpecifierSet

    ids = [s.id for s in _specs()]
    assert ids == list(registry.PATCH_MODULES), "patch id must equal its module name"
    for spec in _specs():
        assert spec.hazard.startswith("H") and spec.summary and spec.upstream
        SpecifierSet(spec.torch_versions)  # parses
        assert spec.modules and all(m == "torch" or m.startswith("torch.") for m in spec.modules)


def test_bootstrap_and_env_read_the_table() -> None:
    # No hand-kept copies: the interpreter-start hook and TTC_DISABLE's ids come from the table itself.
    finder = _bootstrap._PostImportFinder()
    assert finder.find_spec("json") is None and finder.watched is None, "the table is read only for torch modules"
    finder.find_spec("torch.this_module_does_not_exist")
    assert finder.watched == registry.watched_modules(_specs())
    assert _env.known_patches() == set(registry.PATCH_MODULES)
    assert not _env.read_settings({"TTC_DISABLE": ",".join(registry.PATCH_MODULES)}).problems
    assert _env.read_settings({"TTC_DISABLE": "no_such_patch"}).problems


def test_declared_contracts_name_real_patches_and_capabilities() -> None:
    ids = set(registry.PATCH_MODULES)
    providers = registry.capability_providers()
    for spec in _specs():
        assert set(spec.after) <= ids and spec.id not in spec.after, spec.id
        assert set(spec.requires) <= set(providers), f"{spec.id} requires what nobody provides: {spec.requires}"
        assert not set(spec.provides) & set(spec.requires), spec.id
    required = {name for spec in _specs() for name in spec.requires}
    assert set(providers) <= required, f"provided but never required: {set(providers) - required}"


def test_undeclared_capabilities_are_refused() -> None:
    """The journal enforces the rows: a capability a patch did not declare fails its apply."""
    import types

    import pytest

    from torch_threadsafe_compile._journal import Changes, UndeclaredCapability

    with pytest.raises(UndeclaredCapability, match="provides"):
        Changes("export_serial").provide("compile_lock.priority", object())
    with pytest.raises(UndeclaredCapability, match="requires"):
        Changes("export_serial").require("compile_lock.priority")
    with pytest.raises(UndeclaredCapability, match="requires"):
        Changes("export_serial").redirect_module(types.ModuleType("torch.compiler"), {})
    with pytest.raises(UndeclaredCapability):
        Changes("not_in_the_table").require("call_plumbing")
    # Declared: provided while applied, withdrawn by revert, read by the consumer at call time.
    consumer = Changes("first_compile").require("call_plumbing")
    before = list(consumer.values)
    provider, token = Changes("fx_patcher"), compile("0", "<token>", "eval")
    provider.provide("call_plumbing", token)
    assert consumer.values[-1] is token and consumer.get() is token
    provider.revert()
    assert consumer.values == before


def test_undeclared_use_fails_the_patch_at_apply_time() -> None:
    """A patch whose apply uses a capability its row does not declare ends ``failed``, reverted."""
    code = """
import json, sys, torch, torch._dynamo, torch.export._trace
from torch_threadsafe_compile import _lifecycle, registry
from torch_threadsafe_compile.patches import export_serial
spec = registry.SPECS["export_serial"]
real_apply = export_serial.apply
def apply(changes):
    real_apply(changes)
    changes.require("compile_lock.priority")  # not in export_serial's row
export_serial.apply = apply
import torch_threadsafe_compile as ttc
ttc.uninstall(); ttc.install()
ps = _lifecycle.states()["export_serial"]
print("OUT " + json.dumps({"state": ps.state.value, "reason": ps.reason}))
"""
    p = run_py(code, env={"TTC_DISABLE": "0"}, timeout=120)
    line = [x for x in p.stdout.splitlines() if x.startswith("OUT ")]
    assert line, p.stderr[-2000:]
    out = json.loads(line[0][4:])
    assert out["state"] == "failed" and "UndeclaredCapability" in out["reason"], out


def test_capability_handles_come_only_from_the_journal() -> None:
    """Patches reach a capability only through ``Changes.provide``/``require`` (so the row is checked):
    nothing outside ``_journal`` touches its store."""
    import pathlib

    root = pathlib.Path(registry.__file__).parent
    for path in root.rglob("*.py"):
        if path.name == "_journal.py":
            continue
        text = path.read_text()
        assert "_capability(" not in text and "_capabilities" not in text, path


def test_order_respects_dependencies() -> None:
    order = list(registry.PATCH_MODULES)
    for spec in _specs():
        for dep in spec.after:
            assert order.index(dep) < order.index(spec.id), f"{spec.id} must come after {dep}"


def test_each_patch_module_cites_its_hazard() -> None:
    for name in registry.PATCH_MODULES:
        mod = importlib.import_module(f"torch_threadsafe_compile.patches.{name}")
        assert mod.SPEC.hazard in (mod.__doc__ or ""), f"{name}: docstring must name {mod.SPEC.hazard}"
        for fn in ("check", "apply", "verify"):
            assert callable(getattr(mod, fn)), f"{name}.{fn}"


# Objects every patch touches, as (expression, is-a-function-whose-code-may-be-swapped).
TARGETS = """
import torch, torch._dynamo, torch._functorch.config, types, threading
import torch.fx._symbolic_trace as st
import torch._dynamo.convert_frame as cf
import torch._dynamo.eval_frame as ef
import torch.utils._config_module as cm
def snapshot():
    out = {
        "st.class": type(st), "compiler.class": type(torch.compiler),
        "Tracer.trace": st.Tracer.__dict__["trace"], "compile_lock": cf.compile_lock,
        "CEW.__call__": cf.CatchErrorsWrapper.__dict__["__call__"],
        "TDC.__call__": ef._TorchDynamoContext.__dict__["__call__"],
        "CM.__setattr__": cm.ConfigModule.__dict__["__setattr__"], "CM.__delattr__": cm.ConfigModule.__dict__["__delattr__"],
        "Patcher.patch": st._Patcher.__dict__["patch"], "Patcher.patch_method": st._Patcher.__dict__["patch_method"],
        "st._new_patcher": st.__dict__.get("_new_patcher"),
        # The thread-local objects that rewritten code reads stay bound after uninstall(): a generator
        # suspended inside rewritten code (another thread's compile session) reads them when it resumes
        # (_journal.Changes.inject, linger=True). Every other name of ours is gone.
        "st.names": sorted(k for k in vars(st) if k.startswith("_ttc") and not k.startswith("_ttc_tls_")),
        "compiler.names": sorted(k for k in vars(torch.compiler) if k.startswith("_ttc") and not k.startswith("_ttc_tls_")),
    }
    for name in ("is_fx_tracing", "is_fx_symbolic_tracing"):
        f = getattr(st, name, None)
        if f is not None:
            out[name] = (f, f.__code__)
    f = torch.compiler.is_compiling
    out["is_compiling"] = (f, f.__code__)
    out["force_non_lazy"] = getattr(torch._functorch.config, "force_non_lazy_backward_lowering", None)
    return out
def fingerprint(snap):
    def fp(v):
        if isinstance(v, tuple):
            return [fp(x) for x in v]
        if isinstance(v, types.CodeType):
            return [v.co_filename.rsplit("torch", 1)[-1], v.co_firstlineno, v.co_code.hex()[:64]]
        if isinstance(v, list):
            return v
        return [type(v).__module__, type(v).__qualname__, getattr(v, "__qualname__", None), getattr(v, "__module__", None)] if not isinstance(v, (bool, type(None))) else v
    return {k: fp(v) for k, v in snap.items()}
"""


def test_disabled_leaves_torch_as_upstream_ships_it() -> None:
    code = TARGETS + """
import json, torch_threadsafe_compile as ttc
ttc.install()  # must be a no-op under TTC_DISABLE=1
print("FP " + json.dumps(fingerprint(snapshot())))
print("STATES " + json.dumps(sorted({p["state"] for p in ttc.status()["patches"]})))
"""
    off = run_py(code, env={"TTC_DISABLE": "1"})
    assert off.returncode == 0, off.stderr
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in off.stdout.splitlines() if line[:3] in ("FP ", "STA")}
    fp = lines["FP"]
    assert lines["STATES"] == ["disabled"]
    assert fp["st.names"] == [] and fp["compiler.names"] == []
    assert fp["st.class"][2] == "module" and fp["compiler.class"][2] == "module"
    assert fp["CEW.__call__"][3] == "torch._dynamo.convert_frame"
    assert fp["compile_lock"][1] == "RLock"

    # The same process state, reached by installing then uninstalling, is identical.
    code2 = TARGETS + """
import json, torch_threadsafe_compile as ttc
ttc.uninstall()
print("FP " + json.dumps(fingerprint(snapshot())))
"""
    on = run_py(code2)
    assert on.returncode == 0, on.stderr
    fp2 = json.loads([line for line in on.stdout.splitlines() if line.startswith("FP ")][0][3:])
    assert fp2 == fp


def test_install_uninstall_round_trips_restore_identity() -> None:
    code = TARGETS + """
import torch_threadsafe_compile as ttc
applied = lambda: sorted(p["id"] for p in ttc.status()["patches"] if p["state"] == "applied")
first = applied()
ttc.uninstall()
orig = snapshot()
assert not applied()
for round in range(2):
    ttc.install()
    assert applied() == first, (applied(), first)
    patched = snapshot()
    changed = [k for k in orig if orig[k] != patched[k]]
    ttc.uninstall()
    back = snapshot()
    for k in orig:
        a, b = orig[k], back[k]
        same = all(x is y for x, y in zip(a, b)) if isinstance(a, tuple) else (a == b if isinstance(a, list) else a is b)
        assert same, f"{k} not restored: {a!r} vs {b!r}"
    ttc.install()
    assert ttc.install()["patches"] == ttc.status()["patches"]  # idempotent
    ttc.uninstall()
print("OK", first, changed)
"""
    p = run_py(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("OK"), p.stdout
    # Sanity: the round trip did change things while installed (otherwise the test proves nothing).
    assert "Tracer.trace" in p.stdout or "is_compiling" in p.stdout or "compile_lock" in p.stdout


def test_is_patched_and_get_original() -> None:
    code = """
import torch, torch._dynamo, torch_threadsafe_compile as ttc
import torch._dynamo.convert_frame as cf
assert ttc.is_patched(cf, "compile_lock")
orig = ttc.get_original(cf, "compile_lock")
assert type(orig).__name__ == "RLock" and cf.compile_lock._inner is orig
ttc.uninstall()
assert not ttc.is_patched(cf, "compile_lock") and cf.compile_lock is orig
print("ok")
"""
    p = run_py(code)
    assert p.stdout.strip() == "ok", p.stderr[-2000:]


def test_doctor_reports_every_patch() -> None:
    p = run_py("import sys; from torch_threadsafe_compile.__main__ import main; sys.exit(main(['doctor']))")
    assert p.returncode == 0, p.stderr
    for spec in _specs():
        assert spec.id in p.stdout
    assert "activation  pth" in p.stdout
    p = run_py("import sys; from torch_threadsafe_compile.__main__ import main; sys.exit(main(['doctor']))", env={"TTC_DISABLE": "1"})
    assert "activation  disabled" in p.stdout


def test_fast_version_check_agrees_with_packaging() -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    specs = {s.torch_versions for s in _specs()} | {">=2.14", "<2.14.1,>=2.4", "==2.13.0", "!=2.12.1", ">2.9"}
    for raw in ["2.4.0", "2.4.1", "2.9.1", "2.12.1", "2.13.0", "2.13.0+cpu", "2.14", "2.14.0", "2.14.1", "2.15.0", "2.16.0", "3.0.0"]:
        v, err = _version_ranges.parse(raw)
        assert isinstance(v, tuple) and err is None, raw
        ref = Version(Version(raw).base_version)
        for spec in specs:
            assert _version_ranges.version_in(v, spec) == SpecifierSet(spec, prereleases=True).contains(ref, prereleases=True), (raw, spec)
    # Pre-releases and dev builds go through packaging.
    assert _version_ranges.version_in(Version("2.16.0"), ">=2.13") and not _version_ranges.version_in(Version("2.13.0"), "<2.13")
    assert _version_ranges.parse("2.16.0.dev20261201")[0] == Version("2.16.0")
    assert _version_ranges.parse("banana")[0] is None and "not a version" in (_version_ranges.parse("banana")[1] or "")


def test_no_patch_id_list_outside_the_table() -> None:
    """One table: no code keeps its own list of patch ids (three or more in one literal, or on one line of a
    shell script), so adding a patch never means finding and editing copies."""
    import ast
    import pathlib
    import re

    root = pathlib.Path(registry.__file__).resolve().parents[1]
    ids = set(registry.PATCH_MODULES)
    found = []
    for top in ("torch_threadsafe_compile", "tests", "bench", "ttc_testing", ".ci", "examples", "sitecustomize"):
        for path in (root / top).rglob("*"):
            if path.name == "registry.py" and path.parent.name == "torch_threadsafe_compile":
                continue
            if path.suffix == ".py":
                for node in ast.walk(ast.parse(path.read_text())):
                    elts = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else (
                        node.keys if isinstance(node, ast.Dict) else [])
                    named = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in ids}
                    if len(named) >= 3:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {sorted(named)}")
            elif path.suffix == ".sh" or (path.parent.name == ".ci" and path.name == "run"):
                for n, line in enumerate(path.read_text().splitlines(), 1):
                    named = set(re.findall(r"\w+", line)) & ids
                    if len(named) >= 3:
                        found.append(f"{path.relative_to(root)}:{n} {sorted(named)}")
    assert not found, "patch id lists outside registry.SPECS:\n" + "\n".join(found)
