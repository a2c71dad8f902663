#!/usr/bin/env bash
# Branching from a checkpoint with real verl 0.9.1: checks docs/verl-resume.md on the GPU.
# Ran on an H100 on 2026-12-07, every check passed (docs/device-runs/2026-12-07-h100-branch-resume;
# its lr-patched copy was rewritten by this script's own torch code then, the launchers' since).
#
# What it runs: the tiny GRPO of scripts/real_verl/make_tiny.py (3.2M Qwen2, sevens reward), with
# in-loss KL (kl_loss_coef 0.001) and adaptive in-reward KL (kl_ctrl.kl_coef 0.001).
#   base        4 steps at lr 1e-4, mini-batch 32 (1 optimizer step a step), saves global_step_4
#   lr-plain    resume, optim.lr=3e-4, data.seed=123, 3 steps
#   lr-patched  resume from a copy of the checkpoint whose optimizer param groups and scheduler
#               base_lrs were rewritten to 3e-5 (launchers/verl_checkpoints.py), optim.lr=3e-5, 3 steps
#   mb-kl       resume, ppo_mini_batch_size 8 (4 optimizer steps a step), micro 32,
#               kl_loss_coef 0.01, kl_ctrl.kl_coef 0.005, 3 steps
# The three branches run at once on the one GPU, each with its own Ray (as the study's probes do).
#
# What it must show (verl's metrics.jsonl, the branches' saved optimizer state, the rollout dumps):
#   - every branch logs steps 5-7 (the global step continues from the folder name)
#   - lr-plain logs actor/lr 1e-4, NOT 3e-4: the checkpoint's optimizer/scheduler state wins
#   - lr-patched logs actor/lr 3e-5, and its Adam step count is 4+3=7 (moments kept)
#   - mb-kl: actor/kl_coef 0.01, actor/lr 1e-4, Adam steps 4+3*4=16
#   - actor/reward_kl_penalty_coeff at step 5 is the config's kl_coef (0.001 or 0.005), not the
#     value the base run's adaptive controller had reached: the controller is not saved
#   - step 5 of all three branches trains on the same prompts (dataloader restored, data.seed
#     ignored), and they are not the base run's step-1 prompts
# It exits non-zero if any of these fails: a value the branching mode sets did not take effect,
# or verl behaved otherwise than the doc says.
#
# usage, after `bash scripts/real_verl/device.sh parts setup` (verl under /tmp/vs/site, the tiny
# model under /tmp/vs-tiny), from the repository root:
#   bash scripts/real_verl/check_branch_resume.sh [base] [branches] [check]   (default: all three)
# base takes ~5 min and branches ~6 min, so on the lent machine (10 min a call) run
# `... base` in one call, then `... branches check` in the next. Files go under
# $VS_BRANCH_ROOT (default /tmp/vs-branch); the metrics and log tails are copied to $OUT if set.
set -uo pipefail
R=${VS_ROOT:-/tmp/vs}; DATA=${VS_DATA:-/tmp/vs-tiny}; W=${VS_BRANCH_ROOT:-/tmp/vs-branch}
mkdir -p "$W"
[ -d "$R/site" ] && export PYTHONPATH=$R/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0 RAY_AUTH_MODE=disabled
export RAY_DEDUP_LOGS=0 RAY_USAGE_STATS_ENABLED=0 RAY_DISABLE_DOCKER_CPU_WARNING=1 SPT_NOENV=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
[ -f "$DATA/model/config.json" ] || python3 scripts/real_verl/make_tiny.py "$DATA" --shape tiny | tail -2
BASE_CKPT=$W/base/ckpt/global_step_4

