#!/usr/bin/env bash
# Train mode on real verl 0.9.1, one lent GPU: written without a GPU, not run yet.
#
# What it runs: studies/tiny-h200.yaml (the 3.2M Qwen2 of make_tiny.py, sevens reward) in train
# mode (check_train_mode.py study): the kl and lr stages as 12-step branches from the chain's
# checkpoint, then the continuation to step 40; SIGKILL of the driver at $KILL_AT s (default 240)
# and `resume`, which must go on from the database and the checkpoints on disk.
# What it must show (check_train_mode.py check exits non-zero otherwise): each branch starts at
# the chain's step + 1, trains at its own lr (the rewrite of its copy took effect) and KL
# coefficient, each stage branches from a checkpoint the stage before saved, and the model is a
# verl checkpoint at step 40. ADAPTIVE_KL=1: the baseline with an adaptive in-reward KL
# controller, and each branch must start it where the chain's run left it (or at its own kl_coef
# where it changes the controller's settings).
#
# usage, after `bash scripts/real_verl/device.sh parts setup`, from the repository root:
#   bash scripts/real_verl/check_train_mode.sh        (about 10 minutes: one lent-machine call)
set -uo pipefail
R=${VS_ROOT:-/tmp/vs}; W=${VS_TRAIN_ROOT:-/tmp/vs-train}; KILL_AT=${KILL_AT:-240}
mkdir -p "$W"
export PYTHONPATH=$R/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
VS_PY='import sys; sys.argv[0] = "verl-sweep"; from verl_sweep.search.commands.cli import main; main()'
STUDY=$W/tiny-h200-train.yaml; DB=sqlite:///$W/tiny-h200-train.db
python3 scripts/real_verl/check_train_mode.py study "$STUDY" ${ADAPTIVE_KL:+adaptive-kl}
python3 -c "$VS_PY" run "$STUDY" --storage "$DB" > "$W/run.log" 2>&1 &
DRIVER=$!
sleep "$KILL_AT"; kill -9 "$DRIVER" 2>/dev/null && echo "SIGKILL the driver at $KILL_AT s"
python3 -c "$VS_PY" resume tiny-h200-train --storage "$DB" > "$W/resume.log" 2>&1; echo "resume: exit $?"
python3 -c "$VS_PY" status tiny-h200-train --storage "$DB" | tee "$W/status.txt" | tail -25
python3 scripts/real_verl/check_train_mode.py check "$STUDY" "$DB"; rc=$?
[ -n "${OUT:-}" ] && cp "$W"/*.log "$W/status.txt" "$OUT"/ 2>/dev/null
exit $rc
