#!/usr/bin/env bash
# Set up and run the test suite. PostgreSQL tests use $VERL_SWEEP_TEST_PG_URL (set by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Two pytest workers (TEST_WORKERS): the suite waits on subprocesses much of the time, and one
# worker kept ~0.8 of CI's 2 cores busy. tests/conftest.py groups the tests so that a module's
# fixtures are built once and the PostgreSQL tests (some restart the server) run one at a time.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
