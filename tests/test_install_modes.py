"""Start-up activation in each way the package can be set up (issue: activation, acceptance 1).

Each test builds a fresh virtual environment *without* torch and lets it see the torch of the
environment running the tests through a path entry (added by a plain ``.pth`` line, so that the
running environment's own ``.pth`` files are not processed there). Then, in that venv:

* ``pip install <copy of the repo>`` (a wheel), ``pip install -e <copy>`` (PEP 660 editable), or no
  install at all with ``sitecustomize/`` and the package on ``PYTHONPATH``;
* ``python -c "import torch; import torch_threadsafe_compile as t; print(t.status())"`` must show the
  activation mode and applied patches, the program having imported nothing of ours before torch;
* ``python -c pass`` must import neither torch nor wrapt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from conftest import REPO

CHECK = ("import sys, json, torch; ours = [m for m in sys.modules if m.startswith('torch_threadsafe_compile')]; "
         "import torch_threadsafe_compile as t; print('STATUS ' + json.dumps(dict(t.status(), ours_before=ours)))")
LIGHT = "import sys, json; print('LIGHT ' + json.dumps(sorted(m for m in ('torch', 'wrapt', 'packaging') if m in sys.modules)))"


def _site_of(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin
    return str(Path(spec.origin).parents[1])


@pytest.fixture()
def fresh_venv(tmp_path: Path) -> tuple[Path, Path]:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # torch, wrapt and packaging of the running environment, as a plain path entry.
    deps = sorted({_site_of("torch"), _site_of("wrapt"), _site_of("packaging")})
    (site / "00_test_deps.pth").write_text("\n".join(deps) + "\n")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "runs", ".pytest_cache"))
    return py, src


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTC_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def _run(py: Path, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=str(cwd), env=_env(**env), timeout=300)


def _status(p: subprocess.CompletedProcess[str]) -> dict:
    lines = [x for x in p.stdout.splitlines() if x.startswith("STATUS ")]
    assert lines, p.stdout + p.stderr
    return json.loads(lines[-1][7:])


def _pip(py: Path, *args: str) -> None:
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *args], capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def _assert_active(py: Path, cwd: Path, mode: str, **env: str) -> None:
    st = _status(_run(py, CHECK, cwd, **env))
    assert st["activation"] == mode
    # Before the program's first import of ours, the start-up hook had loaded the bootstrap (and, once torch
    # was imported, the registry and patches) by itself.
    assert "torch_threadsafe_compile._bootstrap" in st["ours_before"]
    assert "torch_threadsafe_compile.registry" in st["ours_before"]
    applied = [p["id"] for p in st["patches"] if p["state"] == "applied"]
    assert applied, st["patches"]
    light = _run(py, LIGHT, cwd, **env)
    assert "LIGHT []" in light.stdout, light.stdout + light.stderr
    off = _status(_run(py, CHECK, cwd, TTC_DISABLE="1", **env))
    assert off["activation"] == "disabled" and not [p for p in off["patches"] if p["state"] == "applied"]


def test_wheel_install(fresh_venv: tuple[Path, Path], tmp_path: Path) -> None:
    py, src = fresh_venv
    _pip(py, str(src))
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    assert (site / "torch_threadsafe_compile.pth").exists() and (site / "torch_threadsafe_compile.start").exists()
    _assert_active(py, tmp_path, "pth")


def test_editable_install(fresh_venv: tuple[Path, Path], tmp_path: Path) -> None:
    py, src = fresh_venv
    _pip(py, "-e", str(src))
    _assert_active(py, tmp_path, "pth")


def test_pythonpath_sitecustomize_chains(fresh_venv: tuple[Path, Path], tmp_path: Path) -> None:
    py, src = fresh_venv
    other = tmp_path / "other"
    other.mkdir()
    # Another sitecustomize later on the path (e.g. a distribution's): ours must run it, not shadow it.
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    pp = os.pathsep.join([str(src / "sitecustomize"), str(src), str(other)])
    _assert_active(py, tmp_path, "sitecustomize", PYTHONPATH=pp)
    p = _run(py, "import os; print(os.environ.get('OTHER_SITECUSTOMIZE_RAN'))", tmp_path, PYTHONPATH=pp)
    assert p.stdout.strip() == "1", p.stderr
