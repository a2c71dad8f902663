set -x
# Overrides switched off by commenting their line out, inside the command: bash ends the
# command at the first such line. Written for verl-sweep's tests.
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=128 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    # data.return_raw_chat=True \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.rollout.name=vllm \
    trainer.n_gpus_per_node=4 \
    trainer.total_epochs=10
