#!/usr/bin/env python
"""Summary of ``bench/gpu_cudagraph_trees.sh``'s pytest logs: per mode, what passed and what failed.

    python bench/gpu_cudagraph_summary.py WORKDIR            # Markdown on stdout; WORKDIR/summary.json,
                                                             # WORKDIR/active_only.txt (node ids)

Log names: ``<step>-<mode>[-<n>].txt`` with step ``attr``, ``full`` or ``rerun`` and mode ``off``
(``TTC_DISABLE=1``) or ``on`` (active). Each log is pytest's ``-v -rfE`` output: a test's outcome is read
from its ``-v`` line(s) (``PASSED``, ``FAILED``, ``ERROR`` at setup or teardown, ``SKIPPED``...) and from the
short summary (``FAILED nodeid - message``); a test fails if any of them says FAILED or ERROR. A log
without pytest's final ``==== ... in N s ====`` line is reported as incomplete (stopped by its timeout).
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from typing import Any

NAME = re.compile(r"^(attr|full|rerun)-(off|on)(?:-(\d+))?\.txt$")
VLINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
SHORT = re.compile(r"^(FAILED|ERROR) (\S+::\S+?)(?: - (.*))?$")
FINAL = re.compile(r"^=+ (.*) in [\d.]+s(?: \([^)]*\))? =+$")
COLLECTED = re.compile(r"collected (\d+) items?(?: / (\d+) deselected)?")


def parse(path: str) -> dict[str, Any]:
    outcomes: dict[str, set[str]] = collections.defaultdict(set)
    messages: dict[str, str] = {}
    final, collected = None, None
    with open(path, errors="replace") as fh:
        for line in fh:
            line = line.rstrip("\n")
            m = VLINE.match(line)
            if m:
                outcomes[m.group(1)].add(m.group(2))
                continue
            m = SHORT.match(line)
            if m:
                outcomes[m.group(2)].add(m.group(1))
                if m.group(3):
                    messages.setdefault(m.group(2), m.group(3)[:200])
                continue
            m = FINAL.match(line)
            if m:
                final = m.group(1)
            m = COLLECTED.search(line)
            if m and collected is None:
                collected = int(m.group(1)) - int(m.group(2) or 0)
    return {"outcomes": outcomes, "messages": messages, "final": final, "collected": collected}


def verdict(states: set[str]) -> str:
    if states & {"FAILED", "ERROR"}:
        return "fail"
    if states & {"PASSED", "XFAIL", "XPASS"}:
        return "pass"
    return "skip" if "SKIPPED" in states else "?"


def short(nodeid: str) -> str:
    return nodeid.split("::", 1)[1] if "::" in nodeid else nodeid


def main() -> int:
    work = sys.argv[1]
    logs: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = collections.defaultdict(list)
    for name in sorted(os.listdir(work)):
        m = NAME.match(name)
        if m:
            logs[(m.group(1), m.group(2))].append((name, parse(os.path.join(work, name))))
    out: dict[str, Any] = {}
    md: list[str] = []
    for step in ("attr", "full"):
        per_mode: dict[str, dict[str, str]] = {}
        msgs: dict[str, dict[str, str]] = {}
        rows = []
        for mode in ("off", "on"):
            tests: dict[str, str] = {}
            msgs[mode] = {}
            incomplete, collected = [], 0
            for name, p in logs.get((step, mode), []):
                for nid, st in p["outcomes"].items():
                    tests[nid] = verdict(st)
                msgs[mode].update(p["messages"])
                collected += p["collected"] or 0
                if p["final"] is None:
                    incomplete.append(name)
            per_mode[mode] = tests
            c = collections.Counter(tests.values())
            rows.append((mode, collected, c["pass"], c["fail"], c["skip"], c["?"], incomplete))
        if not any(r[1] or r[2] or r[3] for r in rows):
            continue
        on, off = per_mode["on"], per_mode["off"]
        active_only = sorted(t for t, v in on.items() if v == "fail" and off.get(t) == "pass")
        off_only = sorted(t for t, v in off.items() if v == "fail" and on.get(t) == "pass")
        both = sorted(t for t, v in on.items() if v == "fail" and off.get(t) == "fail")
        unpaired = sorted(t for t in set(on) ^ set(off))
        keys = ("collected", "passed", "failed", "skipped", "unknown", "incomplete_logs")
        out[step] = {"modes": {r[0]: dict(zip(keys, r[1:])) for r in rows},
                     "active_only": active_only, "off_only": off_only, "both": both, "unpaired": unpaired,
                     "messages": {t: {"on": msgs["on"].get(t), "off": msgs["off"].get(t)} for t in active_only + off_only + both}}
        md += [f"## {step}", "", "| mode | collected | passed | failed (F or E) | skipped | ? | incomplete logs |",
               "|---|---|---|---|---|---|---|"]
        for r in rows:
            label = "TTC_DISABLE=1" if r[0] == "off" else "active"
            md.append(f"| {label} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {', '.join(r[6]) or '-'} |")
        md += ["", f"active only ({len(active_only)}): " + (", ".join(short(t) for t in active_only) or "none"),
               f"off only ({len(off_only)}): " + (", ".join(short(t) for t in off_only) or "none"),
               f"both modes ({len(both)}): " + (", ".join(short(t) for t in both) or "none"),
               f"seen in one mode only (not run in the other: {len(unpaired)}): "
               + (", ".join(short(t) for t in unpaired[:20]) or "none"), ""]
        for t in active_only + off_only + both:
            md.append(f"- `{short(t)}`: on: {msgs['on'].get(t) or '-'} | off: {msgs['off'].get(t) or '-'}")
        md.append("")
        if step == "full":
            with open(os.path.join(work, "active_only.txt"), "w") as fh:
                fh.write("".join(t + "\n" for t in active_only))
    reruns: dict[str, dict[str, list[str]]] = collections.defaultdict(lambda: {"off": [], "on": []})
    for mode in ("off", "on"):
        for _name, p in logs.get(("rerun", mode), []):
            for nid, st in p["outcomes"].items():
                reruns[nid][mode].append(verdict(st))
    if reruns:
        md += ["## reruns", "", "| test | fails with TTC_DISABLE=1 | fails active |", "|---|---|---|"]
        for nid, r in sorted(reruns.items()):
            md.append(f"| `{short(nid)}` | {r['off'].count('fail')} of {len(r['off'])} | {r['on'].count('fail')} of {len(r['on'])} |")
        out["reruns"] = reruns
        md.append("")
    with open(os.path.join(work, "summary.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
