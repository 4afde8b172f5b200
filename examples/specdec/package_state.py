"""Whether torch_threadsafe_compile protects this process, as the package itself says (its ``status()``): for the
trainer's start line, its error policy, summary.json and the ``SUMMARY`` line, and for the benches that read them.

Never decided here from the environment (the package alone parses its ``TTC_*`` variables, with every spelling
it accepts) nor from "the module imports": run from a checkout, the package is importable in a process that
nothing activated (after ``pip uninstall``, or without the start-up hook), and protects nothing there. Imports
nothing heavy: the package's ``status()`` does not import torch.
"""
from __future__ import annotations

from typing import Any


def active() -> bool:
    """Whether torch_threadsafe_compile protects this process: the one place the trainer decides it (``state``
    asks the package). The error policy's default (``config.resolve``), ``--no-ttc``'s re-execution
    (``cli.reexec_without_ttc``), the start line and the summaries all go by this answer."""
    return bool(state()["active"])


def state() -> dict[str, Any]:
    """``{"importable", "active", "label", ["in_force"], "status"}``: ``in_force`` lists the patches applied,
    ``status`` is the package's ``status()`` (None when it
    cannot be imported or asked; ``reason`` says why), ``active`` its word on activation, ``label`` the short form
    of the ``SUMMARY`` line. Never raises: a broken package is a fact of the run, not a reason to stop it."""
    try:
        import torch_threadsafe_compile as ttc
    except Exception as e:
        return {"importable": False, "active": False, "label": "not importable", "status": None,
                "reason": f"{type(e).__name__}: {e}"}
    try:
        status = dict(ttc.status())
    except Exception as e:
        return {"importable": True, "active": False, "label": "status() failed", "status": None,
                "reason": f"{type(e).__name__}: {e}"}
    # The package's own word on this process, not the environment: TTC_DISABLE has several spellings, and an
    # importable package protects nothing where nothing activated it.
    is_active = bool(status.get("active"))
    return {"importable": True, "active": is_active, "label": label(status, is_active),
            "in_force": in_force(status), "status": status}


def label(status: dict[str, Any], is_active: bool) -> str:
    """``active``, ``active, protection missing: ...``, ``disabled (TTC_DISABLE=...)``, ``uninstalled`` or
    ``not activated``: the package's own words, shortened."""
    if is_active:
        missing = status.get("protection_missing") or []
        return "active" if not missing else "active, protection missing: " + "; ".join(missing)
    activation = str(status.get("activation"))
    return f"{activation} ({status['inactive_reason']})" if activation == "disabled" else activation


def in_force(status: dict[str, Any] | None) -> list[str]:
    """The ids of the patches applied in this process."""
    return [p["id"] for p in (status or {}).get("patches", []) if p.get("state") == "applied"]


def start_line(st: dict[str, Any], error_policy: str | None) -> str:
    """The trainer's first line: whether the package protects this run, and what an error in a compiled call does
    (``--error-policy``). Patches apply as torch loads the modules they target: which ones are in force is said at
    the end, in summary.json."""
    status = st["status"] or {}
    if st["active"]:
        what = f"active ({status.get('activation')})"
    else:
        what = f"{status.get('activation') or st['label']} ({status.get('inactive_reason') or st.get('reason')})"
    policy = ("errors in compiled calls are counted and retried" if error_policy == "count"
              else "an error in a compiled call stops the run")
    return f"torch-threadsafe-compile: {what}; {policy}"
