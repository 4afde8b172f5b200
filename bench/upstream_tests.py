#!/usr/bin/env python
"""PyTorch's own test files, run with the package active and with ``TTC_DISABLE=1``, compared test by test.

The project's promise is that outside what a threading hazard needs, torch behaves as upstream ships it:
a test that passes with ``TTC_DISABLE=1`` must pass with the package active. This script is the evidence.

    python bench/upstream_tests.py                                # every test file, both modes
    python bench/upstream_tests.py --tests-dir PATH/TO/pytorch/test
    python bench/upstream_tests.py --files 'dynamo/*' --files test_utils_config_module.py
    python bench/upstream_tests.py --list                         # which files would run
    python bench/upstream_tests.py --md docs/upstream-tests.md --json results.json   # table into the doc
    python bench/upstream_tests.py --parallel-threads 4 --md docs/upstream-tests.md  # every test body in 4 threads
    python bench/upstream_tests.py --jobs 2 --files 'dynamo/test_misc.py'      # two files at once (verdicts only)

Test roots (each one a ``test/`` folder laid out as in ``pytorch/pytorch``, with an optional
``../baseline-disabled.txt`` of tests known to fail with ``TTC_DISABLE=1``):

* ``--tests-dir`` (repeatable), default ``../shared/pytorch-tests/test`` relative to the repository root
  when that folder exists;
* the project's own additions, ``bench/pytorch_tests/test`` (``--no-own`` leaves them out).

A *test file* is a ``test_*.py`` that no other file of its root imports: ``test_fx.py`` imports the test
classes of ``fx/test_*.py`` and collects them itself, so those run once, as part of it.

Each file runs in its own ``python -m pytest`` subprocess, from its test root (helper modules such as
``fx.*``, ``_repros_*``, ``utils``, ``testing`` resolve from there), once per mode, the order of the two
modes alternating from file to file so that drift of the machine (load from other processes, warm caches)
hits both alike. Results come from pytest's JUnit XML. Children get the caller's environment without any
``TTC_*`` variable, then ``TTC_DISABLE=1`` (disabled) or ``TTC_DISABLE=0`` (active), and without
``PYTHONDONTWRITEBYTECODE`` (bytecode caching on, as users run, with ``PYTHONPYCACHEPREFIX`` pointing
outside the test folders, which stay untouched). Before the files run, one child per mode
reports whether the package is active there, so an "active" column can never silently be an unpatched run.

An *active-only failure* is a test that failed or errored with the package active and did not with
``TTC_DISABLE=1`` (a whole file that crashed or timed out only when active counts too). Active-only
failures are re-run one by one, alone in a fresh interpreter, both modes (``--rerun N`` per file, default
8), to tell failures of the test itself from failures that need the rest of its file (state leaking from
earlier tests). Exit status: 0 when there is no active-only failure, 1 when there is one (with
``--parallel-threads``: one that, alone, still fails active and passes with ``TTC_DISABLE=1``, the rule of
:func:`still_active_only`), 2 when the comparison could not be made (no test file, the package not
active in the active child, or in effect in the disabled one).

With ``--parallel-threads N`` (N > 1) every test body runs in N threads at once (pytest-run-parallel, which
must be installed where the tests run), except tests that call one of :data:`THREAD_UNSAFE` (each with the
reason: it changes process-global state by itself, so N copies of it at once test the test, not torch);
those run in one thread. The children run with faulthandler on and under an address-space limit
(``--memory-limit-gb``, so that a test that loops forever in N threads cannot take the machine's memory);
a file that dies is reported with its signal and faulthandler's first frames of the crashing thread. The
markdown then also says, per file, which tests the package fixed (failed with ``TTC_DISABLE=1``, passed
active). Without the option nothing changes.

Both modes run the same *thread plan* (which tests run in one thread), made in a collection pass before the
file runs. ``--thread-plan union`` (the default) runs a test in N threads in both modes if either mode's
judgement would run it there: with the package active pytest-run-parallel judges some tests thread-safe that
it judges unsafe with ``TTC_DISABLE=1`` (torch's entry points are transparent wrappers there), so the union is
the stricter plan, the one that tests the package where it claims to help. ``--thread-plan disabled`` is the
earlier plan, the judgement with ``TTC_DISABLE=1`` alone.

A stall detector watches every child with ``--parallel-threads``: a child whose output has not grown for
``--stall-s`` seconds (default 120; pytest prints a line per test) is counted as a *hang*, not a timeout: its
threads' native stacks are dumped first (``py-spy dump --native`` where py-spy is installed, else ``gdb``),
then faulthandler's Python stacks (SIGABRT), into its log; then its process group is killed. Silence alone
does not tell a deadlock from a slow test, so the detector also reads the CPU time of the child's process
group (Linux ``/proc``): a child that used at least a quarter of a core over the last ``--stall-s`` seconds is
*computing* and is left to run (a note in its log says so) until it has been silent for ``--busy-stall-s``
seconds (default 600; then it is a *busy hang*: a livelock or a test too slow to judge); a child whose threads
all wait (less CPU than that) is a *blocked hang* at once. Where ``/proc`` cannot be read, silence decides.

Standard library only, so the script runs under any Python >= 3.9 (``--python`` picks the interpreter
that runs the tests; it needs torch, pytest, pytest-timeout and expecttest).
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from _harness import child_environ, kill_group, write_between  # standard library only, like this script
from _repo import ROOT

OWN_TESTS = ROOT / "bench" / "pytorch_tests" / "test"
PLUGINS = ROOT / "bench" / "pytest_plugins"  # on every child's PYTHONPATH: ttc_torch_compat, ttc_parallel_plan
# Loaded in every pytest child (runs and collection passes): the stored test files collect on other releases.
COMPAT_PLUGIN = ["-p", "ttc_torch_compat"]
SHARED_TESTS = ROOT.parent / "shared" / "pytorch-tests" / "test"
MODES = ("active", "disabled")
FAILED = ("failed", "error")
# Worst status wins when pytest reports one node id more than once (subtests, a teardown error).
_RANK = {"skipped": 0, "passed": 1, "failed": 2, "error": 3}
_TAGS = {"failure": "failed", "error": "error", "skipped": "skipped"}  # JUnit child element -> status
# Code run in each mode before the test files: is the package active, and in which state are its patches?
_PROBE = r"""
import json, sys
import torch
for name in ("torch._dynamo", "torch.export", "torch.fx"):
    try:
        __import__(name)
    except Exception:
        pass
mod = sys.modules.get("torch_threadsafe_compile")
info = {"torch": torch.__version__, "imported": mod is not None}
if mod is not None:
    try:
        st = mod.status()
        info["activation"] = st.get("activation")
        info["inactive_reason"] = st.get("inactive_reason")
        info["patches"] = {p.get("id"): p.get("state") for p in st.get("patches", [])}
    except Exception as e:
        info["status_error"] = repr(e)
