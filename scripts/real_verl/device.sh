#!/usr/bin/env bash
# On the lent H200, from the repository root: a real-verl study, one phase after another.
# Idempotent; each device call runs some phases:  bash scripts/real_verl/device.sh PHASE...
# The study: $VS_STUDY (default tiny-h200, studies/$VS_STUDY.yaml) on the workload that
# make_tiny.py builds with --shape $VS_SHAPE (default tiny) under $VS_DATA (default /tmp/vs-tiny).
#   parts         copy the carried parts (.realverl/cN/pNN) to $R/parts
#   setup         join + check + unpack the site tree, build the tiny model/data, print versions
#   start         GPU monitor, nvidia-smi snapshot, the study driver and the failure provocations
#   killresume:S  S s after start: SIGKILL the driver, record what it left, then `resume`
#   monitor       the GPU monitor alone
#   resume        `resume` the study from the database an earlier lease brought back (the
#                 study spans leases: $RESUME_DB, committed under docs/device-runs/)
#   side          prune_sigterm.py: a candidate pruned, then SIGTERM to its driver (background)
#   side-wait:T   wait for it until T s into this call, then bring its evidence back ($OUT/side.tar.gz)
#   oom:D         the memory-fraction provocation, D s from now (background)
#   follow:S      follow the study for up to S s (returns early when the driver exits)
#   follow-until:T  the same, until T s after this call began
#   snapshot      the database, the runs' metrics and GPU samples, the logs' ends, to $OUT
#   finish        status, report, export, real training from the export, evidence to $OUT
set -uo pipefail
REPO=$PWD; R=${VS_ROOT:-/tmp/vs}; EV=$R/evidence; NAME=${VS_STUDY:-tiny-h200}; STUDY=$R/study/$NAME.yaml
DB=sqlite:///$R/study/$NAME.db; SHAPE=${VS_SHAPE:-tiny}; DATA=${VS_DATA:-/tmp/vs-tiny}
STUDY_SRC=${VS_STUDY_SRC:-studies/$NAME.yaml}
mkdir -p "$R/parts" "$EV" "$R/study"
export PYTHONPATH=$R/site:$REPO PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
export VLLM_USE_FLASHINFER_SAMPLER=0 RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0 RAY_DISABLE_DOCKER_CPU_WARNING=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
VS_PY='import sys; sys.argv[0] = "verl-sweep"; from verl_sweep.search.commands.cli import main; main()'
vs() { python3 -c "$VS_PY" "$@"; }
stamp() { date -u +%FT%T.%3NZ; }
marked() {  # every live process that carries a run marker or is a Ray process
  python3 - <<'PY'
import psutil
for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
    try:
        env = p.environ().get("VERL_SWEEP_RUN_DIR", "")
    except psutil.Error:
        env = ""
    name = p.info["name"] or ""
    cmd = " ".join(p.info["cmdline"] or [])[:120]
    if env or name.startswith("ray::") or "raylet" in cmd or "gcs_server" in cmd:
        print(p.info["pid"], p.info["status"], name, env.rsplit("/", 1)[-1] or "-", cmd)
PY
}
smi() { nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu --format=csv,noheader; \
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; }
keep_tails() {  # the last 400 kB of each big run log, under $R/logs (the whole logs stay here)
  for f in "$@"; do
    [ -f "$f" ] && { d=$(dirname "$f"); mkdir -p "$R/logs/${d#$R/}"; tail -c 400000 "$f" > "$R/logs/${d#$R/}/$(basename "$f").tail"; }
  done
}
running() { [ -f "$R/driver.pid" ] && kill -0 "$(cat "$R/driver.pid")" 2>/dev/null; }
progress() {
  local n; n=$(ls "$R"/study/runs/$NAME 2>/dev/null | wc -l)
  echo "$(stamp) driver $(running && echo alive || echo gone); runs $n; steps: $(for f in "$R"/study/runs/$NAME/*/metrics.jsonl; do [ -f "$f" ] && printf '%s ' "$(wc -l < "$f")"; done)"
}

