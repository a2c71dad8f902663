#!/usr/bin/env bash
# Set up and run the test suite. PostgreSQL tests use $VERL_SWEEP_TEST_PG_URL (set by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
if [ "${1:-}" = "--newest" ]; then
  # The newest releases in range (scripts/setup.sh --newest): the fast tier, the Optuna forks'
  # suites, and whole studies on SQLite and PostgreSQL (with no warning printed), so that a new
  # release of a dependency fails here the day it ships. Tiers are markers (pyproject.toml):
  # `fast` marks the inner loop, `newest` the forks' suites and the whole studies.
  shift
  bash scripts/setup.sh --newest
  exec .venv-newest/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile \
    -m "fast or newest" "$@"
fi
bash scripts/setup.sh
# Two pytest workers (TEST_WORKERS): the suite waits on subprocesses much of the time, and one
# worker kept ~0.8 of CI's 2 cores busy. A test file runs on one worker (its module fixtures
# are built once); tests/conftest.py runs the PostgreSQL tests one at a time. (--dist loadgroup
# does not group under pytest 9.2: xdist 3.8 marks a group by setting item._nodeid, which pytest
# 9 no longer reads.)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
