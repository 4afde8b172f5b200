"""The README's commands: what is marked to run parses, names files and presets that exist, and the quick
start's test command is the one CI runs. ``bench/readme_commands.py`` runs them for real in a fresh clone."""

from __future__ import annotations

import difflib
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


def _shown(text: str) -> list[str]:
    """A sample as compared: the interpreter's version and path are the machine's, not the project's."""
    return ["python      <version>  (<interpreter>)" if line.startswith("python      ") else line
            for line in text.splitlines()]


def _rows(lines: list[str]) -> list[list[str]]:
    """The doctor table's patch, hazard and torch-range columns (what the registry decides, on any torch)."""
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["patch", "hazard"])
    end = next((i for i in range(at + 1, len(lines)) if not lines[i].strip()), len(lines))  # the table's end
    return [line.split()[:3] for line in lines[at + 1:end]]


def test_samples_are_what_a_real_run_prints() -> None:
    """Every sample output of the README is a transcript of a real run (``bench/readme_commands.py
    --write-samples``): on the torch the sample names, line for line; on another torch (CI runs 2.11 and 2.15 too)
    its rows still name every patch of the registry, in order. Before: the doctor sample listed 13 of 21 patches."""
    text = README.read_text()
    found = readme_commands.samples(text)
    assert set(found) == set(readme_commands.SAMPLES), found
    lines = text.splitlines()
    for name, (first, end) in found.items():
        shown, real = _shown("\n".join(lines[first:end])), _shown(readme_commands.sample_text(name))
        torch_line = [line for line in shown if line.startswith("torch       ")]
        if torch_line and torch_line[0] in real:
            assert shown == real, "\n".join(difflib.unified_diff(shown, real, "README.md", "a real run", lineterm=""))
        else:
            assert _rows(shown) == _rows(real), (name, _rows(shown), _rows(real))
