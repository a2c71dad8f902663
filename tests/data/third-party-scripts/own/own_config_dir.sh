# A multi-turn run composed from the project's own config directory (verl's sglang_multiturn
# example config). Written for verl-sweep's tests.
set -x
ulimit -n 65535
PROJECT_DIR="$(pwd)"
CONFIG_PATH="$PROJECT_DIR/examples/sglang_multiturn/config"
python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='search_multiturn_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=512 \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B \
    actor_rollout_ref.rollout.name=sglang \
    trainer.n_gpus_per_node=8 \
    trainer.total_epochs=1 $@