COMMON=(
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=True algorithm.kl_ctrl.type=adaptive algorithm.kl_ctrl.kl_coef=0.001
  algorithm.kl_ctrl.target_kl=0.0001 algorithm.kl_ctrl.horizon=256
  data.train_files=$DATA/data/train.parquet data.val_files=$DATA/data/val.parquet
  data.train_batch_size=32 data.max_prompt_length=32 data.max_response_length=32
  data.filter_overlong_prompts=True data.truncation=error data.dataloader_num_workers=0
  actor_rollout_ref.model.path=$DATA/model
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.use_remove_padding=False actor_rollout_ref.model.enable_gradient_checkpointing=False
  actor_rollout_ref.actor.strategy=fsdp actor_rollout_ref.actor.optim.lr=1e-4
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
  actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.use_torch_compile=False
  actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.n=8
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.1
  actor_rollout_ref.rollout.free_cache_engine=False actor_rollout_ref.rollout.enforce_eager=True
  actor_rollout_ref.rollout.max_num_seqs=256 actor_rollout_ref.rollout.max_model_len=128
  actor_rollout_ref.rollout.max_num_batched_tokens=8192 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64
  actor_rollout_ref.rollout.agent.num_workers=2 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64
  reward.custom_reward_function.path=$DATA/reward_sevens.py reward.custom_reward_function.name=compute_score
  reward.num_workers=1
  'trainer.logger=["console","file"]' trainer.project_name=vs-branch trainer.n_gpus_per_node=1 trainer.nnodes=1
  trainer.val_before_train=False trainer.test_freq=-1 trainer.total_epochs=1000
  ray_kwargs.ray_init.num_cpus=16 +ray_kwargs.ray_init.include_dashboard=False
  transfer_queue.backend.SimpleStorage.num_data_storage_units=2
)

train() {  # train NAME [overrides...]: one main_ppo run under $W/NAME (its own Ray, metrics, rollouts)
  local name=$1; shift; local d=$W/$name; rm -rf "$d"; mkdir -p "$d"
  VERL_FILE_LOGGER_PATH=$d/metrics.jsonl timeout "${RUN_TIMEOUT:-560}" python3 -m verl.trainer.main_ppo "${COMMON[@]}" \
    trainer.experiment_name="$name" trainer.default_local_dir="$d/ckpt" trainer.rollout_data_dir="$d/rollouts" \
    hydra.run.dir="$d/hydra" +ray_kwargs.ray_init.address=local +ray_kwargs.ray_init._temp_dir="/tmp/rb-$name" \
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=$d/metrics.jsonl" "$@" > "$d/train.log" 2>&1
  echo "$(date -u +%T) $name: exit $?, steps logged $(wc -l < "$d/metrics.jsonl" 2>/dev/null || echo 0)"
  grep -E "Traceback|Error" "$d/train.log" | tail -3
}

patch_lr() {  # patch_lr SRC_STEP_DIR DST_ROOT NEW_LR: the branch's copy of the checkpoint, its lr
  # rewritten by the launchers' own code (what train mode runs before a branch that changes the lr)
  PYTHONPATH=$PWD:${PYTHONPATH:-} python3 -c 'import sys
from verl_sweep.launchers.verl_checkpoints import branch_checkpoint
print("patched", branch_checkpoint(sys.argv[1], sys.argv[2], lr=float(sys.argv[3])).step_dir, "to lr", sys.argv[3])' "$@"
}

BRANCH=(trainer.resume_mode=resume_path trainer.total_training_steps=7 trainer.save_freq=100)  # saves at its last step
for phase in "${@:-base branches check}"; do for p in $phase; do case $p in
  base)
    train base trainer.resume_mode=disable trainer.total_training_steps=4 trainer.save_freq=4 ;;
  branches)
    [ -f "$BASE_CKPT/actor/optim_world_size_1_rank_0.pt" ] || { echo "no base checkpoint at $BASE_CKPT"; exit 1; }
    rm -rf "$W/patched-src"; patch_lr "$BASE_CKPT" "$W/patched-src" 3e-5 || exit 1
    train lr-plain "${BRANCH[@]}" trainer.resume_from_path="$BASE_CKPT" actor_rollout_ref.actor.optim.lr=3e-4 data.seed=123 &
    sleep 20
    train lr-patched "${BRANCH[@]}" trainer.resume_from_path="$W/patched-src/global_step_4" actor_rollout_ref.actor.optim.lr=3e-5 &
    sleep 20
    train mb-kl "${BRANCH[@]}" trainer.resume_from_path="$BASE_CKPT" actor_rollout_ref.actor.ppo_mini_batch_size=8 \
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.kl_loss_coef=0.01 \
      algorithm.kl_ctrl.kl_coef=0.005 &
    wait ;;
  check)
    if [ -n "${OUT:-}" ]; then
      for n in base lr-plain lr-patched mb-kl; do
        mkdir -p "$OUT/$n"; cp "$W/$n/metrics.jsonl" "$OUT/$n/" 2>/dev/null
        tail -c 300000 "$W/$n/train.log" > "$OUT/$n/train.log.tail" 2>/dev/null
      done
    fi
    python3 - "$W" <<'PY' || exit 1
