#!/usr/bin/env python
"""Compatibility matrix: every hazard scenario and every patch, on every supported torch version.

For each torch version (default: the latest patch release of every minor release from 2.4 to 2.15) this
builds or reuses a virtual environment with that torch and this package installed editable, then runs in it,
once unpatched (``TTC_DISABLE=1``) and once active:

* ``python -m torch_threadsafe_compile doctor --json`` (activation and each patch's state/reason), and
* the hazard scenarios of ``ttc_testing/scenarios/`` (``python -m ttc_testing.scenarios NAME k=v``), each in
  a fresh interpreter,

and writes ``docs/compat.md``: one row per hazard scenario and per patch, one column per torch version; its
header names the commit it was generated at and whether the working tree differed from it.

    python bench/compat_matrix.py                                  # all default versions, venvs under .venvs/
    python bench/compat_matrix.py --venv-root ~/torch-venvs         # or BENCH_COMPAT_VENV_ROOT=~/torch-venvs
    python bench/compat_matrix.py --versions 2.11.0 2.13.0
    python bench/compat_matrix.py --reuse-venv 2.13.0=/path/to/venv --versions 2.13.0 --out /tmp/compat.md
    python bench/compat_matrix.py --json /tmp/m.json ...; python bench/compat_matrix.py --from-json /tmp/m.json

Venvs: ``<venv-root>/torch-<V>`` is used when it exists and created otherwise (``pip install --no-cache-dir
torch==V wrapt packaging numpy pytest`` with ``PIP_CONFIG_FILE=/dev/null``, except 2.13.0, which takes the
local pip configuration's CPU wheel; then ``pip install --no-deps -e <repo>``), unless that would leave less
than ``--min-free-gb`` (default 12) free on its disk: such a version reads "not run (venv)". The venv root defaults to
``$BENCH_COMPAT_VENV_ROOT``, else ``.venvs/`` in the repository (git-ignored by a ``.gitignore`` written into
it). ``--reuse-venv V=PATH`` (repeatable) takes an existing venv for version V as found: nothing is installed
into it except this package when it does not resolve to this checkout; a torch mismatch is reported.

Standard library only: this script runs under any Python >= 3.9; torch only lives in the venvs. Children get
the caller's environment minus ``TTC_*``, ``PYTHONPATH`` and ``VIRTUAL_ENV``; scenario children get the
repository root as ``PYTHONPATH`` (``ttc_testing`` is not installed). They run from a neutral working
directory so that the venv's installed package and its start-up ``.pth`` hook are what gets exercised. Every
cell is independent: a timeout or a crash (segfault, ...) is reported with its exit status, signal and
faulthandler headline, and the matrix goes on. The code lives in ``bench/compat/``.
"""

from __future__ import annotations

import sys

from compat.cli import main

if __name__ == "__main__":
    sys.exit(main(doc=__doc__ or ""))
