"""Activation state of this process, and the one warning line we allow ourselves.

The leaf of the package: standard library only (modules the interpreter has already imported at start-up),
and nothing of ours. Every other layer may import it; it imports none of them, so the layers stay a DAG::

    __init__ (public API) -> _bootstrap -> _state
                          -> _lifecycle -> registry, _versions, _patching, _state
                          -> _status    -> _lifecycle, _state
    patches/*             -> registry, _patching, _torch
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["TTCWarning", "mode", "inactive_reason", "warn_once", "warn_line"]


class TTCWarning(UserWarning):
    """Category of every warning this package emits (filter with ``-W ignore::torch_threadsafe_compile.TTCWarning``)."""


# How the package was activated in this process: "pth", "sitecustomize", "explicit" (install()), or None.
mode: str | None = None
# Why it is not active, when it is not ("TTC_DISABLE=1", ...).
inactive_reason: str | None = None

_warned = False


def warn_once(msg: str) -> None:
    """Emit ``msg`` as one line on stderr, once per process; later problems go to the logger only.

    A :class:`TTCWarning` at a pseudo-location (no source line is printed, so it stays one line), so users
    can filter it like any warning. Interpreter start must never raise: with ``-W error`` the warning would
    be an exception, so it is written as a plain line instead.
    """
    global _warned
    if _warned:
        return
    _warned = True
    warn_line(msg)


def warn_line(msg: str) -> None:
    """Emit ``msg`` as one line on stderr (see :func:`warn_once`), every time: for protection that a patch
    could not give, which must never go unsaid, even after the start-up line was spent."""
    try:
        # Shown as "torch-threadsafe-compile:0: TTCWarning: <msg>".
        warnings.warn_explicit(msg, TTCWarning, "torch-threadsafe-compile", 0, module="torch_threadsafe_compile")
    except Exception:
        try:
            sys.stderr.write(f"torch-threadsafe-compile: {msg}\n")
        except Exception:  # a closed stderr must not break the user's program
            pass
