#!/usr/bin/env bash
# Set up and run the test suite. PostgreSQL tests use $VERL_SWEEP_TEST_PG_URL (set by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
