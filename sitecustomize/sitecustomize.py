"""Activation for set-ups that put directories on PYTHONPATH instead of pip-installing.

Put this directory (``sitecustomize/``) and the directory holding ``torch_threadsafe_compile`` on
``PYTHONPATH``. Python imports the first ``sitecustomize`` it finds, so this file would shadow any other
one (a distribution's, a virtualenv's): it therefore imports the next ``sitecustomize`` on ``sys.path``
after itself, then activates. Never raises.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_ttc_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _chain()
except Exception as e:  # the shadowed sitecustomize failed: report as Python itself would, then go on
    sys.stderr.write(f"Error in sitecustomize (chained by torch-threadsafe-compile): {e!r}\n")

try:  # TTC_DISABLE and the other TTC_* variables are read by the bootstrap (torch_threadsafe_compile/_env.py)
    from torch_threadsafe_compile import _bootstrap

    _bootstrap.activate("sitecustomize")
except Exception as e:
    sys.stderr.write(f"torch-threadsafe-compile: not activated ({e!r})\n")
