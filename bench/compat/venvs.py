"""One virtual environment per torch version: create it (or take an existing one), install, probe.

A missing venv is created as ``<venv-root>/torch-<V>`` with ``pip install torch==V`` plus ``TORCH_EXTRAS``
and this package installed editable (``pip install --no-deps -e <repo>``). Torch comes from the index pip
sees without any configuration file (``PIP_CONFIG_FILE=/dev/null``), except for ``PLAIN_PIP_VERSIONS``, for
which the local pip configuration is used (it may provide a CPU-only wheel). ``--no-cache-dir`` always: a CUDA
build is several GB and would be stored twice otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from _harness import child_environ, run_proc

from . import ROOT
from .scrub import SCRUB
from .supervise import child_env, last_line, log

# The latest patch release of every minor release the package supports.
DEFAULT_VERSIONS = ["2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0",
                    "2.14.1", "2.15.0"]
# Versions installed with the machine's pip configuration instead of PIP_CONFIG_FILE=/dev/null.
PLAIN_PIP_VERSIONS = {"2.13.0"}
# pytest: the venvs double as test environments for the suite on that torch.
TORCH_EXTRAS = ["wrapt", "packaging", "numpy", "pytest"]
VENV_ROOT_ENV = "BENCH_COMPAT_VENV_ROOT"
VENV_GB = 6.0  # what one venv with a CUDA build of torch takes on disk, rounded up (4.7-5.5 GB for 2.4-2.15)
MIN_FREE_GB = 12.0  # default floor of free disk space that creating a venv must leave
DEFAULT_VENV_ROOT = ROOT / ".venvs"

PROBE = (
    "import json, sys\n"
    "out = {'python': sys.version.split()[0]}\n"
    "try:\n"
    "    import torch; out['torch'] = torch.__version__\n"
    "except Exception as e:\n"
    "    out['torch_error'] = f'{type(e).__name__}: {e}'\n"
    "try:\n"
    "    import importlib.util as u; s = u.find_spec('torch_threadsafe_compile'); out['ttc'] = s.origin if s else None\n"
    "except Exception as e:\n"
    "    out['ttc_error'] = repr(e)\n"
    "print('PROBE ' + json.dumps(out))\n"
)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def base_version(v: str) -> str:
    return v.split("+")[0]


def probe(py: Path, cwd: str) -> dict[str, Any]:
    """Python and torch versions of the venv, and where ``torch_threadsafe_compile`` resolves from there."""
    pr = run_proc([str(py), "-c", PROBE], child_env(disable=True), 300, cwd=cwd)
    for line in pr["stdout"].splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"probe_error": SCRUB(last_line(pr["stderr"]) or f"rc={pr['rc']}")}


def ensure_root(root: Path) -> None:
    """Create the venv root; one inside the repository gets a ``.gitignore`` so that git never sees the venvs."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        root.resolve().relative_to(ROOT.resolve())
    except ValueError:
        return
    marker = root / ".gitignore"
    if not marker.exists():
        marker.write_text("# torch venvs of bench/compat_matrix.py\n*\n")


def _pip(py: Path, args: list[str], env: dict[str, str], label: str) -> None:
    log(f"{label}: pip {' '.join(shlex.quote(a) for a in args)}")
    p = subprocess.run([str(py), "-m", "pip", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"pip {args[0]} failed (rc={p.returncode}): {last_line(p.stdout)}")


def _pip_env() -> dict[str, str]:
    return child_environ(disable="1")  # pip itself runs in the venv: the package must not patch anything there


def _check_disk(root: Path, min_free_gb: float) -> None:
    """Refuse to install a torch that would leave less than ``min_free_gb`` free: a full disk would break far
    more than this matrix (other venvs, builds, whoever shares the machine)."""
    probe_dir = next((p for p in [root, *root.parents] if p.exists()), Path("/"))
    free_gb = shutil.disk_usage(probe_dir).free / 1e9
    if free_gb - VENV_GB < min_free_gb:
        raise RuntimeError(f"not installing torch: {free_gb:.1f} GB free, a torch venv takes up to {VENV_GB:g} GB and "
                           f"at least {min_free_gb:g} GB must stay free (--min-free-gb)")


def _create(version: str, venv: Path) -> None:
    log(f"{version}: creating venv")
    ensure_root(venv.parent)
    p = subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"venv creation failed: {last_line(p.stdout)}")


def _install_torch(py: Path, version: str, min_free_gb: float) -> str:
    _check_disk(py.parent, min_free_gb)
    env = _pip_env()
    if version not in PLAIN_PIP_VERSIONS:
        env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no configuration file at all
    _pip(py, ["install", "--no-cache-dir", f"torch=={version}", *TORCH_EXTRAS], env, version)
    return f"installed torch=={version}" + ("" if version in PLAIN_PIP_VERSIONS else " (PIP_CONFIG_FILE=/dev/null)")


def _resolves_here(info: dict[str, Any]) -> bool:
    origin = info.get("ttc") or ""
    return bool(origin) and Path(origin).resolve().is_relative_to(ROOT.resolve())  # type: ignore[attr-defined]


def prepare_venv(version: str, venv: Path, reused: bool, cwd: str,
                 min_free_gb: float = MIN_FREE_GB) -> dict[str, Any]:
    """Make sure ``venv`` has torch==version and this package (editable). Returns the probe plus notes.

    A reused venv (``--reuse-venv``) is never re-installed into: a torch mismatch is only noted."""
    notes: list[str] = []
    py = venv_python(venv)
    if not py.exists():
        if reused:
            raise RuntimeError("--reuse-venv path has no Python interpreter")
        _create(version, venv)
        notes.append("venv created")
    info = probe(py, cwd)
    if "probe_error" in info:
        raise RuntimeError(f"venv interpreter does not start: {info['probe_error']}")
    if base_version(info.get("torch") or "") != version:
        if reused:
            notes.append(f"reused venv has torch {info.get('torch') or 'none'}, not {version}")
        else:
            notes.append(_install_torch(py, version, min_free_gb))
    if not _resolves_here(info):
        _pip(py, ["install", "--no-cache-dir", "--no-deps", "-e", str(ROOT)], _pip_env(), version)
        notes.append("installed this package (--no-deps -e)" + (" (it resolved elsewhere before)"
                                                                 if info.get("ttc") else ""))
    info = probe(py, cwd)
    if "torch_error" in info:
        raise RuntimeError(f"torch does not import: {SCRUB(info['torch_error'])}")
    if not _resolves_here(info):
        raise RuntimeError("torch_threadsafe_compile does not resolve to this repository in the venv")
    info["notes"] = notes
    return info