print("TTC-PROBE " + json.dumps(info))
"""


# What pytest-run-parallel must run in one thread (its ``thread_unsafe_functions``): functions that, called
# from a test body, change process-global state on their own, so N threads of the same test would fight over
# it whatever torch does. The plugin already treats ``unittest.mock.*`` and ``gc.collect`` as unsafe; the
# mock entries are listed anyway, as the reason is the same. Each entry: (qualified name, reason).
THREAD_UNSAFE: tuple[tuple[str, str], ...] = (
    ("torch._dynamo.reset", "frees every compiled function of the process, the other threads' included"),
    ("torch._dynamo.reset_code_caches", "frees the compiled code of every function of the process"),
    ("torch.compiler.reset", "calls torch._dynamo.reset"),
    ("torch._dynamo.testing.standard_test", "calls torch._dynamo.reset before and after its checks"),
    ("torch._dynamo.explain", "calls torch._dynamo.reset before and after it runs the function"),
    ("unittest.mock.patch", "replaces a module attribute for every thread while the test runs"),
    ("unittest.mock.patch.object", "replaces an object's attribute for every thread while the test runs"),
    ("unittest.mock.patch.dict", "changes a process-global dict (os.environ, a registry) for every thread"),
    ("torch.profiler.profile", "one profiler per process: a second one in another thread fails to start"),
    ("torch.set_default_dtype", "sets the process-global default dtype for every thread"),
    ("torch.testing._internal.common_utils.set_default_dtype",
     "sets the process-global default dtype and restores the one it saw: in N threads at once the last to "
     "restore can put back another thread's dtype, and the file's next tests run with it "
     "(ttc_testing.crash_scenarios default_dtype_restore_race)"),
    ("torch.use_deterministic_algorithms", "switches a process-global mode for every thread"),
    ("torch.set_default_device",
     "its context is per thread, but the device dynamo's DEFAULT_DEVICE guard reads "
     "(torch.utils._device.CURRENT_DEVICE) is process-global: one thread's reset ends another's device "
     "(ttc_testing.crash_scenarios default_device_restore_race)"),
)

# Listed functions that tests import inside their own body (``from .utils import ...``), where no judge
# resolves them: the plan plugin matches ``from <module> import <name>`` in the test's code by the module's last
# name and the function's name (``BENCH_THREAD_UNSAFE_IMPORTS``). Not given to pytest-run-parallel: a module
# named ``utils`` on its list would make it walk into every function of any module of that name.
THREAD_UNSAFE_IMPORTED: tuple[tuple[str, str], ...] = (
    ("utils.install_guard_manager_testing_hook",
     "PyTorch's test/dynamo/utils.py: installs a hook in the process-global "
     "torch._dynamo.guards.guard_manager_testing_hook_fn, which every thread's compile calls, and restores the "
     "hook it saw, so the last to restore leaves another thread's installed (ttc_testing.crash_scenarios "
     "guard_hook_race)"),
    ("torch._C._dynamo.eval_frame._reset_precompile_entries",
     "frees the precompile entries of a code object, which every thread's call of a function with that code "
     "reads (a test's nested function shares its code object across threads): upstream's race, in both modes "
     "(ttc_testing.crash_scenarios precompile_entries_shared_code)"),
    ("torch._C._dynamo.eval_frame._load_precompile_entry",
     "adds a precompile entry to a code object every thread's calls read, each thread its own"),
)


@dataclass
class TestFile:
    root: Path
    rel: str  # path relative to its root, "/"-separated, e.g. "dynamo/test_misc.py"
    suite: str  # "own" for the project's additions, else the root's folder name chain

    @property
    def key(self) -> str:
        return f"{self.suite}:{self.rel}"


@dataclass
class Run:
    mode: str
    rc: int | None
    wall_s: float
    timed_out: bool = False
    hung: bool = False  # the stall detector stopped it: no output for STALL_S seconds
    hang_kind: str = ""  # with hung: "blocked" (its threads all waited) or "busy" (still computing at BUSY_STALL_S)
    crashed: str = ""  # why there are no per-test results (no XML, pytest usage/internal error, ...)
    signal: str = ""  # the signal that killed pytest (SIGSEGV, ...), empty when it exited
    frames: list[str] = field(default_factory=list)  # faulthandler: the crashing thread's first frames
    statuses: dict[str, str] = field(default_factory=dict)  # node id -> passed/failed/error/skipped
    messages: dict[str, str] = field(default_factory=dict)  # node id -> first line of its error

    def count(self, *states: str) -> int:
        return sum(1 for s in self.statuses.values() if s in states)


@dataclass
class FileResult:
    file: str
    suite: str
    runs: dict[str, Run]
    active_only: list[str] = field(default_factory=list)
    disabled_only: list[str] = field(default_factory=list)
    rerun: dict[str, dict[str, str]] = field(default_factory=dict)  # node id -> mode -> status when run alone
    baseline_unexpected: list[str] = field(default_factory=list)  # disabled failures not in baseline list
    baseline_passing: list[str] = field(default_factory=list)  # baseline-listed tests that passed disabled


# ---------------------------------------------------------------------------------------------------------
# Discovery


def _imported_modules(path: Path) -> set[str]:
    """Dotted names this file imports (``from fx import test_x`` yields ``fx`` and ``fx.test_x``)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def discover(root: Path, suite: str) -> list[TestFile]:
    candidates = sorted(p for p in root.rglob("test_*.py") if "__pycache__" not in p.parts)
    imported: set[str] = set()
    for p in root.rglob("*.py"):
        imported |= _imported_modules(p)
    files = []
    for p in candidates:
        rel = p.relative_to(root).as_posix()
        if rel[:-3].replace("/", ".") not in imported:
            files.append(TestFile(root, rel, suite))
    return files


def read_baseline(root: Path) -> set[str]:
    path = root.parent / "baseline-disabled.txt"
    if not path.is_file():
        return set()
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def select(files: list[TestFile], include: list[str], exclude: list[str]) -> list[TestFile]:
    def hit(f: TestFile, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatch(f.rel, pat) or fnmatch.fnmatch(f.key, pat) for pat in patterns)

    out = [f for f in files if not include or hit(f, include)]
    return [f for f in out if not hit(f, exclude)]


# ---------------------------------------------------------------------------------------------------------
# Running


# Where children keep their bytecode caches (PYTHONPYCACHEPREFIX): test folders are often read-only copies
# that must stay as laid (permission bits do not stop root), so neither Python nor pytest's assertion
# rewriting may write __pycache__ next to them. Persistent, so that only the first child of the first run
# compiles torch's sources into it.
PYCACHE_PREFIX: str | None = str(Path(tempfile.gettempdir()) / "ttc-upstream-pycache")


def child_env(mode: str) -> dict[str, str]:
    env = child_environ(disable="1" if mode == "disabled" else "0")
    # Bytecode caching on, as users run (an environment that forbids .pyc files would make every child
    # compile torch's and our sources on import, a cost neither mode has in practice).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if PYCACHE_PREFIX:
        env["PYTHONPYCACHEPREFIX"] = PYCACHE_PREFIX
    env["PYTHONPATH"] = str(PLUGINS) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# Parallel runs only (--parallel-threads): the children's address-space limit in bytes (None: no limit).
