"""H6 — config set by the program in its main thread reaches every thread again; everything else stays per thread.

From torch 2.12, ``torch.utils._config_module`` keeps each user override in a ``ContextVar``. A new
``threading.Thread`` starts with an empty context, so ``torch._dynamo.config.recompile_limit = 64`` made in
the main thread is not seen by worker threads, nor by autograd engine threads where lazy backward
compiles run: they silently use the defaults (measured on 2.13: main thread 64, new thread 8). Upstream
also keeps assignments per thread *on purpose* (its own test ``test_get_hash_per_thread_isolation``: a
child thread's assignment must not change the main thread's ``get_hash()``).

The rule, which satisfies both:

* an assignment (or ``del``) made in the **main thread** by code outside torch — the program's own
  configuration, a library, ``unittest.mock`` — is a **process-wide default**: every thread without a value
  of its own sees it at once, threads already running and torch's own autograd and compile threads
  included; its aliases (``cache_size_limit`` for ``recompile_limit``) likewise;
* an assignment made in **any other thread** stays in that thread, exactly as upstream;
* ``config.patch(...)`` stays in the thread that entered it, in every thread, and no other thread's
  assignment can reach into it; when it exits, a key the thread had no value of its own for before follows
  the process-wide default again (upstream leaves a copy of the value it saw, which would go stale);
* torch's own save-and-restore assignments and ``_make_closure_patcher`` stay per thread, as upstream.

Inside one thread nothing changes: it reads what it assigned or patched, as upstream; the main thread reads
its own context only, and an assignment inside the main thread's own ``config.patch`` of that key ends with
the patch, as upstream.

How: the first process-wide assignment of a key wraps that entry's ``ContextVar`` in a :class:`_Layered`
variable that answers ``get()`` from the context when the context has a value, else from the process-wide
default; keys never assigned that way keep upstream's plain ``ContextVar``. A process-wide assignment also
gives the module fresh hash and ``_get_dict`` cache variables, so every thread recomputes the config hash
that inductor's cache keys use. Nothing changes a config value by itself: ``verify`` works in a copied
context and restores every object it touched.
"""

from __future__ import annotations

import functools
import sys
import threading
from contextvars import ContextVar, copy_context
from threading import get_ident
from typing import Any

from torch_threadsafe_compile._journal import Changes, run_in_thread
from torch_threadsafe_compile._torch import CONFIG_MODULE, config_entries, config_unset, loaded, reset_config_caches, uses_context_vars
from torch_threadsafe_compile.registry import SPECS

SPEC = SPECS["config_overrides"]

_CONFIG_MODULE_FILE = "_config_module.py"
_PATCH_METHODS = ("__enter__", "__exit__")  # ConfigPatch's, in _config_module.py

# The kind of the outermost config write under way in this thread: an alias assignment writes its target
# through a nested __setattr__, which must count as the same kind.
class _Mode(threading.local):
    kind: str | None = None  # a class default: a thread's first read costs no AttributeError


_mode = _Mode()


class _Layered:
    """A ``ContextVar`` stand-in: the context's value if it has one, else the process-wide default.

    ``set``/``reset`` act on the context exactly as upstream's variable does (they are upstream's variable).
    A value that ``config.patch`` put back on exit for a key the context had no value of its own for is
    not the context's own either (see ``_restored``).
    """

    __slots__ = ("var", "process", "name", "key")

    def __init__(self, var: ContextVar[Any], process: Any, key: tuple[int, str]) -> None:
        self.var = var
        self.process = process
        self.name = var.name
        self.key = key

    def get(self, *default: Any) -> Any:
        value = self.var.get(*default)
        if get_ident() == _MAIN[0]:  # the main thread reads its own context, exactly as upstream
            return value
        if value is _UNSET[0]:
            return self.process
        restored = _restored.get()
        if restored and restored.get(self.key, _ABSENT) is value:
            return self.process
        return value

    def set(self, value: Any) -> Any:
        if value is _UNSET[0] and get_ident() == _MAIN[0]:
            # The main thread resets the key to "not set" (a test's tearDown does it this way): so is the
            # process-wide default it had made.
            self.process = value
        return self.var.set(value)

    def reset(self, token: Any) -> None:
        self.var.reset(token)

    def __repr__(self) -> str:
        return f"<_Layered {self.name!r} process={self.process!r}>"


