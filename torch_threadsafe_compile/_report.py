"""``status()``: this process as a structured report (versions, activation, every patch).

Only formats :func:`torch_threadsafe_compile._lifecycle.snapshot`: what is active, disabled or waiting, and
why, is decided there.
"""

from __future__ import annotations

import sys
from typing import Any

from torch_threadsafe_compile import _lifecycle
from torch_threadsafe_compile._package_version import __version__

__all__ = ["build", "protection_missing"]


def _row(view: _lifecycle.PatchView) -> dict[str, Any]:
    spec = view.spec
    row: dict[str, Any] = {
        "id": spec.id,
        "hazard": spec.hazard,
        "summary": spec.summary,
        "upstream": spec.upstream,
        "torch_versions": spec.torch_versions,
        "state": view.state.value,
        "reason": view.reason,
    }
    if view.open is None:  # disabled
        return row
    row["open"] = view.open
    if view.replaced_by_others:
        row["replaced_by_others"] = list(view.replaced_by_others)
    if view.stats is not None:
        row["stats"] = view.stats
    return row


def protection_missing(snap: _lifecycle.Snapshot) -> list[str]:
    """Why protection is missing in this process, one entry per cause: the package not activated (no
    start-up hook ran), and every patch whose hazard stays open for a reason other than this torch's version
    or an upstream fix. Empty while every hazard of this torch is covered, and while the package is off on
    purpose (``TTC_DISABLE``, ``uninstall()``): what the user switched off is not missing."""
    if snap.activation in ("disabled", "uninstalled"):
        return []
    out = [f"{view.spec.id} ({view.spec.hazard}): {view.state.value}" for view in snap.patches if view.open]
    if snap.activation == "not activated":
        out.insert(0, "not activated")
    return out


def capabilities() -> dict[str, dict[str, list[str]]]:
    """What patches hand each other (``registry.PatchSpec.provides``/``requires``): per capability, the
    patches that provide it *now* (from the journal: applied providers only; ``core`` for the package's
    own) and those whose rows require it."""
    from torch_threadsafe_compile import _journal, registry

    live = _journal.capabilities()
    out: dict[str, dict[str, list[str]]] = {}
    for name, declared_by in registry.capability_providers().items():
        provided = ["core"] if name in registry.CORE_CAPABILITIES else list(
            dict.fromkeys(live[name].providers) if name in live else ())
        out[name] = {"provided_by": provided, "declared_by": list(declared_by) or ["core"],
                     "required_by": [s.id for s in registry.SPECS.values() if name in s.requires]}
    return out


def build() -> dict[str, Any]:
    torch_mod = sys.modules.get("torch")
    snap = _lifecycle.snapshot()
    return {
        "version": __version__,
        "torch": str(getattr(torch_mod, "__version__", None)) if torch_mod is not None else None,
        "python": sys.version.split()[0],
        "activation": snap.activation,
        "inactive_reason": snap.inactive_reason,
        "active": snap.inactive_reason is None,
        "protection_missing": protection_missing(snap),
        "patches": [_row(view) for view in snap.patches],
        "capabilities": capabilities(),
    }
