from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

# In CI a skip fails unless its reason is a fact of CI's machine (tests/strict_skips.py).
pytest_plugins = ["strict_skips"]

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
        [sys.executable, "-m", "verl_sweep.search.commands.cli", *args],
        cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest-xdist worker of this run shares (each worker's temp folder is its
    own, and the folder above it the run's); without xdist, the session's temp folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture
def demo_copy(tmp_path: Path) -> Path:
    """The demo study, written into a temporary directory (its database lands beside it)."""
    return write_study(tmp_path, demo_data(), "demo.yaml")


@pytest.fixture(autouse=True)
def _one_postgres_test_at_a_time(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """scripts/test.sh runs two pytest-xdist workers, a test file each at a time; some
    PostgreSQL tests restart the server, so every test that needs it holds one lock shared by
    the workers (the folder above each worker's temp folder is the run's)."""
    if request.node.get_closest_marker("postgres") is None:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "postgres.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
