#!/usr/bin/env bash
# mypy over every module of verl_sweep (pyproject.toml's [tool.mypy]). The packages live in the
# repository's top-level folders and pyproject maps them into verl_sweep, a mapping mypy cannot
# read: it checks them through a tree of links under build/ (ignored), named as installed.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck/verl_sweep
rm -rf build/typecheck && mkdir -p "$tree"
for name in search spaces objectives launchers verl_knowledge verl_sweep/__init__.py verl_sweep/__main__.py; do
  ln -s "$PWD/$name" "$tree/$(basename "$name")"
done
cd build/typecheck
exec "${MYPY:-../../.venv/bin/mypy}" --config-file ../../pyproject.toml -p verl_sweep "$@"
