"""Rewriting torch's functions from torch's own source, and routing calls through trampolines.

:func:`rewrite_function` compiles a function's definition, passed through an AST transformer, from its
module's file, and only after proving that the unchanged source compiles to the very code that is
running: nothing is cached on disk, so nothing read back from disk is ever executed.
:func:`thread_local_global` uses it to make one module global per-thread (a :class:`ThreadFlag`);
:func:`route_through` gives a function too large to rewrite a same-signature trampoline instead.
Every resulting edit is recorded in the caller's :class:`~torch_threadsafe_compile._journal.Changes`.
"""

from __future__ import annotations
import __future__

import ast
import os
import textwrap
import threading
import types
import weakref
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe
from torch_threadsafe_compile._journal import Changes, SourceUnavailable, TargetMismatch

_MISSING_DEFAULT: Any = object()


def make_thread_local(default: Any) -> threading.local:
    """A ``threading.local`` whose ``value`` is ``default`` in every thread until that thread sets it."""
    cls = type("ThreadLocalFlag", (threading.local,), {"value": default, "_ttc_injected": True})
    tls: threading.local = cls()
    return tls


_flags: weakref.WeakSet[ThreadFlag] = weakref.WeakSet()


class ThreadFlag:
    """A module global made per-thread, as cheap to read as the global while no thread has it set.

    ``local.value`` is the calling thread's value (a ``threading.local``); the module global ``<name>_n``
    counts the threads whose value is not ``default``. Rewritten readers read
    ``(<name>_local.value if <name>_n else <default>)``: while no thread has the flag set (a warm compiled
    call while nothing compiles, traces or exports) that is one module-global read, as upstream's; reading
    the thread-local costs about 25 ns more, and a warm call reads such flags five times. Every write goes
    through :attr:`value`'s setter, which counts the thread in *before* its value leaves the default and
    out *after* it is back, so a thread whose own value is set always finds the count non-zero.
    """

    _ttc_injected = True  # a lingering object of ours that a later inject may replace

    def __init__(self, default: Any, namespace: dict[str, Any], count_name: str) -> None:
        self.default = default
        self.local = make_thread_local(default)
        self._ns = namespace
        self._count_name = count_name
        self._lock = threading.Lock()
        _flags.add(self)

    @property
    def value(self) -> Any:
        return self.local.value

    @value.setter
    def value(self, new: Any) -> None:
        local, default = self.local, self.default
        was, now = local.value is not default, new is not default
        if now and not was:
            self._count(1)
            local.value = new
        elif was and not now:
            local.value = new
            self._count(-1)
        else:
            local.value = new

    def _count(self, k: int) -> None:
        with self._lock:
            self._ns[self._count_name] = self._ns.get(self._count_name, 0) + k

    def after_fork(self) -> None:
        """In a forked child only the forking thread exists: count it alone."""
        self._lock = threading.Lock()
        self._ns[self._count_name] = int(self.local.value is not self.default)


@_forksafe.in_child
def _flags_after_fork() -> None:
    for flag in list(_flags):
        flag.after_fork()


class _RenameGlobal(ast.NodeTransformer):
    """Rewrite every use of global ``name``: reads into ``(<tls>_local.value if <tls>_n else <default>)``,
    writes into ``<tls>.value = ...`` (the :class:`ThreadFlag`'s counting setter); drop ``global name``."""

    def __init__(self, name: str, tls_name: str, default: Any = None) -> None:
        self.name = name
        self.tls_name = tls_name
        self.default = default
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
        if not isinstance(node.ctx, ast.Load):
            return ast.copy_location(
                ast.Attribute(value=ast.Name(id=self.tls_name, ctx=ast.Load()), attr="value", ctx=node.ctx), node
            )
        local = ast.Attribute(value=ast.Name(id=f"{self.tls_name}_local", ctx=ast.Load()), attr="value", ctx=ast.Load())
        fast = ast.IfExp(test=ast.Name(id=f"{self.tls_name}_n", ctx=ast.Load()), body=local,
                         orelse=ast.Constant(value=self.default))
        return ast.copy_location(fast, node)


# The last few source files read, with the (mtime, size) they were read at: several rewritten functions
# share a file (``torch/fx/_symbolic_trace.py``), read once per ``import torch`` instead of once each. A
# file changed since is read again; what is read is proved against the running code either way.
_LINES_CACHED = 2
_lines: dict[str, tuple[tuple[int, int], list[str]]] = {}
_lines_lock = threading.Lock()