_UNSET: list[Any] = []  # [_UNSET_SENTINEL], filled by apply()
# The thread whose context holds the process-wide assignments: the main thread. Kept as is in a child
# forked by another thread: the forking thread's context has none of them, so it reads them as any other
# thread does (its own writes there are process-wide: it is the child's main thread, _is_main_thread).
_MAIN = [threading.main_thread().ident]
_ABSENT = object()
# Per context: for each ConfigPatch entry, whether the key had no value of its own in this context before.
_patch_stack: ContextVar[tuple[tuple[int, str, bool], ...]] = ContextVar("ttc_config_patch_stack", default=())
# Per context: {(id(module), key): value} that a ConfigPatch exit put back for a key the context had no value
# of its own for. Upstream's exit leaves that value in the context (kept: same-thread reads, _is_default and
# codegen stay upstream's); a process-wide default of the key shows through it (``_Layered.get``).
_restored: ContextVar[dict[tuple[int, str], Any]] = ContextVar("ttc_config_restored", default={})  # noqa: B039 - never mutated: replaced


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _caller_kind(frame: Any) -> str:
    """"patch" (ConfigPatch.__enter__/__exit__), "torch" (any other torch code) or "program"."""
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_filename.endswith(_CONFIG_MODULE_FILE):
            if code.co_name in _PATCH_METHODS:
                return "patch"
            if code.co_name in ("__setattr__", "__delattr__"):  # SubConfigProxy forwarding: look at its caller
                f = f.f_back
                continue
        name = f.f_globals.get("__name__", "")
        return "torch" if name == "torch" or name.startswith("torch.") else "program"
    return "program"


def _make_process_wide(module: Any, name: str, value: Any) -> None:
    entry = config_entries(module)[name]
    var = entry.user_override
    if isinstance(var, _Layered):
        var.process = value
    elif isinstance(var, ContextVar):
        entry.user_override = _Layered(var, value, (id(module), name))
    else:  # not what check() saw: leave upstream's behaviour alone
        return
    reset_config_caches(module)


def _raw_var(entry: Any) -> ContextVar[Any]:
    var = entry.user_override
    return var.var if isinstance(var, _Layered) else var


def _patched_key(module: Any, name: str, entering: bool) -> None:
    """Bookkeeping of ``config.patch`` around upstream's write of ``name``: a key that had no value of its
    own in this context before the patch has none after it either (``_restored``)."""
    entry = config_entries(module).get(name)
    if entry is None or entry.alias is not None:
        return
    key = id(module)
    if entering:
        had_none = _raw_var(entry).get() is _UNSET[0]
        _patch_stack.set(_patch_stack.get() + ((key, name, had_none),))
        return
    stack = list(_patch_stack.get())
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][:2] == (key, name):
            had_none = stack.pop(i)[2]
            _patch_stack.set(tuple(stack))
            if had_none:
                _restored.set({**_restored.get(), (key, name): _raw_var(entry).get()})
            return


def _own_value(module: Any, name: str) -> None:
    """A write that is the context's own (anything but a ConfigPatch exit) ends a ``_restored`` mark."""
    restored = _restored.get()
    if (id(module), name) in restored:
        _restored.set({k: v for k, v in restored.items() if k != (id(module), name)})


def _write(self: Any, name: str, kind: str, upstream: Any, *args: Any) -> None:
    """Run upstream's ``__setattr__``/``__delattr__`` and apply the rule of the module docstring."""
    config = self.__dict__.get("_config")
    if config is None or name not in config:
        upstream(self, name, *args)
        return
    outer = _mode.kind
    kind = outer or kind
    _mode.kind = kind
    try:
        if kind == "patch-enter":
            _patched_key(self, name, entering=True)
        upstream(self, name, *args)
        if kind == "patch-exit":
            _patched_key(self, name, entering=False)
        else:
            _own_value(self, name)
        if kind == "process" and config[name].alias is None:
            _make_process_wide(self, name, args[0] if args else _UNSET[0])
    finally:
        _mode.kind = outer


