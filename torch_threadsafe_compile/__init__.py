"""torch-threadsafe-compile: make ``torch.compile`` safe to use from many threads of one process.

Installed with pip, the package activates itself at interpreter start (a ``.pth`` file) and patches torch
lazily, when the torch modules concerned are imported. Programs that cannot rely on that call
:func:`install`. ``TTC_DISABLE=1`` turns everything off. See ``python -m torch_threadsafe_compile doctor``.

This module stays import-light on purpose: the start-up bootstrap lives in the same package, so nothing
here may import torch, wrapt or packaging at module level.
"""

from __future__ import annotations

# `typing` costs ~2.5 ms to import: far more than the whole bootstrap. Annotations here are strings
# (postponed evaluation), so it is only needed by type checkers.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "status", "is_patched", "get_original", "__version__"]


def install() -> dict[str, Any]:
    """Apply every patch that fits this torch, now and for torch modules imported later. Idempotent.

    Covers compiled functions created before the call for the tracing/config patches (H1, H2, H6, H4);
    functions compiled before the call keep upstream behaviour for H3 (see ``first_compile``).
    Does nothing when ``TTC_DISABLE`` is set to a true value. Returns :func:`status`.
    """
    from torch_threadsafe_compile import registry

    return registry.install()


def uninstall() -> None:
    """Revert every applied patch; the original torch objects are restored, identity included."""
    from torch_threadsafe_compile import registry

    registry.uninstall()


def status() -> dict[str, Any]:
    """A structured report: versions, activation mode, and per patch its state and reason.

    ``{"version", "torch", "python", "activation", "inactive_reason", "patches": [{"id", "hazard",
    "summary", "upstream", "torch_versions", "state", "reason", ["stats"], ["replaced_by_others"]}]}``
    where ``state`` is one of ``pending`` (waits for its torch module to be imported), ``applied``,
    ``skipped``, ``failed``, ``reverted``, ``disabled``.
    """
    from torch_threadsafe_compile import registry

    return registry.status()


def is_patched(obj: Any, attr: str) -> bool:
    """Whether ``obj.attr`` is currently replaced by one of our patches."""
    from torch_threadsafe_compile._patching import is_patched as _is

    return _is(obj, attr)


def get_original(obj: Any, attr: str) -> Any:
    """The upstream object behind ``obj.attr`` (itself when not patched)."""
    from torch_threadsafe_compile._patching import get_original as _get

    return _get(obj, attr)
