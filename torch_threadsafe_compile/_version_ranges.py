"""torch's version and version ranges.

``packaging`` is the reference (``SpecifierSet`` with pre-releases allowed). One fast path stands in front
of it because it runs inside every ``import torch``: plain release versions (``2.13.0``, ``2.13.0+cpu``)
against clauses of the form ``>=2.4`` / ``<2.14.1`` are compared as integer tuples, which saves the
~6 ms that importing ``packaging.specifiers`` costs. Both give the same answers for every clause the
registry uses; ``tests/test_registry.py`` checks them against each other.
"""

from __future__ import annotations

import re
import sys
from typing import Any

__all__ = ["Version", "torch_version", "version_error", "version_in", "format_version"]

# A release tuple such as (2, 13, 0), or a packaging Version for pre-releases and dev builds.
Version = Any

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\+[0-9A-Za-z.]+)?$")
_CLAUSE = re.compile(r"^(>=|<=|==|!=|<|>)\s*(\d+)\.(\d+)(?:\.(\d+))?$")
_OPS = {">=": tuple.__ge__, "<=": tuple.__le__, "==": tuple.__eq__, "!=": tuple.__ne__, "<": tuple.__lt__, ">": tuple.__gt__}

_cache: dict[str, tuple[Version | None, str | None]] = {}


def parse(raw: str) -> tuple[Version | None, str | None]:
    """``(version, None)`` or ``(None, why it is not a version)``; the local part (``+cpu``) is dropped."""
    m = _RELEASE.match(raw)
    if m:
        return tuple(int(x or 0) for x in m.groups()), None
    from packaging.version import InvalidVersion
    from packaging.version import Version as PVersion

    try:
        return PVersion(PVersion(raw).base_version), None
    except InvalidVersion:
        return None, f"torch.__version__ {raw!r} is not a version"


def _torch_raw() -> str:
    return str(getattr(sys.modules.get("torch"), "__version__", ""))


def torch_version() -> Version | None:
    """The version of the imported torch (None when it is not a version; see :func:`version_error`)."""
    raw = _torch_raw()
    if raw not in _cache:
        _cache[raw] = parse(raw)
    return _cache[raw][0]


def version_error() -> str | None:
    raw = _torch_raw()
    if raw not in _cache:
        _cache[raw] = parse(raw)
    return _cache[raw][1]


def version_in(version: Version, specifier: str) -> bool:
    """``version in SpecifierSet(specifier)``, pre-releases allowed."""
    if isinstance(version, tuple):
        parsed = [_CLAUSE.match(c.strip()) for c in specifier.split(",") if c.strip()]
        if parsed and all(parsed):
            return all(_OPS[m.group(1)](version, tuple(int(x or 0) for x in m.groups()[1:])) for m in parsed if m)
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version as PVersion

    v = PVersion(".".join(map(str, version))) if isinstance(version, tuple) else version
    return bool(SpecifierSet(specifier, prereleases=True).contains(v, prereleases=True))


def format_version(version: Version) -> str:
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
