"""The verdict of each matrix cell. Every cell that shows a problem of the package (or a failure) also adds a
line to ``findings``, the list the document prints under *Findings*."""

from __future__ import annotations

import re
from typing import Any

from .rows import Row
from .scrub import SCRUB

VResult = dict[str, Any]  # one version's results, as measure.run_version returns them
ACTIVATED = ("pth", "start", "sitecustomize", "explicit")


def short_reason(reason: str) -> str:
    m = re.match(r"fixed upstream in torch (\S+)", reason)
    if m:
        return f"fixed upstream in {m.group(1)}"
    m = re.match(r"torch \S+ is outside (.+?) \(hazard absent there\)", reason)
    if m:
        return f"outside {m.group(1)}"
    return reason


def patch_state(vres: VResult, patch_id: str | None) -> dict[str, Any] | None:
    """The patch's entry in ``doctor --json`` when active, or None."""
    act = vres.get("doctor", {}).get("active", {})
    for p in act.get("patches", []) or []:
        if p.get("id") == patch_id:
            return p
    return None


def state_text(p: dict[str, Any] | None) -> str:
    if p is None:
        return "state unknown"
    return p["state"] if p["state"] == "applied" else f"{p['state']}: {short_reason(p.get('reason', ''))}"


def value(row: Row, r: dict[str, Any]) -> str:
    return r["short"] if r.get("failed") else row.show(r)


def _failed_cell(row: Row, v: str, u: dict[str, Any], a: dict[str, Any], st: str, findings: list[str]) -> str:
    """A cell where at least one of the two runs produced no result (crash, timeout, unreadable result)."""
    uv, av = value(row, u), value(row, a)
    if a.get("failed") and not u.get("failed"):
        findings.append(f"torch {v}: `{row.invocation}` fails only when active: {a['short']} "
                        f"(unpatched: {uv}; {row.patch}: {st})")
        return f"ACTIVE FAILS: {uv} → {av} ({st})"
    if u.get("failed") and not a.get("failed"):
        still_bad = row.bad(a)
        if still_bad:
            findings.append(f"torch {v}: `{row.invocation}` unpatched {uv}; active still bad: {av} ({st})")
        return f"unpatched failed, {'still bad' if still_bad else 'ok when active'}: {uv} → {av} ({st})"
    findings.append(f"torch {v}: `{row.invocation}` fails in both modes (with and without the package): "
                    f"{uv} / {av}")
    return f"failed both: {uv} ({st})" if uv == av else f"failed both: {uv} → {av} ({st})"


def _control_cell(row: Row, v: str, uv: str, av: str, bu: bool, ba: bool, st: str, findings: list[str]) -> str:
    if not ba:
        return f"kept ({uv} → {av})" if not bu else f"fixed?! ({uv} → {av}; {st})"
    findings.append(f"torch {v}: `{row.invocation}` control broken when active: {av} (unpatched: {uv}; {st})")
    return f"BROKEN: {uv} → {av} ({st})"


def _read_pair(row: Row, v: str, u: dict[str, Any], a: dict[str, Any], ps: dict[str, Any] | None,
               findings: list[str]) -> str:
    """Both runs produced a result: reproduced / absent / skipped, or a problem of the package."""
    st = state_text(ps)
    skipped = ps is not None and ps["state"] == "skipped"
    uv, av = value(row, u), value(row, a)
    bu, ba = row.bad(u), row.bad(a)
    broke = row.control(u, a) if row.control else None
    if broke:
        findings.append(f"torch {v}: `{row.invocation}` when active: {broke} ({st})")
        return f"BROKEN: {broke}; {uv} → {av} ({st})"
    if row.is_control:
        return _control_cell(row, v, uv, av, bu, ba, st, findings)
    if bu and not ba:
        return f"reproduced: {uv} → {av} ({st})"
    if bu and ba:
        if skipped:
            findings.append(f"torch {v}: hazard reproduced by `{row.invocation}` but {row.patch} is {st}: {uv} → {av}")
            return f"reproduced, patch {st}: {uv} → {av}"
        findings.append(f"torch {v}: `{row.invocation}` still bad when active: {uv} → {av} ({st})")
        return f"NOT FIXED: {uv} → {av} ({st})"
    if not bu and ba:
        findings.append(f"torch {v}: `{row.invocation}` regresses when active: {uv} → {av} ({st})")
        return f"REGRESSION: {uv} → {av} ({st})"
    if skipped:
        return f"skipped: {short_reason(ps.get('reason', ''))} — absent ({uv} → {av})"  # type: ignore[union-attr]
    return f"absent ({uv} → {av})" + ("" if st == "applied" else f" ({st})")


def hazard_cell(row: Row, vres: VResult, findings: list[str]) -> str:
    if "error" in vres:
        return "not run (venv)"
    pair = vres["rows"].get(row.key)
    if pair is None:
        return "not run"
    u, a = pair["unpatched"], pair["active"]
    ps = patch_state(vres, row.patch)
    if u.get("failed") or a.get("failed"):
        return _failed_cell(row, vres["version"], u, a, state_text(ps), findings)
    return _read_pair(row, vres["version"], u, a, ps, findings)


def patch_cell(patch_id: str, vres: VResult, findings: list[str]) -> str:
    if "error" in vres:
        return "not run (venv)"
    act = vres.get("doctor", {}).get("active", {})
    if act.get("failed"):
        return f"doctor {act['short']}"
    p = patch_state(vres, patch_id)
    if p is None:
        return "not in the package when this version ran"
    text = state_text(p)
    if p["state"] == "failed":
        findings.append(f"torch {vres['version']}: patch {patch_id} failed: {SCRUB(p.get('reason', ''))}")
        text = f"FAILED: {SCRUB(p.get('reason', ''))}"
    elif p["state"] not in ("applied", "skipped"):
        findings.append(f"torch {vres['version']}: patch {patch_id} is {p['state']} after doctor: {p.get('reason')}")
    if p.get("replaced_by_others"):
        text += f" (replaced by others: {', '.join(p['replaced_by_others'])})"
    return text


def version_findings(vres: VResult) -> list[str]:
    """Activation and doctor problems of one version (not tied to a cell)."""
    out: list[str] = []
    v = vres["version"]
    doctor = vres.get("doctor", {})
    act = doctor.get("active", {})
    if act and not act.get("failed") and act.get("activation") not in ACTIVATED:
        out.append(f"torch {v}: activation when active is {act.get('activation')!r} ({act.get('inactive_reason')})")
    unp = doctor.get("unpatched", {})
    if unp and not unp.get("failed"):
        not_disabled = [p["id"] for p in unp.get("patches", []) if p.get("state") != "disabled"]
        if not_disabled or unp.get("activation") != "disabled":
            out.append(f"torch {v}: with TTC_DISABLE=1 activation is {unp.get('activation')!r}, "
                       f"patches not disabled: {not_disabled}")
    for mode in ("unpatched", "active"):
        d = doctor.get(mode, {})
        if d.get("failed"):
            out.append(f"torch {v}: doctor ({mode}) {d['short']}")
    if "error" in vres:
        out.append(f"torch {v}: not run: {vres['error']}")
    return out
