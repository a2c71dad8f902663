#!/usr/bin/env bash
# Set up and run the demo study end to end on the verl simulator with SQLite, then show its
# status and export the winner.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rm -f studies/demo.db && rm -rf studies/runs/demo
.venv/bin/verl-sweep run studies/demo.yaml
.venv/bin/verl-sweep status demo --storage sqlite:///studies/demo.db
.venv/bin/verl-sweep export demo --storage sqlite:///studies/demo.db -o out/best.yaml
echo "exported out/best.yaml"