@_forksafe.in_child
def _lines_after_fork() -> None:
    global _lines_lock
    _lines_lock = threading.Lock()  # a thread of the parent may have held it (a patch applied in a thread)


def _file_lines(filename: str) -> list[str]:
    st = os.stat(filename)
    stamp = (st.st_mtime_ns, st.st_size)
    with _lines_lock:
        hit = _lines.get(filename)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    with open(filename, encoding="utf-8") as fh:
        lines = fh.read().splitlines(True)
    with _lines_lock:
        _lines.pop(filename, None)
        while len(_lines) >= _LINES_CACHED:
            _lines.pop(next(iter(_lines)))
        _lines[filename] = (stamp, lines)
    return lines


def _function_source(code: types.CodeType) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The definition of ``code`` parsed from its file (the lines its code object spans; no ``inspect``)."""
    try:
        lines = _file_lines(code.co_filename)[code.co_firstlineno - 1 :]
    except OSError as e:
        raise SourceUnavailable(f"cannot read torch's source of {code.co_name} ({type(e).__name__}: {e})") from e
    positions = getattr(code, "co_positions", None)
    if positions is not None:  # 3.11+: the last line any instruction spans ends the definition
        last = max((end for _, end, _, _ in positions() if end is not None), default=code.co_firstlineno)
        lines = lines[: last - code.co_firstlineno + 1]
    else:  # 3.10: the indented block that starts there
        import inspect

        lines = inspect.getblock(lines)
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError as e:
        raise TargetMismatch(f"the source of {code.co_name} does not parse on its own: {e}") from e
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) or fdef.name != code.co_name:
        raise TargetMismatch(f"unexpected source shape for {code.co_name}")
    fdef.decorator_list = []
    ast.increment_lineno(fdef, code.co_firstlineno - 1)  # line 1 of the slice is co_firstlineno of the file
    # Annotations may name TYPE_CHECKING-only imports; they are not part of the code object.
    fdef.returns = None
    for a in fdef.args.posonlyargs + fdef.args.args + fdef.args.kwonlyargs + [fdef.args.vararg, fdef.args.kwarg]:
        if a is not None:
            a.annotation = None
    return fdef


_FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    _FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag


def _compile_def(
    fdef: ast.FunctionDef | ast.AsyncFunctionDef, like: types.CodeType, imported: frozenset[str] = frozenset()
) -> types.CodeType:
    """Compile a single function definition and return its code object (no ``exec``: the code is dug
    out of the module code's constants), named and placed like ``like``.

    ``imported``: global names the function's module binds by ``import``. CPython (3.11+) compiles
    ``name.attr(...)`` differently when ``name`` is import-bound at module level, so they are declared by
    import statements in front of the definition (never executed: only the code object is used).
    """
    prelude: list[ast.stmt] = [ast.Import(names=[ast.alias(name="__future__", asname=n)]) for n in sorted(imported)]
    module = ast.Module(body=[*prelude, fdef], type_ignores=[])
    ast.fix_missing_locations(module)
    # The module's own ``from __future__`` features (``annotations`` changes the bytecode of nested defs).
    top = compile(module, like.co_filename, "exec", flags=like.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    code = next(c for c in top.co_consts if isinstance(c, types.CodeType))
    if hasattr(like, "co_qualname"):
        return code.replace(**{"co_name": like.co_name, "co_qualname": like.co_qualname})  # 3.11+
    return code.replace(co_name=like.co_name)


def _call_bases(fdef: ast.AST) -> set[str]:
    """Names used as ``name.attr(...)`` in a definition (where import-bound names compile differently)."""
    return {
        n.func.value.id
        for n in ast.walk(fdef)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
    }


def _module_imports(filename: str) -> frozenset[str]:
    """Every name bound by an ``import`` statement at module level in ``filename`` (the slow, exact way)."""
    with open(filename, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    names: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))  # module scope goes on inside if/try/with blocks
    return frozenset(names)


def _recompile_verified(fdef: ast.FunctionDef | ast.AsyncFunctionDef, func: types.FunctionType) -> frozenset[str]:
    """Prove that ``fdef`` compiles to ``func``'s running code; returns the import-bound names that takes.

    First guess: the names used as ``name.attr(...)`` whose global is a module (``import torch``); if that
    does not reproduce the code, the module's import statements are read exactly (a parse of its file).
    """
    code = func.__code__
    bases = _call_bases(fdef)
    guess = frozenset(n for n in bases if isinstance(func.__globals__.get(n), types.ModuleType))
    if _same_code(_compile_def(fdef, code, guess), code):
        return guess
    exact = _module_imports(code.co_filename) & bases
    if exact != guess and _same_code(_compile_def(fdef, code, exact), code):
        return exact
    raise TargetMismatch(f"the source of {func.__module__}.{code.co_name} on disk is not the code that is running")


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Same bytecode, names and constants (nested code objects compared the same way; positions ignored)."""
    if a.co_code != b.co_code or a.co_names != b.co_names or a.co_varnames != b.co_varnames:
        return False
    if a.co_freevars != b.co_freevars or len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def rewrite_function(func: types.FunctionType, transformer: ast.NodeTransformer, what: str) -> types.CodeType:
    """A code object for ``func`` with its definition passed through ``transformer``.

    Compiled from ``func``'s own source, in its module's file and line numbers (tracebacks still point at
    the upstream lines). The source is used only after proving that it is what is running: compiled
    unchanged, it must give the very bytecode, names and constants of ``func.__code__``; otherwise (a torch
    file edited in place, a build without sources) the patch is skipped with the reason. Costs well under a
    millisecond for the small functions it is mostly used on, which is why nothing is cached.
    ``transformer.hits`` must count what it changed (0: ``TargetMismatch``, the target no longer has ``what``).
    """
    code = func.__code__
    fdef = _function_source(code)
    mangled = {
        n.attr if isinstance(n, ast.Attribute) else n.id
        for n in ast.walk(fdef)
        if isinstance(n, (ast.Attribute, ast.Name))
        and (n.attr if isinstance(n, ast.Attribute) else n.id).startswith("__")
        and not (n.attr if isinstance(n, ast.Attribute) else n.id).endswith("__")
    }
    if mangled or "super" in {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)}:
        # Compiled outside its class, the copy would lose name mangling / the __class__ cell.
        raise TargetMismatch(f"{code.co_name} uses {sorted(mangled) or ['super()']}: cannot be recompiled")
    imported = _recompile_verified(fdef, func)
    transformer.visit(fdef)
    if not getattr(transformer, "hits", 0):
        raise TargetMismatch(f"{func.__module__}.{code.co_name} no longer has {what}")
    return _compile_def(fdef, code, imported)


