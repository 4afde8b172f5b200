"""Interpreter-start activation. Standard library only, and nothing heavy of that.

The ``.pth`` file and ``sitecustomize`` call :func:`activate`. It reads ``TTC_*`` and, unless disabled,
puts a small finder at the front of ``sys.meta_path`` that watches for ``torch`` and the torch
submodules our patches target. Nothing of ours beyond this file, ``_env`` and ``_activation`` is imported
until torch is: a process that never imports torch pays for three tiny modules and one ``os.environ`` read.

When a watched module finishes executing, :func:`_on_import` hands over to ``_lifecycle``, which applies
each patch whose target modules are all loaded. Patches are never applied by importing their targets
early: ``import torch._dynamo`` alone costs about a second, and users who never compile should not pay it.

Invariant: nothing here raises into the interpreter start or into the user's ``import``. A failure is
reported as one line on stderr and the program runs on, unpatched.
"""

from __future__ import annotations

import sys

from torch_threadsafe_compile import _activation

TYPE_CHECKING = False  # `typing` is not worth importing at interpreter start; annotations are strings
if TYPE_CHECKING:
    from typing import Any



def _watched() -> frozenset[str]:
    """The torch modules whose completed import can make a patch ready: the table's (``registry``), read
    when the program first looks for a torch module, so that a process that never imports torch never
    loads the table."""
    try:
        from torch_threadsafe_compile import registry

        return registry.watched_modules()
    except Exception as e:  # never break the user's import of torch
        _activation.warn_once(f"not active ({type(e).__name__}: {e}); torch runs unpatched")
        return frozenset()


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

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._ttc_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
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

    def __init__(self) -> None:
        self.watched: frozenset[str] | None = None  # the table's, once a torch module is looked for

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        watched = self.watched
        if watched is None:
            if name != "torch" and not name.startswith("torch."):
                return None  # before torch: nothing to watch (and the table stays unread)
            watched = self.watched = _watched()  # two threads may both read it: the same set
        if name not in watched:
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
        from torch_threadsafe_compile import _lifecycle

        _lifecycle.on_module_imported(name)
    except Exception as e:  # never break the user's import of torch
        _activation.warn_once(f"not active ({type(e).__name__}: {e}); torch runs unpatched")
    _hide_finder_from_dynamo()


_problems_reported = False


def _report_problems(problems: list[str]) -> None:
    """Bad ``TTC_*`` values: one warning line per process, whoever reads the settings first."""
    global _problems_reported
    if problems and not _problems_reported:
        _problems_reported = True
        _activation.warn_once("; ".join(problems))


def activate(how: str) -> bool:
    """Activate for this process. Returns True when active. Never raises."""
    global _finder
    try:
        if _activation.mode() is not None:  # a .pth listed twice, or .pth plus sitecustomize
            return True
        from torch_threadsafe_compile import _env

        _report_problems(_env.current().problems)
        if not _activation.start(how):  # disabled
            return False
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
        if "torch" in sys.modules:
            # Started after torch was imported (explicit install(), or a sitecustomize imported it):
            # apply what can be applied now; the finder takes care of modules imported later.
            _on_import("torch")
        return True
    except Exception as e:
        _activation.warn_once(f"not activated ({type(e).__name__}: {e})")
        return False


def deactivate() -> None:
    """Remove the import hook (``_lifecycle`` reverts applied patches separately)."""
    global _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
    _finder = None
    _activation.stop()


def activate_start() -> None:
    """Entry point named in ``torch_threadsafe_compile.start`` (PEP 829)."""
    activate("pth")


_finder_hidden = False


def _hide_finder_from_dynamo() -> None:
    """Tell dynamo to run the bootstrap's meta-path finder as it is, never to compile it (once dynamo's
    ``skip_code`` exists; applied whatever the patches' states, as the finder is there whatever they are).

    Why: importlib calls every meta-path finder's ``find_spec`` while it holds the global import lock. When
    the importing frame runs with dynamo's callback set (a frame of a compiled function that dynamo skipped),
    the finder's frame reaches the callback like any user frame; torch skips its own and the standard
    library's frames before taking ``compile_lock``, but not ours, so the callback waited for ``compile_lock``
    while holding the import lock -- and a thread compiling, whose tracing imports (``IMPORT_NAME``), held
    ``compile_lock`` and waited for the import lock: a hang that upstream, without this finder, does not have
    (``ttc_testing.crash_scenarios finder_under_import_lock_deadlock others=drop``; seen as the stall of
    ``dynamo/test_misc.py::test_raises_importerror1`` at 4 threads). Our frame is skipped only: the finders
    it consults for watched names are frames of their own, judged by dynamo as upstream judges them."""
    global _finder_hidden
    if _finder_hidden:
        return
    skip = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
    if skip is None:  # dynamo not imported, or still importing: the next watched import tries again
        return
    try:
        skip(_PostImportFinder.find_spec.__code__)
    except Exception:  # a torch whose skip_code differs: the finder stays as it was
        pass
    _finder_hidden = True
