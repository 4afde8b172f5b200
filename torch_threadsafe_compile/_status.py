"""``status()``: a structured report of this process (versions, activation, every patch)."""

from __future__ import annotations

import sys
from typing import Any

from torch_threadsafe_compile import _env, _lifecycle, _state
from torch_threadsafe_compile._lifecycle import State
from torch_threadsafe_compile._version import __version__

__all__ = ["build", "patch_state"]


def _activation(settings: _env.Settings) -> str:
    if settings.disabled:
        return "disabled"
    return _state.mode or "not activated"


def _row(ps: _lifecycle.PatchState, disabled: bool) -> dict[str, Any]:
    spec = ps.spec
    row: dict[str, Any] = {
        "id": spec.id,
        "hazard": spec.hazard,
        "summary": spec.summary,
        "upstream": spec.upstream,
        "torch_versions": spec.torch_versions,
        "state": State.DISABLED.value if disabled else ps.state.value,
        "reason": "TTC_DISABLE" if disabled else ps.reason,
    }
    if disabled:
        return row
    # The hazard stays open for a reason other than this torch's version or an upstream fix.
    row["open"] = ps.state is State.FAILED or ps.skip in _lifecycle.LOST or (ps.state is State.PENDING and _state.mode is None)
    if ps.state is State.PENDING and not ps.reason:
        if _state.mode is None:
            row["reason"] = "not activated: the start-up hook did not run (install() applies it)"
        elif "torch" not in sys.modules:
            row["reason"] = "waits for torch"
        else:
            missing = [m for m in spec.modules if m not in sys.modules]
            row["reason"] = ("waits for import of " + ", ".join(missing)) if missing else "waits for " + ", ".join(spec.after)
    if ps.changes is not None:
        replaced = ps.changes.intact()
        if replaced:
            row["replaced_by_others"] = replaced
    report = getattr(ps.impl, "report", None) if ps.state is State.APPLIED else None  # applied: imported already
    if report is not None:
        try:
            row["stats"] = report()
        except Exception as e:  # a report must not break status()
            row["stats"] = {"error": repr(e)}
    return row


def build() -> dict[str, Any]:
    settings = _env.current()
    torch_mod = sys.modules.get("torch")
    out: dict[str, Any] = {
        "version": __version__,
        "torch": str(getattr(torch_mod, "__version__", None)) if torch_mod is not None else None,
        "python": sys.version.split()[0],
        "activation": _activation(settings),
        "inactive_reason": _state.inactive_reason,
        "patches": [],
    }
    # Only reads: patches settle when their modules are imported (or at install()), never because someone
    # asked (a process where the start-up hook did not run would otherwise be patched by a status() call).
    with _lifecycle._lock:
        out["patches"] = [_row(ps, settings.disabled) for ps in _lifecycle.states().values()]
    return out


def patch_state(patch_id: str) -> State:
    """The state of one patch (``KeyError`` for an unknown id)."""
    if _env.current().disabled:
        _lifecycle.states()[patch_id]  # unknown ids still raise
        return State.DISABLED
    return _lifecycle.states()[patch_id].state
