"""The compatibility matrix, as a package: ``bench/compat_matrix.py`` is its command-line entry point.

* ``venvs``      creating and probing one virtual environment per torch version
* ``supervise``  running children with timeouts; exit status, signal and faulthandler headline of a crash
* ``rows``       what is measured: one row per hazard scenario, and how to read its result
* ``measure``    running doctor and every row in one venv, unpatched and active
* ``cells``      the verdict of each matrix cell, and the findings it implies
* ``render``     the Markdown document
* ``provenance`` the commit (and local changes) a matrix was generated at, and the command as typed
* ``scrub``      keeps paths of the machine that ran it out of the document

Standard library only: the driver runs under any Python >= 3.9; torch only lives in the venvs.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root (bench/compat/ -> bench/ -> root)
