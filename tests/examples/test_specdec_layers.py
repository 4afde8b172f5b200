"""The reference trainer's modules form at most five floors: a module imports only modules on floors below its own,
so each can be read (and tested) with only what is under it. Computed from the source with ``ast``: every
intra-package import counts, at module level or inside a function, ``from . import x`` and ``from .x import y``
alike. No torch needed."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = "examples.specdec"
SOURCE = Path(__file__).resolve().parents[2] / "examples" / "specdec"
MAX_FLOORS = 5


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere in its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 0:  # absolute: from examples.specdec[.x] import y
                if base != PACKAGE and not base.startswith(PACKAGE + "."):
                    continue
                base = base[len(PACKAGE) + 1:]
            if base:
                found.add(base.split(".")[0])
            else:  # from . import x, y
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name[len(PACKAGE) + 1:].split(".")[0] for a in node.names if a.name.startswith(PACKAGE + "."))
    return found & modules - {path.stem}


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the package's ``__init__`` imports nothing and is left out)."""
    files = {p.stem: p for p in SOURCE.glob("*.py") if p.stem != "__init__"}
    return {name: imports(path, set(files)) for name, path in files.items()}


def floors(deps: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module -> the longest chain of imports that starts at it (its floor is the chain's length). Raises
    ValueError naming a cycle."""
    @cache
    def chain(name: str, path: tuple[str, ...] = ()) -> tuple[str, ...]:
        if name in path:
            raise ValueError("import cycle: " + " -> ".join(path[path.index(name):] + (name,)))
        below = [chain(d, path + (name,)) for d in sorted(deps[name])]
        return (name, *max(below, key=len, default=()))

    return {name: list(chain(name)) for name in deps}


def test_floors_computed_like_this() -> None:
    """The measure itself, on a made-up graph: a leaf is floor 1, a cycle is found."""
    assert {m: len(c) for m, c in floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}).items()} == {"a": 3, "b": 2, "c": 1}
    try:
        floors({"a": {"b"}, "b": {"a"}})
    except ValueError as e:
        assert "import cycle" in str(e)
    else:
        raise AssertionError("a cycle was not found")


def test_trainer_modules_form_at_most_five_floors_without_cycles() -> None:
    deps = graph()
    assert {"train", "config", "steps"} <= set(deps), sorted(deps)  # the right directory
    chains = floors(deps)
    longest = max(chains.values(), key=len)
    table = "\n".join(f"{len(c)}  {' -> '.join(c)}" for c in sorted(chains.values(), key=len, reverse=True))
    assert len(longest) <= MAX_FLOORS, f"{len(longest)} floors; longest chain per module:\n{table}"
