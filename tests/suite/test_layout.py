"""The test suite's layout: test folders mirror the packages, helpers come from ``support``
(never from conftest, which holds fixtures and hooks only), a test file imports another only
from its own folder, and every test file a document names exists."""

from __future__ import annotations

import re
import subprocess

import pytest

from support import REPO

pytestmark = pytest.mark.fast

TESTS = REPO / "tests"
#: a folder per package (search/ by layer), product/ for the whole product, suite/ for the suite
SUBJECTS = ("search", "spaces", "objectives", "launchers", "benchmarks", "product", "suite")
#: dated records: they name the files as they were then
JOURNALS = ("CHANGELOG.md", "benchmarks/results/HISTORY.md", "docs/device-runs/")


def _test_files() -> list[str]:
    return sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if "data" not in p.relative_to(TESTS).parts)


def test_no_file_imports_conftest() -> None:
    found = subprocess.run(["git", "grep", "--untracked", "-n", "-E", r"^\s*(from conftest import|import conftest)", "--", "*.py"],
                           cwd=REPO, capture_output=True, text=True).stdout
    assert not found, ("tests/conftest.py must hold fixtures and hooks only, but these import from it:\n" + found
                       + "Import helpers from tests/support (`from support import cli`).")


def test_every_test_file_sits_in_a_subject_folder() -> None:
    misplaced = [f for f in _test_files() if f.split("/")[0] not in SUBJECTS]
    assert _test_files() and not misplaced, (
        f"a test file must sit in one of tests/{{{','.join(SUBJECTS)}}}/, but got {misplaced}. Move it (git mv) to "
        "the folder of the package it tests; its speed tier is a marker (pytestmark = pytest.mark.fast), not a folder.")


def test_a_test_file_imports_other_test_files_only_from_its_own_folder() -> None:
    """pytest puts each test file's folder on sys.path: ``from test_x import …`` finds test_x
    only beside it (or by luck of collection order). Shared helpers belong in tests/support."""
    crossing = []
    for name in _test_files():
        path = TESTS / name
        for imported in re.findall(r"^\s*from (test_\w+) import", path.read_text(), flags=re.M):
            if not (path.parent / f"{imported}.py").is_file():
                crossing.append(f"{name} imports {imported}")
    assert not crossing, f"a test file may import another only from its own folder, but {crossing}. Move the helper to tests/support."


def test_every_test_file_a_document_names_exists() -> None:
    found = subprocess.run(["git", "grep", "--untracked", "-h", "-o", "-E", r"tests/[A-Za-z0-9_/.-]+\.py", "--", ".",
                            *(f":!{journal}" for journal in JOURNALS)],
                           cwd=REPO, capture_output=True, text=True).stdout.split()
    missing = sorted({path for path in found if not (REPO / path).is_file()})
    assert found and not missing, f"these test files are named but not there: {missing}. Update the text to the file's new place."
