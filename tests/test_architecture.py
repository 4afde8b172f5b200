"""The shape of the runtime package (docs/architecture.md), checked statically on its source.

* no import circle between its modules, counting imports inside functions too (``from pkg import mod``
  is an edge to ``pkg.mod``; a package's parent, which Python imports anyway, is not an edge);
* no function longer than 120 lines, in the reference trainer (``examples/``) too;
* no frame locals read for control flow: ``f_locals`` appears only where guards are evaluated on a
  frame's arguments (``first_compile/_cache_probe.py``);
* no module outside ``_env`` reads the package's ``TTC_*`` variables, in the trainer, the benches and the test
  harness too: they ask ``status()``;
* every bench script is named in the docs (or the README), and every bench command the docs quote names a
  script that exists: a figure's command can be run again, and no script is left unexplained;
* every module of ``ttc_testing/scenarios/`` is found by the package and registers scenarios.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "torch_threadsafe_compile"
EXAMPLES = PKG.parent / "examples"
ROOT = "torch_threadsafe_compile"
MAX_FUNCTION_LINES = 120
F_LOCALS_ALLOWED = {"patches/first_compile/_cache_probe.py", "patches/first_compile/_calls.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _edges(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports: resolve against this module's package
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    out.discard(name)
    return out


def test_no_import_circle() -> None:
    mods = _modules()
    graph = {name: _edges(name, path, set(mods)) for name, path in mods.items()}
    assert graph[ROOT], "the import scan found nothing: it proves nothing"
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_leaf_and_the_floors() -> None:
    """The patch table (registry) imports nothing of ours; _env at most the table (its ids, only when
    TTC_DISABLE lists some), _activation only _env (both run at every interpreter start); the bootstrap
    never imports the patches; patches never import each other (shared torch knowledge lives in _torch)."""
    mods = _modules()
    graph = {name: _edges(name, path, set(mods)) for name, path in mods.items()}
    assert graph[f"{ROOT}.registry"] == set()
    assert graph[f"{ROOT}._env"] <= {f"{ROOT}.registry"}
    assert graph[f"{ROOT}._activation"] == {f"{ROOT}._env"}
    assert not {m for m in graph[f"{ROOT}._bootstrap"] if ".patches" in m}
    for name, deps in graph.items():
        if name.startswith(f"{ROOT}.patches."):
            own = ".".join(name.split(".")[:3])  # the patch itself (a module or a package)
            foreign = {d for d in deps if d.startswith(f"{ROOT}.patches.") and not d.startswith(own)}
            assert not foreign, f"{name} imports other patches: {foreign}"


def _allowed_table() -> list[tuple[list[str], set[str]]]:
    """(module patterns, allowed targets) rows of docs/architecture.md's "Allowed imports" table."""
    doc = (PKG.parent / "docs" / "architecture.md").read_text()
    body = doc.split("<!-- allowed-imports -->", 1)[1].split("<!-- /allowed-imports -->", 1)[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        left, right = (cell.strip() for cell in line.strip().strip("|").split("|"))
        names = lambda cell: [c.strip().strip("`") for c in cell.split(",") if c.strip() not in ("", "—")]  # noqa: E731
        rows.append((names(left), set(names(right))))
    return rows


def _row_for(name: str, rows: list[tuple[list[str], set[str]]]) -> set[str] | None:
    short = name[len(ROOT) + 1 :] if name != ROOT else "__init__"
    for patterns, allowed in rows:
        for pat in patterns:
            if short == pat or (pat.endswith(".*") and short.startswith(pat[:-1])):
                return allowed
    return None


def test_imports_follow_the_documented_table() -> None:
    """Every import edge between the package's modules is allowed by docs/architecture.md's table, and
    every module has a row (a new module must say where it stands)."""
    mods = _modules()
    rows = _allowed_table()
    assert len(rows) > 5, "the table was not found: the check proves nothing"
    bad = []
    for name, path in mods.items():
        allowed = _row_for(name, rows)
        if allowed is None:
            bad.append(f"{name}: no row in docs/architecture.md's allowed-imports table")
            continue
        for dep in _edges(name, path, set(mods)):
            short = dep[len(ROOT) + 1 :] if dep != ROOT else "__init__"
            own = name.startswith(f"{ROOT}.patches.") and dep.startswith(".".join(name.split(".")[:3]))
            if short not in allowed and not (own and "own" in allowed):
                bad.append(f"{name} imports {dep}")
    assert not bad, bad


def test_no_long_functions() -> None:
    long = []
    paths = [*PKG.rglob("*.py"), *EXAMPLES.rglob("*.py")]
    assert any(p.is_relative_to(EXAMPLES) for p in paths), "no example found: the check proves nothing there"
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_frame_locals_for_control_flow() -> None:
    uses = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "f_locals" in p.read_text()]
    assert set(uses) <= F_LOCALS_ALLOWED, uses


