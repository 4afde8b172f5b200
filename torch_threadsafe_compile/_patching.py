"""Low-level, reversible edits of live objects, with the originals kept (gevent.monkey style).

Every change a patch makes goes through a :class:`Changes` journal, so that ``revert`` undoes exactly
what was done, in reverse order, restoring object identity; and so that ``is_patched``/``get_original``
and ``doctor`` can answer questions about any patched attribute.

Three kinds of edit:

* ``setattr`` of an attribute (functions on classes, module attributes);
* swapping a function's ``__code__`` — the function *object* stays the same, so references captured
  before we ran (closures made by ``torch.compile()``, ``from x import f``, dicts keyed by the function)
  all see the new behaviour;
* swapping a module's ``__class__`` for a subclass with properties, so that ``module.flag`` reads and
  writes from other modules can be redirected to thread-local storage.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import marshal
import os
import sys
import textwrap
import threading
import types
from typing import Any, Callable

_MISSING = object()

# (id(obj), attr) -> (obj, attr, original, replacement, patch_id); for is_patched()/get_original().
_journal_index: dict[tuple[int, str], tuple[Any, str, Any, Any, str]] = {}


class TargetMismatch(Exception):
    """A patch target does not look as expected: the patch is skipped with this reason, never guessed."""


class Changes:
    """The journal of one patch's edits."""

    def __init__(self, patch_id: str) -> None:
        self.patch_id = patch_id
        self._undo: list[Callable[[], None]] = []
        self._checks: list[tuple[str, Callable[[], bool]]] = []

    # -- edits -------------------------------------------------------------------------------
    def setattr(self, obj: Any, attr: str, new: Any) -> Any:
        """``setattr(obj, attr, new)``; returns the original. Reads the raw value (no descriptor binding)."""
        d = getattr(obj, "__dict__", {})
        original = d[attr] if attr in d else getattr(obj, attr, _MISSING)
        setattr(obj, attr, new)
        key = (id(obj), attr)
        _journal_index[key] = (obj, attr, original, new, self.patch_id)

        def undo() -> None:
            current = _raw_get(obj, attr)
            if current is not new:
                # Somebody re-wrapped or replaced our object since (e.g. dynamo wraps functions with
                # `disable`). Putting our original back would silently drop their change: leave it.
                _journal_index.pop(key, None)
                raise TargetMismatch(f"{_name(obj)}.{attr} was replaced by another patcher; left in place")
            if original is _MISSING:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, original)
            _journal_index.pop(key, None)

        self._undo.append(undo)
        self._checks.append((f"{_name(obj)}.{attr}", lambda: _raw_get(obj, attr) is new))
        return original

    def wrap(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> Any:
        """Replace ``owner.attr`` by a ``wrapt.FunctionWrapper`` calling ``wrapper(wrapped, instance, args, kwargs)``.

        wrapt keeps the wrapper transparent (name, signature, ``__wrapped__``, ``inspect``, descriptor binding),
        which matters for methods that other libraries introspect. Not for hot paths that inspect frames.
        """
        import wrapt

        original = _raw_get(owner, attr)
        if original is _MISSING:
            raise TargetMismatch(f"{_name(owner)}.{attr} not found")
        proxy = wrapt.FunctionWrapper(original, wrapper)
        self.setattr(owner, attr, proxy)
        return proxy

    def swap_code(self, func: types.FunctionType, new_code: types.CodeType) -> None:
        if func.__code__.co_freevars != new_code.co_freevars:
            raise TargetMismatch(f"{func.__qualname__}: closure variables differ, cannot swap its code")
        original = func.__code__
        func.__code__ = new_code
        key = (id(func), "__code__")
        _journal_index[key] = (func, "__code__", original, new_code, self.patch_id)

        def undo() -> None:
            func.__code__ = original
            _journal_index.pop(key, None)

        self._undo.append(undo)
        self._checks.append((f"{func.__module__}.{func.__qualname__}.__code__", lambda: func.__code__ is new_code))

    def swap_module_class(self, module: types.ModuleType, properties: dict[str, property]) -> None:
        """Give ``module`` a subclass of its current class carrying ``properties``."""
        base = type(module)
        cls = type(base.__name__, (base,), dict(properties, __ttc_patch__=self.patch_id))
        module.__class__ = cls

        def undo() -> None:
            if type(module) is cls:
                module.__class__ = base
            else:  # somebody swapped it again on top of us: splice ourselves out of the chain
                k = type(module)
                while k is not None and k.__bases__ and k.__bases__[0] is not cls:
                    k = k.__bases__[0] if k.__bases__[0] is not object else None
                if k is not None and k.__bases__ and k.__bases__[0] is cls:
                    k.__bases__ = (base,) + k.__bases__[1:]

        self._undo.append(undo)
        self._checks.append((f"{module.__name__}.__class__", lambda: isinstance(module, cls)))

    def inject(self, module: types.ModuleType, name: str, value: Any) -> None:
        """Add a private global to ``module`` (e.g. the thread-local object that rewritten code reads)."""
        if name in module.__dict__:
            raise TargetMismatch(f"{module.__name__}.{name} already exists")
        module.__dict__[name] = value
        self._undo.append(lambda: module.__dict__.pop(name, None))

    def on_revert(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    # -- bookkeeping --------------------------------------------------------------------------
    def revert(self) -> None:
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as e:  # keep going: undo as much as we can
                errors.append(e)
        self._checks.clear()
        if errors:
            raise errors[0]

    def intact(self) -> list[str]:
        """Names of edits that somebody else has since replaced (re-wrapped, unwrapped, reassigned)."""
        return [name for name, ok in self._checks if not ok()]


def _raw_get(obj: Any, attr: str) -> Any:
    d = getattr(obj, "__dict__", {})
    return d[attr] if attr in d else getattr(obj, attr, _MISSING)


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def is_patched(obj: Any, attr: str) -> bool:
    return (id(obj), attr) in _journal_index


def get_original(obj: Any, attr: str) -> Any:
    """The object that was there before a patch replaced ``obj.attr`` (``obj.attr`` itself if unpatched)."""
    entry = _journal_index.get((id(obj), attr))
    if entry is None:
        return _raw_get(obj, attr)
    return entry[2]


# -- thread-local module globals ------------------------------------------------------------------


def make_thread_local(default: Any) -> threading.local:
    """A ``threading.local`` whose ``value`` is ``default`` in every thread until that thread sets it."""
    cls = type("ThreadLocalFlag", (threading.local,), {"value": default})
    return cls()


class _RenameGlobal(ast.NodeTransformer):
    """Rewrite every use of global ``name`` into ``tls_name.value``; drop ``global name``."""

    def __init__(self, name: str, tls_name: str) -> None:
        self.name = name
        self.tls_name = tls_name
        self.hits = 0

    def visit_Global(self, node: ast.Global) -> ast.AST:
        names = [n for n in node.names if n != self.name]
        if len(names) == len(node.names):
            return node
        self.hits += 1
        return ast.Global(names=names) if names else ast.Pass()

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id != self.name:
            return node
        self.hits += 1
        return ast.copy_location(
            ast.Attribute(value=ast.Name(id=self.tls_name, ctx=ast.Load()), attr="value", ctx=node.ctx), node
        )


def _cache_dir() -> str | None:
    base = os.environ.get("TTC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "torch_threadsafe_compile"
    )
    return base if base and base != "0" else None


def rewrite_global_reads(func: types.FunctionType, name: str, tls_name: str) -> types.CodeType:
    """:func:`_rewrite_global_reads`, cached on disk.

    Reading, parsing and compiling ``Tracer.trace`` takes ~15 ms at every ``import torch``; its result only
    depends on the original code object, so it is kept (marshal) under ``~/.cache/torch_threadsafe_compile``
    (``TTC_CACHE_DIR``; ``TTC_CACHE_DIR=0`` turns the cache off) keyed by a hash of that code object, the
    rewrite and the Python version. A cache that cannot be read or written is simply not used.
    """
    from torch_threadsafe_compile import __version__

    try:
        key = hashlib.sha256(
            marshal.dumps(func.__code__) + f"|{name}|{tls_name}|{sys.version}|{__version__}".encode()
        ).hexdigest()[:32]
    except ValueError:  # an unmarshallable constant: no cache
        return _rewrite_global_reads(func, name, tls_name)
    directory = _cache_dir()
    path = os.path.join(directory, f"{func.__name__}-{key}.code") if directory else None
    if path is not None:
        try:
            with open(path, "rb") as fh:
                code = marshal.load(fh)
            if isinstance(code, types.CodeType) and code.co_freevars == func.__code__.co_freevars:
                return code
        except (OSError, EOFError, ValueError, TypeError):
            pass
    code = _rewrite_global_reads(func, name, tls_name)
    if path is not None:
        try:
            os.makedirs(directory, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                marshal.dump(code, fh)
            os.replace(tmp, path)
        except OSError:
            pass
    return code


def _rewrite_global_reads(func: types.FunctionType, name: str, tls_name: str) -> types.CodeType:
    """Compile a copy of ``func`` in which global ``name`` is replaced by ``<tls_name>.value``.

    The copy is compiled from ``func``'s own source, in its module's namespace and file/line numbers, so
    tracebacks still point at the upstream lines. Raises :class:`TargetMismatch` when the source cannot
    be read or does not mention ``name`` (upstream changed shape: skip rather than guess).
    """
    try:
        src = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError) as e:
        raise TargetMismatch(f"cannot read the source of {func.__qualname__}: {e}") from e
    tree = ast.parse(src)
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or fdef.name != func.__name__:
        raise TargetMismatch(f"unexpected source shape for {func.__qualname__}")
    fdef.decorator_list = []
    # Annotations may name TYPE_CHECKING-only imports; they are not needed on the code object.
    fdef.returns = None
    for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs:
        a.annotation = None
    for a in (fdef.args.vararg, fdef.args.kwarg):
        if a is not None:
            a.annotation = None
    mangled = {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(fdef)
        if isinstance(n, (ast.Attribute, ast.Name))
        and (n.attr if isinstance(n, ast.Attribute) else n.id).startswith("__")
        and not (n.attr if isinstance(n, ast.Attribute) else n.id).endswith("__")
    }
    if mangled or "super" in {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)}:
        # Compiled outside its class, the copy would lose name mangling / the __class__ cell.
        raise TargetMismatch(f"{func.__qualname__} uses {sorted(mangled) or ['super()']}: cannot be recompiled")
    renamer = _RenameGlobal(name, tls_name)
    renamer.visit(fdef)
    if not renamer.hits:
        raise TargetMismatch(f"{func.__module__}.{func.__qualname__} no longer uses {name}")
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, func.__code__.co_firstlineno - 1)
    code = compile(tree, func.__code__.co_filename, "exec", dont_inherit=True)
    ns: dict[str, Any] = {}
    exec(code, func.__globals__, ns)
    new = ns[func.__name__].__code__
    return new.replace(co_name=func.__code__.co_name, co_qualname=func.__code__.co_qualname) if hasattr(
        new, "co_qualname"
    ) else new.replace(co_name=func.__code__.co_name)


