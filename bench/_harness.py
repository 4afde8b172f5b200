"""The bench scripts' harness: the two modes, fresh interpreters, and the tables they print.

Every bench compares the package active with upstream's behaviour (``TTC_DISABLE=1``, the package off) in
fresh interpreters, and prints Markdown tables that the docs quote. What they share lives here:

* modes: ``mode_label``, ``scenario_env``, ``alternating`` (ABBA order, so that drifts of the machine hit both
  modes alike), ``alternate`` (median and ratio of a measurement made that way);
* children: ``child_environ`` (the package's own helper), ``child_env`` (a bench child's environment in one mode),
  ``run_child`` / ``run_child_json`` (``python -c CODE`` in that environment), ``run_proc`` (a command in its own
  process group under a timeout, never raising for the child's sake), ``result_line`` (a child's ``RESULT``
  JSON line), ``cold_env`` / ``run_cold`` / ``run_row`` (a run with an empty compile cache, as a table row),
  ``kill_group``, ``own_group`` (a child's ``preexec_fn``), ``kill_children_on_stop``, ``log``; inside a
  child: ``child_call``, ``print_result``, ``unpatched_side`` and ``error_kind``;
* output: ``cell``, ``md_table``, ``spread`` (median and range) and ``write_between`` (a table into a document
  between its markers).

Standard library only, and runs on any Python >= 3.9: the compatibility matrix (``bench/compat/``) drives
venvs of other torch releases from an interpreter that need not have the package installed, so the package's
``_env`` (standard library only too) is loaded from this checkout by path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from _repo import ROOT  # the repository root, on sys.path too: ttc_testing and examples import from there

_spec = importlib.util.spec_from_file_location("_ttc_env_for_bench", ROOT / "torch_threadsafe_compile" / "_env.py")
assert _spec is not None and _spec.loader is not None
_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_env)
child_environ = _env.child_environ

# ---------------------------------------------------------------------------------------------------------
# The two modes.

UNPATCHED, ACTIVE = "TTC_DISABLE=1", "active"


def mode_label(disabled: bool) -> str:
    """How the tables name a mode: ``TTC_DISABLE=1`` (the package off: upstream) or ``active``."""
    return UNPATCHED if disabled else ACTIVE


def scenario_env(disabled: bool) -> dict[str, str]:
    """The variables to lay over a child's environment for one mode (``ttc_testing``'s ``run(env=...)``)."""
    return {"TTC_DISABLE": "1" if disabled else "0"}


def alternating(rounds: int, disabled_first: bool = True) -> Iterator[tuple[int, bool]]:
    """``(round, disabled)`` for both modes in every round, the order swapped from one round to the next."""
    for i in range(rounds):
        first = disabled_first if i % 2 == 0 else not disabled_first
        yield i, first
        yield i, not first


def alternate(measure: Callable[[bool], float], rounds: int) -> dict[str, float]:
    """Run ``measure(disabled)`` alternately (ABBA...) so drifts of the machine hit both sides alike."""
    on: list[float] = []
    off: list[float] = []
    for _, disabled in alternating(rounds, disabled_first=False):
        (off if disabled else on).append(measure(disabled))
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"active_median": m_on, "unpatched_median": m_off, "ratio": m_on / m_off, "rounds": rounds}


# ---------------------------------------------------------------------------------------------------------
# Children.


def child_env(disabled: bool | str | None, tree: str | None = None) -> dict[str, str]:
    """The environment of a benchmark child: the caller's without ``TTC_*``; ``TTC_DISABLE=1`` when
    ``disabled`` is True, ``TTC_DISABLE=<disabled>`` for a string (patch ids, e.g. ``first_compile``), the package's
    default (active) for False or None; with ``tree`` (a checkout of this project) first on ``PYTHONPATH``, so
    that the child's start-up hook activates that tree's package instead of the installed one (two commits in one
    run)."""
    env = child_environ(disable="1" if disabled is True else (disabled or None))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH", "")) if p)
    # Measure as users run: with bytecode caching (pip install writes .pyc files; an environment that
    # forbids writing them would make every start compile our sources, ~3 ms, and torch's).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def add_tree_option(ap: Any) -> None:
    """``--tree PATH`` (repeatable): a checkout of the package to measure; several compare commits in one run."""
    ap.add_argument("--tree", action="append", default=None, metavar="PATH",
                    help="a checkout of the package to measure (repeatable; default: the installed package)")


def trees_of(ap: Any, args: Any) -> list[str | None]:
    """The trees ``--tree`` named (None: the installed package); a path without the package is a usage error."""
    trees: list[str | None] = list(args.tree) if args.tree else [None]
    for t in trees:
        if t is not None and not os.path.isfile(os.path.join(t, "torch_threadsafe_compile", "__init__.py")):
            ap.error(f"--tree {t}: no torch_threadsafe_compile package there")
    return trees


def tree_turns(trees: Sequence[str | None], round_no: int) -> Sequence[str | None]:
    """The trees in the order of round ``round_no``: forwards, then backwards, so drifts hit each alike."""
    return trees if round_no % 2 == 0 else trees[::-1]


def run_child(code: str, disabled: bool, args: tuple[str, ...] = (), tree: str | None = None) -> str:
    """``python [args] -c code`` in a fresh interpreter of one mode; its stdout (it raises if the child fails)."""
    p = subprocess.run([sys.executable, *args, "-c", code], env=child_env(disabled, tree), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"benchmark child failed (rc={p.returncode}):\n{p.stderr[-2000:]}")
    return p.stdout


def run_child_json(code: str, disabled: bool, args: tuple[str, ...] = (), tree: str | None = None) -> Any:
    """The JSON value that ``run_child`` printed on its last line."""
    return json.loads(run_child(code, disabled, args, tree).strip().splitlines()[-1])


_print_lock = threading.Lock()
_children: set[subprocess.Popen[str]] = set()  # running children of run_proc, killed if we are stopped


def log(msg: str, tag: str = "bench") -> None:
    """One time-stamped progress line on stderr (whole lines, from any thread)."""
    with _print_lock:
        print(f"[{tag} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kill_group(p: subprocess.Popen[Any]) -> None:
    """SIGKILL to the process group that child ``p`` leads (its compile workers too); ``p`` alone if it leads none."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except OSError:
            pass


