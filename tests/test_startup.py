"""Interpreter start: cheap when torch is never imported, and never raises (issue: activation).

Each case runs a fresh interpreter of this environment, where the package is installed and its ``.pth``
file is active. Fake ``torch`` packages are put first on ``PYTHONPATH`` to simulate a missing, broken or
unknown torch and changed patch targets.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from conftest import run_py, stderr_lines


def _fake_torch(root: Path, version: str, files: dict[str, str]) -> Path:
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n" + files.pop("__init__.py", ""))
    for rel, body in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(pkg).parents:
            init = pkg / parent / "__init__.py"
            if not init.exists():
                init.write_text("")
        path.write_text(textwrap.dedent(body))
    return root


STATUS = "import json, torch_threadsafe_compile as t; print('STATUS ' + json.dumps(t.status()))"
# Patches that apply when torch._dynamo is imported and read its submodules: left out where a fake torch
# has an empty ``_dynamo`` (only for the patches of ``torch.compiler``'s flags, which apply there).
NEEDS_REAL_DYNAMO = "guard_invalidation,code_reset,deferred_code_callbacks"


def _status(p) -> dict:  # noqa: ANN001
    line = [x for x in p.stdout.splitlines() if x.startswith("STATUS ")]
    assert line, p.stdout + p.stderr
    return json.loads(line[-1][7:])


def test_plain_start_imports_nothing_heavy() -> None:
    p = run_py("import sys; print(sorted(m for m in ('torch', 'wrapt', 'packaging', 'logging', 'torch_threadsafe_compile.registry') if m in sys.modules)); "
               "import torch_threadsafe_compile._activation as b; print(b.mode())")
    assert p.returncode == 0, p.stderr
    imported, mode = p.stdout.split("\n")[:2]
    assert imported == "[]"
    assert mode == "pth", "the .pth file did not activate the package in this environment"
    assert not stderr_lines(p)


def test_disabled_start_activates_nothing() -> None:
    p = run_py("import sys; print(sorted(m for m in ('torch', 'wrapt', 'packaging', 'logging', 'torch_threadsafe_compile.registry', "
               "'torch_threadsafe_compile._lifecycle') if m in sys.modules)); from torch_threadsafe_compile import _activation as a; "
               "print(a.mode(), a.disabled_by()); print(any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))",
               env={"TTC_DISABLE": "1"})
    assert p.stdout.split("\n")[:3] == ["[]", "None TTC_DISABLE=1", "False"], p.stdout + p.stderr


def test_torch_absent(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('No module named torch (simulated)')\n")
    p = run_py("try:\n    import torch\nexcept ImportError as e:\n    print('absent', e)\n", env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 0 and p.stdout.startswith("absent")
    assert not stderr_lines(p)


def test_broken_torch_error_is_the_users_not_ours(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("__version__ = '2.13.0'\nraise RuntimeError('broken install')\n")
    p = run_py("import torch", env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode != 0 and "broken install" in p.stderr
    assert not [line for line in p.stderr.splitlines() if "torch-threadsafe-compile" in line]


def test_unknown_torch_version(tmp_path: Path) -> None:
    _fake_torch(tmp_path, "banana", {"__init__.py": "from . import compiler\n", "compiler/__init__.py": "_is_compiling_flag = False\ndef is_compiling():\n    return _is_compiling_flag\n"})
    p = run_py("import torch\n" + STATUS, env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    st = _status(p)
    states = {r["id"]: (r["state"], r["reason"]) for r in st["patches"]}
    assert states["compile_session_flag"][0] == "skipped" and "not a version" in states["compile_session_flag"][1]
    assert len(stderr_lines(p)) <= 1


def test_changed_patch_target_is_skipped_with_reason(tmp_path: Path) -> None:
    # A torch 2.13 whose fx module no longer has the global flag (as if upstream had changed it).
    _fake_torch(tmp_path, "2.13.0", {
        "__init__.py": "from .fx import _symbolic_trace\nfrom . import compiler\n",
        "fx/_symbolic_trace.py": "def is_fx_tracing():\n    return False\nclass Tracer:\n    def trace(self, root):\n        return root\n",
        "compiler/__init__.py": "_is_compiling_flag = False\ndef is_compiling():\n    return _is_compiling_flag\n"
                                "_is_exporting_flag = False\ndef is_exporting():\n    return _is_exporting_flag\n",
        "_dynamo/__init__.py": "",  # the compiler's flag patches apply once dynamo is imported
    })
    # The patches that need a real dynamo's internals are left out: this fake has none.
    p = run_py("import torch, torch._dynamo\n" + STATUS, env={"PYTHONPATH": str(tmp_path), "TTC_DISABLE": NEEDS_REAL_DYNAMO})
    assert p.returncode == 0, p.stderr
    states = {r["id"]: (r["state"], r["reason"]) for r in _status(p)["patches"]}
    assert states["fx_tracing_flag"][0] == "skipped"
    assert "_is_fx_tracing_flag not found" in states["fx_tracing_flag"][1]
    # The other patch still applies to the parts that look as expected.
    assert states["compile_session_flag"][0] == "applied"
    assert len(stderr_lines(p)) <= 1


def test_target_without_source_is_skipped_with_one_warning_at_most(tmp_path: Path) -> None:
    # is_compiling's source cannot be read (compiled from a string): the rewrite fails -> skipped, torch untouched.
    _fake_torch(tmp_path, "2.13.0", {
        "__init__.py": "from . import compiler\n",
        "compiler/__init__.py": "_is_compiling_flag = False\nexec('def is_compiling():\\n    return _is_compiling_flag\\n')\n",
        "_dynamo/__init__.py": "",
    })
    # This fake has no torch.compile (compile_import_lock would say so at import torch: another line) and no
    # export flag: the patches of those stay out, so that the warning is this patch's alone.
    p = run_py("import torch, torch._dynamo, types\n" + STATUS + "\nprint(type(torch.compiler) is types.ModuleType)",
               env={"PYTHONPATH": str(tmp_path), "TTC_DISABLE": NEEDS_REAL_DYNAMO + ",compile_import_lock,export_flag"})
    assert p.returncode == 0, p.stderr
    states = {r["id"]: r["state"] for r in _status(p)["patches"]}
    assert states["compile_session_flag"] == "skipped"
    assert p.stdout.strip().endswith("True"), "a skipped patch must leave no change behind"
    assert len(stderr_lines(p)) <= 1


@pytest.mark.parametrize("env", [
    {"TTC_DISABLE": "maybe?"},
    {"TTC_LOG": "shout"},
    {"TTC_WATCHDOG": "-1"},
    {"TTC_DISABLE": "not_a_patch"},
    {"TTC_DISABLE": "!!", "TTC_LOG": "x", "TTC_WATCHDOG": "y"},
])
def test_garbage_env_values_run_on_with_one_warning(env: dict[str, str]) -> None:
    p = run_py("import torch\n" + STATUS, env=env)
    assert p.returncode == 0, p.stderr
    ours = [line for line in p.stderr.splitlines() if "torch-threadsafe-compile" in line]
    assert len(ours) == 1, p.stderr
    assert _status(p)["activation"] == "pth"


def test_wrapt_missing(tmp_path: Path) -> None:
    (tmp_path / "wrapt.py").write_text("raise ImportError('No module named wrapt (simulated)')\n")
    p = run_py("import torch, torch._dynamo\n" + STATUS, env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    states = {r["id"]: r["state"] for r in _status(p)["patches"]}
    assert states["compile_lock_watchdog"] == "applied"  # needs no wrapt (and covers every supported torch)
    assert "failed" in states.values()  # the wrapt-based ones fail cleanly ...
    assert len([line for line in p.stderr.splitlines() if "torch-threadsafe-compile" in line]) == 1  # ... with one line


def test_double_activation_is_harmless() -> None:
    p = run_py("""
        import sys
        from torch_threadsafe_compile import _bootstrap
        n = len(sys.meta_path)
        assert _bootstrap.activate('pth') and _bootstrap.activate('sitecustomize')
        from torch_threadsafe_compile import _activation
        assert len(sys.meta_path) == n and _activation.mode() == 'pth'
        print('ok')
    """)
    assert p.stdout.strip() == "ok", p.stderr


@pytest.mark.parametrize("what", ["torch", "torch._dynamo, torch._functorch.config"])
def test_import_loads_no_extra_torch_modules(what: str) -> None:
    code = f"import sys, {what}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    active = run_py(code)
    off = run_py(code, env={"TTC_DISABLE": "1"})
    assert active.returncode == 0 and off.returncode == 0
    assert active.stdout == off.stdout
