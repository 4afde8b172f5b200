"""The journal of edits: every change a patch makes to a live object, with the original kept (gevent.monkey style).

Every change a patch makes goes through a :class:`Changes` journal, so that ``revert`` undoes exactly
what was done, in reverse order, restoring object identity; and so that ``is_patched``/``get_original``
and ``doctor`` can answer questions about any patched attribute.

The kinds of edit:

* ``setattr`` of an attribute (functions on classes, module attributes), and ``wrap`` with a transparent
  ``wrapt.FunctionWrapper``;
* swapping a function's ``__code__``: the function *object* stays the same, so references captured
  before we ran (closures made by ``torch.compile()``, ``from x import f``, dicts keyed by the function)
  all see the new behaviour;
* giving a module a subclass with properties (:class:`ModuleRedirect`), so that ``module.flag`` reads and
  writes from other modules can be redirected to thread-local storage, for good or while known code runs;
* injecting a name into a module's namespace (what rewritten code reads);
* offering a capability to other patches (:meth:`Changes.provide`), and taking one (:meth:`Changes.require`).

Capabilities are the contracts between patches, by name, declared in each patch's row of the table
(``registry.PatchSpec.provides``/``requires``): the journal refuses an undeclared one at apply time
(:class:`UndeclaredCapability`), and what a patch provided is withdrawn with its revert. A consumer reads a
:class:`Capability` at call time, so the order of the two patches does not matter, and falls back to
upstream's behaviour while nobody provides it (the provider skipped, disabled or reverted).

Also here, because every patch and ``_lifecycle`` share them: the exceptions by which an edit or a patch's
``apply`` says no (:class:`TargetMismatch`, :class:`SourceUnavailable`: skipped with the reason;
:class:`TargetBusy`: tried again shortly), and :func:`run_in_thread`, the probe of patches' verify steps.
New code for torch's functions is made in ``_rewrite``.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Callable

from torch_threadsafe_compile import _forksafe

_MISSING = object()

# (id(obj), attr) -> the edits of that attribute in force, oldest first; for is_patched()/get_original(), and
# so that an edit one patch builds on another's (export_flag routes the code that compile_session_flag
# routed already) is known as the package's own, not as somebody else's replacement.
_journal_index: dict[tuple[int, str], list[Edit]] = {}
# (id(namespace), name) of injected names left bound after revert (Changes.inject, linger=True).
_lingering: set[tuple[int, str]] = set()


class TargetMismatch(Exception):
    """A patch target does not look as expected: the patch is skipped with this reason, never guessed."""


class SourceUnavailable(TargetMismatch):
    """torch's source of a function the patch must rewrite cannot be read (a stripped or locked-down
    install): the target may be exactly as expected, but the patch cannot prove it, so it stays out."""


class TargetBusy(Exception):
    """The target is in use right now (a trace in progress in another thread): the patch is tried again
    shortly, not skipped."""


class UndeclaredCapability(Exception):
    """A patch provided or required a capability that its row of the table does not declare: a bug of the
    package (the patch fails and is reverted; tests/test_registry.py and the conformance kit see it)."""


class Capability:
    """What patches offer each other under one name (``compile_lock.priority``, ``call_plumbing``, ...).

    ``values`` is one list for the life of the process, changed in place by providers (in the order they
    applied) and by their reverts: a consumer may keep a reference to it, or call :meth:`get` for the newest.
    One instance per name (:func:`_capability`); patches reach it only through ``Changes.provide``/``require``.
    """

    __slots__ = ("name", "values", "providers")

    def __init__(self, name: str) -> None:
        self.name = name
        self.values: list[Any] = []
        self.providers: list[str] = []  # patch id of each value, same order

    def get(self) -> Any:
        """The newest provided value, or None while no applied patch provides it."""
        values = self.values
        return values[-1] if values else None

    def __repr__(self) -> str:
        return f"Capability({self.name!r}, providers={self.providers})"


_capabilities: dict[str, Capability] = {}
_capabilities_lock = threading.Lock()


def _capability(name: str) -> Capability:
    with _capabilities_lock:
        cap = _capabilities.get(name)
        if cap is None:
            cap = _capabilities[name] = Capability(name)
        return cap


def capabilities() -> dict[str, Capability]:
    """Every capability some patch provided or required in this process (for ``doctor`` and the tests)."""
    with _capabilities_lock:
        return dict(_capabilities)


def _declared(patch_id: str, field: str, name: str) -> None:
    """Raise unless the table's row of ``patch_id`` lists ``name`` in ``field`` (``provides``/``requires``)."""
    from torch_threadsafe_compile.registry import SPECS

    spec = SPECS.get(patch_id)
    if spec is None or name not in getattr(spec, field):
        raise UndeclaredCapability(f"patch {patch_id} uses capability {name!r} without declaring it in its "
                                   f"row's {field} (registry.SPECS)")


