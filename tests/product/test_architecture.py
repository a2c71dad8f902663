"""The import directions of STYLE.md: verl_knowledge/ is the leaf, spaces/ and launchers/ know only
it, objectives/ knows only the launcher interface, search/ composes everything; heavy packages are
imported lazily."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

pytestmark = pytest.mark.fast

OURS = {"search", "spaces", "objectives", "launchers", "verl_knowledge"}  # folders; installed as verl_sweep.<folder>
ALLOWED = {
    "verl_knowledge": {"verl_knowledge"},
    "spaces": {"spaces", "verl_knowledge"},
    "launchers": {"launchers", "verl_knowledge"},
    "objectives": {"objectives", "spaces", "launchers.base", "launchers.run_dir"},
    "search": OURS,
}
#: search/'s layers, top to bottom: a module imports its own layer's and the layers below it
LAYERS = ("commands", "views", "engine", "method", "database", "spec")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _ours(name: str) -> str | None:
    """``verl_sweep.search.engine.driver`` -> ``search.engine.driver``; None for another package's."""
    head, _, rest = name.partition(".")
    return rest or None if head == "verl_sweep" else None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_directions(package: str) -> None:
    allowed = ALLOWED[package]
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in filter(None, map(_ours, _imports(path))):
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []


def test_search_layers_import_down_only() -> None:
    """Each folder of search/ is a layer (its __init__ says what it is for); a module imports
    its own layer and those below it, never one above."""
    assert sorted(p.name for p in (REPO / "search").iterdir() if (p / "__init__.py").is_file()) == sorted(LAYERS)
    bad = []
    for layer in LAYERS:
        purpose = ast.get_docstring(ast.parse((REPO / "search" / layer / "__init__.py").read_text())) or ""
        assert purpose and "\n" not in purpose, f"search/{layer}/__init__.py: its purpose in one line"
        for path in sorted((REPO / "search" / layer).rglob("*.py")):
            for name in filter(None, map(_ours, _imports(path))):
                parts = name.split(".")
                if parts[0] == "search" and len(parts) > 1 and LAYERS.index(parts[1]) < LAYERS.index(layer):
                    bad.append(f"{path.relative_to(REPO)} ({layer}) imports {name} ({parts[1]})")
    assert bad == []


