#!/usr/bin/env python
"""Run the README's shell blocks that are meant to run on a CPU machine, as written, in a fresh clone; and make
its sample outputs from real runs.

A block runs when the line before its fence is ``<!-- readme-commands: run -->``; the other blocks are
illustrations (GPU presets, several nodes, console transcripts). The blocks run in order, each line with
``bash -e`` in one fresh ``git clone`` of the current commit (so later blocks see what earlier ones built, as
a reader's shell would), with a timeout per block. Printed: each command, its exit status and wall time.

A console block after ``<!-- readme-sample: NAME -->`` is a transcript of the commands ``SAMPLES[NAME]``, run with
this interpreter (the environment's ``TTC_*`` variables removed, its path shown as ``.venv/bin/python``, the
quick start's): ``--samples`` prints them fresh, ``--write-samples`` puts them into the README.

    python bench/readme_commands.py              # run them (the quick start installs torch: minutes)
    python bench/readme_commands.py --list       # show what would run
    python bench/readme_commands.py --keep DIR   # clone into DIR and leave it there
    python bench/readme_commands.py --write-samples   # the sample outputs, from real runs, into README.md

``tests/test_readme.py`` checks the same blocks statically (syntax, files and presets they name), and each sample
against a real run.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import child_environ
from _repo import ROOT

MARK = "<!-- readme-commands: run -->"
SAMPLE = re.compile(r"^<!-- readme-sample: ([\w-]+) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")
# The commands of each sample, as the README shows them (``python`` is this interpreter when run here).
SAMPLES: dict[str, list[str]] = {
    "doctor": ["python -m torch_threadsafe_compile --version", "python -m torch_threadsafe_compile doctor"],
}
SHOWN_PYTHON = ".venv/bin/python"  # what the quick start creates; the sample shows no path of the machine it ran on


def blocks(text: str) -> list[tuple[bool, str, list[str]]]:
    """Every fenced block as (marked to run, language, lines)."""
    out: list[tuple[bool, str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m and m.group(1):
            marked = i > 0 and lines[i - 1].strip() == MARK
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((marked, m.group(1), lines[i + 1:j]))
            i = j + 1
        else:
            i += 1
    return out


def runnable(path: Path = ROOT / "README.md") -> list[str]:
    """The commands of the marked blocks, in order (comments and blank lines dropped)."""
    cmds = []
    for marked, lang, body in blocks(path.read_text()):
        if marked:
            if lang != "bash":
                raise SystemExit(f"{path.name}: a block marked to run must be bash, not {lang!r}")
            cmds += [ln for ln in body if ln.strip() and not ln.lstrip().startswith("#")]
    return cmds


def samples(text: str) -> dict[str, tuple[int, int]]:
    """Every marked sample: name -> (first, end) line indices of its block's body in ``text``."""
    lines = text.splitlines()
    out: dict[str, tuple[int, int]] = {}
    for i, line in enumerate(lines[:-1]):
        m = SAMPLE.match(line.strip())
        if m and FENCE.match(lines[i + 1]):
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out[m.group(1)] = (i + 2, end)
    return out


def sample_text(name: str) -> str:
    """The sample ``name`` made now: each command after ``$ ``, then what it printed (stdout and stderr)."""
    env = child_environ()  # the package's defaults
    env.setdefault("PYTHONWARNINGS", "ignore")
    out = []
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: the package comes from the installation
        for cmd in SAMPLES[name]:
            argv = [sys.executable, *cmd.split()[1:]] if cmd.startswith("python ") else cmd.split()
            p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            out.append(f"$ {cmd}")
            out += (p.stdout + p.stderr).rstrip("\n").replace(sys.executable, SHOWN_PYTHON).splitlines()
    return "\n".join(out)


def write_samples(path: Path = ROOT / "README.md") -> list[str]:
    """Replace every marked sample's block in ``path`` by a fresh one; returns the names whose text changed."""
    text = path.read_text()
    lines = text.splitlines()
    changed = []
    for name, (first, end) in sorted(samples(text).items(), key=lambda kv: -kv[1][0]):
        fresh = sample_text(name).splitlines()
        if lines[first:end] != fresh:
            changed.append(name)
            lines[first:end] = fresh
    path.write_text("\n".join(lines) + "\n")
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--keep", type=Path, help="clone here (must not exist) and keep it")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per command (default 3600)")
    ap.add_argument("--samples", action="store_true", help="print every sample output, made now")
    ap.add_argument("--write-samples", action="store_true", help="make every sample output now and put it into README.md")
    a = ap.parse_args()
    if a.samples:
        for name in samples((ROOT / "README.md").read_text()):
            print(f"<!-- readme-sample: {name} -->\n{sample_text(name)}\n")
        return 0
    if a.write_samples:
        changed = write_samples()
        print(f"README.md: samples changed: {', '.join(changed) or 'none'}")
        return 0
    cmds = runnable()
    if a.list:
        print("\n".join(cmds))
        return 0
    work = a.keep or Path(tempfile.mkdtemp(prefix="readme-commands-")) / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(work)], check=True)
    failed = 0
    for cmd in cmds:
        t0 = time.monotonic()
        try:
            p = subprocess.run(["bash", "-e", "-c", cmd], cwd=work, capture_output=True, text=True, timeout=a.timeout)
            rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        wall = time.monotonic() - t0
        print(f"$ {cmd}\n  -> exit {rc}, {wall:.0f} s", flush=True)
        if rc != 0:
            failed += 1
            print("  " + tail.replace("\n", "\n  "), flush=True)
    print(f"{len(cmds) - failed}/{len(cmds)} commands ok (clone: {work})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
