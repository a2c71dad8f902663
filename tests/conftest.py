"""Fixtures and hooks only: helpers live in tests/support (``from support import …``).

Tiers are markers, not folders (pyproject's ``markers`` lists them): ``fast`` (a module's
``pytestmark``) is the inner loop, ``pytest -m fast``; ``slow`` tests take more than ~20 s;
``newest`` tests also run against the newest releases (``scripts/test.sh --newest``).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Iterator

import pytest

from support import demo_data, write_study

# In CI a skip fails unless its reason is a fact of CI's machine (tests/support/strict_skips.py).
pytest_plugins = ["support.strict_skips"]

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

#: markers a fast test may not carry: the fast tier runs in-process without a server
NOT_FAST = ("slow", "postgres")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test is in one speed tier: ``fast`` cannot be ``slow`` or need PostgreSQL."""
    clashes = [f"{item.nodeid} ({name})" for item in items if item.get_closest_marker("fast")
               for name in NOT_FAST if item.get_closest_marker(name)]
    if clashes:
        raise pytest.UsageError("A fast test must not be marked " + " or ".join(NOT_FAST)
                                + ", but these are: " + ", ".join(clashes)
                                + ". Drop the module's fast mark or move the test to a file without it.")


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
