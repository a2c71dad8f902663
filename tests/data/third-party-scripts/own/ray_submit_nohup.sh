#!/usr/bin/env bash
# A multi-node launch: ray job submit with a JSON runtime env, in the background under nohup,
# its log in a folder the script makes; overrides kept in bash arrays. Written for verl-sweep's tests.
set -xeuo pipefail

RAY_ADDRESS=${RAY_ADDRESS:-"http://127.0.0.1:8265"}
WORKING_DIR=${WORKING_DIR:-"${PWD}"}
NNODES=${NNODES:-2}
LOG_DIR=${LOG_DIR:-/mnt/shared/logs/$(date +%Y%m%d)}
mkdir -p "${LOG_DIR}"

data=(
    data.train_files="['/mnt/data/dapo-math-17k.parquet']"
    data.val_files="['/mnt/data/aime-2024.parquet']"
    data.train_batch_size=512
    data.max_prompt_length=2048
    data.max_response_length=8192
)
actor=(
    actor_rollout_ref.model.path=Qwen/Qwen3-8B
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480
    actor_rollout_ref.actor.clip_ratio_low=0.2
    actor_rollout_ref.actor.clip_ratio_high=0.28
)
rollout=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=16
    actor_rollout_ref.rollout.tensor_model_parallel_size=4
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7
)

nohup ray job submit --address="${RAY_ADDRESS}" \
    --runtime-env-json='{"working_dir": "'"${WORKING_DIR}"'", "env_vars": {"NCCL_DEBUG": "WARN", "VLLM_USE_V1": "1"}}' \
    -- python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    "${data[@]}" \
    "${actor[@]}" \
    "${rollout[@]}" \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='DAPO' \
    trainer.experiment_name="qwen3-8b-dapo-${NNODES}nodes" \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes="${NNODES}" \
    trainer.total_training_steps=400 \
    "$@" > "${LOG_DIR}/train.log" 2>&1 &
echo "submitted: pid $!"
