"""The README's commands: what is marked to run parses, names files and presets that exist, and the quick
start's test command is the one CI runs. ``bench/readme_commands.py`` runs them for real in a fresh clone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import readme_commands  # noqa: E402

README = ROOT / "README.md"


def test_quick_start_is_two_commands_and_ci_runs_the_test_command() -> None:
    text = README.read_text()
    quick = text[text.index("## Quick start"):text.index("## Installing")]
    marked = [body for ok, lang, body in readme_commands.blocks(quick) if ok]
    assert len(marked) == 1 and len(marked[0]) == 2, marked
    test_cmd = marked[0][1]
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
    assert "--preset cpu-tiny" in marked[0][0]


def test_runnable_blocks_parse() -> None:
    cmds = readme_commands.runnable()
    assert cmds
    for cmd in cmds:
        p = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert p.returncode == 0, (cmd, p.stderr)


def test_files_and_presets_named_in_readme_exist() -> None:
    text = README.read_text()
    for rel in set(re.findall(r"\b((?:examples|bench|docs|tests|sitecustomize)/[\w./-]+\.(?:py|md))\b", text)):
        assert (ROOT / rel).exists(), rel
    from examples.specdec.config import PRESETS  # the repository root is on pytest's path (pyproject.toml)

    for preset in set(re.findall(r"--preset ([\w-]+)", text)):
        assert preset in PRESETS, preset


def test_python_requires_matches_readme() -> None:
    cfg = (ROOT / "setup.cfg").read_text()
    assert re.search(r"python_requires\s*=\s*>=\s*3\.10", cfg)
    assert "Python 3.10 or newer" in README.read_text()