# The package's own variables: every TTC_* name that _env, their one parser, knows of.
PACKAGE_VARIABLES = frozenset(
    node.value for node in ast.walk(ast.parse((PKG / "_env.py").read_text()))
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"TTC_[A-Z_]+", node.value)
)
# Where such a variable may be read: its parser. Everything else asks the package (``status()``); setting one for a
# child process (``--no-ttc``'s re-exec, a bench's unpatched side) is not a read.
READERS_ALLOWED = {"torch_threadsafe_compile/_env.py"}


def _package_variable(node: ast.AST, names: dict[str, str]) -> str | None:
    value = node.value if isinstance(node, ast.Constant) else names.get(node.id) if isinstance(node, ast.Name) else None
    return value if value in PACKAGE_VARIABLES else None


def _variable_reads(path: Path) -> list[str]:
    """Reads of a package variable's value: ``x.get("TTC_…")``, ``getenv("TTC_…")``, ``environ["TTC_…"]``,
    ``"TTC_…" in environ``, the name also through a module-level constant."""
    tree = ast.parse(path.read_text())
    names = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value.value, str)}
    found = []
    for node in ast.walk(tree):
        var = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            var = _package_variable(node.args[0], names) if called in ("get", "getenv") else None
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            var = _package_variable(node.slice, names)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            var = _package_variable(node.left, names)
        if var is not None:
            found.append(f"{path}:{node.lineno}: reads {var}")
    return found


def test_no_module_outside_env_reads_the_package_variables() -> None:
    """One owner of "is the package active, and which patches are in force": its ``status()``. Before: the trainer
    read ``TTC_DISABLE`` itself with ``== "1"`` in four modules (the package also accepts true/yes/on/all), and two
    benches and the free-threading harness took any value for "off"."""
    assert {"TTC_DISABLE", "TTC_LOG", "TTC_WATCHDOG"} <= PACKAGE_VARIABLES
    repo = PKG.parent
    reads = []
    for top in ("torch_threadsafe_compile", "examples", "bench", "ttc_testing", "sitecustomize"):
        for path in sorted((repo / top).rglob("*.py")):
            if str(path.relative_to(repo)) not in READERS_ALLOWED:
                reads += _variable_reads(path)
    assert not reads, "\n".join(reads)
    assert _variable_reads(PKG / "_env.py"), "the scan finds nothing even in the parser: it proves nothing"


REPO = PKG.parent
BENCH = REPO / "bench"


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))])


def _bench_scripts() -> list[str]:
    """What is run by hand or by CI: ``bench/*.py`` and ``bench/*.sh`` (not the ``_`` helpers they import) and the
    pytest plugins. The packages under bench/ (``compat``) belong to the script that imports them, and
    ``pytorch_tests`` holds upstream's test files, not ours."""
    paths = [*BENCH.glob("*.py"), *BENCH.glob("*.sh"), *(BENCH / "pytest_plugins").glob("*.py")]
    return sorted(str(p.relative_to(REPO)) for p in paths if not p.name.startswith("_"))


def test_every_bench_script_is_named_in_the_docs() -> None:
    """A bench script backs a figure the docs quote (with the command that made it), or serves one that does.
    A script no document names is a one-off: its findings go into the docs and the script into the history."""
    scripts = _bench_scripts()
    assert "bench/warm_call.py" in scripts and "bench/pytest_plugins/ttc_parallel_plan.py" in scripts, scripts
    text = _docs_text()
    unnamed = [s for s in scripts if s not in text]
    assert not unnamed, f"bench scripts that no document in docs/ or README.md names: {unnamed}"


def test_bench_commands_in_the_docs_name_existing_scripts() -> None:
    """``python bench/x.py ...`` / ``bash bench/x.sh ...`` in the docs: x exists (a removed one-off probe is named
    as such, not as a command to run)."""
    commands = re.findall(r"\b(?:python3?|bash)\s+(bench/[\w./-]+\.(?:py|sh))\b", _docs_text())
    assert len(commands) > 20, "the scan found almost no bench command: it proves nothing"
    missing = sorted({c for c in commands if not (REPO / c).is_file()})
    assert not missing, f"the docs quote commands of bench scripts that do not exist: {missing}"


def test_scenario_modules_are_found_and_register_scenarios() -> None:
    """``ttc_testing.scenarios`` imports every module of its package (pkgutil): a new module needs no other edit."""
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from ttc_testing import scenarios

    files = sorted(p.stem for p in (REPO / "ttc_testing" / "scenarios").glob("*.py") if not p.stem.startswith("_"))
    assert files == scenarios.MODULES
    for name in files:
        module = sys.modules[f"ttc_testing.scenarios.{name}"]
        mine = [k for k, v in scenarios.SCENARIOS.items() if getattr(v, "__module__", None) == module.__name__]
        assert mine, f"ttc_testing/scenarios/{name}.py registers no scenario"
        assert all(getattr(scenarios, k) is scenarios.SCENARIOS[k] for k in mine)
