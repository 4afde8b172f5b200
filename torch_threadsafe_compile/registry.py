"""The patch registry: which patches exist, in which order, and what each declares about itself.

It holds specs, not logic (OpenTelemetry-instrumentor style). Each patch lives in its own module under
``torch_threadsafe_compile/patches/``, named after what it fixes, and provides:

* ``SPEC``: a :class:`PatchSpec` (hazard id, the torch versions it covers, the upstream issue, the torch
  modules it needs, the patches it must follow);
* ``check()``: why its target does not look as expected on this torch, or None;
* ``apply(changes)``: every edit through the :class:`~torch_threadsafe_compile._patching.Changes` journal,
  so that revert is exact;
* ``verify()``: raises if the patch does not work (then everything it did is reverted);
* optionally ``report()``: statistics for ``status()``.

When each one runs is decided by :mod:`torch_threadsafe_compile._lifecycle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    from torch_threadsafe_compile._patching import Changes

__all__ = ["PatchSpec", "Patch", "PATCH_MODULES"]

# Explicit order (gevent.monkey style): a patch may only rely on the ones before it. The tracing flags come
# before the compile gate, whose verification reads them; the compile-lock instrumentation comes before
# everything that takes the lock.
PATCH_MODULES: tuple[str, ...] = (
    "fx_tracing_flag",  # H1
    "fx_patcher",  # H7
    "compile_session_flag",  # H2
    "export_flag",  # H7
    "config_overrides",  # H6
    "dynamic_flags",  # H5
    "compile_import_lock",  # H7
    "compile_lock_watchdog",  # H4 (detector)
    "export_lock",  # H7
    "export_serial",  # H7
    "lazy_backward",  # H4
    "cuda_device_guard",  # H3 (crash)
    "guard_invalidation",  # H8 (crash)
    "code_reset",  # H9 (crash)
    "first_compile",  # H3
    "cudagraph_trees_per_thread",  # H7
    "cudagraph_rng",  # H7
)


@dataclass(frozen=True)
class PatchSpec:
    """What a patch declares about itself. See any module in ``patches/`` for an example."""

    id: str  # equal to the module name
    hazard: str  # H1 ... H9 (docs/hazards.md)
    summary: str
    upstream: str  # the upstream issue / PR behind the hazard
    torch_versions: str  # a packaging specifier set, e.g. ">=2.4,<2.14"
    modules: tuple[str, ...]  # torch modules that must have been imported before it can apply
    fixed_in: str | None = None  # first torch release where upstream fixed the hazard
    after: tuple[str, ...] = ()  # patches that must be settled (applied or skipped) first
    # Patches whose changes it picks up at call time when they are applied, in any order (no waiting):
    # the contracts between patches that no import shows (tests/test_registry.py checks they exist).
    uses: tuple[str, ...] = ()


class Patch(Protocol):
    """The shape of a patch module (modules satisfy protocols structurally)."""

    SPEC: PatchSpec

    def check(self) -> str | None: ...

    def apply(self, changes: Changes) -> Mapping[str, Any] | None: ...

    def verify(self) -> None: ...


def watched_modules(specs: list[PatchSpec]) -> frozenset[str]:
    """Every torch module whose completed import can make a patch ready (what the bootstrap must watch)."""
    return frozenset({"torch", *(m for s in specs for m in s.modules)})
