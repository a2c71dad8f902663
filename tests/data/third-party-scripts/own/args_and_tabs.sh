#!/bin/bash
# rllm's shape (a --model argument parsed in a while/case loop, "${@:1}" at the end) with tab
# indentation and plain `python`. Written for verl-sweep's tests.
set -x
while [[ $# -gt 0 ]]; do
	case $1 in
		--model)
			MODEL_PATH="$2"
			shift 2
			;;
		*)
			break
			;;
	esac
done
if [ -z "$MODEL_PATH" ]; then
	MODEL_PATH="Qwen/Qwen3-4B"
fi
python -m verl.trainer.main_ppo \
	algorithm.adv_estimator=rloo \
	data.train_files=$HOME/data/math/train.parquet \
	data.val_files=$HOME/data/math/test.parquet \
	data.train_batch_size=128 \
	data.max_prompt_length=1024 \
	data.max_response_length=4096 \
	actor_rollout_ref.model.path=$MODEL_PATH \
	actor_rollout_ref.actor.optim.lr=1e-6 \
	actor_rollout_ref.actor.ppo_mini_batch_size=64 \
	actor_rollout_ref.actor.use_dynamic_bsz=True \
	actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
	actor_rollout_ref.rollout.name=sglang \
	actor_rollout_ref.rollout.n=8 \
	actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
	actor_rollout_ref.rollout.gpu_memory_utilization=0.8 \
	actor_rollout_ref.rollout.val_kwargs.temperature=0.6 \
	actor_rollout_ref.rollout.val_kwargs.n=4 \
	trainer.logger=['console'] \
	trainer.n_gpus_per_node=8 \
	trainer.nnodes=1 \
	trainer.total_epochs=30 "${@:1}"
