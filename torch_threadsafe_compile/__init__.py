"""torch-threadsafe-compile: make ``torch.compile`` safe to use from many threads of one process.

Installed with pip, the package activates itself at interpreter start (a ``.pth`` file) and patches torch
lazily, when the torch modules concerned are imported. Programs that cannot rely on that call
:func:`install`. ``TTC_DISABLE=1`` turns everything off. See ``python -m torch_threadsafe_compile doctor``.

This module stays import-light on purpose: the start-up bootstrap lives in the same package, so nothing
here may import torch, wrapt, packaging or ``typing`` at module level.
"""

from __future__ import annotations

from torch_threadsafe_compile._activation import TTCWarning
from torch_threadsafe_compile._package_version import __version__

# `typing` costs ~2.5 ms to import: far more than the whole bootstrap. Annotations here are strings
# (postponed evaluation), so it is only needed by type checkers.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["install", "uninstall", "status", "is_patched", "get_original", "TTCWarning", "__version__"]


def install() -> dict[str, Any]:
    """Apply every patch that fits this torch, now and for torch modules imported later. Idempotent.

    Covers compiled functions created before the call for the tracing/config patches (H1, H2, H6, H4);
    functions compiled before the call keep upstream behaviour for H3 (see ``patches/first_compile``).
    Does nothing when ``TTC_DISABLE`` is set to a true value. Returns :func:`status`.
    """
    from torch_threadsafe_compile import _activation, _bootstrap, _lifecycle, _report

    if _activation.disabled_by() is None:
        _lifecycle.reset_for_install()
        if _bootstrap.activate("explicit"):
            _lifecycle.apply_ready()
    return _report.build()


def uninstall() -> None:
    """Revert every applied patch; the original torch objects are restored, identity included."""
    from torch_threadsafe_compile import _bootstrap, _lifecycle

    _lifecycle.revert_all()
    _bootstrap.deactivate()


def status() -> dict[str, Any]:
    """A structured report: versions, activation mode, and per patch its state and reason.

    ``{"version", "torch", "python", "activation", "inactive_reason", "active", "protection_missing",
    "patches": [{"id", "hazard", "summary", "upstream", "torch_versions", "state", "reason", ["open"], ["stats"],
    ["replaced_by_others"]}]}`` where ``activation`` is ``pth``, ``sitecustomize`` or ``explicit`` while active,
    else ``disabled`` (``TTC_DISABLE``), ``uninstalled`` (:func:`uninstall`) or ``not activated`` (no start-up
    hook ran); ``inactive_reason`` is None exactly when ``active``; ``protection_missing`` lists why hazards of
    this torch stay open (empty while the package is off on purpose); and ``state`` is one of ``pending`` (waits
    for its torch module to be imported), ``applied``, ``skipped``, ``failed``, ``reverted``, ``disabled``
    (switched off by the user).
    """
    from torch_threadsafe_compile import _report

    return _report.build()


def is_patched(obj: Any, attr: str | None = None) -> bool:
    """Whether a patch is in effect.

    ``is_patched("fx_tracing_flag")``: whether that patch (an id of ``status()``) is applied.
    ``is_patched(obj, "attr")``: whether ``obj.attr`` was edited by one of our patches — an attribute
    replaced, a function whose code was swapped (``is_patched(torch.fx._symbolic_trace.Tracer, "trace")``),
    or a module whose attribute reads are redirected (``is_patched(torch.compiler, "_is_compiling_flag")``).
    """
    if attr is None:
        if not isinstance(obj, str):
            raise TypeError("is_patched(patch_id) takes a patch id; for an attribute use is_patched(obj, 'attr')")
        from torch_threadsafe_compile import _lifecycle

        return _lifecycle.snapshot(stats=False).patch(obj).state is _lifecycle.State.APPLIED
    from torch_threadsafe_compile._journal import is_patched as _is

    return _is(obj, attr)


def get_original(obj: Any, attr: str) -> Any:
    """The upstream object behind ``obj.attr`` (itself when not patched); for a function whose code was
    swapped, a copy of the function with its original code."""
    from torch_threadsafe_compile._journal import get_original as _get

    return _get(obj, attr)