def test_only_the_one_import_name_is_used() -> None:
    """Every import of our code goes through verl_sweep: the folders' own names are not installed."""
    bad = []
    for folder in (*OURS, "benchmarks", "tests", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            bad += [f"{path.relative_to(REPO)} imports {name}" for name in _imports(path) if name.split(".")[0] in OURS]
    assert bad == []


def test_packages_import_without_heavy_dependencies() -> None:
    code = (
        "import sys, verl_sweep.search.commands.cli, verl_sweep.search.engine.driver, verl_sweep.launchers, verl_sweep.spaces, "
        "verl_sweep.verl_knowledge, "
        "verl_sweep.objectives.probe\n"
        "heavy = [m for m in ('ray', 'torch', 'verl', 'hydra') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _module_graph() -> dict[str, set[str]]:
    """Our modules and the modules of ours each imports (anywhere in it, lazily too). ``from
    package import name`` imports the submodule when ``name`` is one, else the package."""
    modules: dict[str, Path] = {}
    for package in (*OURS, "benchmarks"):
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            prefix = ("verl_sweep",) if package in OURS else ()
            modules[".".join(prefix + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                deps.update(subs or {node.module})
                if len(subs) < len(node.names):
                    deps.add(node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    """Nowhere in our packages or the benchmarks (their modules count as ours here)."""
    graph = _module_graph()
    assert "benchmarks.peers" in graph and "verl_sweep.search.engine.driver" in graph
    assert _circles(graph) == []


def test_modules_stay_short() -> None:
    lengths = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for package in OURS
               for p in (REPO / package).rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 600} == {}
    assert lengths["search/engine/driver.py"] <= 450


def test_only_the_records_know_the_trial_attribute_names() -> None:
    """Role names are the ``Role`` enum's, and ``user_attrs`` keys are spelled in one module."""
    from verl_sweep.search.database.records import Role

    bad = []
    for package in ("search", "objectives"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name == "records.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                # t.user_attrs.get("role") / t.user_attrs["seed"]: a key read outside records.py
                if isinstance(node, (ast.Call, ast.Subscript)):
                    target = node.func if isinstance(node, ast.Call) else node
                    owner = getattr(target, "value", None)
                    if isinstance(owner, ast.Attribute) and owner.attr in ("user_attrs", "system_attrs"):
                        args = node.args if isinstance(node, ast.Call) else [node.slice]
                        if args and isinstance(args[0], ast.Constant) and not str(args[0].value).isupper():
                            bad.append(f"{path.relative_to(REPO)}:{node.lineno} reads {args[0].value!r}")
                # role == "rerun": a role compared as a bare string
                if isinstance(node, ast.Compare) and any(
                        isinstance(c, ast.Constant) and c.value in {r.value for r in Role} and c.value != "skipped"
                        for c in [node.left, *node.comparators]):
                    names = ast.dump(node)
                    if "role" in names:
                        bad.append(f"{path.relative_to(REPO)}:{node.lineno} compares a role with a string")
    assert bad == []


@functools.lru_cache(maxsize=1)
def _sources() -> dict[str, ast.AST]:
    """Every module of ours and of the benchmarks, parsed, by path."""
    return {str(p.relative_to(REPO)): ast.parse(p.read_text()) for package in (*OURS, "benchmarks")
            for p in sorted((REPO / package).rglob("*.py"))}


def test_what_a_stage_moves_is_read_in_one_module() -> None:
    """A space says what its knobs move (``Space.moves``); only ``verl_sweep.search.method.stage.Stage`` reads it
    and derives the probe length, warm-up, scorer and pruning from it (the spaces declare it)."""
    readers = set()
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("moves", "speed_only") and isinstance(node.ctx, ast.Load):
                readers.add(path)
            if isinstance(node, ast.Name) and node.id == "speed_only":
                readers.add(path)
    assert readers == {"search/method/stage.py"}


def test_no_stage_decision_is_read_from_its_text() -> None:
    """Decisions are data (``records.Decision``): only the reader of what earlier releases
    stored (``search/database/compat.py``) may look at the text of a decision or a close reason."""
    bad = []
    for path, tree in _sources().items():
        if path == "search/database/compat.py":
            continue
        for node in ast.walk(tree):
            searched = None  # the text a call or comparison looks into
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "startswith", "endswith", "find", "split", "partition"):
                searched = node.func.value
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                searched = node.comparators[0]
            if searched is not None and any(word in ast.unparse(searched) for word in ("decision", "summary")):
                bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in (
                    "WASTED_PREFIX", "KEPT", "SLOW_START"):
                bad.append(f"{path}:{node.lineno} {node.id}")
    assert bad == []


def test_launcher_kinds_are_spelled_once() -> None:
    """A launcher kind is its class's ``name`` (``launchers.LAUNCHERS`` is built from them): no
    other code of ours names one, so a new launcher is registered in one place."""
    from verl_sweep.launchers import LAUNCHERS

    spelled = []
    for path, tree in _sources().items():
        if path.startswith("benchmarks/"):
            continue
        names = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and [ast.unparse(t) for t in node.targets] == ["name"] and path.startswith("launchers/")}
        spelled += [f"{path}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and node.value in LAUNCHERS and id(node) not in names]
    assert spelled == []


def test_no_code_cites_an_issue_number() -> None:
    """The tracker is not in the repository: a comment says why, not which issue asked."""
    import re

    cited = re.compile(r"\b[Ii]ssues? ?\d+|(?<![\w&])#\d+\b(?!;)")
    found = []
    for folder in (*OURS, "benchmarks", "tests", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if cited.search(line) and "optuna#" not in line and "its issue #" not in line:
                    found.append(f"{path.relative_to(REPO)}:{number}")
    assert found == []


def _resolves(dotted: str) -> bool:
    """A module, or a module's attribute (a class, a method): ``verl_sweep.a.b.Class.method``."""
    import importlib

    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for name in parts[n:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_module_the_architecture_names_exists() -> None:
    """docs/architecture.md is the map: each file or folder it names (``search/engine/driver.py``,
    ``spaces/``) and each dotted module (``verl_sweep.search.engine.driver``) is there."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text()
    roots = "|".join((*sorted(OURS), "benchmarks", "tests", "scripts", "studies", "docs"))
    paths = set(re.findall(rf"(?<![\w/.-])((?:{roots})/[\w./-]*)", text))
    missing = [p for p in sorted(paths) if not (REPO / p.rstrip(".")).exists()]
    for dotted in set(re.findall(r"\bverl_sweep(?:\.\w+)+", text)):
        missing += [] if _resolves(dotted) else [dotted]
    assert len(paths) >= 20, "the map names the modules it describes"
    assert missing == []


def test_space_kinds_are_spelled_once() -> None:
    """A space kind is its class's ``kind`` (``register_space`` fills ``SPACES`` from them): no
    other code compares a space or a stage's space with a spelled kind, or names one as a
    stage's ``space``, so a new stage is registered in one place."""
    from verl_sweep.spaces import SPACES

    spelled = []
    for path, tree in _sources().items():
        if not path.startswith(("search/", "objectives/", "launchers/")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
                kinds = [c for p in parts for c in ast.walk(p) if isinstance(c, ast.Constant) and c.value in SPACES]
                if kinds and any(("space" in ast.unparse(p) or "kind" in ast.unparse(p)) for p in parts):
                    spelled.append(f"{path}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.keyword) and node.arg == "space" and isinstance(node.value, ast.Constant):
                spelled.append(f"{path}:{node.value.lineno} space={node.value.value!r}")
    assert spelled == []
