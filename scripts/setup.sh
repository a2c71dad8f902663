#!/usr/bin/env bash
# Create .venv (Python 3.10-3.12) and install verl-sweep with everything its tests need.
# Idempotent: a second run only checks that the packages are there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp=.venv/.verl-sweep-installed
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # The CPU build of torch first: verl pulls torch, and a bare `torch` would fetch a CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  # constraints.txt pins every dependency to a tested set: reproducible, and no resolver
  # backtracking through verl's large dependency tree.
  .venv/bin/pip install -q -c constraints.txt -e ".[verl,ray,gpu,postgres,test]"
  echo "$want" > "$stamp"
fi
