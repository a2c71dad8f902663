"""What tests share: the repository's paths, the demo study, and the CLI run as a user runs it.

One place for test helpers (import them as ``from support import …``; pyproject's pytest
``pythonpath`` puts ``tests/`` on the path). Beside this module:

- ``support.cluster``: a PostgreSQL database per test, tiny studies, worker processes.
- ``support.launcher_contract``: the behavioural suite every launcher passes.
- ``support.fake_probe``: a stand-in verl probe (a script the launcher tests start).
- ``support.verl_examples``: verl's own launch scripts played as a user would.
- ``support.curves``: synthetic verl-like runs for scorer, health and pruner tests.
- ``support.strict_skips``: the pytest plugin that turns skips into failures in CI.

``tests/conftest.py`` holds only fixtures and hooks; nothing imports from it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "studies" / "demo.yaml"


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


def kill_run_when(study: Path, ready: Callable[[], bool], *, timeout_s: float, what: str, poll_s: float = 0.3) -> None:
    """Start ``run STUDY`` (in the study's folder), SIGKILL it the moment ``ready()`` holds (a
    crash at that point), and fail with ``what`` if it never does or the driver ends first."""
    import signal
    import time

    driver = subprocess.Popen([sys.executable, "-m", "verl_sweep.search.commands.cli", "run", str(study)],
                              cwd=study.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert driver.poll() is None, f"driver ended early: {driver.stderr.read() if driver.stderr else ''}"
            if ready():
                break
            time.sleep(poll_s)
        else:
            pytest.fail(what)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    finally:
        if driver.poll() is None:
            driver.kill()


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest-xdist worker of this run shares (each worker's temp folder is its
    own, and the folder above it the run's); without xdist, the session's temp folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
