#!/usr/bin/env python
"""Run the README's shell blocks that are meant to run on a CPU machine, as written, in a fresh clone.

A block runs when the line before its fence is ``<!-- readme-commands: run -->``; the other blocks are
illustrations (GPU presets, several nodes, console transcripts). The blocks run in order, each line with
``bash -e`` in one fresh ``git clone`` of the current commit (so later blocks see what earlier ones built, as
a reader's shell would), with a timeout per block. Printed: each command, its exit status and wall time.

    python bench/readme_commands.py              # run them (the quick start installs torch: minutes)
    python bench/readme_commands.py --list       # show what would run
    python bench/readme_commands.py --keep DIR   # clone into DIR and leave it there

``tests/test_readme.py`` checks the same blocks statically (syntax, files and presets they name).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- readme-commands: run -->"
FENCE = re.compile(r"^```(\w*)\s*$")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--keep", type=Path, help="clone here (must not exist) and keep it")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per command (default 3600)")
    a = ap.parse_args()
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
