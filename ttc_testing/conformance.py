"""The conformance kit's probe: every patch of the table, checked by the same rules, from the journal.

``python -m ttc_testing.conformance`` (in a fresh interpreter with the package active) imports every torch
module some patch waits for, so that every patch that fits this torch applies, and then checks each patch
(``tests/test_conformance.py`` turns the answers into one test per patch):

* **applied**: every edit the journal holds for it is in place and differs from its original; nobody
  replaced one (``status()``'s ``replaced_by_others`` is empty);
* **install twice**: a second ``install()`` adds no edit and changes no state;
* **uninstall**: every journaled object (listed from the journal, not by hand) is again the original the
  journal kept, identity included; a module that wore a redirect class wears its own again; the journal
  holds nothing of the patch;
* **install again**: the same attributes are edited again (a round trip, not a one-way door);
* **capabilities**: an applied patch provides every capability its row declares (``provides``), and
  ``uninstall()`` withdraws them (a consumer falls back to upstream's behaviour);
* **fork**: for each lock at module level in the patch's modules, a fork while another thread holds it
  leaves a child in which that lock can be taken (the module registered a reset with ``_forksafe``) and a
  new function compiles and runs.

The fork rule also covers the package's own modules outside ``patches/``. Prints one line
``CONFORMANCE <json>``: ``{"torch", "patches": {id: {"state", "reason", "edits", "undo", "problems", "locks"}},
"core": {"locks", "problems"}}``. Only standard library and the package at module level; torch is imported in :func:`main`.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import signal
import sys
import threading
import time
import types
from typing import Any

LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
FORK_CHILD_TIMEOUT_S = 60.0


def _edits_by_patch() -> dict[str, list[Any]]:
    """The journal's edits in force, by patch id, in the order they were made."""
    from torch_threadsafe_compile import _journal

    out: dict[str, list[Any]] = {}
    for stack in _journal._journal_index.values():
        for edit in stack:
            out.setdefault(edit.patch_id, []).append(edit)
    return out


def _label(edit: Any) -> str:
    from torch_threadsafe_compile._journal import _name

    return f"{getattr(edit.obj, '__module__', '') or ''}:{_name(edit.obj)}.{edit.attr}"


def _current(edit: Any) -> Any:
    from torch_threadsafe_compile._journal import raw_get

    if isinstance(edit.obj, types.ModuleType) and isinstance(edit.new, property):
        return edit.obj.__dict__.get(edit.attr, _missing())  # a redirect: the module's own value
    return raw_get(edit.obj, edit.attr)


def _missing() -> Any:
    from torch_threadsafe_compile import _journal

    return _journal._MISSING


def _patch_modules(patch_id: str) -> list[types.ModuleType]:
    """The patch's module and, for a package (first_compile), every module in it."""
    from torch_threadsafe_compile import registry

    mod = importlib.import_module(registry.SPECS[patch_id].module)
    mods = [mod]
    if hasattr(mod, "__path__"):
        for info in pkgutil.iter_modules(mod.__path__):
            mods.append(importlib.import_module(f"{mod.__name__}.{info.name}"))
    return mods


def _locks_in(modules: list[types.ModuleType]) -> list[tuple[types.ModuleType, str]]:
    """(module, name) of every lock bound at module level in ``modules``."""
    return [(m, name) for m in modules for name, value in sorted(vars(m).items()) if isinstance(value, LOCK_TYPES)]


def _module_locks(patch_id: str) -> list[tuple[types.ModuleType, str]]:
    return _locks_in(_patch_modules(patch_id))


def _core_locks() -> list[tuple[types.ModuleType, str]]:
    import torch_threadsafe_compile as pkg

    return _locks_in([importlib.import_module(f"{pkg.__name__}.{info.name}")
                      for info in pkgutil.iter_modules(pkg.__path__) if info.name not in ("patches", "__main__")])


def _fork_while_held(module: types.ModuleType, name: str) -> str | None:
    """Fork while another thread holds ``module.name``; None when the child can take the lock (read again
    from the module: a reset rebinds it) and compile, else what went wrong. Bounded: a child that does not
    finish within FORK_CHILD_TIMEOUT_S is killed and reported."""
    import torch

    lock = getattr(module, name)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(FORK_CHILD_TIMEOUT_S + 30)

    t = threading.Thread(target=holder, name="conformance-holder", daemon=True)
    t.start()
    if not held.wait(10):
        release.set()
        return "the holder thread could not take the lock in 10 s"
    pid = os.fork()
    if pid == 0:  # the child: exit status tells the parent what happened
        code = 0
        try:
            child_lock = getattr(module, name)
            if not child_lock.acquire(timeout=5):
                code = 3
            else:
                child_lock.release()  # the compile below may take it
                def fresh(x: Any) -> Any:
                    return x * 3 + 1

                x = torch.ones(4)
                if not torch.equal(torch.compile(fresh, backend="eager")(x), fresh(x)):
                    code = 4
        except BaseException:
            code = 5
        os._exit(code)
    try:
        deadline = time.monotonic() + FORK_CHILD_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"the child did not finish in {FORK_CHILD_TIMEOUT_S:.0f} s (killed)"
            time.sleep(0.05)
    finally:
        release.set()
        t.join(10)
    if os.WIFSIGNALED(status):
        return f"the child died of signal {os.WTERMSIG(status)}"
    rc = os.WEXITSTATUS(status)
    return {0: None, 3: "the lock stayed held in the child (no fork reset)",
            4: "a compiled call in the child returned a wrong value",
            5: "the child raised"}.get(rc, f"the child exited with status {rc}")


