"""Activation of this process: the one decision "active, or disabled and why", how the package was
activated, and the one warning line we allow ourselves.

Read at every interpreter start (by ``_bootstrap``), so standard library only, and nothing of ours but
``_env``. The rest of the package reads activation through ``_lifecycle.snapshot()``, which combines it with
every patch's state; only the bootstrap changes it (:func:`start`, :func:`stop`).
"""

from __future__ import annotations

import sys
import warnings

from torch_threadsafe_compile import _env

__all__ = ["TTCWarning", "ACTIVE_MODES", "disabled_by", "start", "stop", "mode", "uninstalled", "warn_once", "warn_line"]


class TTCWarning(UserWarning):
    """Category of every warning this package emits (filter with ``-W ignore::torch_threadsafe_compile.TTCWarning``)."""


# How the package was activated in this process: "pth", "sitecustomize", "explicit" (install()), or None.
_mode: str | None = None
ACTIVE_MODES = frozenset({"pth", "sitecustomize", "explicit"})
# uninstall() ran in this process and no activation since: off at run time, which is not the same as a
# start-up hook that never ran (the remedy differs: install() again, or fix the installation).
_uninstalled = False


def disabled_by() -> str | None:
    """Why the package is off in this process (``"TTC_DISABLE=1"``), or None when it may be active: the
    one place that decides (from ``_env``'s reading of the environment, once per process)."""
    return _env.current().disabled_by


def start(how: str) -> bool:
    """Record that the package is active, activated by ``how``; False when it is disabled. An activation
    that finds the package active already keeps the first one (a ``.pth`` listed twice, ``.pth`` plus
    sitecustomize) and returns True."""
    global _mode, _uninstalled
    if _mode is not None:
        return True
    if disabled_by() is not None:
        return False
    _mode = how
    _uninstalled = False
    return True


def stop() -> None:
    """``uninstall()``: not active any more (``install()`` activates again)."""
    global _mode, _uninstalled
    _mode = None
    _uninstalled = True


def mode() -> str | None:
    """How the package was activated in this process, or None (not activated, or disabled)."""
    return _mode


def uninstalled() -> bool:
    """Whether ``uninstall()`` turned the package off in this process (and nothing activated it since)."""
    return _uninstalled


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