MEMORY_LIMIT: int | None = None


def _limit_memory() -> None:  # runs in the child, between fork and exec
    import resource

    if MEMORY_LIMIT:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


# With --parallel-threads: seconds without any new output after which a child counts as hung (0: off).
STALL_S = 0.0
# ... unless it is computing: then it counts as hung (busy) only after this many silent seconds.
BUSY_STALL_S = 600.0
# The CPU share (of one core, over the last STALL_S seconds) above which a silent child is computing.
BUSY_SHARE = 0.25
_POLL_S = 2.0
# With --jobs: set when the main thread is interrupted (Ctrl-C, SIGTERM), so that every worker kills the
# child it is running and starts no other.
_STOP = threading.Event()


def _group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid`` (the child
    and, say, inductor's compile workers), from Linux ``/proc``; None where that cannot be read."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        names = os.listdir("/proc")
    except (AttributeError, ValueError, OSError):
        return None
    total = 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 3 of stat(5)
        if int(fields[2]) == pgid:  # pgrp
            total += int(fields[11]) + int(fields[12])  # utime, stime (all its threads)
    return total / tick


class _Stall:
    """Decides, from output growth and CPU time, whether a silent child is hung (see the module docstring)."""

    def __init__(self, pgid: int, stall_s: float, busy_stall_s: float, share: float | None = None) -> None:
        self.pgid, self.stall_s, self.busy_stall_s = pgid, stall_s, max(busy_stall_s, stall_s)
        self.share = BUSY_SHARE if share is None else share
        self.size, self.changed = -1, time.monotonic()
        self.samples: list[tuple[float, float]] = []  # (time, group CPU seconds), the last stall_s seconds
        self.noted = 0.0  # when the log last said "computing"

    def check(self, size: int, now: float) -> tuple[str, str]:
        """("", "") while the child may go on; ("blocked" | "busy", why) when it is hung; ("", note) to log."""
        if size != self.size:
            self.size, self.changed = size, now
        cpu = _group_cpu_s(self.pgid)
        if cpu is not None:
            self.samples.append((now, cpu))
            while len(self.samples) > 1 and self.samples[1][0] <= now - self.stall_s:
                self.samples.pop(0)
        silent = now - self.changed
        if silent <= self.stall_s:
            return "", ""
        if cpu is None or not self.samples or self.samples[0][0] > now - self.stall_s + _POLL_S:
            return "blocked", f"no output for {silent:.0f} s (CPU time unknown)"
        t0, cpu0 = self.samples[0]
        used = cpu - cpu0
        if used < self.share * (now - t0):
            return "blocked", f"no output for {silent:.0f} s and {used:.1f} s of CPU in the last {now - t0:.0f} s: " \
                              "its threads all wait"
        if silent > self.busy_stall_s:
            return "busy", f"no output for {silent:.0f} s, still computing ({used:.1f} s of CPU in the last " \
                           f"{now - t0:.0f} s): a livelock or a test too slow to judge"
        if now - self.noted >= self.stall_s:
            self.noted = now
            return "", f"no output for {silent:.0f} s but {used:.1f} s of CPU in the last {now - t0:.0f} s: " \
                       f"computing, not blocked; waiting up to {self.busy_stall_s:.0f} s of silence"
        return "", ""


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float,
         stall_s: float = 0.0, busy_stall_s: float | None = None) -> tuple[int | None, str, float, bool, str]:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (inductor's compile workers
    included) so nothing of a hung file outlives it. With ``stall_s``, a child whose output has not grown
    for that long while it does not compute (:class:`_Stall`) is dumped (:func:`_dump_stacks`) and killed.
    Returns (rc, output, wall, timed out, hang kind: "" when not hung, else "blocked" or "busy")."""
    t0 = time.monotonic()
    if _STOP.is_set():
        raise KeyboardInterrupt
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_limit_memory if MEMORY_LIMIT else None)
        timed_out = False
        hung = ""
        rc: int | None = None
        stall = _Stall(proc.pid, stall_s, BUSY_STALL_S if busy_stall_s is None else busy_stall_s) if stall_s else None
        try:
            while rc is None:
                try:
                    rc = proc.wait(timeout=_POLL_S)
                except subprocess.TimeoutExpired:
                    if _STOP.is_set():
                        raise KeyboardInterrupt from None
                    now = time.monotonic()
                    if now - t0 > timeout:
                        timed_out = True
                    elif stall is not None:
                        kind, why = stall.check(os.fstat(out.fileno()).st_size, now)
                        if kind:
                            hung = kind
                            _append(out, f"\n=== stall detector: {kind} hang: {why}; stacks follow ===\n")
                            _dump_stacks(proc.pid, out)
                        elif why:
                            _append(out, f"\n=== stall detector: {why} ===\n")
                            stall.size = os.fstat(out.fileno()).st_size  # our note is not the child's output
                    if timed_out or hung:
                        kill_group(proc)
                        rc = proc.wait()
        except BaseException:  # Ctrl-C, SIGTERM (see main): the child's group must not outlive us
            kill_group(proc)
            proc.wait()
            raise
        wall = time.monotonic() - t0
        out.seek(0)
        text = out.read()
    return rc, text, wall, timed_out, hung


def _append(out: object, text: str) -> None:
    """Append to the child's output file: it shares the file offset with the child, so write through the
    descriptor at its end (a buffered write from here could land on the child's own output)."""
    fd = out.fileno()  # type: ignore[attr-defined]
    os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, text.encode("utf-8", "replace"))


def _dump_stacks(pid: int, out: object) -> None:
    """Every thread's native stack of a hung child (py-spy with --native where installed, else gdb), then
    faulthandler's Python stacks: SIGABRT makes the child (run with ``-X faulthandler``) print them as it dies."""
    import shutil

    native = None
    if shutil.which("py-spy"):
        native = ["py-spy", "dump", "--native", "--pid", str(pid)]
    elif shutil.which("gdb"):
        native = ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"]
    if native is None:
        _append(out, "--- no py-spy or gdb: no native stacks ---\n")
    else:
        try:
            p = subprocess.run(native, capture_output=True, text=True, timeout=90, errors="replace")
            _append(out, f"--- {native[0]} (exit {p.returncode}) ---\n{p.stdout}{p.stderr[-4000:]}\n")
        except (OSError, subprocess.TimeoutExpired) as e:
            _append(out, f"--- {native[0]} failed: {e!r} ---\n")
    try:
        os.kill(pid, signal.SIGABRT)
        time.sleep(5)  # faulthandler writes every thread's Python stack before the process dies
    except ProcessLookupError:
        pass


def probe(python: str, cwd: Path, mode: str, timeout: float) -> dict:
    rc, text, _, timed_out, _ = _run([python, "-c", _PROBE], cwd, child_env(mode), timeout)
    for line in text.splitlines():
        if line.startswith("TTC-PROBE "):
            info = json.loads(line[len("TTC-PROBE "):])
            info["warnings"] = [x for x in text.splitlines() if "torch-threadsafe-compile" in x][:3]
            return info
    return {"error": f"probe failed (rc={rc}, timed out={timed_out}): {_tail(text)}"}


