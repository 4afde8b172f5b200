"""Examples that use torch-threadsafe-compile; not part of the installed package.

Importable as ``examples.<name>`` from the repository root: the tests get it from pytest's ``pythonpath``, the
bench scripts from ``bench/_repo.py``, and ``examples/specdec/train.py`` run as a script sets it up itself.
"""