class Edit:
    """One edit in force: ``obj.attr`` (or a function's ``__code__``) was ``original``, is now ``new``, by patch
    ``patch_id``; ``in_place()`` says whether the target still holds ``new``."""

    __slots__ = ("key", "obj", "attr", "original", "new", "patch_id", "in_place")

    def __init__(self, obj: Any, attr: str, original: Any, new: Any, patch_id: str,
                 in_place: Callable[[], bool]) -> None:
        self.key = (id(obj), attr)
        self.obj, self.attr, self.original, self.new, self.patch_id = obj, attr, original, new, patch_id
        self.in_place = in_place


def _record(edit: Edit) -> Edit:
    _journal_index.setdefault(edit.key, []).append(edit)
    return edit


def _on_class(cls: type, name: str, value: Any) -> Callable[[], bool]:
    return lambda: cls.__dict__.get(name) is value


def _forget(edit: Edit) -> None:
    stack = _journal_index.get(edit.key)
    if stack is None:
        return
    stack[:] = [e for e in stack if e is not edit]
    if not stack:
        del _journal_index[edit.key]


def _holds(edit: Edit) -> bool:
    """Whether ``edit`` is still in force: its value is in place, or later edits of this package were made on
    top of it, each taking the one below as its original, and the newest of them is in place."""
    if edit.in_place():
        return True
    stack = _journal_index.get(edit.key, [])
    at = next((i for i, e in enumerate(stack) if e is edit), None)
    if at is None or at == len(stack) - 1:
        return False
    if any(above.original is not below.new for below, above in zip(stack[at:], stack[at + 1:])):
        return False
    return stack[-1].in_place()