def is_active(info: dict) -> bool:
    """The package is active in that child (it may be imported and report itself disabled: that is not)."""
    return bool(info.get("imported")) and info.get("activation") not in (None, "disabled", "not activated") \
        and not info.get("inactive_reason") and not info.get("error")


def is_disabled(info: dict) -> bool:
    """Nothing of the package is in effect in that child: not imported, or imported and reporting itself
    disabled with no patch applied."""
    if info.get("error"):
        return False
    if not info.get("imported"):
        return True
    return info.get("activation") == "disabled" and "applied" not in (info.get("patches") or {}).values()


def _tail(text: str, n: int = 3) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return " | ".join(lines[-n:])[-400:]


def _first_line(text: str) -> str:
    """The error's first line; a short generic one ("AssertionError: Scalars are not equal!") gets the
    line after it, which says what differed."""
    lines = []
    for x in (text or "").splitlines():
        if x.strip().startswith("To execute this test"):  # torch's TestCase appends how to re-run it
            break
        if x.strip():
            lines.append(x.strip())
    if not lines:
        return ""
    first = lines[0]
    if len(first) < 60 and len(lines) > 1:
        first = f"{first} {lines[1]}"
    return first[:300]


def _node_id(rel: str, classname: str, name: str) -> str:
    mod = rel[:-3].replace("/", ".")
    if classname == mod:
        return f"{rel}::{name}"
    if classname.startswith(mod + "."):
        return f"{rel}::{classname[len(mod) + 1:].replace('.', '::')}::{name}"
    return f"{rel}::{classname.replace('.', '::')}::{name}"  # a class pytest attributes to another module


def parse_junit(path: Path, rel: str) -> tuple[dict[str, str], dict[str, str]]:
    statuses: dict[str, str] = {}
    messages: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        nid = _node_id(rel, case.get("classname", ""), case.get("name", ""))
        found = {_TAGS[c.tag]: c for c in case if c.tag in _TAGS}
        status = next((s for s in ("error", "failed", "skipped") if s in found), "passed")
        message = _first_line(found[status].get("message") or found[status].text or "") if status in found else ""
        if nid not in statuses or _RANK[status] > _RANK[statuses[nid]]:
            statuses[nid] = status
            if status in FAILED:
                messages[nid] = message
    return statuses, messages


# --parallel-threads: every test body in this many threads at once (pytest-run-parallel); 1: plain pytest.
PARALLEL_THREADS = 1


def parallel_args(threads: int) -> list[str]:
    """pytest-run-parallel's options: N threads, and THREAD_UNSAFE as its ``thread_unsafe_functions`` (an
    ini line list, given with -o since no configuration file applies)."""
    names = "\n".join(name for name, _ in THREAD_UNSAFE)
    return ["--parallel-threads", str(threads), "-o", f"thread_unsafe_functions={names}", "-p", "ttc_parallel_plan"]


def plan_env(env: dict[str, str], plan: Path, mode: str) -> dict[str, str]:
    """The environment of a --parallel-threads child: the plan plugin's file and mode (``child_env`` makes
    the plugin importable)."""
    env = dict(env)
    env["BENCH_PARALLEL_PLAN"] = str(plan)
    env["BENCH_PARALLEL_PLAN_MODE"] = mode
    env["BENCH_THREAD_UNSAFE_IMPORTS"] = ",".join(name for name, _ in THREAD_UNSAFE_IMPORTED)
    return env


# "union": a test runs in N threads in both modes if either mode's judgement runs it there (the stricter
# plan); "disabled": the judgement with TTC_DISABLE=1 alone (the earlier plan).
THREAD_PLAN = "union"


def make_plan(python: str, f: TestFile, tmp: Path, timeout: float) -> tuple[Path, str]:
    """Which tests of ``f`` run in one thread in both modes (see ttc_parallel_plan and THREAD_PLAN): a
    collection pass per judging mode; with "union", one thread only for the tests both modes judge unsafe."""
    stem = f.key.replace("/", "_").replace(":", "_")
    plan = tmp / f"{stem}.plan.json"
    cmd = [python, "-m", "pytest", f.rel, "-c", os.devnull, "--rootdir", ".", "-p", "no:cacheprovider",
           "--collect-only", "-q", *COMPAT_PLUGIN, *parallel_args(PARALLEL_THREADS)]
    judges = ("disabled", "active") if THREAD_PLAN == "union" else ("disabled",)
    verdicts: dict[str, dict[str, str]] = {}
    for mode in judges:
        path = tmp / f"{stem}.plan-{mode}.json"
        rc, text, _, _, _ = _run(cmd, f.root, plan_env(child_env(mode), path, "write"), timeout)
        if not path.is_file():
            return plan, f"collection pass with {mode} failed (rc={rc}): {_tail(text)}"
        verdicts[mode] = json.loads(path.read_text(encoding="utf-8"))
    single = {nid: f"{reason} (judged with TTC_DISABLE=1)" for nid, reason in verdicts["disabled"].items()
              if all(nid in v for v in verdicts.values())}
    plan.write_text(json.dumps(single), encoding="utf-8")
    return plan, ""


def pytest_cmd(python: str, targets: list[str], xml: Path, test_timeout: float) -> list[str]:
    # -c os.devnull: no configuration file applies, wherever the test root lies (inside this repository,
    # pyproject.toml would otherwise add its pythonpath/addopts to upstream's tests); --rootdir keeps node
    # ids relative to the test root, as in baseline-disabled.txt.
    if PARALLEL_THREADS > 1:  # -v: one line per test, so a file that dies still has the results before
        return [python, "-X", "faulthandler", "-m", "pytest", *targets, "-c", os.devnull, "--rootdir", ".",
                "-p", "no:cacheprovider", "--timeout", str(int(test_timeout)), "-v", "-rfE", f"--junitxml={xml}",
                *COMPAT_PLUGIN, *parallel_args(PARALLEL_THREADS)]
    return [python, "-m", "pytest", *targets, "-c", os.devnull, "--rootdir", ".", "-p", "no:cacheprovider",
            "--timeout", str(int(test_timeout)), "-q", "-rfE", f"--junitxml={xml}", *COMPAT_PLUGIN]


_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (?:PARALLEL )?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_VERBOSE_STATUS = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "error",
                   "SKIPPED": "skipped", "XFAIL": "skipped"}


