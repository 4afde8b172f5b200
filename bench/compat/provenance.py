"""Where a matrix comes from: the commit it was generated at (and whether the working tree differed from it),
and the command line as typed, without the machine's paths."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Iterable

from . import ROOT
from .scrub import SCRUB

# Paths whose local changes change what the matrix measures (the rest, e.g. docs, do not).
MEASURED = ("torch_threadsafe_compile/", "sitecustomize/", "ttc_testing/", "setup.py", "setup.cfg", "pyproject.toml")


def _git(*args: str) -> str:
    # --no-optional-locks: status must not refresh (write) the index while others work in the same checkout.
    p = subprocess.run(["git", "--no-optional-locks", *args], cwd=ROOT, capture_output=True, text=True, errors="replace", timeout=60)
    if p.returncode != 0:
        raise OSError(p.stderr.strip() or f"git {args[0]} failed")
    return p.stdout


def _fingerprint(changed: list[str]) -> str:
    """A short hash of the local changes (diff of tracked files, contents of untracked ones): two runs with the
    same commit and fingerprint ran the same code."""
    h = hashlib.sha256(_git("diff", "HEAD", "--binary", "--", *changed).encode())
    for path in changed:
        full = ROOT / path
        if full.is_file():
            h.update(path.encode() + b"\0" + full.read_bytes())
    return h.hexdigest()[:10]


def revision(exclude: Iterable[Path] = ()) -> dict[str, Any]:
    """HEAD and the files that differ from it (``git status``: modified, staged, untracked, not ignored).

    ``exclude``: files the run itself writes (the document, the JSON dump), which would otherwise make a
    re-run look dirty."""
    skip = set()
    for p in exclude:
        try:
            skip.add(str(Path(p).resolve().relative_to(ROOT.resolve())))
        except ValueError:
            pass
    try:
        full = _git("rev-parse", "HEAD").strip()
        lines = _git("status", "--porcelain", "--untracked-files=all").splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "full": "", "dirty": [], "fingerprint": ""}
    changed = sorted({ln[3:].split(" -> ")[-1].strip('"') for ln in lines if len(ln) > 3} - skip)
    return {"commit": full[:7], "full": full, "dirty": changed, "fingerprint": _fingerprint(changed) if changed else ""}


def _areas(paths: list[str]) -> str:
    counts: dict[str, int] = {}
    for p in paths:
        top = p.split("/", 1)[0] + ("/" if "/" in p else "")
        counts[top] = counts.get(top, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _dirt(rev: dict[str, Any]) -> str:
    if not rev["dirty"]:
        return "clean (no file differs from the commit)"
    text = (f"DIRTY: {len(rev['dirty'])} files differ from the commit ({_areas(rev['dirty'])}; "
            f"local-changes fingerprint `{rev['fingerprint']}`)")
    if any(p.startswith(MEASURED) for p in rev["dirty"]):
        text += "; they include the package or the scenarios, so the numbers are of that uncommitted code"
    return text


def describe_run(start: Any, end: Any | None) -> list[str]:
    """Header bullets: the commit, whether the working tree differed from it, and whether either changed while
    the matrix ran (``end``: the revision at the end, None when unknown)."""
    if isinstance(start, str):  # dumps written before revisions were recorded as dicts
        return [f"- commit: {start}"]
    if start["commit"] == "unknown":
        return ["- commit: unknown (not a git checkout)"]
    out = [f"- commit: `{start['commit']}` (`{start['full']}`)", f"- working tree: {_dirt(start)}"]
    if isinstance(end, dict) and end != start:
        moved = f"HEAD moved to `{end['commit']}`; " if end["commit"] != start["commit"] else ""
        out.append(f"- the tree changed during the run: at the end, {moved}working tree {_dirt(end)}")
    return out


def _path_arg(a: str) -> str:
    p = Path(os.path.expanduser(a)).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return "<dir>/" + p.name


def command_line(argv: list[str], script: str) -> str:
    """The command as typed, with machine-specific paths replaced (reused venvs become ``V=<venv>``)."""
    script = os.path.relpath(os.path.abspath(script), os.getcwd()) if script else "bench/compat_matrix.py"
    if os.path.abspath(os.getcwd()) != str(ROOT):
        script = "bench/compat_matrix.py"
    parts = ["python", script]
    it = iter(argv)
    for a in it:
        if a == "--reuse-venv" or a.startswith("--reuse-venv="):
            val = a.split("=", 1)[1] if a.startswith("--reuse-venv=") else next(it, "")
            parts += ["--reuse-venv", f"{val.split('=', 1)[0]}=<venv>"]
        elif os.path.isabs(a) or a.startswith("~"):
            parts.append(_path_arg(a))
        else:
            parts.append(SCRUB(a))
    return " ".join(shlex.quote(x) if not x.endswith("=<venv>") and not x.startswith("<dir>") else x for x in parts)
