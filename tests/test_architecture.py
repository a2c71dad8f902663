"""The import directions of STYLE.md: spaces/ and launchers/ are leaves, objectives/ knows only
the launcher interface, search/ composes everything; heavy packages are imported lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

OURS = {"search", "spaces", "objectives", "launchers"}
ALLOWED = {
    "spaces": {"spaces"},
    "launchers": {"launchers"},
    "objectives": {"objectives", "spaces", "launchers.base"},
    "search": OURS,
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_import_directions(package: str) -> None:
    allowed = ALLOWED[package]
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in OURS:
                continue
            if not any(name == a or name.startswith(a + ".") or a == top and "." not in a for a in allowed):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []


def test_packages_import_without_heavy_dependencies() -> None:
    code = (
        "import sys, search.cli, search.driver, launchers, spaces, objectives.probe\n"
        "heavy = [m for m in ('ray', 'torch', 'verl', 'hydra') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
