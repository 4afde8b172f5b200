"""H6 — config assignments made by the program reach every thread again.

From torch 2.12, ``torch.utils._config_module`` keeps each user override in a ``ContextVar``. A new
``threading.Thread`` starts with an empty context, so ``torch._dynamo.config.recompile_limit = 64`` made in
the main thread is not seen by worker threads, nor by autograd engine threads where lazy backward
compiles run: they silently use the defaults (measured on 2.13: main thread 64, new thread 8).

Semantics after this patch (the same as torch ≤ 2.11 for assignments, and as upstream for ``patch``):

* an assignment ``config.name = value`` (or ``del config.name``) made by code *outside* torch — the user's
  program, a library, ``unittest.mock`` — is process-wide: every thread, including threads already
  running and threads started later, sees it at once;
* ``config.patch(...)``, ``_make_closure_patcher`` and torch's own save-and-restore assignments (for example
  in ``_set_compilation_env``) stay local to the calling thread/context, so one thread's patch never
  leaks into another thread's compile (pytorch#118260);
* a patch active in a thread shadows the process-wide value there; an assignment of the same key made
  elsewhere while that patch is active takes effect in that thread too (the patch of that key ends early).

How: a process-wide assignment replaces the entry's ``ContextVar`` with a fresh one whose *default* is the
new value, so no context has a stale local value; the module's per-context hash and ``_get_dict`` caches
are replaced the same way, so every thread recomputes config hashes (used in inductor cache keys).
"""

from __future__ import annotations

import functools
import sys
from contextvars import ContextVar
from typing import Any

from torch_threadsafe_compile._patching import Changes, run_in_thread
from torch_threadsafe_compile.registry import PatchSpec

SPEC = PatchSpec(
    id="config_overrides",
    hazard="H6",
    summary="config assignments apply to every thread (config.patch stays thread-local)",
    upstream="pytorch/pytorch#118260 (config patching across threads); ContextVar overrides since 2.12",
    torch_versions=">=2.12",
    modules=("torch.utils._config_module",),
    tested="2.12.1, 2.13.0, 2.14.1, 2.15.0",
)

# Per-module cache ContextVars and their defaults (set in install_config_module).
CACHE_VARS = {
    "_hash_dirty_var": True,
    "_hash_cache_var": None,
    "_get_dict_dirty_keys_var": None,
    "_get_dict_cache_var": None,
}
_CONFIG_MODULE_FILE = "_config_module.py"
_WRAPPERS = frozenset({"global_setattr", "global_delattr"})


def _cm() -> Any:
    return sys.modules["torch.utils._config_module"]


def _from_outside_torch() -> bool:
    """True when the assignment comes from code outside the torch package.

    Frames of ``_config_module`` itself are skipped only for the attribute forwarding of ``SubConfigProxy``
    (``config.triton.cudagraphs = True``), which belongs to its caller; ``ConfigPatch`` frames count as torch.
    """
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        mod = f.f_globals.get("__name__", "")
        # Skip our own wrappers ...
        if mod == __name__ and code.co_name in _WRAPPERS:
            f = f.f_back
            continue
        # ... and SubConfigProxy's forwarding, whose caller is the one that assigned.
        if code.co_filename.endswith(_CONFIG_MODULE_FILE) and code.co_name in ("__setattr__", "__delattr__"):
            f = f.f_back
            continue
        name = f.f_globals.get("__name__", "")
        return not (name == "torch" or name.startswith("torch."))
    return True


def check() -> str | None:
    cm = _cm()
    cls = getattr(cm, "ConfigModule", None)
    if cls is None or "__setattr__" not in cls.__dict__ or "__delattr__" not in cls.__dict__:
        return "ConfigModule.__setattr__/__delattr__ not found"
    entry_cls = getattr(cm, "_ConfigEntry", None)
    if entry_cls is None:
        return "_ConfigEntry not found"
    ann = getattr(entry_cls, "__annotations__", {})
    if "user_override" not in ann:
        return "_ConfigEntry.user_override not found"
    if getattr(cm, "_UNSET_SENTINEL", None) is None:
        return "_UNSET_SENTINEL not found"
    return None


def make_global(module: Any, name: str, value: Any) -> None:
    entry = module._config[name]
    var = entry.user_override
    if not isinstance(var, ContextVar):
        raise TypeError(f"{module.__name__}.{name}: user_override is {type(var).__name__}, not a ContextVar")
    entry.user_override = ContextVar(var.name, default=value)
    reset_config_caches(module)


def reset_config_caches(module: Any) -> None:
    """Invalidate a config module's hash and ``_get_dict`` caches in every thread."""
    for attr, default in CACHE_VARS.items():
        old = module.__dict__.get(attr)
        if isinstance(old, ContextVar):  # 2.12+: one cache per context; a fresh variable resets them all
            module.__dict__[attr] = ContextVar(old.name, default=default)
    if "_is_dirty" in module.__dict__:  # <= 2.11: one process-wide cache
        module.__dict__["_is_dirty"] = True


def apply(changes: Changes) -> dict[str, Any]:
    cm = _cm()
    cls = cm.ConfigModule
    unset = cm._UNSET_SENTINEL

    orig_setattr = cls.__dict__["__setattr__"]
    orig_delattr = cls.__dict__["__delattr__"]

    # Plain functions, not wrapt: this patch applies during `import torch`, where importing wrapt would
    # cost ~6 ms; functools.wraps keeps name, docs and __wrapped__.
    @functools.wraps(orig_setattr)
    def global_setattr(self: Any, name: str, value: object) -> None:
        orig_setattr(self, name, value)
        config = self.__dict__.get("_config")
        if (
            config is not None
            and name in config
            and name not in getattr(type(self), "_bypass_keys", ())
            and config[name].alias is None
            and _from_outside_torch()
        ):
            make_global(self, name, value)

    @functools.wraps(orig_delattr)
    def global_delattr(self: Any, name: str) -> None:
        orig_delattr(self, name)
        config = self.__dict__.get("_config")
        if config is not None and name in config and _from_outside_torch():
            make_global(self, name, unset)

    changes.setattr(cls, "__setattr__", global_setattr)
    changes.setattr(cls, "__delattr__", global_delattr)
    return {}


def verify() -> None:
    # A config module that exists whenever torch is imported.
    cfg = sys.modules.get("torch.compiler.config") or sys.modules.get("torch._functorch.config")
    if cfg is None or not getattr(cfg, "_config", None):
        return  # nothing to exercise without importing more of torch
    name = next(
        (k for k, e in cfg._config.items() if isinstance(e.default, bool) and e.alias is None
         and getattr(e, "env_value_force", None) is _cm()._UNSET_SENTINEL), None
    )
    if name is None:
        return
    entry = cfg._config[name]
    saved = entry.user_override
    try:
        setattr(cfg, name, not entry.default)
        if run_in_thread(lambda: getattr(cfg, name)) != (not entry.default):
            raise AssertionError(f"{cfg.__name__}.{name} assignment not seen by a new thread")
    finally:
        entry.user_override = saved
        reset_config_caches(cfg)
