"""Parsing of the ``TTC_*`` environment variables: the one place that knows their values; and whether the
interpreter is a free-threaded build.

Standard library only: this module is imported by the interpreter-start bootstrap, which must stay
well under a millisecond and must never raise. Bad values never raise either; they produce a message
that the caller reports (one warning line per process) and the documented default is used instead.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # `typing` is not worth importing at interpreter start; annotations are strings
if TYPE_CHECKING:
    from typing import Mapping

__all__ = ["Settings", "read_settings", "current", "is_true", "DISABLE", "free_threaded_build"]

DISABLE = "TTC_DISABLE"  # the variable that turns the package off (``1``), or some patches (``id,id``)

TRUE_VALUES = frozenset({"1", "true", "yes", "on", "all"})
FALSE_VALUES = frozenset({"", "0", "false", "no", "off", "none"})
LOG_LEVELS = ("debug", "info", "warning", "error")
# Variables this package no longer reads; setting one gets a warning instead of silence.
RETIRED = {"TTC_CACHE_DIR": "the package keeps no on-disk cache any more (nothing of it is read or written)"}
# The watchdog wakes about four times per bound; a compile holds dynamo's lock for longer than this in normal
# operation, so a shorter bound is a busy loop that only ever reports ordinary compiles.
WATCHDOG_MIN_S = 0.1
# A bad value is quoted in the warning line up to this many characters (the line stays one line).
QUOTE_MAX = 40


def _quote(raw: str) -> str:
    """``raw`` for a warning line: repr'd (no control characters), cut to ``QUOTE_MAX`` characters."""
    text = repr(raw[:QUOTE_MAX])
    return text if len(raw) <= QUOTE_MAX else f"{text[:-1]}…{text[-1]} ({len(raw)} characters)"


def is_true(value: str | None) -> bool:
    """Whether ``value`` is one of the documented true values of a boolean ``TTC_*`` variable."""
    return (value or "").strip().lower() in TRUE_VALUES


class Settings:
    """The parsed environment. ``problems`` lists human-readable complaints about bad values."""

    __slots__ = ("disabled", "disabled_by", "disabled_patches", "log_level", "watchdog_s", "problems")

    def __init__(self) -> None:
        self.disabled = False  # TTC_DISABLE=1: nothing is patched, explicit install() included
        self.disabled_by: str | None = None  # when disabled: the setting that says so ("TTC_DISABLE=1")
        self.disabled_patches: frozenset[str] = frozenset()  # TTC_DISABLE=id,id
        self.log_level: str | None = None  # TTC_LOG; None: leave the logger alone
        self.watchdog_s: float | None = None  # TTC_WATCHDOG seconds; None: off
        self.problems: list[str] = []

    def patch_disabled_by(self, patch_id: str) -> str | None:
        """The setting that keeps ``patch_id`` out (``"TTC_DISABLE=a,b"``), or None."""
        if patch_id not in self.disabled_patches:
            return None
        return f"{DISABLE}={','.join(sorted(self.disabled_patches))}"

    def __repr__(self) -> str:
        return (
            f"Settings(disabled={self.disabled}, disabled_patches={sorted(self.disabled_patches)}, "
            f"log_level={self.log_level!r}, watchdog_s={self.watchdog_s})"
        )


def known_patches() -> frozenset[str]:
    """The patch ids ``TTC_DISABLE`` may name: the table's (read only when the variable lists ids)."""
    from torch_threadsafe_compile.registry import SPECS

    return frozenset(SPECS)


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    s = Settings()

    raw = env.get(DISABLE, "").strip()
    low = raw.lower()
    if low in TRUE_VALUES:
        s.disabled = True
        s.disabled_by = f"{DISABLE}={env.get(DISABLE, '')}"
    elif low not in FALSE_VALUES:
        ids = [p.strip().replace("-", "_") for p in low.split(",") if p.strip()]
        if [p for p in ids if not p.replace("_", "").isalnum()]:
            # Not a list of patch ids and not a boolean: the documented default is "enabled".
            s.problems.append(f"TTC_DISABLE={_quote(raw)} is neither a boolean nor a list of patch ids; ignored")
        else:
            s.disabled_patches = frozenset(ids)
            known_ids = known_patches()
            unknown = sorted(s.disabled_patches - known_ids)
            if unknown:
                known = ",".join(sorted(known_ids))
                s.problems.append(f"TTC_DISABLE names unknown patches {_quote(','.join(unknown))}; known: {known}")

    raw = env.get("TTC_LOG", "").strip().lower()
    if raw:
        if raw in LOG_LEVELS:
            s.log_level = raw
        else:
            s.problems.append(f"TTC_LOG={_quote(raw)} is not one of {'|'.join(LOG_LEVELS)}; using the default")

    raw = env.get("TTC_WATCHDOG", "").strip()
    if raw and raw.lower() not in FALSE_VALUES:
        try:
            v = float(raw)
            if not (WATCHDOG_MIN_S <= v < float("inf")):
                raise ValueError
            s.watchdog_s = v
        except ValueError:
            s.problems.append(f"TTC_WATCHDOG={_quote(raw)} is not a number of seconds >= {WATCHDOG_MIN_S:g}; watchdog off")

    for name, why in RETIRED.items():
        if env.get(name):
            s.problems.append(f"{name} is ignored: {why}")
    return s


_current: Settings | None = None


def current() -> Settings:
    """The settings of this process, read from ``os.environ`` once (a variable changed later has no effect)."""
    global _current
    if _current is None:
        _current = read_settings()
    return _current


PREFIX = "TTC_"  # every variable of the package starts with it


def child_environ(environ: Mapping[str, str] | None = None, disable: str | None = None,
                  watchdog_s: float | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default ``os.environ``) for a child process that must start from the package's
    defaults: every ``TTC_*`` variable removed; with ``disable``, ``TTC_DISABLE`` set to it (``"1"``: the
    package off, ``"0"``: on; patch ids: those left out); with ``watchdog_s``, ``TTC_WATCHDOG``. The one place
    outside the package's settings that knows the variables' names: the benches and examples ask here instead
    of reading or filtering them themselves."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if not k.startswith(PREFIX)}
    if disable is not None:
        env[DISABLE] = disable
    if watchdog_s is not None:
        env["TTC_WATCHDOG"] = f"{watchdog_s:g}"
    return env


def free_threaded_build() -> bool:
    """Whether this CPython is a free-threaded build (``Py_GIL_DISABLED``), whatever the GIL's state now.
    ``sys.abiflags`` says so on POSIX ("t"); ``sysconfig`` elsewhere (it costs ~1 ms to load its data, paid
    at ``import torch`` where the registry asks)."""
    flags = getattr(sys, "abiflags", None)
    if flags is not None:
        return "t" in flags
    import sysconfig

    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
