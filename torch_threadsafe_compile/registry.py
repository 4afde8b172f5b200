"""The patch registry: which patches exist, in which order, and their state in this process.

The registry holds specs, not logic (OpenTelemetry-instrumentor style): each patch lives in its own
module under ``torch_threadsafe_compile/patches/`` and declares its hazard id, the torch versions it
covers, the upstream issue, the torch modules it needs, the patches it must follow, and the
``check``/``apply``/``verify``/``revert`` steps. This module only decides *when* each one runs.

Lifecycle of a patch in a process::

    pending --(its modules imported, version in range, enabled)--> check --ok--> apply --> verify --> applied
        \\--> skipped (version out of range / fixed upstream / disabled / target mismatch)
        \\--> failed (apply or verify raised: everything it did is reverted)
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from torch_threadsafe_compile._patching import Changes, TargetMismatch

log = logging.getLogger("torch_threadsafe_compile")

# Explicit order: a patch may only rely on the ones before it. ``config_overrides`` (H6) comes before
# ``lazy_backward`` (H4), whose setting must reach every thread; the tracing flags come before the
# compile gate, whose verification compiles nothing but reads them.
PATCH_MODULES: tuple[str, ...] = (
    "fx_tracing_flag",  # H1
    "fx_patcher",  # H7
    "compile_session_flag",  # H2
    "export_flag",  # H7
    "export_lock",  # H7
    "config_overrides",  # H6
    "dynamic_flags",  # H5
    "lazy_backward",  # H4
    "compile_lock_watchdog",  # H4 (detector)
    "first_compile",  # H3
)


@dataclass
class PatchSpec:
    """What a patch declares about itself. See any module in ``patches/`` for an example."""

    id: str
    hazard: str
    summary: str
    upstream: str
    torch_versions: str  # a packaging SpecifierSet, e.g. ">=2.9,<2.14"
    modules: tuple[str, ...]  # torch modules that must have been imported before it can apply
    fixed_in: str | None = None  # first torch release where upstream fixed the hazard
    tested: str = ""  # the versions the compatibility matrix ran it on, for the doctor
    after: tuple[str, ...] = ()


@dataclass
class PatchState:
    spec: PatchSpec
    impl: Any
    state: str = "pending"  # pending | applied | skipped | failed | reverted
    reason: str = ""
    changes: Changes | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_lock = threading.RLock()
_states: dict[str, PatchState] | None = None
_torch_version: Any = None
_version_error: str | None = None
_finished: set[str] = set()  # watched modules whose body finished executing


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


def _load() -> dict[str, PatchState]:
    global _states
    if _states is None:
        settings = _settings()
        _configure_logging(settings.log_level)
        known = set(PATCH_MODULES)
        unknown = sorted(settings.disabled_patches - known)
        if unknown:
            _warn(f"TTC_DISABLE names unknown patches {unknown}; known: {sorted(known)}")
        states = {}
        for name in PATCH_MODULES:
            mod = importlib.import_module(f"torch_threadsafe_compile.patches.{name}")
            spec: PatchSpec = mod.SPEC
            states[spec.id] = PatchState(spec=spec, impl=mod)
        _states = states
    return _states


def specs() -> list[PatchSpec]:
    return [s.spec for s in _load().values()]


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


def _torch_ready() -> bool:
    return _module_ready("torch")


_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\+[0-9A-Za-z.]+)?$")
_CLAUSE = re.compile(r"^(>=|<=|==|!=|<|>)\s*(\d+)\.(\d+)(?:\.(\d+))?$")


def torch_version() -> Any:
    """torch's version, local part dropped: a release tuple ``(2, 13, 0)`` for plain releases (the fast path:
    ``packaging.specifiers`` alone costs ~6 ms of every ``import torch``), else a ``packaging`` Version
    (pre-releases, dev builds), or None when it is not a version at all."""
    global _torch_version, _version_error
    if _torch_version is None and _version_error is None:
        raw = str(getattr(sys.modules.get("torch"), "__version__", ""))
        m = _RELEASE.match(raw)
        if m:
            _torch_version = tuple(int(x or 0) for x in m.groups())
        else:
            from packaging.version import InvalidVersion, Version

            try:
                _torch_version = Version(Version(raw).base_version)
            except InvalidVersion:
                _version_error = f"torch.__version__ {raw!r} is not a version"
    return _torch_version


def version_in(version: Any, specifier: str) -> bool:
    """``version in SpecifierSet(specifier)`` with pre-releases allowed.

    Release tuples against clauses of the form ``>=2.4``/``<2.14.1`` are compared directly; anything else
    (a ``packaging`` Version, ``~=``, wildcards) is left to ``packaging``. Both give the same answers for the
    clauses we use (tests/test_registry.py checks them against each other)."""
    if isinstance(version, tuple):
        clauses = [c.strip() for c in specifier.split(",") if c.strip()]
        parsed = [_CLAUSE.match(c) for c in clauses]
        if all(parsed):
            ops = {">=": tuple.__ge__, "<=": tuple.__le__, "==": tuple.__eq__, "!=": tuple.__ne__,
                   "<": tuple.__lt__, ">": tuple.__gt__}
            return all(ops[m.group(1)](version, tuple(int(x or 0) for x in m.groups()[1:])) for m in parsed)
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    v = Version(".".join(map(str, version))) if isinstance(version, tuple) else version
    return SpecifierSet(specifier, prereleases=True).contains(v, prereleases=True)


def _format_version(version: Any) -> str:
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _settings() -> Any:
    from torch_threadsafe_compile._env import read_settings

    return read_settings()


def _decide(ps: PatchState, settings: Any) -> str | None:
    """Why ``ps`` must not apply here, or None."""
    spec = ps.spec
    if spec.id in settings.disabled_patches:
        return f"disabled by TTC_DISABLE={','.join(sorted(settings.disabled_patches))}"
    v = torch_version()
    if v is None:
        return _version_error or "unknown torch version"
    if spec.fixed_in is not None and version_in(v, f">={spec.fixed_in}"):
        return f"fixed upstream in torch {spec.fixed_in}"
    if not version_in(v, spec.torch_versions):
        return f"torch {_format_version(v)} is outside {spec.torch_versions} (hazard absent there)"
    for dep in spec.after:
        dep_state = _load()[dep]
        if dep_state.state == "pending":
            return "waiting"
    return None


def _try_apply(ps: PatchState, settings: Any) -> None:
    reason = _decide(ps, settings)
    if reason == "waiting":
        return
    if reason is not None:
        ps.state, ps.reason = "skipped", reason
        log.debug("%s: skipped: %s", ps.spec.id, reason)
        return
    changes = Changes(ps.spec.id)
    try:
        problem = ps.impl.check()
        if problem:
            ps.state, ps.reason = "skipped", f"target changed: {problem}"
            log.info("%s skipped: %s", ps.spec.id, ps.reason)
            return
        ps.extra = ps.impl.apply(changes) or {}
        ps.changes = changes
        ps.impl.verify()
    except TargetMismatch as e:
        _undo(changes)
        ps.changes = None
        ps.state, ps.reason = "skipped", f"target changed: {e}"
        log.info("%s skipped: %s", ps.spec.id, ps.reason)
        return
    except Exception as e:
        _undo(changes)
        ps.changes = None
        ps.state, ps.reason = "failed", f"{type(e).__name__}: {e}"
        _warn(f"patch {ps.spec.id} ({ps.spec.hazard}) failed and was reverted: {ps.reason}; torch runs without it")
        return
    ps.state, ps.reason = "applied", ""
    log.debug("%s applied", ps.spec.id)


def _warn(msg: str) -> None:
    """One line on stderr for the first problem of the process (never more); every problem in the log."""
    from torch_threadsafe_compile import _bootstrap

    log.info(msg)
    _bootstrap.warn(msg + " (details: TTC_LOG=info, or python -m torch_threadsafe_compile doctor)")


def _undo(changes: Changes) -> None:
    try:
        changes.revert()
    except Exception as e:  # reported, never raised at import time
        _warn(f"revert incomplete: {e}")


def _apply_ready() -> None:
    if not _torch_ready():
        return
    settings = _settings()
    if settings.disabled:
        return
    with _lock:
        states = _load()
        # Loop: applying one patch can make a later one ready (``after``).
        progress = True
        while progress:
            progress = False
            for ps in states.values():
                if ps.state != "pending":
                    continue
                if not all(_module_ready(m) for m in ps.spec.modules):
                    continue
                before = ps.state
                _try_apply(ps, settings)
                progress = progress or ps.state != before


def on_module_imported(name: str) -> None:
    """Called by the bootstrap when a watched torch module finished importing."""
    _finished.add(name)
    _apply_ready()


def install() -> dict[str, Any]:
    """Activate in this process (idempotent). Returns :func:`status`."""
    from torch_threadsafe_compile import _bootstrap

    settings = _settings()
    if settings.disabled:
        return status()
    with _lock:
        for ps in _load().values():
            if ps.state in ("reverted", "skipped") and not ps.reason.startswith("fixed upstream"):
                ps.state, ps.reason = "pending", ""
    if _bootstrap.mode is None:
        _bootstrap.activate("explicit")
    _apply_ready()
    return status()


def uninstall() -> None:
    """Revert every applied patch, in reverse order, restoring the original objects."""
    from torch_threadsafe_compile import _bootstrap

    with _lock:
        for ps in reversed(list(_load().values())):
            if ps.state == "applied" and ps.changes is not None:
                _undo(ps.changes)
                ps.changes = None
                ps.state, ps.reason = "reverted", "uninstall()"
            elif ps.state == "pending":
                ps.state, ps.reason = "reverted", "uninstall()"
    _bootstrap.deactivate()


def status() -> dict[str, Any]:
    """A structured report; see the README for its fields."""
    from torch_threadsafe_compile import __version__, _bootstrap

    settings = _settings()
    torch_mod = sys.modules.get("torch")
    if settings.disabled:
        activation = "disabled"
    elif _bootstrap.mode is not None:
        activation = _bootstrap.mode
    else:
        activation = "not activated"
    out: dict[str, Any] = {
        "version": __version__,
        "torch": str(getattr(torch_mod, "__version__", None)) if torch_mod is not None else None,
        "python": sys.version.split()[0],
        "activation": activation,
        "inactive_reason": _bootstrap.inactive_reason,
        "patches": [],
    }
    with _lock:
        for ps in _load().values():
            row: dict[str, Any] = {
                "id": ps.spec.id,
                "hazard": ps.spec.hazard,
                "summary": ps.spec.summary,
                "upstream": ps.spec.upstream,
                "torch_versions": ps.spec.torch_versions,
                "state": ps.state if not settings.disabled else "disabled",
                "reason": ps.reason if not settings.disabled else "TTC_DISABLE",
            }
            if ps.state == "pending" and not settings.disabled:
                missing = [m for m in ps.spec.modules if m not in sys.modules]
                row["reason"] = ("waits for import of " + ", ".join(missing)) if missing else "waits for torch"
            if ps.changes is not None:
                replaced = ps.changes.intact()
                if replaced:
                    row["replaced_by_others"] = replaced
            report = getattr(ps.impl, "report", None)
            if ps.state == "applied" and report is not None:
                try:
                    row["stats"] = report()
                except Exception as e:  # a report must not break status()
                    row["stats"] = {"error": repr(e)}
            out["patches"].append(row)
    return out


def state_of(patch_id: str) -> str:
    return _load()[patch_id].state