def rewrite_global(func: types.FunctionType, name: str, tls_name: str, default: Any = None) -> types.CodeType:
    """A code object for ``func`` in which global ``name`` is the :class:`ThreadFlag` at ``tls_name``."""
    return rewrite_function(func, _RenameGlobal(name, tls_name, default), f"the global {name}")


def thread_local_global(
    changes: Changes,
    module: types.ModuleType,
    name: str,
    functions: list[types.FunctionType],
    default: Any = _MISSING_DEFAULT,
    held_by: list[tuple[types.FunctionType, Callable[..., Any]]] | None = None,
) -> ThreadFlag:
    """Make module global ``name`` per-thread.

    * readers/writers inside ``module`` (``functions``, small ones) get their code rewritten to use the
      thread-local (:func:`rewrite_global`);
    * ``module.name`` reads and writes from anywhere else go through a property on the module's class
      (:class:`~torch_threadsafe_compile._journal.ModuleRedirect`): for good, or, with ``held_by``, only
      while one of those functions runs. ``held_by`` lists every function outside ``module`` that reads or
      writes ``module.name`` (generator functions, as torch's are context managers), each with a template
      of its signature that only delegates to ``_ttc_held_<name>`` (:func:`route_through`, e.g.
      ``return (yield from _ttc_held_is_exporting_flag())``); a patch passes it only where it knows that list complete
      (its torch versions' sources were read). Elsewhere ``module`` keeps its own class, whose attribute
      reads CPython specialises (a warm compiled call reads ``torch.compiler``'s several times);
    * every thread starts from ``default``, or else from the value the global has now. A flag that another
      thread holds set while the patch applies (a late ``install()`` during a compile) must not become
      every thread's start value: such patches pass the upstream default.
    """
    if name not in module.__dict__:
        raise TargetMismatch(f"{module.__name__}.{name} does not exist")
    start = module.__dict__[name] if default is _MISSING_DEFAULT else default
    if not isinstance(start, (bool, int, str, type(None))):
        raise TargetMismatch(f"{module.__name__}.{name} starts as a {type(start).__name__}, not a constant")
    tls_name = f"_ttc_tls_{name.strip('_')}"
    new_codes = [(f, rewrite_global(f, name, tls_name, start)) for f in functions]  # all or nothing
    flag = ThreadFlag(start, module.__dict__, f"{tls_name}_n")
    # The count first (the readers test it), then what they read; all linger (see Changes.inject).
    changes.inject(module.__dict__, f"{tls_name}_n", 0, linger=True)
    changes.inject(module.__dict__, f"{tls_name}_local", flag.local, linger=True)
    changes.inject(module.__dict__, tls_name, flag, linger=True)

    def fget(_mod: types.ModuleType, _flag: ThreadFlag = flag) -> Any:
        return _flag.value

    def fset(_mod: types.ModuleType, value: Any, _flag: ThreadFlag = flag) -> None:
        _flag.value = value

    prop = property(fget, fset, doc=f"per-thread {name} (torch-threadsafe-compile)")
    redirect = changes.redirect_module(module, {name: prop}, permanent=not held_by)
    for func, template in held_by or ():
        route_through(changes, func, template, f"_ttc_held_{name.strip('_')}", _holding(redirect))
    for f, code in new_codes:
        changes.swap_code(f, code)
    return flag


