#!/usr/bin/env bash
# Set up and run the test suite. PostgreSQL tests use $VERL_SWEEP_TEST_PG_URL (set by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
if [ "${1:-}" = "--newest" ]; then
  # The newest releases in range (scripts/setup.sh --newest): the fast tier, the Optuna forks'
  # suites, and whole studies on SQLite and PostgreSQL (with no warning printed), so that a new
  # release of a dependency fails here the day it ships.
  shift
  bash scripts/setup.sh --newest
  studies=tests/test_first_contact.py::test_
  exec .venv-newest/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadfile \
    tests/unit tests/test_optuna_forks.py \
    "${studies}run_starts_a_study_on_an_empty_sqlite_file_and_leaves_only_the_database_and_runs" \
    "${studies}postgres_first_run_on_an_empty_database_and_beside_another_applications_tables" \
    "${studies}postgres_worker_started_first_waits_on_an_empty_database_and_joins" "$@"
fi
bash scripts/setup.sh
# Two pytest workers (TEST_WORKERS): the suite waits on subprocesses much of the time, and one
# worker kept ~0.8 of CI's 2 cores busy. A test file runs on one worker (its module fixtures
# are built once); tests/conftest.py runs the PostgreSQL tests one at a time. (--dist loadgroup
# does not group under pytest 9.2: xdist 3.8 marks a group by setting item._nodeid, which pytest
# 9 no longer reads.)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
