"""When each patch runs, and the state of every patch in this process: its one owner.

:func:`snapshot` is how anything else reads that state: an immutable view taken under this module's lock,
with the activation of the process (``_activation``) and every patch as ``status()`` reports it (``disabled``
while ``TTC_DISABLE`` is set, the reason a pending patch waits). ``status()`` and ``doctor`` only format it.

Lifecycle of a patch::

    pending --(torch imported)--> skipped   (disabled, version outside its range, fixed upstream)
    pending --(its torch modules imported, the patches it follows settled)--> check
        check --problem--> skipped (target changed: the reason, never a guess)
        check --ok--> apply --> verify --ok--> applied
                                      \\--raised--> failed (everything it did is reverted; one warning line)
    applied --uninstall()--> reverted --install()--> pending

Nothing here raises into the user's ``import``: a failure is one warning line and torch runs without the patch.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from enum import Enum
from typing import Any, Mapping, Protocol, cast

from torch_threadsafe_compile import _activation, _env, _forksafe, _version_ranges
from torch_threadsafe_compile._journal import Changes, SourceUnavailable, TargetBusy, TargetMismatch
from torch_threadsafe_compile.registry import SPECS, Frozen, PatchSpec

log = logging.getLogger("torch_threadsafe_compile")

__all__ = ["State", "Skip", "PatchState", "PatchView", "Snapshot", "states", "snapshot", "on_module_imported",
           "apply_ready", "reset_for_install", "revert_all", "warn"]


class Patch(Protocol):
    """The shape of a patch module (modules satisfy protocols structurally; see ``registry``)."""

    SPEC: PatchSpec

    def check(self) -> str | None: ...

    def apply(self, changes: Changes) -> Mapping[str, Any] | None: ...

    def verify(self) -> None: ...


class State(str, Enum):
    PENDING = "pending"  # waits for its torch modules (or for torch itself)
    APPLIED = "applied"
    SKIPPED = "skipped"  # see Skip
    FAILED = "failed"  # apply or verify raised; reverted
    REVERTED = "reverted"  # uninstall()
    DISABLED = "disabled"  # switched off by the user: TTC_DISABLE=1, or TTC_DISABLE=<its id> (in snapshot(); never stored)


class Skip(str, Enum):
    """Why a patch was skipped. Only a changed target is worth another try at the next ``install()``."""

    DISABLED = "disabled"
    UNKNOWN_VERSION = "unknown version"
    FIXED_UPSTREAM = "fixed upstream"
    OUT_OF_RANGE = "out of range"
    TARGET_CHANGED = "target changed"
    SOURCE_UNAVAILABLE = "source unavailable"  # torch's source cannot be read: the patch cannot prove its rewrite
    BUSY_TOO_LONG = "target busy"  # its target stayed in use (a trace in progress) for BUSY_RETRY_S


# Skips that leave a hazard open for a reason other than the torch version: each is said in a warning line.
LOST = frozenset({Skip.TARGET_CHANGED, Skip.SOURCE_UNAVAILABLE, Skip.BUSY_TOO_LONG})
# A patch whose target is busy (TargetBusy) is tried again every BUSY_RETRY_EVERY_S, for BUSY_RETRY_S at most.
BUSY_RETRY_EVERY_S = 0.2
BUSY_RETRY_S = 60.0


class PatchState:
    """One patch's state (mutable, under ``_lock``; a plain class, for the reason ``registry.Frozen`` gives)."""

    __slots__ = ("spec", "state", "skip", "reason", "changes", "extra")

    def __init__(self, spec: PatchSpec) -> None:
        self.spec = spec
        self.state = State.PENDING
        self.skip: Skip | None = None
        self.reason = ""
        self.changes: Changes | None = None
        self.extra: Mapping[str, Any] = {}

    def settle(self, state: State, reason: str = "", skip: Skip | None = None) -> None:
        self.state, self.reason, self.skip = state, reason, skip

    @property
    def impl(self) -> Patch:
        """The patch module, imported on first use: only once its torch modules are there and it is about
        to be checked (the registry's spec table decides everything before that)."""
        return cast(Patch, importlib.import_module(self.spec.module))


