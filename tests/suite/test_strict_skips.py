"""tests/support/strict_skips.py, run by pytest on generated test files: in CI (the CI variable set) a
skip for a missing part fails, whichever way it was raised; an allowed reason stays a skip;
without CI every skip stays a skip."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

TESTS = Path(__file__).resolve().parents[1]

MISSING = '''
import pytest
from support.strict_skips import ALLOWED_SKIPS

def verl_available():
    return False

def test_importorskip():
    pytest.importorskip("a_module_that_went_missing")

@pytest.mark.skipif(not verl_available(), reason="verl is not installed")
def test_skipif():
    pass

def test_skip_call():
    pytest.skip("needs verl")

@pytest.fixture
def server():
    pytest.skip("no PostgreSQL server (set VERL_SWEEP_TEST_PG_URL)")

def test_skip_in_a_fixture(server):
    pass

@pytest.mark.parametrize("reason", sorted(ALLOWED_SKIPS))
def test_a_fact_of_the_machine(reason):
    pytest.skip(reason)

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_an_xfail_is_no_skip():
    assert False

def test_passes():
    pass
'''

MODULE_LEVEL = '''
import pytest
pytest.importorskip("a_module_that_went_missing")

def test_never_collected():
    pass
'''


def _pytest(tmp_path: Path, source: str, ci: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_generated.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # 2-3 s a run less; xdist is named where a test wants it
    if ci is not None:
        env["CI"] = ci
    # -c /dev/null and --rootdir: not the repository's pytest settings nor its conftest, only the plugin.
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "support.strict_skips", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(tmp_path), "-rA", *args, "test_generated.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.parametrize("workers", [[], ["-p", "xdist.plugin", "-n", "2"]], ids=["one process", "xdist"])
def test_in_ci_a_skip_for_a_missing_part_fails_and_an_allowed_one_does_not(tmp_path: Path, workers: list[str]) -> None:
    """A skip raised in a test fails it; one raised while setting it up (a skipif mark, a
    fixture) is an error; both fail the run. Under xdist too (scripts/test.sh's -n 2)."""
    from support.strict_skips import ALLOWED_SKIPS

    result = _pytest(tmp_path, MISSING, "true", *workers)
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b2 failed, 1 passed, {len(ALLOWED_SKIPS)} skipped, 1 xfailed, 2 errors\b", summary), result.stdout[-3000:]
    assert result.returncode == pytest.ExitCode.TESTS_FAILED
    for name in ("test_importorskip", "test_skipif", "test_skip_call", "test_skip_in_a_fixture"):
        assert re.search(rf"^(FAILED|ERROR) test_generated\.py::{name}\b", result.stdout, re.M), result.stdout[-3000:]
    assert "a skip in CI must be a fact of CI's machine, but got 'verl is not installed'." in result.stdout
    assert "but got \"could not import 'a_module_that_went_missing'" in result.stdout


def test_in_ci_a_module_skipped_at_collection_fails(tmp_path: Path) -> None:
    result = _pytest(tmp_path, MODULE_LEVEL, ci="1")
    assert result.returncode != 0 and "1 error" in result.stdout.strip().splitlines()[-1], result.stdout[-3000:]
    assert "a skip in CI must be a fact of CI's machine" in result.stdout


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_outside_ci_skips_stay_skips(tmp_path: Path, ci: str | None) -> None:
    from support.strict_skips import ALLOWED_SKIPS

    result = _pytest(tmp_path, MISSING, ci=ci)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(rf"\b1 passed, {4 + len(ALLOWED_SKIPS)} skipped, 1 xfailed\b", result.stdout), result.stdout[-3000:]
    result = _pytest(tmp_path, MODULE_LEVEL, ci=ci)
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "1 skipped" in result.stdout, result.stdout[-3000:]