def verbose_statuses(text: str) -> dict[str, str]:
    """Per-test results from pytest -v's lines: what a file that died reported before it died (no XML)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _VERBOSE_LINE.match(line)
        if m:
            status = _VERBOSE_STATUS[m.group(2)]
            if m.group(1) not in out or _RANK[status] > _RANK[out[m.group(1)]]:
                out[m.group(1)] = status
    return out


def crash_frames(text: str, n: int = 4) -> list[str]:
    """faulthandler's dump: the fatal error line, then the crashing thread's first ``n`` frames (shortened
    to ``file:line in function`` relative to site-packages or the test root)."""
    lines = text.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            out.append(line.split(":", 1)[-1].strip())
        if line.startswith("Current thread"):
            for x in lines[i + 1:i + 1 + n]:
                x = x.strip()
                m = re.match(r'File "(.*)", line (\d+) in (.*)', x)
                if m:
                    path = m.group(1)
                    # torch's files relative to site-packages; others by their last two parts (no
                    # absolute paths of the machine in reports)
                    path = path.split("site-packages/")[-1] if "site-packages/" in path else "/".join(path.split("/")[-2:])
                    x = f"{path}:{m.group(2)} {m.group(3)}"
                out.append(x)
            break
    return out


def run_file(python: str, f: TestFile, mode: str, tmp: Path, file_timeout: float, test_timeout: float,
             targets: list[str] | None = None, log_dir: Path | None = None, plan: Path | None = None) -> Run:
    xml = tmp / f"{f.key.replace('/', '_').replace(':', '_')}.{mode}.{time.monotonic_ns()}.xml"
    cmd = pytest_cmd(python, targets or [f.rel], xml, test_timeout)
    env = child_env(mode) if plan is None else plan_env(child_env(mode), plan, "read")
    rc, text, wall, timed_out, hang = _run(cmd, f.root, env, file_timeout, STALL_S if PARALLEL_THREADS > 1 else 0.0)
    hung = bool(hang)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        suffix = ("." + re.sub(r"[^\w.-]+", "_", targets[0].split("::", 1)[-1])[:80]) if targets else ""
        (log_dir / f"{f.key.replace('/', '_').replace(':', '_')}.{mode}{suffix}.log").write_text(text, encoding="utf-8")
    run = Run(mode=mode, rc=rc, wall_s=wall, timed_out=timed_out, hung=hung, hang_kind=hang)
    if rc is not None and rc < 0 and not hung:
        try:
            run.signal = signal.Signals(-rc).name
        except ValueError:
            run.signal = f"signal {-rc}"
        run.frames = crash_frames(text)
    if hung:
        run.crashed = (f"hung ({hang}): no output for {STALL_S if hang == 'blocked' else BUSY_STALL_S:.0f} s"
                       " or more (native and Python stacks in its log)")
    elif timed_out:
        run.crashed = f"timed out after {file_timeout:.0f} s"
    elif run.signal:
        run.crashed = f"died of {run.signal}" + (f" ({'; '.join(run.frames)})" if run.frames else "")
    elif rc not in (0, 1, 5) or not xml.is_file():  # 5: no test collected (a GPU-only file on a CPU machine)
        run.crashed = f"pytest exit status {rc}: {_tail(text)}"
    if xml.is_file():
        try:
            run.statuses, run.messages = parse_junit(xml, f.rel)
        except ET.ParseError as e:
            run.crashed = run.crashed or f"unreadable JUnit XML: {e}"
    elif PARALLEL_THREADS > 1:
        run.statuses = verbose_statuses(text)
    return run


def compare(f: TestFile, runs: dict[str, Run], baseline: set[str]) -> FileResult:
    act, dis = runs["active"], runs["disabled"]
    res = FileResult(file=f.rel, suite=f.suite, runs=runs)
    for nid, s in act.statuses.items():
        d = dis.statuses.get(nid)
        if s in FAILED and d not in FAILED and not (d is None and dis.crashed):
            res.active_only.append(nid)
    for nid, d in dis.statuses.items():
        if d in FAILED and act.statuses.get(nid) not in FAILED and not (nid not in act.statuses and act.crashed):
            res.disabled_only.append(nid)
    if act.crashed and not dis.crashed:
        res.active_only.append(f"{f.rel} (whole file: {act.crashed})")
    if dis.crashed and not act.crashed:
        res.disabled_only.append(f"{f.rel} (whole file: {dis.crashed})")
    mine = {b for b in baseline if b.split("::", 1)[0] == f.rel}
    failed_dis = {nid for nid, d in dis.statuses.items() if d in FAILED}
    res.baseline_unexpected = sorted(failed_dis - mine)
    res.baseline_passing = sorted(nid for nid in mine if dis.statuses.get(nid) == "passed")
    return res


def log(msg: str) -> None:
    print(f"[upstream {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def file_plan(python: str, f: TestFile, tmp: Path, file_timeout: float) -> Path | None:
    """With --parallel-threads: the file's thread plan (``make_plan``), or None when its collection pass
    failed (then the plugin's own verdicts apply in each run)."""
    if PARALLEL_THREADS <= 1:
        return None
    plan, problem = make_plan(python, f, tmp, min(file_timeout, 600))
    if problem:
        log(f"{f.key}: {problem}; the plugin's own verdicts apply in each mode")
        return None
    return plan


def _run_both_modes(i: int, f: TestFile, python: str, tmp: Path, file_timeout: float, test_timeout: float,
                    rerun: int, log_dir: Path | None, baseline: set[str]) -> FileResult:
    """One file in both modes (the order alternating with ``i``), then its active-only failures alone."""
    order = MODES if i % 2 == 0 else MODES[::-1]
    runs: dict[str, Run] = {}
    plan = file_plan(python, f, tmp, file_timeout)
    for mode in order:
        log(f"{f.key} [{mode}] ...")
        runs[mode] = r = run_file(python, f, mode, tmp, file_timeout, test_timeout, log_dir=log_dir, plan=plan)
        log(f"{f.key} [{mode}] {r.count('passed')} passed, {r.count(*FAILED)} failed, "
            f"{r.count('skipped')} skipped, {r.wall_s:.1f} s{' — ' + r.crashed if r.crashed else ''}")
    res = compare(f, runs, baseline)
    # Each failure alone, in a fresh interpreter per mode: a test that passes alone failed through
    # state left by earlier tests of its file (a leak across tests), not by itself.
    for nid in [nid for nid in res.active_only if "::" in nid][:rerun]:
        for mode in order:
            alone = run_file(python, f, mode, tmp, file_timeout, test_timeout, targets=[nid], log_dir=log_dir,
                             plan=plan)
            res.rerun.setdefault(nid, {})[mode] = alone.statuses.get(nid) or (alone.crashed and "crashed") or "not run"
    return res


def still_active_only(alone: dict[str, str] | None) -> bool:
    """Whether a test that failed only active in a run is still held against the package after its re-run
    alone (``FileResult.rerun``'s entry, or None if it was not re-run): it is unless, alone, it passed active
    or did not pass with ``TTC_DISABLE=1`` either (a crash or no result active counts against the package). A
    test that races with itself in N threads fails now in one mode, now in the other; its run alone is the one
    reading that does not depend on the schedule of its file."""
    return alone is None or (alone.get("active") != "passed" and alone.get("disabled") == "passed")


def run_all(files: list[TestFile], python: str, file_timeout: float, test_timeout: float, rerun: int,
            log_dir: Path | None, jobs: int = 1) -> tuple[list[FileResult], dict[str, dict]]:
    """Every file in both modes. With ``jobs`` > 1, that many files at once (each file's two modes still one
    after the other, in one worker): a verdict per test does not depend on the machine's load the way a
    timing does, so CI runs its comparison two files at a time on two cores."""
    baselines = {root: read_baseline(root) for root in {f.root for f in files}}
    probes = {mode: probe(python, files[0].root, mode, min(file_timeout, 300)) for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="ttc-upstream-") as tmpdir:
        tmp = Path(tmpdir)
        args = (python, tmp, file_timeout, test_timeout, rerun, log_dir)
        if jobs <= 1:
            return [_run_both_modes(i, f, *args, baselines[f.root]) for i, f in enumerate(files)], probes
        pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="upstream-file")
        futures = [pool.submit(_run_both_modes, i, f, *args, baselines[f.root]) for i, f in enumerate(files)]
        try:
            results = [fu.result() for fu in futures]  # in the files' order, whatever order they end in
        except BaseException:
            _STOP.set()  # each worker kills its child's process group (see _run) and starts no other
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    return results, probes