def thread_local_global(
    changes: Changes,
    module: types.ModuleType,
    name: str,
    functions: list[types.FunctionType],
) -> threading.local:
    """Make module global ``name`` per-thread.

    * readers/writers inside ``module`` (``functions``) get their code rewritten to use the thread-local;
    * ``module.name`` reads and writes from anywhere else go through a property on the module's class;
    * every thread starts from the value the global has now (normally the upstream default).
    """
    if name not in module.__dict__:
        raise TargetMismatch(f"{module.__name__}.{name} does not exist")
    tls = make_thread_local(module.__dict__[name])
    tls_name = f"_ttc_tls_{name.strip('_')}"
    new_codes = [(f, rewrite_global_reads(f, name, tls_name)) for f in functions]  # all or nothing
    changes.inject(module, tls_name, tls)

    def fget(_mod: types.ModuleType, _tls: threading.local = tls) -> Any:
        return _tls.value

    def fset(_mod: types.ModuleType, value: Any, _tls: threading.local = tls) -> None:
        _tls.value = value

    changes.swap_module_class(module, {name: property(fget, fset, doc=f"per-thread {name} (torch-threadsafe-compile)")})
    for f, code in new_codes:
        changes.swap_code(f, code)
    return tls


def run_in_thread(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn`` in a fresh thread and return its result (used by patches' verify steps)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            box.append((False, e))

    t = threading.Thread(target=target, name="ttc-verify", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise RuntimeError("verification thread did not finish")
    ok, value = box[0]
    if not ok:
        raise value
    return value
