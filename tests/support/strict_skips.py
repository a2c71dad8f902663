"""Strict skips: in CI a skipped test fails, unless its reason is a fact of CI's machine.

A part that goes missing (verl no longer importable, the bench extra not installed, a server
not started) used to turn the tests that need it into skips, and CI stayed green. With the
environment variable ``CI`` set (``.ci/run`` sets it, as CI services do; ``0`` or ``false``
turn it off), every skip, whatever raised it (``pytest.skip``, ``importorskip``, a ``skipif``
mark, a module-level skip at collection), becomes a failure unless its reason is in
``ALLOWED_SKIPS``. Without ``CI`` skips stay skips: a developer without PostgreSQL or the
bench extra can still run the suite. tests/conftest.py loads this plugin; tests/suite/
test_strict_skips.py runs it on generated test files.
"""

from __future__ import annotations

import os
from typing import Any, Generator

import pytest

#: Skip reasons that are true facts of the machine CI runs on, not parts that could go missing.
ALLOWED_SKIPS = frozenset({
    "chattr +i is not permitted here",  # a container without CAP_LINUX_IMMUTABLE
    "fake GPU ids are only fake on a machine without NVML GPUs",  # a machine with GPUs
    "needs a machine without GPUs",
})


def strict() -> bool:
    """True in CI: a skip whose reason is not in ALLOWED_SKIPS is a failure."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_reason(longrepr: Any) -> str:
    """The reason a skip report gives (pytest keeps it as "Skipped: <reason>")."""
    message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    prefix = "Skipped: "
    return message[len(prefix):] if message.startswith(prefix) else message


def _fail_unless_allowed(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or not strict():
        return
    reason = skip_reason(report.longrepr)
    if reason in ALLOWED_SKIPS:
        return
    report.outcome = "failed"
    report.longrepr = (f"a skip in CI must be a fact of CI's machine, but got {reason!r}. Install or start what "
                       "the test needs in .ci/run, or, if CI's machine truly lacks it, add the reason to "
                       "ALLOWED_SKIPS in tests/support/strict_skips.py.")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    _fail_unless_allowed(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _fail_unless_allowed(outcome.get_result())