def _complete_runs(f: TestFile, python: str, tmp: Path, file_timeout: float, test_timeout: float, runs: int,
                   log_dir: Path | None) -> list[dict]:
    """One file's completion runs, one after the other (its thread plan made once, as for the comparison)."""
    rows: list[dict] = []
    plan = file_plan(python, f, tmp, file_timeout)
    for k in range(runs):
        log(f"{f.key} [active, run {k + 1}/{runs}] ...")
        r = run_file(python, f, "active", tmp, file_timeout, test_timeout, log_dir=log_dir, plan=plan)
        log(f"{f.key} [active, run {k + 1}/{runs}] {r.count('passed')} passed, {r.count(*FAILED)} failed, "
            f"{r.wall_s:.1f} s{' — ' + r.crashed if r.crashed else ''}")
        rows.append({"file": f.rel, "run": k + 1, "completed": not r.crashed, "crashed": r.crashed,
                     "timed_out": r.timed_out, "passed": r.count("passed"), "failed": r.count(*FAILED),
                     "wall_s": round(r.wall_s, 1)})
    return rows


def run_completion(files: list[TestFile], python: str, file_timeout: float, test_timeout: float, runs: int,
                   log_dir: Path | None, jobs: int = 1) -> list[dict]:
    """``--completion-runs K``: each file K times with the package active only (fresh process each, the
    file's thread plan made once by ``make_plan``, as in the comparison): does the process complete, and with
    how many tests passed and failed. A crash is the one answer the package must never give, and a rare one
    shows only over several runs; which failures are the package's is the comparison's job. With ``jobs`` > 1,
    that many files at once (a file's runs still one after the other), as ``run_all`` does."""
    with tempfile.TemporaryDirectory(prefix="ttc-upstream-") as tmpdir:
        tmp = Path(tmpdir)
        args = (python, tmp, file_timeout, test_timeout, runs, log_dir)
        if jobs <= 1:
            return [row for f in files for row in _complete_runs(f, *args)]
        pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="upstream-file")
        futures = [pool.submit(_complete_runs, f, *args) for f in files]
        try:
            per_file = [fu.result() for fu in futures]  # in the files' order
        except BaseException:
            _STOP.set()  # each worker kills its child's process group (see _run) and starts no other
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    return [row for rows in per_file for row in rows]