def own_group() -> None:
    """A child's ``preexec_fn``: its own process group (a timeout kills its compile workers too), and SIGKILL
    when the benchmark process dies (Linux), so that no child outlives it."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _on_stop(signum: int, _frame: Any) -> None:
    for p in list(_children):
        kill_group(p)
    raise SystemExit(128 + signum)


def kill_children_on_stop() -> None:
    """SIGTERM / SIGINT kill every running child's process group (of ``run_proc``) before we exit."""
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)


def run_proc(cmd: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own process group; on timeout kill that group. Never raises for the child's sake:
    ``{"rc", "stdout", "stderr", "timeout", "secs"}`` (``rc`` None when it could not start)."""
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", start_new_session=True)
    except OSError as e:
        return {"rc": None, "stdout": "", "stderr": f"{type(e).__name__}: {e}", "timeout": False, "secs": 0.0}
    _children.add(p)
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_group(p)
        out, err = p.communicate()
        timed_out = True
    finally:
        _children.discard(p)
    return {"rc": p.returncode, "stdout": out or "", "stderr": err or "", "timeout": timed_out,
            "secs": round(time.monotonic() - t0, 1)}


def result_line(stdout: str, prefix: str = "RESULT ") -> dict[str, Any] | None:
    """The JSON object of the last ``prefix`` line, or None (no such line, or not JSON)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(prefix):
            try:
                value = json.loads(line[len(prefix):])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def cold_env(disabled: bool, cache: str, watchdog_s: float | None = None) -> dict[str, str]:
    """A child's environment in one mode with an inductor/Triton cache of its own (``cache``, empty: cold
    compiles), the repository root on ``PYTHONPATH`` (the child imports ``ttc_testing`` and the bench script
    from there), unbuffered output; ``watchdog_s``: the package's compile-lock watchdog."""
    env = child_environ(disable="1" if disabled else None, watchdog_s=watchdog_s)
    env.update(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_cold(cmd: list[str], disabled: bool, timeout: float, watchdog_s: float | None = None) -> dict[str, Any]:
    """``run_proc`` of ``cmd`` from the repository root with ``cold_env`` and a fresh cache directory, removed
    afterwards."""
    cache = tempfile.mkdtemp(prefix="ttc-bench-cache-")
    try:
        return run_proc(cmd, cold_env(disabled, cache, watchdog_s), timeout, cwd=str(ROOT))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_row(pr: dict[str, Any], **head: Any) -> dict[str, Any]:
    """The row of one ``run_proc`` run: ``head`` (the job's labels), ``job_wall_s``, ``rc`` (None: killed at its
    timeout), then the fields of its RESULT line with ``completed=True``, or, without one,
    ``completed=False, ok=False``, ``hung`` and the tail of its stderr."""
    rc = None if pr["timeout"] else pr["rc"]
    row: dict[str, Any] = {**head, "job_wall_s": pr["secs"], "rc": rc}
    res = result_line(pr["stdout"])
    if res is not None:
        row.update(completed=True, **res)
    else:
        err = pr["stderr"]
        row.update(completed=False, ok=False, hung=rc is None or "Timeout (" in err, tail=err[-1500:])
    return row


def run_pool(jobs: list[dict[str, Any]], run: Callable[[dict[str, Any]], dict[str, Any]], parallel: int,
             budget_s: float, hide: Sequence[str] = ("traceback", "tail")) -> list[dict[str, Any]]:
    """``run(job)`` for every job, ``parallel`` at a time (they share one GPU), rows in the jobs' order; a job not
    started within ``budget_s`` of the first gets ``skipped="budget"`` instead. Each row is printed as one JSON
    line (without the ``hide`` keys) as it comes."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()

    def one(job: dict[str, Any]) -> dict[str, Any]:
        if time.time() - t0 > budget_s:
            return {"job": job["tag"], "scenario": job["name"], "package": mode_label(job["disabled"]),
                    "completed": False, "ok": False, "skipped": "budget"}
        row = run(job)
        print(json.dumps({k: v for k, v in row.items() if k not in hide}, default=str), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, jobs))


def report_pool(rows: list[dict[str, Any]], json_path: str | None, table: str, t0: float) -> None:
    """The end of a ``run_pool`` bench: every row to ``json_path`` (if any), the table, and how many active runs
    were ok."""
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    print()
    print(table)
    active = [r for r in rows if r.get("package") == ACTIVE]
    print(f"active: {sum(bool(r.get('ok')) for r in active)}/{len(active)} runs ok; total {time.time() - t0:.0f} s")


def child_call(fn: Callable[[bool], dict[str, Any]], watchdog: float) -> dict[str, Any]:
    """In a child: ``fn(unpatched_side())`` under a faulthandler watchdog (a hang prints every thread's stack and
    exits after ``watchdog`` s); an exception is reported as ``ok=False`` with its kind and traceback."""
    import faulthandler
    import traceback

    faulthandler.dump_traceback_later(watchdog, exit=True)
    try:
        res = fn(unpatched_side())
    except BaseException as e:  # the parent reports it
        res = {"ok": False, "exception": error_kind(e), "traceback": traceback.format_exc()[-3000:]}
    faulthandler.cancel_dump_traceback_later()
    return res


def print_result(res: dict[str, Any]) -> None:
    """A child's answer: one ``RESULT`` JSON line (what ``result_line`` reads)."""
    print("RESULT " + json.dumps(res, default=str), flush=True)


def unpatched_side() -> bool:
    """In a child: whether it is the unpatched side (the parent set TTC_DISABLE=1 for it), in the package's own
    words: its status() says "disabled" for every spelling of the variable it accepts."""
    import torch_threadsafe_compile as ttc

    return bool(ttc.status()["activation"] == "disabled")


def error_kind(e: BaseException) -> str:
    """An exception as a table shows it: its type and the first line of its message."""
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0][:120] if s else ''}"