_lock = threading.RLock()
_states: dict[str, PatchState] | None = None
_finished: set[str] = set()  # watched modules whose body finished executing


@_forksafe.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()  # a thread of the parent may have been installing


DETAILS = " (details: TTC_LOG=info, or python -m torch_threadsafe_compile doctor)"


def warn(msg: str) -> None:
    """One line on stderr for the first problem of the process (never more); every problem in the log."""
    log.info(msg)
    _activation.warn_once(msg + DETAILS)


def _say_lost(lost: list[PatchState]) -> None:
    """One line for every settling pass in which patches ended without giving their protection."""
    if lost:
        what = "; ".join(f"{ps.spec.id} ({ps.spec.hazard}) {ps.state.value}: {ps.reason}" for ps in lost)
        log.warning("hazards left open: %s", what)
        _activation.warn_line(f"hazards left open, torch runs without these patches: {what}{DETAILS}")


def _configure_logging(level: str | None) -> None:
    """TTC_LOG=debug|info|warning|error: give our logger that level and a handler of its own."""
    if not level or getattr(log, "_ttc_configured", False):
        return
    log.setLevel(level.upper())
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("torch-threadsafe-compile %(levelname)s: %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    log._ttc_configured = True  # type: ignore[attr-defined]


def states() -> dict[str, PatchState]:
    """Every patch, in order, from the registry's spec table (no patch module is imported here)."""
    global _states
    with _lock:
        if _states is None:
            settings = _env.current()
            _configure_logging(settings.log_level)
            _states = {pid: PatchState(spec=spec) for pid, spec in SPECS.items()}
        return _states


def _module_ready(name: str) -> bool:
    """``name`` and every package above it finished executing (not just present in ``sys.modules``).

    Inside ``import torch._dynamo`` its submodules appear one by one while the package is still
    initializing; patching a half-built package would see half-built targets.
    """
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        mod = sys.modules.get(prefix)
        if mod is None:
            return False
        # importlib clears _initializing only after our post-exec hook returned: trust the hook.
        if prefix not in _finished and getattr(getattr(mod, "__spec__", None), "_initializing", False):
            return False
    return True


def _static_skip(spec: PatchSpec, settings: _env.Settings) -> tuple[Skip, str] | None:
    """Why ``spec`` can never apply in this process (decidable as soon as torch is imported), or None."""
    disabled_by = settings.patch_disabled_by(spec.id)
    if disabled_by is not None:
        return Skip.DISABLED, f"disabled by {disabled_by}"
    if spec.free_threaded and not _env.free_threaded_build():
        return Skip.OUT_OF_RANGE, "a GIL build: the hazard needs free-threaded CPython"
    v = _version_ranges.torch_version()
    if v is None:
        return Skip.UNKNOWN_VERSION, _version_ranges.version_error() or "unknown torch version"
    if spec.fixed_in is not None and _version_ranges.version_in(v, f">={spec.fixed_in}"):
        return Skip.FIXED_UPSTREAM, f"fixed upstream in torch {spec.fixed_in}"
    if not _version_ranges.version_in(v, spec.torch_versions):
        return Skip.OUT_OF_RANGE, f"torch {_version_ranges.format_version(v)} is outside {spec.torch_versions} (hazard absent there)"
    return None


def _undo(changes: Changes) -> None:
    try:
        changes.revert()
    except Exception as e:  # reported, never raised at import time
        warn(f"revert incomplete: {e}")


def _try_apply(ps: PatchState) -> None:
    changes = Changes(ps.spec.id)
    try:
        problem = ps.impl.check()
        if problem:
            ps.settle(State.SKIPPED, f"target changed: {problem}", Skip.TARGET_CHANGED)
            return
        ps.extra = ps.impl.apply(changes) or {}
        ps.changes = changes
        ps.impl.verify()
    except TargetBusy as e:
        _undo(changes)
        ps.changes = None
        _busy(ps, str(e))
        return
    except SourceUnavailable as e:
        _undo(changes)
        ps.changes = None
        ps.settle(State.SKIPPED, f"{e}; a stripped or locked-down torch install?", Skip.SOURCE_UNAVAILABLE)
        return
    except TargetMismatch as e:
        _undo(changes)
        ps.changes = None
        ps.settle(State.SKIPPED, f"target changed: {e}", Skip.TARGET_CHANGED)
        return
    except Exception as e:
        _undo(changes)
        ps.changes = None
        ps.settle(State.FAILED, f"{type(e).__name__}: {e}; reverted")
        return
    ps.settle(State.APPLIED)
    _busy_since.pop(ps.spec.id, None)
    log.debug("%s applied", ps.spec.id)


# patch id -> when its target was first found busy (TargetBusy); such a patch stays pending and is retried.
_busy_since: dict[str, float] = {}
_retry: list[threading.Timer] = []


def _busy(ps: PatchState, why: str) -> None:
    """The target is in use: stay pending and try again shortly (a timer), for BUSY_RETRY_S at most."""
    import time

    first = _busy_since.setdefault(ps.spec.id, time.monotonic())
    if time.monotonic() - first > BUSY_RETRY_S:
        _busy_since.pop(ps.spec.id, None)
        ps.settle(State.SKIPPED, f"{why} for {BUSY_RETRY_S:.0f} s; install() again when idle", Skip.BUSY_TOO_LONG)
        return
    ps.settle(State.PENDING, f"waits: {why} (tried again every {BUSY_RETRY_EVERY_S} s)")
    if not any(t.is_alive() for t in _retry):
        timer = threading.Timer(BUSY_RETRY_EVERY_S, apply_ready)
        timer.daemon = True
        timer.name = "ttc-retry"
        _retry[:] = [timer]
        timer.start()


def _ready(ps: PatchState, table: dict[str, PatchState]) -> bool:
    if not all(_module_ready(m) for m in ps.spec.modules):
        return False
    return all(table[dep].state is not State.PENDING for dep in ps.spec.after)


def apply_ready() -> None:
    """Settle every pending patch that can be settled now. Called after each watched import."""
    if not _module_ready("torch") or _activation.disabled_by() is not None:
        return
    settings = _env.current()
    with _lock:
        table = states()
        for ps in table.values():
            if ps.state is State.PENDING:
                skip = _static_skip(ps.spec, settings)
                if skip is not None:
                    ps.settle(State.SKIPPED, skip[1], skip[0])
                    log.debug("%s skipped: %s", ps.spec.id, ps.reason)
        # Loop: applying one patch can make a later one ready (``after``). A busy target is tried once a pass.
        tried: set[str] = set()
        progress = True
        while progress:
            progress = False
            for ps in table.values():
                if ps.state is State.PENDING and ps.spec.id not in tried and _ready(ps, table):
                    tried.add(ps.spec.id)
                    _try_apply(ps)
                    progress = True
        _say_lost([ps for ps in table.values() if ps.spec.id in tried and (ps.state is State.FAILED or ps.skip in LOST)])


def on_module_imported(name: str) -> None:
    """Called by the bootstrap when a watched torch module finished importing."""
    _finished.add(name)
    apply_ready()


def reset_for_install() -> None:
    """``install()`` after ``uninstall()`` (or after a target was busy): those patches are pending again."""
    with _lock:
        for ps in states().values():
            if ps.state in (State.REVERTED, State.FAILED) or ps.skip in LOST:
                ps.settle(State.PENDING)


def revert_all() -> None:
    """Revert every applied patch, in reverse order, restoring the original objects."""
    with _lock:
        for ps in reversed(list(states().values())):
            if ps.state is State.APPLIED and ps.changes is not None:
                _undo(ps.changes)
                ps.changes = None
                ps.settle(State.REVERTED, "uninstall()")
            elif ps.state is State.PENDING:
                ps.settle(State.REVERTED, "uninstall()")


# -- reading: one immutable view, taken under the lock --------------------------------------------------


class PatchView(Frozen):
    """One patch as :func:`snapshot` saw it."""

    __slots__ = ("spec", "state", "reason", "open", "replaced_by_others", "stats")

    spec: PatchSpec
    state: State
    reason: str
    # The hazard stays open for a reason other than this torch's version or an upstream fix; None while the
    # package is disabled (off on purpose: nothing is open).
    open: bool | None
    replaced_by_others: tuple[str, ...]  # edits somebody else has since replaced (Changes.intact)
    stats: Any  # an applied patch's report(), when asked for

    def __init__(self, spec: PatchSpec, state: State, reason: str, open: bool | None,
                 replaced_by_others: tuple[str, ...] = (), stats: Any = None) -> None:
        self._set(spec, state, reason, open, replaced_by_others, stats)


class Snapshot(Frozen):
    """The activation of this process and every patch, in patch order, at one moment."""

    __slots__ = ("activation", "inactive_reason", "patches")

    # How it was activated ("pth", "sitecustomize", "explicit"), or why not: "disabled" (TTC_DISABLE),
    # "uninstalled" (uninstall() at run time), "not activated" (no start-up hook ran, no install()).
    activation: str
    inactive_reason: str | None  # why it is off, in words ("TTC_DISABLE=1"); None exactly when it is active
    patches: tuple[PatchView, ...]

    def __init__(self, activation: str, inactive_reason: str | None, patches: tuple[PatchView, ...]) -> None:
        self._set(activation, inactive_reason, patches)

    def patch(self, patch_id: str) -> PatchView:
        """One patch's view (``KeyError`` for an unknown id)."""
        for view in self.patches:
            if view.spec.id == patch_id:
                return view
        raise KeyError(patch_id)


def _waits_for(spec: PatchSpec, mode: str | None) -> str:
    """Why a pending patch that has no reason of its own has not settled yet."""
    if mode is None:
        return "not activated: the start-up hook did not run (install() applies it)"
    if "torch" not in sys.modules:
        return "waits for torch"
    missing = [m for m in spec.modules if m not in sys.modules]
    return ("waits for import of " + ", ".join(missing)) if missing else "waits for " + ", ".join(spec.after)


def _stats(ps: PatchState) -> Any:
    report = getattr(ps.impl, "report", None) if ps.state is State.APPLIED else None  # applied: imported already
    if report is None:
        return None
    try:
        return report()
    except Exception as e:  # a report must not break status()
        return {"error": repr(e)}


def _view(ps: PatchState, mode: str | None, stats: bool, settings: _env.Settings) -> PatchView:
    disabled_by = settings.patch_disabled_by(ps.spec.id)
    if disabled_by is not None:  # off on purpose, stored as a skip once torch is imported: its own state
        return PatchView(ps.spec, State.DISABLED, f"disabled by {disabled_by}", None)
    opened = ps.state is State.FAILED or ps.skip in LOST or (ps.state is State.PENDING and mode is None)
    reason = ps.reason
    if ps.state is State.PENDING and not reason:
        reason = _waits_for(ps.spec, mode)
    replaced = tuple(ps.changes.intact()) if ps.changes is not None else ()
    return PatchView(ps.spec, ps.state, reason, opened, replaced, _stats(ps) if stats else None)


def snapshot(stats: bool = True) -> Snapshot:
    """Activation and every patch's state, read under the lock (``stats``: with applied patches' reports).

    Only reads: patches settle when their modules are imported (or at install()), never because someone
    asked (a process where the start-up hook did not run would otherwise be patched by a status() call).
    """
    disabled_by = _activation.disabled_by()
    settings = _env.current()
    with _lock:
        mode = _activation.mode()
        table = states()
        if disabled_by is not None:
            reason = f"disabled by {disabled_by}"
            views = tuple(PatchView(ps.spec, State.DISABLED, reason, None) for ps in table.values())
        else:
            views = tuple(_view(ps, mode, stats, settings) for ps in table.values())
    activation, why = _activation_state(disabled_by, mode)
    return Snapshot(activation, why, views)


NOT_ACTIVATED = "the start-up hook did not run and install() was not called"
UNINSTALLED = "uninstall() was called in this process; install() activates it again"


def _activation_state(disabled_by: str | None, mode: str | None) -> tuple[str, str | None]:
    """``Snapshot.activation`` and ``inactive_reason``: the reason is None exactly when the package is active."""
    if disabled_by is not None:
        return "disabled", disabled_by
    if mode is not None:
        return mode, None
    if _activation.uninstalled():
        return "uninstalled", UNINSTALLED
    return "not activated", NOT_ACTIVATED
