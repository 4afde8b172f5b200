"""Closure continuations before torch 2.12: trampolines swapped in by a dynamo bytecode hook.

Before 2.12, a graph-break continuation that needs a closure is built by the compiled code itself, from a
code object among its constants (``MAKE_FUNCTION`` with the closure cells of the compiled frame), so there
is no global to put a gate in. Dynamo's own hook for rewriting the code it generates
(``convert_frame.register_bytecode_hook``) swaps each such constant for a *trampoline*: a code object with
the same free variables, in the same order (so ``MAKE_FUNCTION`` builds it from the same cells), whose body
calls :func:`call_closure_resume`, which makes the real continuation from those very cells and calls it
through a resume gate. A continuation whose free variables cannot be reproduced stays as upstream.

The trampoline is compiled (never executed as a module: its code object is taken from the constants) from
a template filled in with the continuation's free-variable names, which are checked to be identifiers.
The two objects it needs — the helper and the real code — are placed in its own constants, so it reads
nothing from the compiled function's globals or the builtins.
"""

from __future__ import annotations

import keyword
import sys
import types
from typing import Any, Callable

from torch_threadsafe_compile.patches.first_compile._gate import make_resume_gate

_CALL = "<torch-threadsafe-compile: call>"
_REAL = "<torch-threadsafe-compile: continuation>"
_PREFIX = "torch_dynamo_resume_in_"


def call_closure_resume(real: types.CodeType, cells_fn: Any, args: Any, kwargs: Any) -> Any:
    # Runs under dynamo's callback (called from compiled code): no comprehension, no Python callee that is
    # not skipped, so that dynamo sees no frame of ours but the continuation's.
    by_name = dict(zip(cells_fn.__code__.co_freevars, cells_fn.__closure__))
    cells = []
    for n in real.co_freevars:
        cells.append(by_name[n])
    fn = types.FunctionType(real, sys._getframe(1).f_globals, real.co_name, None, tuple(cells))
    return make_resume_gate(fn, wraps=False)(*args, **kwargs)


def trampoline(real: types.CodeType) -> types.CodeType | None:
    """The trampoline for continuation ``real`` (None if its free variables cannot be reproduced)."""
    fvs = real.co_freevars
    if not all(n.isidentifier() and not keyword.iskeyword(n) for n in fvs) or not real.co_name.isidentifier():
        return None
    body = "".join(f"    {n} = None\n" for n in fvs)
    src = (
        f"def ttc_outer():\n{body}"
        f"    def {real.co_name}(*args, **kwargs):\n"
        f"        def ttc_cells():\n"
        f"            return ({', '.join(fvs)},)\n"
        f"        ttc_call__ = {_CALL!r}\n"
        f"        ttc_real__ = {_REAL!r}\n"
        f"        return ttc_call__(ttc_real__, ttc_cells, args, kwargs)\n"
        f"    return {real.co_name}\n"
    )
    module = compile(src, "<torch-threadsafe-compile continuation trampoline>", "exec", dont_inherit=True)
    outer = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    tramp = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    if tramp.co_freevars != fvs:
        return None
    if _CALL not in tramp.co_consts or _REAL not in tramp.co_consts:
        return None
    consts = tuple(call_closure_resume if c == _CALL else real if c == _REAL else c for c in tramp.co_consts)
    return tramp.replace(co_consts=consts)


def make_hook(skip_code: Callable[[types.CodeType], Any]) -> Callable[[types.CodeType, types.CodeType], types.CodeType | None]:
    def closure_continuations_hook(code: types.CodeType, out_code: types.CodeType) -> types.CodeType | None:
        """Dynamo bytecode hook: swap the code constants of closure continuations for trampolines."""
        consts = list(out_code.co_consts)
        changed = False
        for i, c in enumerate(consts):
            if isinstance(c, types.CodeType) and c.co_freevars and c.co_name.startswith(_PREFIX):
                tramp = trampoline(c)
                if tramp is not None:
                    skip_code(tramp)
                    consts[i], changed = tramp, True
        return out_code.replace(co_consts=tuple(consts)) if changed else None

    return closure_continuations_hook