def _holding(redirect: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``route_through``'s ``around`` for a generator function: the redirect is held while it runs."""

    def around(original: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            redirect.hold()
            try:
                return (yield from original(*args, **kwargs))
            finally:
                redirect.release()

        return held

    return around


def route_through(
    changes: Changes,
    func: types.FunctionType,
    template: Callable[..., Any],
    helper: str,
    around: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> None:
    """Make every call of ``func`` go through ``around(original)``, keeping the function object.

    For functions too large to rewrite cheaply, or whose body must stay upstream's: ``func`` gets the code
    of ``template`` — a function of the same signature that only calls the global ``helper`` with its
    arguments — placed at ``func``'s file and line; ``helper`` (injected into ``func``'s module) is
    ``around`` applied to a copy of ``func`` with its original code. Raises :class:`TargetMismatch` when
    the signatures differ.
    """
    code = func.__code__
    tcode: types.CodeType = template.__code__  # type: ignore[attr-defined]
    for attr in ("co_argcount", "co_posonlyargcount", "co_kwonlyargcount", "co_freevars"):
        if getattr(code, attr) != getattr(tcode, attr):
            raise TargetMismatch(f"{func.__qualname__}: signature differs from the expected one ({attr})")
    n = code.co_argcount + code.co_kwonlyargcount
    if code.co_varnames[:n] != tcode.co_varnames[:n] or (code.co_flags ^ tcode.co_flags) & 0x0C:
        raise TargetMismatch(f"{func.__qualname__}: signature differs from the expected one")
    if tcode.co_names != (helper,):
        raise TargetMismatch(f"template for {func.__qualname__} must call {helper} only")
    original = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    original.__kwdefaults__, original.__qualname__ = func.__kwdefaults__, func.__qualname__
    changes.inject(func.__globals__, helper, around(original))
    placed = tcode.replace(co_filename=code.co_filename, co_firstlineno=code.co_firstlineno, co_name=code.co_name)
    if hasattr(code, "co_qualname"):
        placed = placed.replace(**{"co_qualname": code.co_qualname})  # 3.11+
    changes.swap_code(func, placed)


def scoped_value(
    changes: Changes,
    func: types.FunctionType,
    template: Callable[..., Any],
    tls: ThreadFlag,
    value: Any,
) -> None:
    """Make ``func`` set ``tls.value = value`` for the duration of each call (restoring it afterwards)
    (:func:`route_through`, helper ``_ttc_scoped_<name>``). Whatever ``func``'s own code does to the module
    global meanwhile is invisible: every reader of that global reads the thread-local."""

    def around(original: Callable[..., Any]) -> Callable[..., Any]:
        def scoped(*args: Any, **kwargs: Any) -> Any:
            old = tls.value
            tls.value = value
            try:
                return original(*args, **kwargs)
            finally:
                tls.value = old

        return scoped

    route_through(changes, func, template, f"_ttc_scoped_{func.__code__.co_name}", around)