for phase in "$@"; do
  echo "== $(stamp) phase $phase"
  case $phase in
  parts)
    for d in .realverl/c*; do [ -d "$d" ] && cp -n "$d"/* "$R/parts/"; done
    ls -la "$R/parts"; nvidia-smi -L; df -h /tmp | tail -1 ;;
  setup)
    if [ ! -f "$R/site/.ok" ]; then
      [ "$(ls "$R"/parts/p* | wc -l)" -ge 3 ] || { echo "missing parts"; exit 1; }
      cat "$R"/parts/p* > "$R/site.tar.xz"
      (cd "$R" && sha256sum -c parts/site.tar.xz.sha256) || { echo "SHA MISMATCH"; exit 1; }
      mkdir -p "$R/site" && tar -C "$R/site" -xJf "$R/site.tar.xz" && touch "$R/site/.ok"
      rm -f "$R/site.tar.xz"
    fi
    # verl-sweep's own CLI packages at the versions of constraints.txt (the image's may be older)
    for w in .realverl/c*/extra/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" "$R/site"; done
    python3 -c "import torch, vllm, verl, ray, optuna, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'verl', verl.__version__, 'ray', ray.__version__, 'optuna', optuna.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1 | tee "$EV/versions.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$EV/versions.txt"
    [ -f "$DATA/model/config.json" ] || python3 scripts/real_verl/make_tiny.py "$DATA" --shape "$SHAPE" 2>&1 | tail -3 ;;
  start)
    cp "$STUDY_SRC" "$STUDY"
    [ -f "$R/monitor.pid" ] || { setsid nohup python3 scripts/real_verl/gpu_monitor.py "$EV/gpu_monitor.jsonl" >"$R/monitor.log" 2>&1 < /dev/null & echo $! > "$R/monitor.pid"; }
    { stamp; smi; } > "$EV/nvidia-smi-before-study.txt"
    if [ ! -f "$R/driver.pid" ]; then
      date +%s > "$R/driver.started"
      setsid nohup python3 -c "$VS_PY" run "$STUDY" > "$R/driver1.log" 2>&1 < /dev/null & echo $! > "$R/driver.pid"
      cp "$R/driver.pid" "$R/driver1.pid"
      [ "${VS_PROVOKE:-1}" = 1 ] && setsid nohup python3 scripts/real_verl/provoke.py "$STUDY" "$R/provoke-runs" "$EV/provoke.json" > "$EV/provoke.log" 2>&1 < /dev/null &
    fi
    sleep 5; progress ;;
  killresume:*)
    [ -f "$R/driver2.pid" ] && { echo "resumed already"; continue; }
    wait_s=${phase#killresume:}; start=$(cat "$R/driver.started")
    while [ $(( $(date +%s) - start )) -lt "$wait_s" ]; do sleep 2; done
    { echo "# $(stamp) before SIGKILL of the driver (pid $(cat "$R/driver.pid"))"; marked; } > "$EV/killresume.txt"
    vs status "$NAME" --storage "$DB" >> "$EV/killresume.txt" 2>&1
    kill -9 "$(cat "$R/driver.pid")"; sleep 3
    { echo "# $(stamp) after SIGKILL: the dead driver's probes run on"; marked; } >> "$EV/killresume.txt"
    date +%s > "$R/resume.started"
    setsid nohup python3 -c "$VS_PY" resume "$NAME" --storage "$DB" > "$R/driver2.log" 2>&1 < /dev/null & echo $! > "$R/driver.pid"
    cp "$R/driver.pid" "$R/driver2.pid"
    sleep 25
    { echo "# $(stamp) 25 s into resume"; marked; head -30 "$R/driver2.log"; } >> "$EV/killresume.txt"
    tail -25 "$EV/killresume.txt" ;;
  monitor)
    [ -f "$R/monitor.pid" ] || { setsid nohup python3 scripts/real_verl/gpu_monitor.py "$EV/gpu_monitor.jsonl" >"$R/monitor.log" 2>&1 < /dev/null & echo $! > "$R/monitor.pid"; } ;;
  resume)
    [ -f "$R/driver.pid" ] && { echo "driver started already"; continue; }
    cp "$STUDY_SRC" "$STUDY"
    [ -f "$R/study/$NAME.db" ] || cp "${RESUME_DB:-docs/device-runs/2026-12-01-h200/tiny-h200.db}" "$R/study/$NAME.db"
    [ -f "$R/monitor.pid" ] || { setsid nohup python3 scripts/real_verl/gpu_monitor.py "$EV/gpu_monitor.jsonl" >"$R/monitor.log" 2>&1 < /dev/null & echo $! > "$R/monitor.pid"; }
    { stamp; smi; } > "$EV/nvidia-smi-before-resume.txt"
    vs status "$NAME" --storage "$DB" > "$EV/status-before-resume.txt" 2>&1
    date +%s > "$R/driver.started"
    setsid nohup python3 -c "$VS_PY" resume "$NAME" --storage "$DB" > "$R/driver-resume.log" 2>&1 < /dev/null & echo $! > "$R/driver.pid"
    sleep 5; head -12 "$R/driver-resume.log"; progress ;;
  side)
    [ -f "$R/side.pid" ] || { setsid nohup python3 scripts/real_verl/prune_sigterm.py "${VS_STUDY_SRC:-studies/tiny-h200.yaml}" "$R/side" "$EV/side" > "$R/side.log" 2>&1 < /dev/null & echo $! > "$R/side.pid"; } ;;
  side-wait:*)
    end=${phase#side-wait:}  # seconds since this call began: the evidence must be out before its limit
    while [ $SECONDS -lt $end ] && kill -0 "$(cat "$R/side.pid")" 2>/dev/null; do
      sleep 20; echo "$(stamp) $(grep -v '^    |' "$R/side/driver.log" 2>/dev/null | tail -1 | cut -c1-160)"
    done
    cp "$R/side"/*.db "$R/side"/*.yaml "$R/side/driver.log" "$EV/side/" 2>/dev/null
    cat "$EV/side/prune-sigterm.txt" 2>/dev/null | head -40
    keep_tails "$R"/side/runs/*/*/std*.log
    { stamp; smi; echo; marked; } > "$EV/side/after-side.txt"
    tar -C "$R" -czf "$OUT/side.tar.gz" --exclude='std*.log' evidence side/runs $( [ -d "$R/logs" ] && echo logs ) ;;
  oom:*)
    [ -f "$R/oom.pid" ] || { PROVOKE_DELAY_S=${phase#oom:} setsid nohup python3 scripts/real_verl/provoke.py "$STUDY" "$R/provoke-runs" "$EV/provoke-oom.json" oom_memory_fraction > "$EV/provoke-oom.log" 2>&1 < /dev/null & echo $! > "$R/oom.pid"; } ;;
  follow-until:*)  # follow the study until T s after this call began (returns early when the driver exits)
    end=${phase#follow-until:}
    while [ $SECONDS -lt $end ] && running; do sleep 20; progress; done
    progress; grep -v '^    |' "$R"/driver*.log | tail -8 | cut -c1-400 ;;
  snapshot)  # what a lost machine would take with it: the database, the runs' metrics, the logs' ends
    python3 -c "import sqlite3, sys; s = sqlite3.connect(sys.argv[1]); d = sqlite3.connect(sys.argv[2]); s.backup(d)" \
      "$R/study/$NAME.db" "$EV/$NAME.db" 2>&1 | tail -2
    keep_tails "$R"/study/runs/*/*/std*.log
    cp "$R"/driver*.log "$EV/" 2>/dev/null
    (cd "$R" && tar -czf "$OUT/snapshot.tar.gz" --exclude='std*.log' evidence study/runs $( [ -d "$R/logs" ] && echo logs ))
    ls -la "$OUT" ;;
  follow:*)
    end=$(( SECONDS + ${phase#follow:} ))
    while [ $SECONDS -lt $end ] && running; do sleep 20; progress; done
    progress; for f in "$R"/driver*.log; do echo "... $f"; grep -v '^    |' "$f" | tail -12; done
    echo "... side"; grep -v '^    |' "$R/side/driver.log" 2>/dev/null | tail -8; tail -3 "$R/side.log" 2>/dev/null
    cat "$EV"/provoke*.log 2>/dev/null ;;
  finish)
    running && echo "STUDY NOT FINISHED: exporting its best so far"
    for p in side oom; do  # the background evidence: wait for it a while
      for _ in $(seq 60); do [ -f "$R/$p.pid" ] && kill -0 "$(cat "$R/$p.pid")" 2>/dev/null || break; sleep 2; done
    done
    [ -d "$R/side" ] && { cp "$R/side"/*.db "$R/side"/*.yaml "$R/side/driver.log" "$EV/side/" 2>/dev/null; \
      vs status tiny-h200-prune --storage "sqlite:///$R/side/tiny-h200-prune.db" > "$EV/side/status.txt" 2>&1; }
    { stamp; smi; echo; marked; } > "$EV/after-study.txt"
    # SIGTERM first: the driver's own stop path (cancel every probe, queue their trials
    # again), as a Ctrl-C would; the study resumes from this database in the next lease
    running && { kill "$(cat "$R/driver.pid")"; for _ in $(seq 40); do running || break; sleep 1; done; }
    vs status "$NAME" --storage "$DB" > "$EV/status.txt" 2>&1; cat "$EV/status.txt" | head -60
    vs status "$NAME" --storage "$DB" --json > "$EV/status.json" 2>&1
    vs report "$NAME" --storage "$DB" -o "$EV/report.html" > "$EV/report.log" 2>&1
    vs export "$NAME" --storage "$DB" -o "$EV/best.yaml" 2>&1 | tail -2
    { stamp; smi; echo; marked; } > "$EV/after-sigterm.txt"
    { stamp; smi; } > "$EV/nvidia-smi-before-train.txt"
    [ "${TRAIN_STEPS:-3}" -gt 0 ] && VERL_FILE_LOGGER_PATH=$EV/train_from_export.metrics.jsonl timeout 420 python3 -m verl.trainer.main_ppo \
      --config-path "$EV" --config-name best trainer.total_training_steps=${TRAIN_STEPS:-3} \
      'trainer.logger=[console,file]' trainer.val_before_train=false trainer.save_freq=-1 trainer.resume_mode=disable \
      trainer.default_local_dir=$R/ckpt hydra.run.dir=$R/train_hydra > "$EV/train_from_export.log" 2>&1
    echo "train exit $?; steps $(wc -l < "$EV/train_from_export.metrics.jsonl" 2>/dev/null)"
    { stamp; smi; echo; marked; } > "$EV/after-train.txt"
    cp "$R"/driver*.log "$EV/" 2>/dev/null
    cp "$R/study/$NAME.db" "$EV/"
    gzip -f "$EV/train_from_export.log"
    # runs: everything but the big logs, whose ends are kept
    (cd "$R" && tar -czf "$OUT/runs.tar.gz" --exclude='std*.log' study/runs provoke-runs side/runs)
    keep_tails "$R"/study/runs/*/*/std*.log "$R"/provoke-runs/*/std*.log "$R"/side/runs/*/*/std*.log
    (cd "$R" && tar -czf "$OUT/logs.tar.gz" logs)
    tar -C "$R" -czf "$OUT/evidence.tar.gz" evidence
    ls -la "$OUT" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
