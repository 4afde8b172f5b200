"""Interpreter-start activation. Standard library only, and nothing heavy of that.

The ``.pth`` file and ``sitecustomize`` call :func:`activate`. It reads ``TTC_*`` and, unless disabled,
puts a small finder at the front of ``sys.meta_path`` that watches for ``torch`` and the torch
submodules our patches target. Nothing of ours beyond this file is imported until torch is: a
process that never imports torch pays for one tiny module and one ``os.environ`` read.

When a watched module finishes executing, :func:`_on_import` hands over to the registry, which applies
each patch whose target modules are all loaded. Patches are never applied by importing their targets
early: ``import torch._dynamo`` alone costs about a second, and users who never compile should not pay it.

Invariant: nothing here raises into the interpreter start or into the user's ``import``. A failure is
reported as one line on stderr and the program runs on, unpatched.
"""

from __future__ import annotations

import os
import sys

# How we were activated: "pth", "sitecustomize", "explicit" (install()), or None.
mode: str | None = None
# Why we did not activate, when we did not ("TTC_DISABLE=1", ...).
inactive_reason: str | None = None
# torch modules whose completed import should trigger the registry. Kept here (not derived from the
# registry) so that the bootstrap does not have to import the registry before torch is imported;
# tests/test_registry.py checks that this covers every patch's target modules.
WATCHED = frozenset(
    {
        "torch",
        "torch.fx._symbolic_trace",
        "torch.compiler",
        "torch.utils._config_module",
        "torch._dynamo",
        "torch._dynamo.convert_frame",
        "torch._dynamo.eval_frame",
        "torch.export._trace",
        "torch._functorch.config",
        "torch._higher_order_ops.utils",
        "torch._inductor.config",
    }
)

_warned = False


def warn(msg: str) -> None:
    """The one warning line we allow ourselves at start-up (later ones go to the logger)."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        sys.stderr.write(f"torch-threadsafe-compile: {msg}\n")
    except Exception:  # a closed stderr must not break the user's program
        pass


class _LoaderProxy:
    """Wraps a module's loader to run our hook after the module body executed.

    Everything but ``exec_module`` is delegated, and the module's ``__loader__``/``__spec__.loader`` are
    put back to the real loader afterwards, so ``inspect.getsource`` and importlib.resources see no trace.
    """

    def __init__(self, loader: object, name: str) -> None:
        self._ttc_loader = loader
        self._ttc_name = name

    def __getattr__(self, attr: str) -> object:
        return getattr(self._ttc_loader, attr)

    def create_module(self, spec):  # noqa: ANN001 - importlib protocol
        create = getattr(self._ttc_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:  # noqa: ANN001
        loader = self._ttc_loader
        try:
            loader.exec_module(module)  # type: ignore[attr-defined]
        finally:
            try:
                if getattr(module, "__loader__", None) is self:
                    module.__loader__ = loader
                spec = getattr(module, "__spec__", None)
                if spec is not None and spec.loader is self:
                    spec.loader = loader
            except Exception:
                pass
        # Only reached when the module body ran without raising.
        _on_import(self._ttc_name)


class _PostImportFinder:
    """A meta-path finder that finds nothing itself; it only wraps the loader of watched modules."""

    def __init__(self, watched: frozenset[str]) -> None:
        self.watched = watched

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
        if name not in self.watched:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            try:
                spec = find(name, path, target)
            except Exception:
                continue
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderProxy(spec.loader, name)
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


_finder: _PostImportFinder | None = None


def _on_import(name: str) -> None:
    try:
        from torch_threadsafe_compile import registry

        registry.on_module_imported(name)
    except Exception as e:  # never break the user's import of torch
        warn(f"not active ({type(e).__name__}: {e}); torch runs unpatched")


def activate(how: str) -> bool:
    """Activate for this process. Returns True when active. Never raises."""
    global mode, inactive_reason, _finder
    try:
        if mode is not None:  # a .pth listed twice, or .pth plus sitecustomize
            return True
        from torch_threadsafe_compile._env import read_settings

        settings = read_settings()
        if settings.problems:
            warn("; ".join(settings.problems))
        if settings.disabled:
            inactive_reason = "TTC_DISABLE=" + os.environ.get("TTC_DISABLE", "")
            return False
        mode = how
        _finder = _PostImportFinder(WATCHED)
        sys.meta_path.insert(0, _finder)
        if "torch" in sys.modules:
            # Started after torch was imported (explicit install(), or a sitecustomize imported it):
            # apply what can be applied now; the finder takes care of modules imported later.
            _on_import("torch")
        return True
    except Exception as e:
        warn(f"not activated ({type(e).__name__}: {e})")
        return False


def deactivate() -> None:
    """Remove the import hook (the registry reverts applied patches separately)."""
    global mode, _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
    _finder = None
    mode = None


def activate_start() -> None:
    """Entry point named in ``torch_threadsafe_compile.start`` (PEP 829)."""
    activate("pth")