def _own_write(frame: Any) -> bool:
    """The common case, told cheaply: a write by a thread other than the main one, from outside
    ``_config_module`` (not a ``config.patch``), with no write of another kind under way in this thread
    (an alias's nested write comes from ``_config_module``, which ``_kind_of_write`` calls local too). It is
    the thread's own, exactly as upstream, and the wrappers run upstream's write at once: time added there
    also widens upstream's own window in which another thread's read fails (``unittest.mock``'s exit deletes
    a key, which ``ConfigModule`` hides from every thread until the exit assigns it again)."""
    return _mode.kind is None and not frame.f_code.co_filename.endswith(_CONFIG_MODULE_FILE) and not _is_main_thread()


def _kind_of_write(frame: Any, module: Any, name: str) -> str:
    caller = _caller_kind(frame)
    if caller == "patch":
        return "patch-enter" if frame.f_code.co_name == "__enter__" else "patch-exit"
    if caller == "program" and _is_main_thread() and not _inside_patch_of(module, name):
        return "process"
    return "local"  # an assignment inside this thread's own patch of the key ends with that patch, as upstream


def _inside_patch_of(module: Any, name: str) -> bool:
    key = (id(module), name)
    return any(entry[:2] == key for entry in _patch_stack.get())


def check() -> str | None:
    cm = loaded(CONFIG_MODULE)
    cls = getattr(cm, "ConfigModule", None)
    if cls is None or "__setattr__" not in cls.__dict__ or "__delattr__" not in cls.__dict__:
        return "ConfigModule.__setattr__/__delattr__ not found"
    if getattr(cm, "_UNSET_SENTINEL", None) is None:
        return "_UNSET_SENTINEL not found"
    if not uses_context_vars():
        return "config overrides are not ContextVars here"
    patch_cls = cls.__dict__.get("patch")
    if patch_cls is None:
        return "ConfigModule.patch not found"
    return None


def apply(changes: Changes) -> dict[str, Any]:
    cls = loaded(CONFIG_MODULE).ConfigModule
    _UNSET[:] = [config_unset()]
    orig_setattr = cls.__dict__["__setattr__"]
    orig_delattr = cls.__dict__["__delattr__"]

    # Plain functions, not wrapt: this patch applies during `import torch`, where importing wrapt would
    # cost ~6 ms; functools.wraps keeps name, docs and __wrapped__.
    @functools.wraps(orig_setattr)
    def __setattr__(self: Any, name: str, value: object) -> None:
        frame = sys._getframe(1)
        if _own_write(frame):
            orig_setattr(self, name, value)
            if _restored.get():
                _own_value(self, name)
            return
        _write(self, name, _kind_of_write(frame, self, name), orig_setattr, value)

    @functools.wraps(orig_delattr)
    def __delattr__(self: Any, name: str) -> None:
        frame = sys._getframe(1)
        if _own_write(frame):
            orig_delattr(self, name)
            if _restored.get():
                _own_value(self, name)
            return
        _write(self, name, _kind_of_write(frame, self, name), orig_delattr)

    changes.setattr(cls, "__setattr__", __setattr__)
    changes.setattr(cls, "__delattr__", __delattr__)
    return {}


def verify() -> None:
    """A process-wide assignment is seen by a new thread; a thread's own value stays its own. Done in a
    copied context on a config module that exists whenever torch is imported, and undone exactly."""
    cfg = sys.modules.get("torch._functorch.config") or sys.modules.get("torch.compiler.config")
    if cfg is None:
        return
    unset = _UNSET[0]
    name = next((k for k, e in config_entries(cfg).items() if isinstance(e.default, bool) and e.alias is None
                 and getattr(e, "env_value_force", unset) is unset and getattr(e, "env_value_default", unset) is unset), None)
    if name is None:
        return
    entry = config_entries(cfg)[name]
    saved = entry.user_override
    flipped = not entry.default
    try:
        copy_context().run(_make_process_wide, cfg, name, flipped)

        def own_value() -> tuple[Any, Any]:
            seen = getattr(cfg, name)  # the process-wide value
            setattr(cfg, name, entry.default)  # not the main thread: stays in this thread
            return seen, getattr(cfg, name)

        seen, own = run_in_thread(own_value)  # two probe threads in all: import torch pays each start
        if seen is not flipped:
            raise AssertionError(f"{cfg.__name__}.{name}: a process-wide value is not seen by a new thread")
        if own is not entry.default or run_in_thread(lambda: getattr(cfg, name)) is not flipped:
            raise AssertionError(f"{cfg.__name__}.{name}: a thread's own value is not its own")
    finally:
        entry.user_override = saved
        reset_config_caches(cfg)
