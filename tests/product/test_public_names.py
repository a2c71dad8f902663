"""A module of ours uses another module's public names only: a leading underscore means "this
module's own", so no ``from X import _name`` and no ``module._name`` on an imported module of
ours. Tests may reach into private names; the code may not."""

from __future__ import annotations

import ast
from pathlib import Path

from support import REPO

#: the folders whose modules must keep to each other's public names
FOLDERS = ("search", "spaces", "objectives", "launchers", "verl_knowledge", "benchmarks", "scripts")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of ours (``verl_sweep.spaces.limits``,
    ``benchmarks.peers``), not a class or function in one."""
    parts = dotted.split(".")
    if parts[0] == "verl_sweep":
        parts = parts[1:]
    if not parts or parts[0] not in FOLDERS:
        return not parts
    base = REPO.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private_uses(path: Path, *, where: str) -> list[str]:
    """``from X import _name`` of a module of ours, and ``alias._name`` where ``alias`` is bound
    to a module of ours (``import X as alias``, ``from package import module as alias``)."""
    tree = ast.parse(path.read_text())
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> the dotted name it was imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_module(node.module):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno} from {node.module} import {alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            head, _, rest = ast.unparse(node.value).partition(".")
            if head in bound and _is_module(bound[head] + (f".{rest}" if rest else "")):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_checker_finds_both_forms(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from verl_sweep.verl_knowledge.overrides import _NUMBER\n"
                      "from verl_sweep.spaces import bounds as B\n"
                      "import verl_sweep.spaces.registry\n"
                      "from verl_sweep.spaces.base import Space\n"
                      "import os\n"
                      "B._private()\nverl_sweep.spaces.registry._x\nSpace._y\nos._exit\n")
    found = sorted(line.split(" ", 1)[1] for line in private_uses(sample, where="sample"))
    assert found == ["B._private", "from verl_sweep.verl_knowledge.overrides import _NUMBER", "verl_sweep.spaces.registry._x"]


def test_no_module_uses_another_modules_private_name() -> None:
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            found += private_uses(path, where=str(path.relative_to(REPO)))
    assert found == []
