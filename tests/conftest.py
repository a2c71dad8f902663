from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "studies" / "demo.yaml"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def demo_data() -> dict[str, Any]:
    return yaml.safe_load(DEMO.read_text())


def write_study(directory: Path, data: dict[str, Any], name: str = "study.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the verl-sweep CLI as a user would (a separate process)."""
    return subprocess.run(
        [sys.executable, "-m", "search.cli", *args],
        cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    """The demo study, written into a temporary directory (its database lands beside it)."""
    return write_study(tmp_path, demo_data(), "demo.yaml")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist (scripts/test.sh runs ``-n 2 --dist loadgroup``): a module's
    tests share a worker, so a module fixture (a finished demo study, a Ray cluster) is built
    once; every test that needs the PostgreSQL server shares one worker, as some restart it."""
    for item in items:
        needs_pg = item.get_closest_marker("postgres") is not None
        item.add_marker(pytest.mark.xdist_group("postgres" if needs_pg else item.module.__name__))
