#!/usr/bin/env bash
# Create .venv (Python 3.10-3.12) and install verl-sweep with everything its tests need.
# Idempotent: a second run only checks that the packages are there.
# --bench also installs the benchmark's HPO peers (SMAC3, DEHB, NePS, Syne Tune: python -m benchmarks.run).
# --newest makes .venv-newest instead, with the newest releases pyproject.toml's ranges admit
# (what `pip install .` gives a user today), for `scripts/test.sh --newest`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ "${1:-}" = "--newest" ]; then
  [ -x .venv-newest/bin/python ] || "$PYTHON" -m venv .venv-newest
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # Every dependency moved to its newest release in range on each run, but torch: the CPU
  # build stays (torch is the user's own, and a newer one would be a CUDA build of gigabytes).
  echo "torch==2.13.0" > .venv-newest/torch-constraint.txt
  .venv-newest/bin/pip install -q --upgrade --upgrade-strategy eager -c .venv-newest/torch-constraint.txt \
    -e ".[verl,postgres,test]"
  .venv-newest/bin/python -c "import optuna, sqlalchemy, pydantic; print('newest releases in range: optuna', \
optuna.__version__, '· sqlalchemy', sqlalchemy.__version__, '· pydantic', pydantic.__version__)"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp=.venv/.verl-sweep-installed
want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "${1:-}" = "--bench" ]; then
  # Its own stamp: a second --bench only checks, and the plain run after it (scripts/test.sh
  # runs one) finds the base stamp current and leaves the peers as they are.
  bench_stamp=.venv/.verl-sweep-bench-installed
  bench_want=$(cat pyproject.toml constraints.txt constraints-bench.txt scripts/setup.sh | sha256sum | cut -c1-16)
  if [ "$(cat "$bench_stamp" 2>/dev/null)" != "$bench_want" ]; then
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -c constraints-bench.txt -e ".[verl,ray,gpu,postgres,trackers,test,bench]"
    # DEHB 0.1.2 pins numpy<2 (ours is 2.4.6; it runs on it): without its deps, listed in bench.
    .venv/bin/pip install -q --no-deps -c constraints-bench.txt "dehb==0.1.2"
    # NePS 0.17.0 (PriorBand) pins pandas<3 and networkx<3 (ours: 3.1.1, 3.6.1; it runs on them):
    # without its deps, listed in bench; torchvision, which it lists, it never imports.
    .venv/bin/pip install -q --no-deps -c constraints-bench.txt "neural-pipeline-search==0.17.0"
    echo "$bench_want" > "$bench_stamp"
  fi
  echo "$want" > "$stamp"
  exit 0
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # The CPU build of torch first: verl pulls torch, and a bare `torch` would fetch a CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  # constraints.txt pins every dependency to a tested set: reproducible, and no resolver
  # backtracking through verl's large dependency tree.
  .venv/bin/pip install -q -c constraints.txt -e ".[verl,ray,gpu,postgres,trackers,test]"
  echo "$want" > "$stamp"
fi
