"""Command line of ``bench/compat_matrix.py``: parse, run every version, write the document (and a JSON dump)."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _harness import kill_children_on_stop

from . import ROOT
from .measure import run_version
from .provenance import command_line, revision
from .render import render
from .rows import ROW_KEYS, ROWS, Row
from .scrub import SCRUB
from .supervise import log
from .venvs import DEFAULT_VENV_ROOT, DEFAULT_VERSIONS, MIN_FREE_GB, VENV_ROOT_ENV

Job = tuple[str, Path, bool]  # (version, venv, reused)
Results = list[dict[str, Any]]  # one entry per version, as measure.run_version returns it
Meta = dict[str, Any]  # command, date, secs, revision, end_revision


def build_parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="\n\n".join(doc.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv-root", default=os.environ.get(VENV_ROOT_ENV) or str(DEFAULT_VENV_ROOT),
                    help=f"where torch-<V> venvs live or are created (default: ${VENV_ROOT_ENV}, else .venvs/ "
                         "in the repository)")
    ap.add_argument("--versions", nargs="+", default=DEFAULT_VERSIONS, metavar="V",
                    help="torch versions (default: the latest patch release of each minor, 2.4 to 2.15)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "compat.md"), help="markdown output (default docs/compat.md)")
    ap.add_argument("--jobs", type=int, default=1, help="versions run in parallel (default 1: scenarios are CPU-heavy)")
    ap.add_argument("--reuse-venv", action="append", default=[], metavar="V=PATH",
                    help="use an existing venv for version V, as found (repeatable)")
    ap.add_argument("--min-free-gb", type=float, default=MIN_FREE_GB,
                    help=f"do not create a venv that would leave less free disk than this (default {MIN_FREE_GB:g})")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per scenario run (default 300)")
    ap.add_argument("--only", nargs="+", metavar="ROW", choices=ROW_KEYS,
                    help="run only these scenario rows (for a quick check)")
    ap.add_argument("--json", metavar="PATH", help="also dump the raw results (paths scrubbed) as JSON")
    ap.add_argument("--from-json", metavar="PATH", nargs="+",
                    help="run nothing: render --out from --json dumps (several: runs of the same commit over "
                         "different versions, e.g. one venv at a time where disk is short; merged in version order)")
    return ap


def _reused(ap: argparse.ArgumentParser, items: list[str]) -> dict[str, Path]:
    reuse: dict[str, Path] = {}
    for item in items:
        ver, sep, path = item.partition("=")
        if not sep or not ver or not path:
            ap.error(f"--reuse-venv wants V=PATH, got {item!r}")
        reuse[ver] = Path(path).expanduser().absolute()
        SCRUB.add(str(reuse[ver]), "<venv>")
    return reuse


def _run_all(jobs: list[Job], rows: list[Row], args: argparse.Namespace) -> Results:
    def one(job: Job) -> dict[str, Any]:
        v, venv, reused = job
        try:
            return run_version(v, venv, reused, rows, args.timeout, args.min_free_gb)
        except Exception as e:  # a bug here must not cost the other versions
            return {"version": v, "reused": reused, "rows": {}, "error": SCRUB(f"{type(e).__name__}: {e}")}

    if args.jobs <= 1:
        return [one(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
        return list(ex.map(one, jobs))


def _measure(args: argparse.Namespace, argv: list[str], jobs: list[Job], rows: list[Row]) -> tuple[Results, Meta]:
    outputs = [Path(p) for p in (args.out, args.json) if p]  # written by the run: not "local changes"
    meta: dict[str, Any] = {"command": command_line(argv, sys.argv[0]), "revision": revision(outputs),
                            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")}
    t0 = time.monotonic()
    results = _run_all(jobs, rows, args)
    meta["secs"] = time.monotonic() - t0
    meta["end_revision"] = revision(outputs)
    if args.json:
        dump = dict(meta, rows=[r.key for r in rows], results=results)
        Path(args.json).write_text(SCRUB(json.dumps(dump, indent=1, default=str)))
    return results, meta


def _load_one(path: str) -> tuple[Results, Meta, list[Row]]:
    dump = json.loads(Path(path).read_text())
    meta = {k: dump.get(k) for k in ("command", "date", "secs", "end_revision")}
    meta["revision"] = dump.get("revision", "unknown")
    keys = set(dump.get("rows") or ROW_KEYS)
    return dump["results"], meta, [r for r in ROWS if r.key in keys]


def _load(paths: list[str]) -> tuple[Results, Meta, list[Row]]:
    """One dump, or several of the same commit (each its own versions) merged: results in version order, the
    commands one per line, the durations summed; dumps of different commits are refused."""
    parts = [_load_one(p) for p in paths]
    results, meta, rows = parts[0]
    for other, m, r in parts[1:]:
        if m["revision"] != meta["revision"]:
            raise SystemExit(f"--from-json: dumps of different commits ({meta['revision']} vs {m['revision']})")
        results = results + other
        rows = [row for row in rows if row in r]
        meta["secs"] = (meta["secs"] or 0) + (m["secs"] or 0)
        meta["end_revision"] = m["end_revision"]
    if len(parts) > 1:
        commands = list(dict.fromkeys(m["command"] for _, m, _ in parts))
        meta["command"] = "\n".join(commands) + f"\n# {len(parts)} runs of one commit, rendered together with --from-json"
    by_version: dict[str, dict[str, Any]] = {}
    for r in results:  # a version run twice (a venv that could not be made, then was): the run that worked
        if r["version"] not in by_version or "error" in by_version[r["version"]]:
            by_version[r["version"]] = r
    order = {v: i for i, v in enumerate(DEFAULT_VERSIONS)}
    results = sorted(by_version.values(), key=lambda r: order.get(r["version"], len(order)))
    return results, meta, rows


def main(argv: list[str] | None = None, doc: str = "") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    kill_children_on_stop()
    ap = build_parser(doc or (__doc__ or ""))
    args = ap.parse_args(argv)
    reuse = _reused(ap, args.reuse_venv)
    versions = list(dict.fromkeys(args.versions))
    unknown = [v for v in reuse if v not in versions]
    if unknown:
        log(f"--reuse-venv for versions not in --versions, ignored: {unknown}")
    venv_root = Path(args.venv_root).expanduser().absolute()
    SCRUB.add(str(venv_root), "<venv-root>")
    rows = [r for r in ROWS if not args.only or r.key in args.only]
    if args.from_json:
        results, meta, rows = _load(args.from_json)
    else:
        jobs = [(v, reuse.get(v, venv_root / f"torch-{v}"), v in reuse) for v in versions]
        results, meta = _measure(args, argv, jobs, rows)
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results, rows, meta))
    log(f"wrote {SCRUB(str(out.absolute()))} ({meta['secs'] / 60:.1f} min)")
    return 0