def render_completion_md(rows: list[dict], probe: dict, threads: int, command: str) -> str:
    lines = [f"{threads} threads at once, package active; torch {probe.get('torch', '?')}; `{command}`.", "",
             "| file | runs | completed | passed (per run) | failed (per run) | crashes |", "|---|---|---|---|---|---|"]
    for file in dict.fromkeys(r["file"] for r in rows):
        mine = [r for r in rows if r["file"] == file]
        crashes = "; ".join(r["crashed"] for r in mine if r["crashed"]) or "–"
        lines.append(f"| `{file}` | {len(mine)} | {sum(r['completed'] for r in mine)} | "
                     f"{', '.join(str(r['passed']) for r in mine)} | {', '.join(str(r['failed']) for r in mine)} | {crashes} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Reporting


def totals(results: Iterable[FileResult]) -> dict[str, float]:
    results = list(results)
    both = [r for r in results if not r.runs["active"].crashed and not r.runs["disabled"].crashed]
    a = sum(r.runs["active"].wall_s for r in both)
    d = sum(r.runs["disabled"].wall_s for r in both)
    return {"active_wall_s": a, "disabled_wall_s": d, "ratio": (a / d) if d else float("nan"),
            "files_compared": len(both), "files": len(results)}


def _row(r: FileResult, mode: str) -> list[str]:
    run = r.runs[mode]
    return [str(len(run.statuses)), str(run.count("passed")), str(run.count(*FAILED)), str(run.count("skipped")),
            f"{run.wall_s:.1f}" + (" (timeout)" if run.timed_out else " (crash)" if run.crashed else "")]


def table_rows(results: list[FileResult]) -> list[list[str]]:
    rows = []
    for r in results:
        a, d = r.runs["active"], r.runs["disabled"]
        ratio = f"{a.wall_s / d.wall_s:.2f}" if d.wall_s and not (a.crashed or d.crashed) else "–"
        rows.append([r.file, r.suite, *_row(r, "active"), *_row(r, "disabled"), ratio, str(len(r.active_only))])
    return rows


HEADERS = ["file", "suite", "run", "passed", "failed", "skipped", "wall s",
           "run", "passed", "failed", "skipped", "wall s", "ratio", "active-only"]


def held_against_the_package(results: list[FileResult]) -> list[str]:
    """The active-only failures the package answers for. One thread: every one (the do-no-harm promise is
    exact). N threads: those :func:`still_active_only` keeps after the run alone; the others raced with
    themselves, in both modes or in neither when alone."""
    return [nid for r in results for nid in r.active_only
            if PARALLEL_THREADS <= 1 or still_active_only(r.rerun.get(nid))]


def _failure_lines(results: list[FileResult], md: bool) -> list[str]:
    lines: list[str] = []
    b = "`" if md else ""
    held = set(held_against_the_package(results))
    for r in results:
        for nid in r.active_only:
            msg = r.runs["active"].messages.get(nid, "")
            alone = r.rerun.get(nid)
            alone_s = (f" — alone: active {alone.get('active', '?')}, disabled {alone.get('disabled', '?')}"
                       if alone else "")
            if PARALLEL_THREADS > 1:
                alone_s += " — held against the package" if nid in held else " — not held (see the run alone)"
            lines.append(f"- {b}{nid}{b}{alone_s}" + (f"\n  {b}{msg}{b}" if msg else ""))
    return lines


def _failures_heading(results: list[FileResult], md: bool) -> str:
    """``Active-only failures (n):``, with how many of them are held against the package in N threads."""
    n = sum(len(r.active_only) for r in results)
    if not n:
        return "Active-only failures: none." if md else "active-only failures: 0"
    held = f"; held against the package after the run alone: {len(held_against_the_package(results))}" \
        if PARALLEL_THREADS > 1 else ""
    return f"Active-only failures ({n}{held}):" if md else f"active-only failures: {n}{held}"


def render_text(results: list[FileResult], probes: dict[str, dict]) -> str:
    out = []
    for mode in MODES:
        p = probes.get(mode, {})
        out.append(f"{mode:8s}: torch {p.get('torch', '?')}, package imported={p.get('imported')}, "
                   f"activation={p.get('activation')}" + (f", reason={p['inactive_reason']}" if p.get("inactive_reason") else "")
                   + (f", ERROR {p['error']}" if p.get("error") else ""))
    patches = probes.get("active", {}).get("patches") or {}
    if patches:
        out.append("patches (active): " + ", ".join(f"{k}={v}" for k, v in patches.items()))
    rows = table_rows(results)
    head = ["file", "suite", "A run", "A pass", "A fail", "A skip", "A wall s",
            "D run", "D pass", "D fail", "D skip", "D wall s", "A/D", "active-only"]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    out.append("")
    out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    t = totals(results)
    out.append("")
    out.append(f"wall time: active {t['active_wall_s']:.1f} s, disabled {t['disabled_wall_s']:.1f} s, "
               f"ratio active/disabled {t['ratio']:.3f} over {t['files_compared']} of {t['files']} files")
    out.append("")
    fails = _failure_lines(results, md=False)
    out.append(_failures_heading(results, md=False))
    out.extend("  " + x.replace("\n", "\n  ") for x in fails)
    dis = [f"  - {nid}  {r.runs['disabled'].messages.get(nid, '')}" for r in results for nid in r.disabled_only]
    out.append(f"disabled-only failures: {len(dis)}")
    out.extend(dis)
    # Drift of the TTC_DISABLE=1 baseline (machine, flaky tests, another torch build): informational.
    drift = [nid for r in results for nid in r.baseline_unexpected]
    if drift:
        out.append(f"failing with TTC_DISABLE=1 but not in baseline-disabled.txt: {len(drift)}")
        out.extend(f"  - {nid}" for nid in drift)
    fixed = [nid for r in results for nid in r.baseline_passing]
    if fixed:
        out.append(f"in baseline-disabled.txt but passing with TTC_DISABLE=1: {len(fixed)}")
        out.extend(f"  - {nid}" for nid in fixed)
    return "\n".join(out)


def render_md(results: list[FileResult], probes: dict[str, dict]) -> str:
    t = totals(results)
    act = probes.get("active", {})
    lines = [
        f"torch {act.get('torch', '?')}; active mode: activation `{act.get('activation')}`"
        + (f", inactive: {act['inactive_reason']}" if act.get("inactive_reason") else "") + "; patches: "
        + (", ".join(f"`{k}` {v}" for k, v in (act.get("patches") or {}).items()) or "none reported") + ".",
        "",
        "| | | active | | | | | `TTC_DISABLE=1` | | | | | | |",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    for row in table_rows(results):
        lines.append("| `" + row[0] + "` | " + " | ".join(row[1:]) + " |")
    ra = sum(len(r.runs["active"].statuses) for r in results)
    rd = sum(len(r.runs["disabled"].statuses) for r in results)
    pa = sum(r.runs["active"].count("passed") for r in results)
    pd = sum(r.runs["disabled"].count("passed") for r in results)
    fa = sum(r.runs["active"].count(*FAILED) for r in results)
    fd = sum(r.runs["disabled"].count(*FAILED) for r in results)
    sa = sum(r.runs["active"].count("skipped") for r in results)
    sd = sum(r.runs["disabled"].count("skipped") for r in results)
    lines.append(f"| **all** | | {ra} | {pa} | {fa} | {sa} | {t['active_wall_s']:.1f} | {rd} | {pd} | {fd} | {sd} | "
                 f"{t['disabled_wall_s']:.1f} | **{t['ratio']:.3f}** | {sum(len(r.active_only) for r in results)} |")
    lines.append("")
    fails = _failure_lines(results, md=True)
    lines.append(_failures_heading(results, md=True))
    if fails:
        lines.append("")
        lines.extend(fails)
    dis = [nid for r in results for nid in r.disabled_only]
    lines.append("")
    lines.append(f"Disabled-only failures ({len(dis)}):" if dis else "Disabled-only failures: none.")
    if dis:
        lines.append("")
        lines.extend(f"- `{nid}`" for nid in dis)
    return "\n".join(lines) + "\n"


def _crash_cell(run: Run) -> str:
    if run.hung:
        return "hang" if run.hang_kind != "busy" else "hang (busy)"
    if run.signal:
        return run.signal
    if run.timed_out:
        return "timeout"
    return "died" if run.crashed else "–"


def render_parallel_md(results: list[FileResult], probes: dict[str, dict], threads: int, command: str) -> str:
    """The table of a --parallel-threads run: per file, passing and crashes in both modes, what the package
    fixed (failed with TTC_DISABLE=1, passed active) and what only fails active."""
    act = probes.get("active", {})
    lines = [
        f"{threads} threads at once; torch {act.get('torch', '?')}; `{command}`.",
        "",
        "| file | passed `TTC_DISABLE=1` | passed active | failed `TTC_DISABLE=1` | failed active "
        "| crash `TTC_DISABLE=1` | crash active | fixed by the package | active-only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, d = r.runs["active"], r.runs["disabled"]
        fixed = [nid for nid in r.disabled_only if "::" in nid and a.statuses.get(nid) == "passed"]
        lines.append(f"| `{r.file}` | {d.count('passed')} | {a.count('passed')} | {d.count(*FAILED)} | "
                     f"{a.count(*FAILED)} | {_crash_cell(d)} | {_crash_cell(a)} | {len(fixed)} | {len(r.active_only)} |")
    lines.append("")
    crashes = [(r.file, m, r.runs[m]) for r in results for m in MODES if r.runs[m].crashed]
    if crashes:
        lines.append("Crashes (faulthandler, crashing thread's first frames):")
        lines.append("")
        lines.extend(f"- `{f}` {m}: {run.crashed}" for f, m, run in crashes)
        lines.append("")
    fails = _failure_lines(results, md=True)
    lines.append(_failures_heading(results, md=True))
    if fails:
        lines.append("")
        lines.extend(fails)
    return "\n".join(lines) + "\n"


MD_BEGIN = "<!-- upstream-table:begin -->"
MD_END = "<!-- upstream-table:end -->"


def write_md(path: Path, table: str, begin: str = MD_BEGIN, end: str = MD_END) -> None:
    """Replace the part between the markers when the file has them (docs/upstream-tests.md does), else
    write the table alone."""
    write_between(path, begin, end, table, whole_if_missing=True)


def to_json(results: list[FileResult], probes: dict[str, dict]) -> dict:
    # "held": the active-only failures the package answers for (:func:`held_against_the_package`), so that a
    # reader of the JSON applies the bench's rule instead of writing it again.
    return {"probes": probes, "totals": totals(results), "files": [asdict(r) for r in results],
            "held": held_against_the_package(results)}


# ---------------------------------------------------------------------------------------------------------


def roots_from_args(args: argparse.Namespace) -> list[tuple[Path, str]]:
    roots: list[tuple[Path, str]] = []
    default = [SHARED_TESTS] if SHARED_TESTS.is_dir() and not args.no_shared else []
    dirs = args.tests_dir if args.tests_dir is not None else default
    for d in dirs:
        d = Path(d).resolve()
        if not d.is_dir():
            raise SystemExit(f"--tests-dir {d}: not a directory")
        roots.append((d, d.parent.name or d.name))
    if args.own and OWN_TESTS.is_dir() and all(d != OWN_TESTS.resolve() for d, _ in roots):
        roots.append((OWN_TESTS.resolve(), "own"))
    return roots


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C, so _run kills the running child's process group


def main(argv: list[str] | None = None) -> int:
    global PYCACHE_PREFIX, PARALLEL_THREADS, MEMORY_LIMIT, THREAD_PLAN, STALL_S, BUSY_STALL_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests-dir", action="append", type=Path, default=None,
                    help="a pytorch test/ folder (repeatable); default ../shared/pytorch-tests/test if present")
    ap.add_argument("--no-shared", action="store_true",
                    help="no --tests-dir default: only the project's own files (unless --tests-dir is given)")
    ap.add_argument("--no-own", dest="own", action="store_false",
                    help="leave out the project's own upstream files (bench/pytorch_tests/test)")
    ap.add_argument("--files", action="append", default=[], metavar="GLOB",
                    help="run only files matching (path relative to its root, or SUITE:PATH); repeatable")
    ap.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="leave out matching files")
    ap.add_argument("--completion-runs", type=int, default=0, metavar="K",
                    help="instead of the comparison: each file K times with the package active only; does the "
                         "process complete (with --parallel-threads: the thread plan as in the comparison)")
    ap.add_argument("--timeout", type=float, default=1500, help="seconds for one file in one mode (default 1500)")
    ap.add_argument("--test-timeout", type=float, default=300, help="pytest-timeout per test (default 300)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the tests")
    ap.add_argument("--rerun", type=int, default=8, metavar="N",
                    help="re-run up to N active-only failures per file, each alone, both modes (default 8; 0: none)")
    ap.add_argument("--md", type=Path, help="write the results table (markdown) to this file; in a file that "
                    "has the markers <!-- upstream-table:begin/end --> only the part between them is replaced")
    ap.add_argument("--json", type=Path, help="write every result (per test) as JSON to this file")
    ap.add_argument("--log-dir", type=Path, help="keep each pytest run's output here")
    ap.add_argument("--pycache-prefix", default=PYCACHE_PREFIX,
                    help="children's PYTHONPYCACHEPREFIX (default %(default)s); 'none': caches next to the sources")
    ap.add_argument("--list", action="store_true", help="list the selected files and exit")
    ap.add_argument("--parallel-threads", type=int, default=1, metavar="N",
                    help="run every test body in N threads at once (pytest-run-parallel; THREAD_UNSAFE in one)")
    ap.add_argument("--memory-limit-gb", type=float, default=12.0,
                    help="with --parallel-threads: each child's address-space limit (default 12; 0: none)")
    ap.add_argument("--thread-plan", choices=("union", "disabled"), default="union",
                    help="with --parallel-threads: which tests run in N threads in both modes: 'union' (default) "
                         "if either mode's judgement runs them there; 'disabled': TTC_DISABLE=1's judgement alone")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="run N files at once (each file's two modes, or its --completion-runs, one after the "
                         "other; default 1). Per-test verdicts only: the wall times in the table are then measured "
                         "under each other's load")
    ap.add_argument("--stall-s", type=float, default=120.0,
                    help="with --parallel-threads: a child with no new output for this long is dumped and killed, "
                         "counted as a hang, unless it is computing (default 120; 0: off)")
    ap.add_argument("--busy-stall-s", type=float, default=600.0,
                    help="with --stall-s: a child that is still computing (a quarter of a core or more over the "
                         "last --stall-s seconds) counts as hung (busy) after this long without output (default 600)")
    args = ap.parse_args(argv)
    THREAD_PLAN = args.thread_plan
    STALL_S = max(0.0, args.stall_s)
    BUSY_STALL_S = max(STALL_S, args.busy_stall_s)
    PARALLEL_THREADS = max(1, args.parallel_threads)
    if PARALLEL_THREADS > 1 and args.memory_limit_gb > 0:
        MEMORY_LIMIT = int(args.memory_limit_gb * 2**30)
    PYCACHE_PREFIX = None if args.pycache_prefix.lower() == "none" else args.pycache_prefix
    signal.signal(signal.SIGTERM, _on_sigterm)

    files: list[TestFile] = []
    for root, suite in roots_from_args(args):
        files += discover(root, suite)
    files = select(files, args.files, args.exclude)
    if args.list:
        for f in files:
            print(f"{f.key}\t{f.root}")
        return 0 if files else 2
    if not files:
        print("no test file selected", file=sys.stderr)
        return 2

    command = "python bench/upstream_tests.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.completion_runs:
        probe_active = probe(args.python, files[0].root, "active", min(args.timeout, 300))
        if not is_active(probe_active):
            print("ERROR: the package is not active in the child (see the probe)", file=sys.stderr)
            return 2
        rows = run_completion(files, args.python, args.timeout, args.test_timeout, args.completion_runs, args.log_dir,
                              args.jobs)
        table = render_completion_md(rows, probe_active, PARALLEL_THREADS, command)
        print(table)
        if args.md:
            write_md(args.md, table, f"<!-- upstream-completion-{PARALLEL_THREADS}:begin -->",
                     f"<!-- upstream-completion-{PARALLEL_THREADS}:end -->")
        if args.json:
            args.json.write_text(json.dumps({"probe": probe_active, "runs": rows}, indent=1), encoding="utf-8")
        return 0 if all(r["completed"] for r in rows) else 1

    try:
        results, probes = run_all(files, args.python, args.timeout, args.test_timeout, args.rerun, args.log_dir,
                                  jobs=max(1, args.jobs))
    except KeyboardInterrupt:
        print("interrupted; the running test file was stopped", file=sys.stderr)
        return 130
    print(render_text(results, probes))
    if PARALLEL_THREADS > 1:
        for r in results:
            for mode in MODES:
                if r.runs[mode].crashed:
                    print(f"{r.file} [{mode}]: {r.runs[mode].crashed}")
    if args.md and PARALLEL_THREADS > 1:
        write_md(args.md, render_parallel_md(results, probes, PARALLEL_THREADS, command),
                 f"<!-- upstream-parallel-{PARALLEL_THREADS}:begin -->", f"<!-- upstream-parallel-{PARALLEL_THREADS}:end -->")
    elif args.md:
        write_md(args.md, render_md(results, probes))
    if args.json:
        args.json.write_text(json.dumps(to_json(results, probes), indent=1), encoding="utf-8")
    if not is_active(probes.get("active", {})) or not is_disabled(probes.get("disabled", {})):
        print("\nERROR: the comparison is void: the package is not active in the active child, or is in "
              "effect in the disabled one (see the first two lines)", file=sys.stderr)
        return 2
    return 1 if held_against_the_package(results) else 0


if __name__ == "__main__":
    sys.exit(main())