import glob, json, math, sys, torch
W = sys.argv[1]
fails = []
def check(ok, what):
    print(("[ok]   " if ok else "[FAIL] ") + what)
    if not ok:
        fails.append(what)
def metrics(name):
    rows = {}
    try:
        for line in open(f"{W}/{name}/metrics.jsonl"):
            r = json.loads(line); rows.setdefault(r["step"], {}).update(r["data"])
    except OSError:
        pass
    return rows
def close(a, b):
    return a is not None and math.isclose(a, b, rel_tol=1e-5)
def adam_steps(name, step=7):
    fs = glob.glob(f"{W}/{name}/ckpt/global_step_{step}/actor/optim_world_size_*_rank_0.pt")
    if not fs:
        return None
    st = torch.load(fs[0], map_location="cpu", weights_only=False)["state"]
    return sorted({float(v["step"]) for v in st.values() if "step" in v})
def prompts(name, step):
    try:
        return sorted(json.loads(l)["input"] for l in open(f"{W}/{name}/rollouts/{step}.jsonl"))
    except OSError:
        return None

base = metrics("base")
check(sorted(base) == [1, 2, 3, 4], f"base logged steps {sorted(base)}")
b4 = base.get(4, {})
check(close(b4.get("actor/lr"), 1e-4), f"base actor/lr at step 4 = {b4.get('actor/lr')}")
k4 = b4.get("actor/reward_kl_penalty_coeff")
check(k4 is not None and not close(k4, 1e-3),
      f"base: the adaptive in-reward KL coef moved from 0.001 by step 4 (= {k4}), so a reset is visible")
check(adam_steps("base", 4) == [4.0], f"base: Adam step count in global_step_4 = {adam_steps('base', 4)} (4 expected)")
# name: (config lr, lr verl must log, kl_loss_coef, kl_ctrl.kl_coef, Adam steps after step 7)
expect = {"lr-plain": (3e-4, 1e-4, 0.001, 0.001, 7.0),
          "lr-patched": (3e-5, 3e-5, 0.001, 0.001, 7.0),
          "mb-kl": (1e-4, 1e-4, 0.01, 0.005, 16.0)}
for name, (cfg_lr, lr, kl, klr, adam) in expect.items():
    m = metrics(name)
    check(sorted(m) == [5, 6, 7], f"{name}: logged steps {sorted(m)} (5-7: global step taken from the folder name)")
    lrs = [m.get(s, {}).get("actor/lr") for s in (5, 6, 7)]
    took = all(close(x, cfg_lr) for x in lrs)
    note = "" if cfg_lr == lr else " — the checkpoint's lr wins, as the doc says"
    check(all(close(x, lr) for x in lrs),
          f"{name}: actor/lr {lrs}; config lr {cfg_lr} took effect: {'yes' if took else 'no'}{note}")
    s5 = m.get(5, {})
    check(close(s5.get("actor/kl_coef"), kl), f"{name}: actor/kl_coef at step 5 = {s5.get('actor/kl_coef')} (config {kl})")
    check(close(s5.get("actor/reward_kl_penalty_coeff"), klr),
          f"{name}: actor/reward_kl_penalty_coeff at step 5 = {s5.get('actor/reward_kl_penalty_coeff')} "
          f"(config {klr}; the base run had reached {k4}: the adaptive value is reset, not restored)")
    check(adam_steps(name) == [adam], f"{name}: Adam step count after step 7 = {adam_steps(name)} ({adam} expected)")
p5 = {n: prompts(n, 5) for n in expect}
check(p5["lr-plain"] is not None and p5["lr-plain"] == p5["lr-patched"] == p5["mb-kl"],
      "step 5 trains on the same prompts in every branch (dataloader restored; lr-plain's data.seed=123 ignored)")
check(p5["lr-patched"] is not None and p5["lr-patched"] != prompts("base", 1),
      "step 5's prompts are not the base run's step-1 prompts (the data position is continued, not restarted)")
print(f"\n{len(fails)} check(s) failed" if fails else "\nall checks passed: docs/verl-resume.md holds")
sys.exit(1 if fails else 0)
PY
    ;;
  *) echo "unknown phase $p"; exit 2 ;;
esac; done; done
