"""Parsing of the ``TTC_*`` environment variables.

Standard library only: this module is imported by the interpreter-start bootstrap, which must stay
well under a millisecond and must never raise. Bad values never raise either; they produce a message
that the caller reports (at most once) and the documented default is used instead.
"""

from __future__ import annotations

import os

__all__ = ["Settings", "read_settings"]

_TRUE = frozenset({"1", "true", "yes", "on", "all"})
_FALSE = frozenset({"", "0", "false", "no", "off", "none"})
_LOG_LEVELS = ("debug", "info", "warning", "error")


class Settings:
    """The parsed environment. ``problems`` lists human-readable complaints about bad values."""

    __slots__ = ("disabled", "disabled_patches", "log_level", "watchdog_s", "problems")

    def __init__(self) -> None:
        self.disabled = False  # TTC_DISABLE=1: nothing is patched, explicit install() included
        self.disabled_patches: frozenset[str] = frozenset()  # TTC_DISABLE=id,id
        self.log_level: str | None = None  # TTC_LOG; None: leave the logger alone
        self.watchdog_s: float | None = None  # TTC_WATCHDOG seconds; None: off
        self.problems: list[str] = []

    def __repr__(self) -> str:
        return (
            f"Settings(disabled={self.disabled}, disabled_patches={sorted(self.disabled_patches)}, "
            f"log_level={self.log_level!r}, watchdog_s={self.watchdog_s})"
        )


def read_settings(environ: "os._Environ[str] | dict[str, str] | None" = None) -> Settings:
    env = os.environ if environ is None else environ
    s = Settings()

    raw = env.get("TTC_DISABLE", "").strip()
    low = raw.lower()
    if low in _TRUE:
        s.disabled = True
    elif low not in _FALSE:
        ids = [p.strip().replace("-", "_") for p in low.split(",") if p.strip()]
        bad = [p for p in ids if not p.replace("_", "").isalnum()]
        if bad:
            # Not a list of patch ids and not a boolean: the documented default is "enabled".
            s.problems.append(f"TTC_DISABLE={raw!r} is neither a boolean nor a list of patch ids; ignored")
        else:
            s.disabled_patches = frozenset(ids)

    raw = env.get("TTC_LOG", "").strip().lower()
    if raw:
        if raw in _LOG_LEVELS:
            s.log_level = raw
        else:
            s.problems.append(f"TTC_LOG={raw!r} is not one of {'|'.join(_LOG_LEVELS)}; using the default")

    raw = env.get("TTC_WATCHDOG", "").strip()
    if raw and raw.lower() not in _FALSE:
        try:
            v = float(raw)
            if not (v > 0 and v < float("inf")):
                raise ValueError
            s.watchdog_s = v
        except ValueError:
            s.problems.append(f"TTC_WATCHDOG={raw!r} is not a positive number of seconds; watchdog off")
    return s