# ---------------------------------------------------------------------------------------------------------
# Output.


def cell(v: Any) -> str:
    """A value in a Markdown cell: ``–`` for none, yes/no, ``%g`` floats, ``kind ×n; ...`` for counts."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, dict):
        return "; ".join(f"{k} ×{n}" for k, n in v.items()) or "–"
    return str(v)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], fmt: Callable[[Any], str] = cell) -> str:
    """A Markdown table: the header, its rule, one line per row (each value through ``fmt``; strings as they are)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(x if isinstance(x, str) else fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def spread(values: Iterable[Any], fmt: Callable[[float], str] = lambda v: f"{v:.3g}") -> str:
    """``median (min–max)`` of the numbers among ``values``; the value alone when they are all equal; ``–`` if none."""
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return "–"
    if len(set(nums)) == 1:
        return fmt(nums[0])
    return f"{fmt(statistics.median(nums))} ({fmt(min(nums))}–{fmt(max(nums))})"


def write_between(path: Path, begin: str, end: str, text: str, whole_if_missing: bool = False) -> bool:
    """Put ``text`` between the ``begin`` and ``end`` markers of the document at ``path`` (each marker then on a
    line of its own). Without the markers: write ``text`` as the whole file if ``whole_if_missing``, else nothing.
    Returns whether the file was written."""
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        body = text if text.endswith("\n") else text + "\n"
        new = f"{head}{begin}\n{body}{end}{rest.split(end, 1)[1]}"
    elif whole_if_missing:
        new = text
    else:
        return False
    path.write_text(new, encoding="utf-8")
    return True
