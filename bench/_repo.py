"""The repository root, importable: for the bench scripts that measure the reference trainer (``examples.specdec``).

``python bench/<script>.py`` puts ``bench/`` on ``sys.path``, not the repository root, and the trainer is an example, not
part of the installed package. Importing ``ROOT`` from here is the one step such a script takes before
``from examples.specdec import ...``; the scripts themselves touch no ``sys.path``.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
