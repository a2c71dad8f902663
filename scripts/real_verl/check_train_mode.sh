#!/usr/bin/env bash
# Train mode on real verl 0.9.1, one lent GPU, in phases that span device calls (each call is
# capped at 10 minutes; the driver runs detached between them, the machine held by the calls).
#
# What it runs: studies/tiny-h200.yaml (the 3.2M Qwen2 of make_tiny.py, sevens reward) in train
# mode (check_train_mode.py study): the kl and lr stages as branches from the chain's
# checkpoint, then the continuation to the run's end. QUICK=1: one candidate and one incumbent
# run a stage, 11-step branches, a continuation of 2 steps (three waves of start-ups, ~16 minutes
# on the toy; SPACES=kl: one stage, two waves, ~11 minutes); else 12-step branches, a 40-step
# run and the stages' own budgets.
# What it must show (check_train_mode.py check exits non-zero otherwise): each branch starts at
# the chain's step + 1, trains at its own lr (the rewrite of its copy took effect) and KL
# coefficient, each stage branches from a checkpoint the stage before saved, and the model is a
# verl checkpoint at the run's last step. ADAPTIVE_KL=1: the baseline with an adaptive in-reward
# KL controller, and each branch must start it where the chain's run left it (or at its own
# kl_coef where it changes the controller's settings). KILL_AT=S: SIGKILL the driver S s after
# start and `resume`, which must go on from the database and the checkpoints on disk.
#
# usage, after `bash scripts/real_verl/device.sh parts setup`, from the repository root:
#   bash scripts/real_verl/check_train_mode.sh start wait:550        (first device call)
#   bash scripts/real_verl/check_train_mode.sh wait:560 check        (the next, back to back)
set -uo pipefail
R=${VS_ROOT:-/tmp/vs}; W=${VS_TRAIN_ROOT:-/tmp/vs-train}; T0=$SECONDS
mkdir -p "$W"
export PYTHONPATH=$R/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
VS_PY='import sys; sys.argv[0] = "verl-sweep"; from verl_sweep.search.commands.cli import main; main()'
STUDY=$W/tiny-h200-train.yaml; DB=sqlite:///$W/tiny-h200-train.db; NAME=tiny-h200-train
alive() { [ -f "$W/driver.pid" ] && kill -0 "$(cat "$W/driver.pid")" 2>/dev/null; }
detach() { setsid nohup python3 -c "$VS_PY" "$@" --storage "$DB" >> "$W/driver.log" 2>&1 < /dev/null & echo $! > "$W/driver.pid"; }
bring_back() {  # the logs, and the study's database, its file and each run's metrics and launch, as a tarball
  [ -n "${OUT:-}" ] || return 0
  cp "$W"/driver.log "$W"/status.txt "$W"/check.txt "$OUT"/ 2>/dev/null
  (cd "$W" && find runs -maxdepth 4 -name 'global_step_*' > checkpoints.txt 2>/dev/null
   tar czf "$OUT/train-check.tar.gz" --ignore-failed-read tiny-h200-train.db tiny-h200-train.yaml checkpoints.txt \
     $(find runs -maxdepth 3 -type f \( -name metrics.jsonl -o -name '*.json' -o -name '*.sh' \) 2>/dev/null)) 2>/dev/null; true
}
rc=0
for phase in "$@"; do
  echo "== $(date -u +%T) phase $phase"
  case $phase in
  start)
    python3 scripts/real_verl/check_train_mode.py study "$STUDY" ${ADAPTIVE_KL:+adaptive-kl} ${QUICK:+quick} ${SPACES:+spaces=$SPACES}
    detach run "$STUDY"; date -u +%s > "$W/started" ;;
  wait:*)  # follow the driver until T s into this call; SIGKILL and resume at KILL_AT s after start
    while alive && [ $((SECONDS - T0)) -lt "${phase#wait:}" ]; do
      if [ -n "${KILL_AT:-}" ] && [ ! -f "$W/killed" ] && [ $(( $(date -u +%s) - $(cat "$W/started") )) -ge "$KILL_AT" ]; then
        kill -9 "$(cat "$W/driver.pid")"; touch "$W/killed"; echo "SIGKILL the driver at $KILL_AT s"; sleep 2
        detach resume "$NAME"
      fi
      sleep 10
    done
    tail -5 "$W/driver.log"; alive && echo "driver still running" ;;
  check)
    alive && { echo "the driver has not finished"; rc=1; }
    python3 -c "$VS_PY" status "$NAME" --storage "$DB" > "$W/status.txt" 2>&1; tail -25 "$W/status.txt"
    python3 scripts/real_verl/check_train_mode.py check "$STUDY" "$DB" | tee "$W/check.txt"; rc=$((rc | PIPESTATUS[0])) ;;
  esac
done
bring_back
exit $rc
