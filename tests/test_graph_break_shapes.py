"""Do no harm for graph breaks and their continuations, one thread (issue 37).

``ttc_testing.graph_break_shapes`` runs the shapes of the upstream tests that failed only with the package
(a graph break inside an inlined call with ``nested_graph_breaks`` on, inside ``with`` blocks, below
``super()`` through a metaclass, across a default-dtype change, in re-entrant compiled calls, closures and
generators). Each shape must give the same answer and compile the same number of graphs with the package
active as with ``TTC_DISABLE=1``. On the tree before the fix 7 of the 10 shapes ended in RecursionError,
active only (the gate in front of a continuation was traced by dynamo: see ``_gate.inline_as``).
"""

from __future__ import annotations

import json

from packaging.version import Version

from conftest import run_py, torch_version

# torch < 2.12 (continuations built by the compiled code itself, ``_continuations_pre212``): two shapes still
# differ from upstream with the package active, deterministically, on torch 2.11 — dynamo raises
# "Cannot construct `ConstantVariable` for value of type <class 'function'>" where upstream compiles. Found on
# 2026-12-05 by this test's first run on 2.11; the tree before issue 37's fix failed 8 of the 10 shapes there
# the same way. Open (docs/upstream-tests.md, "Earlier findings", 6): bounded here, so that any other shape,
# or another error, still fails the test.
KNOWN_PRE_212 = {"deep_nesting": "Cannot construct `ConstantVariable`",
                 "closure_continuation": "Cannot construct `ConstantVariable`"}

CODE = "from ttc_testing.graph_break_shapes import run; import json; print('SHAPES ' + json.dumps(run()))"


def _shapes(env: dict[str, str]) -> dict[str, dict[str, object]]:
    p = run_py(CODE, env=env, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("SHAPES ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stderr[-3000:]}"
    return json.loads(lines[0][len("SHAPES "):])


def test_graph_break_shapes_match_upstream_single_threaded() -> None:
    off, on = _shapes({"TTC_DISABLE": "1"}), _shapes({})
    assert off.keys() == on.keys()
    bad_upstream = {k: v for k, v in off.items() if v["result"] != "ok"}
    assert not bad_upstream, f"a shape fails unpatched, so it compares nothing: {bad_upstream}"
    assert sum(int(v["graphs"]) for v in off.values()) >= 10, f"too few graphs compiled to prove anything: {off}"
    differ = {k: {"TTC_DISABLE=1": off[k], "active": on[k]} for k in off if on[k] != off[k]}
    tv = torch_version()
    if tv < Version("2.12"):
        differ = {k: d for k, d in differ.items()
                  if k not in KNOWN_PRE_212 or KNOWN_PRE_212[k] not in str(d["active"]["result"])}
    assert not differ, f"shapes that differ from upstream with the package active: {differ}"


def test_continuation_gates_are_inlined_as_their_continuation() -> None:
    """Where dynamo traces a call of a continuation's gate, it traces the continuation (``_torchdynamo_inline``)."""
    p = run_py(
        """
        import torch
        from torch_threadsafe_compile.patches.first_compile._gate import make_resume_gate
        from torch_threadsafe_compile.patches.first_compile._continuations import make_gated_factory
        def cont(x):
            return x + 1
        def factory():
            return cont
        g, f = make_resume_gate(cont), make_gated_factory(factory)
        print("OK", g._torchdynamo_inline is cont, f._torchdynamo_inline is factory, f()._torchdynamo_inline is cont)
        """,
        timeout=120,
    )
    assert "OK True True True" in p.stdout, p.stdout + p.stderr[-2000:]