class Changes:
    """The journal of one patch's edits."""

    def __init__(self, patch_id: str) -> None:
        self.patch_id = patch_id
        self._undo: list[Callable[[], None]] = []
        self._checks: list[tuple[str, Edit | Callable[[], bool]]] = []

    # -- edits -------------------------------------------------------------------------------
    def setattr(self, obj: Any, attr: str, new: Any) -> Any:
        """``setattr(obj, attr, new)``; returns the original. Reads the raw value (no descriptor binding)."""
        original = raw_get(obj, attr)
        setattr(obj, attr, new)
        edit = _record(Edit(obj, attr, original, new, self.patch_id, lambda: raw_get(obj, attr) is new))

        def undo() -> None:
            current = raw_get(obj, attr)
            _forget(edit)
            if current is not new:
                # Somebody re-wrapped or replaced our object since (e.g. dynamo wraps functions with
                # `disable`). Putting our original back would silently drop their change: leave it.
                raise TargetMismatch(f"{_name(obj)}.{attr} was replaced by another patcher; left in place")
            if original is _MISSING:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, original)

        self._undo.append(undo)
        self._checks.append((f"{_name(obj)}.{attr}", edit))
        return original

    def wrap(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> Any:
        """Replace ``owner.attr`` by a ``wrapt.FunctionWrapper`` calling ``wrapper(wrapped, instance, args, kwargs)``.

        wrapt keeps the wrapper transparent (name, signature, ``__wrapped__``, ``inspect``, descriptor binding),
        which matters for methods that other libraries introspect. Not for hot paths (one extra call layer).
        """
        import wrapt

        original = raw_get(owner, attr)
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
        edit = _record(Edit(func, "__code__", original, new_code, self.patch_id, lambda: func.__code__ is new_code))

        def undo() -> None:
            func.__code__ = original
            _forget(edit)

        self._undo.append(undo)
        self._checks.append((f"{func.__module__}.{func.__qualname__}.__code__", edit))

    def redirect_module(self, module: types.ModuleType, properties: dict[str, property], permanent: bool = True) -> ModuleRedirect:
        """Put ``properties`` on the module's :class:`ModuleRedirect` class. ``permanent``: the module wears
        that class from now until revert; otherwise only while something holds the redirect."""
        # One redirect class per module, shared by the patches that redirect its globals: declared by each.
        _declared(self.patch_id, "requires", redirect_capability(module.__name__))
        redirect = ModuleRedirect.of(module)
        edits = []
        for name, prop in properties.items():
            setattr(redirect.cls, name, prop)
            original = module.__dict__.get(name, _MISSING)
            edits.append(_record(Edit(module, name, original, prop, self.patch_id, _on_class(redirect.cls, name, prop))))
        if permanent:
            redirect.hold()

        def undo() -> None:
            for edit in edits:
                _forget(edit)
            for name in properties:
                if name in redirect.cls.__dict__:
                    delattr(redirect.cls, name)
            if permanent:
                redirect.release()

        self._undo.append(undo)
        cls = redirect.cls
        if permanent:
            self._checks.append((f"{module.__name__}.__class__", lambda: isinstance(module, cls)))
        return redirect

    def inject(self, namespace: dict[str, Any], name: str, value: Any, linger: bool = False) -> None:
        """Add a private name to a module's namespace (e.g. the thread-local object that rewritten code reads).

        ``linger``: revert leaves the name bound. Rewritten code may still be running after ``uninstall()``
        (a generator suspended inside it, such as ``_compile_session_context`` in another thread's compile)
        and reads the name when it resumes: removing it raised ``NameError`` there. A later inject of the
        same name replaces a lingering value of ours (marked ``_ttc_injected``) instead of refusing.
        """
        if name in namespace and not (getattr(namespace[name], "_ttc_injected", False) or (id(namespace), name) in _lingering):
            raise TargetMismatch(f"{namespace.get('__name__', '?')}.{name} already exists")
        namespace[name] = value
        if linger:
            _lingering.add((id(namespace), name))
        else:
            self._undo.append(lambda: namespace.pop(name, None))

    def provide(self, name: str, value: Any) -> None:
        """Offer ``value`` to other patches as capability ``name`` (declared in this patch's ``provides``);
        revert withdraws it."""
        _declared(self.patch_id, "provides", name)
        cap = _capability(name)
        with _capabilities_lock:
            cap.values.append(value)
            cap.providers.append(self.patch_id)

        def undo() -> None:
            with _capabilities_lock:
                for i in range(len(cap.values) - 1, -1, -1):
                    if cap.values[i] is value:  # identity: code objects compare by value
                        del cap.values[i], cap.providers[i]
                        break

        self._undo.append(undo)

    def require(self, name: str) -> Capability:
        """The capability ``name`` (declared in this patch's ``requires``), to read at call time: what its
        providers offer while they are applied, in whatever order the patches applied."""
        _declared(self.patch_id, "requires", name)
        return _capability(name)

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
        """Names of edits that somebody outside this package has since replaced (re-wrapped, unwrapped,
        reassigned). An edit that a later patch of this package built on is not replaced while that one
        holds (``_holds``)."""
        return [name for name, check in self._checks if not (_holds(check) if isinstance(check, Edit) else check())]


class ModuleRedirect:
    """A subclass of a module's class carrying properties (per-thread globals: ``_rewrite``), and when the
    module wears it.

    A module of a subclass of ``ModuleType`` loses CPython's specialised attribute loads: every
    ``torch.compiler.is_exporting`` costs about 13 ns more (measured, CPython 3.11), and a warm compiled call
    reads such attributes several times. So the class is worn only while held: permanently (from apply to
    revert) where unknown code may read or write the redirected globals, or only while known code that
    does runs (``_rewrite.thread_local_global``'s ``held_by``). One class per module, shared by every patch
    that redirects one of its globals (two patches redirect ``torch.compiler``'s flags, and one function
    writes both), so holding it is a count, not a chain of classes.
    """

    _by_module: dict[int, ModuleRedirect] = {}
    _table_lock = threading.Lock()

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.base = type(module)
        self.cls = type(self.base.__name__, (self.base,), {"__ttc_patch__": "redirect"})
        self.held = 0
        self._lock = threading.Lock()  # a leaf lock: nothing is acquired under it

    @classmethod
    def of(cls, module: types.ModuleType) -> ModuleRedirect:
        with cls._table_lock:
            redirect = cls._by_module.get(id(module))
            if redirect is None or redirect.module is not module:
                redirect = cls._by_module[id(module)] = cls(module)
            return redirect

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread of the parent may have held it

    def hold(self) -> None:
        with self._lock:
            self.held += 1
            if self.held == 1 and type(self.module) is self.base:
                self.module.__class__ = self.cls

    def release(self) -> None:
        with self._lock:
            self.held -= 1
            if self.held == 0:
                self._unwear()

    def __enter__(self) -> ModuleRedirect:
        self.hold()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _unwear(self) -> None:
        module, cls = self.module, self.cls
        if type(module) is cls:
            module.__class__ = self.base
            return
        # Somebody swapped the class again on top of ours: splice ours out of the chain.
        k: type | None = type(module)
        while k is not None and k.__bases__ and k.__bases__[0] is not cls:
            k = k.__bases__[0] if k.__bases__[0] is not object else None
        if k is not None and k.__bases__ and k.__bases__[0] is cls:
            k.__bases__ = (self.base,) + k.__bases__[1:]


def redirect_capability(module_name: str) -> str:
    """The capability a patch declares to redirect globals of ``module_name`` (the class is shared)."""
    return f"redirect:{module_name}"


@_forksafe.in_child
def _capabilities_after_fork() -> None:
    global _capabilities_lock
    _capabilities_lock = threading.Lock()


@_forksafe.in_child
def _redirects_after_fork() -> None:
    ModuleRedirect._table_lock = threading.Lock()
    for redirect in list(ModuleRedirect._by_module.values()):
        redirect.after_fork()


def raw_get(obj: Any, attr: str) -> Any:
    """``obj.attr`` without descriptor binding (``_MISSING`` when absent)."""
    d = getattr(obj, "__dict__", {})
    return d[attr] if attr in d else getattr(obj, attr, _MISSING)


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _unwrapped(value: Any) -> Any:
    seen = 0
    while hasattr(value, "__wrapped__") and seen < 16:
        value, seen = value.__wrapped__, seen + 1
    return value


def _entry(obj: Any, attr: str) -> Edit | None:
    """The first edit behind ``obj.attr`` (its ``original`` is upstream's, whatever patches came later): of
    the attribute itself, or of the code of the function it holds (looking through wrappers such as dynamo's
    ``disable`` and ``functools.wraps``)."""
    stack = _journal_index.get((id(obj), attr))
    if stack:
        return stack[0]
    value = raw_get(obj, attr)
    for candidate in (value, getattr(value, "__func__", None), _unwrapped(value)):
        if candidate is not None and candidate is not _MISSING:
            stack = _journal_index.get((id(candidate), "__code__"))
            if stack:
                return stack[0]
    return None


def is_patched(obj: Any, attr: str) -> bool:
    return _entry(obj, attr) is not None


def get_original(obj: Any, attr: str) -> Any:
    """What upstream has at ``obj.attr``: the object a patch replaced; for a function whose code was
    swapped, a copy of that function with its original code; ``obj.attr`` itself when not patched."""
    entry = _entry(obj, attr)
    if entry is None:
        return raw_get(obj, attr)
    target, what, original = entry.obj, entry.attr, entry.original
    if what != "__code__":
        return original
    copy = types.FunctionType(original, target.__globals__, target.__name__, target.__defaults__, target.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__module__ = target.__kwdefaults__, target.__qualname__, target.__module__
    copy.__dict__.update(target.__dict__)
    return copy


def run_in_thread(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn`` in a fresh thread and return its result (used by patches' verify steps)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:
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