def main() -> int:
    import torch

    import torch_threadsafe_compile as ttc
    from torch_threadsafe_compile import registry

    specs = [registry.SPECS[i] for i in registry.PATCH_MODULES]
    for m in sorted(registry.watched_modules(specs)):
        try:
            importlib.import_module(m)
        except Exception:  # a module this torch lacks: its patches say why in status()
            pass
    ttc.install()  # idempotent: settles what the imports made ready

    def states() -> dict[str, dict[str, Any]]:
        return {p["id"]: p for p in ttc.status()["patches"]}

    before = states()
    applied = [pid for pid, p in before.items() if p["state"] == "applied"]
    result: dict[str, dict[str, Any]] = {
        pid: {"state": p["state"], "reason": p.get("reason", ""), "edits": [], "undo": 0, "problems": [], "locks": []}
        for pid, p in before.items()}

    # 1. Applied: every journaled edit in place, different from its original, not replaced by others.
    from torch_threadsafe_compile import _lifecycle
    from torch_threadsafe_compile._journal import _holds

    for pid, ps in _lifecycle.states().items():
        if pid in result and ps.changes is not None:
            # what revert will undo: the journaled edits and the rest (names injected, a C switch turned, ...)
            result[pid]["undo"] = len(ps.changes._undo)

    edits = _edits_by_patch()
    for pid in applied:
        res = result[pid]
        res["edits"] = [_label(e) for e in edits.get(pid, [])]
        if before[pid].get("replaced_by_others"):
            res["problems"].append(f"replaced by others: {before[pid]['replaced_by_others']}")
        missing = set(registry.SPECS[pid].provides) - _provided_by(pid)
        if missing:
            res["problems"].append(f"applied without providing what its row declares: {sorted(missing)}")
        for e in edits.get(pid, []):
            if e.new is e.original:
                res["problems"].append(f"{_label(e)}: the edit's new value is its original")
            if not _holds(e):
                res["problems"].append(f"{_label(e)}: not in place after apply")

    # 2. Install twice: no new edit, no state change.
    ttc.install()
    again = _edits_by_patch()
    after_twice = states()
    for pid in applied:
        if [id(e) for e in again.get(pid, [])] != [id(e) for e in edits.get(pid, [])]:
            result[pid]["problems"].append("a second install() changed the journal's edits")
        if after_twice[pid]["state"] != "applied":
            result[pid]["problems"].append(f"a second install() left it {after_twice[pid]['state']}")

    # 3. Uninstall: every journaled attribute holds upstream's object again (the original of its oldest
    #    edit: patches may build on each other's edits), no module wears a redirect class, the journal is empty.
    oldest = [stack[0] for stack in _journal_stacks()]
    ttc.uninstall()
    left = _edits_by_patch()
    after = states()
    for pid in applied:
        if left.get(pid):
            result[pid]["problems"].append(f"after uninstall() the journal still holds {len(left[pid])} edit(s)")
        if after[pid]["state"] == "applied":
            result[pid]["problems"].append("still applied after uninstall()")
        if _provided_by(pid):
            result[pid]["problems"].append(f"after uninstall() it still provides {sorted(_provided_by(pid))}")
    for first in oldest:
        problems = result[first.patch_id]["problems"]
        now = _current(first)
        if now is not first.original:
            problems.append(f"{_label(first)}: not upstream's object after uninstall() ({now!r:.80})")
        if isinstance(first.obj, types.ModuleType) and "__ttc_patch__" in vars(type(first.obj)):
            problems.append(f"{first.obj.__name__} still wears the redirect class after uninstall()")

    # 4. Install again: the same attributes edited again.
    ttc.install()
    redo = _edits_by_patch()
    for pid in applied:
        if sorted(_label(e) for e in redo.get(pid, [])) != sorted(result[pid]["edits"]):
            result[pid]["problems"].append("install() after uninstall() edited other attributes than the first")
        if _provided_by(pid) != set(registry.SPECS[pid].provides):
            result[pid]["problems"].append("install() after uninstall() did not provide its capabilities again")

    # 5. Fork while each module-level lock of the patch is held by another thread.
    for pid in result:
        for module, name in _module_locks(pid):
            problem = _fork_while_held(module, name)
            where = f"{module.__name__}.{name}"
            result[pid]["locks"].append(where)
            if problem:
                result[pid]["problems"].append(f"fork while {where} is held: {problem}")

    # The same fork rule for the package's own modules outside patches/ (journal, graveyard, lifecycle, ...).
    core: dict[str, Any] = {"locks": [], "problems": []}
    for module, name in _core_locks():
        where = f"{module.__name__}.{name}"
        core["locks"].append(where)
        problem = _fork_while_held(module, name)
        if problem:
            core["problems"].append(f"fork while {where} is held: {problem}")

    print("CONFORMANCE " + json.dumps({"torch": torch.__version__, "patches": result, "core": core}), flush=True)
    return 0


def _provided_by(patch_id: str) -> set[str]:
    """The capabilities ``patch_id`` provides now (from the journal's store, not from its row)."""
    from torch_threadsafe_compile import _journal

    return {name for name, cap in _journal.capabilities().items() if patch_id in cap.providers}


def _journal_stacks() -> list[list[Any]]:
    from torch_threadsafe_compile import _journal

    return [list(stack) for stack in _journal._journal_index.values() if stack]


if __name__ == "__main__":
    sys.exit(main())
