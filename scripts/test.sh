#!/usr/bin/env bash
# Set up and run the test suite. PostgreSQL tests use $VERL_SWEEP_TEST_PG_URL (set by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Two pytest workers (TEST_WORKERS): the suite waits on subprocesses much of the time, and one
# worker kept ~0.8 of CI's 2 cores busy. A test file runs on one worker (its module fixtures
# are built once); tests/conftest.py runs the PostgreSQL tests one at a time. (--dist loadgroup
# does not group under pytest 9.2: xdist 3.8 marks a group by setting item._nodeid, which pytest
# 9 no longer reads.)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
