"""verl 0.9.1's config paths that verl-sweep reads or sets (docs/method.md §3), one name each."""

from __future__ import annotations

# data and trainer
TRAIN_BATCH = "data.train_batch_size"
MAX_PROMPT = "data.max_prompt_length"
MAX_RESPONSE = "data.max_response_length"
N_GPUS_PER_NODE = "trainer.n_gpus_per_node"
NNODES = "trainer.nnodes"

# the actor's batching and optimiser
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
MICRO_BATCH = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
#: older verl's micro-batch over all GPUs, which verl still reads (and checks the mini-batch against)
GLOBAL_MICRO_BATCH = "actor_rollout_ref.actor.ppo_micro_batch_size"
USE_DYNAMIC_BSZ = "actor_rollout_ref.actor.use_dynamic_bsz"
MAX_TOKEN_LEN = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
LR = "actor_rollout_ref.actor.optim.lr"
USE_KL_LOSS = "actor_rollout_ref.actor.use_kl_loss"
KL_LOSS_COEF = "actor_rollout_ref.actor.kl_loss_coef"

# the actor's engine and its layout
MODEL_ENGINE = "model_engine"
STRATEGY = "actor_rollout_ref.actor.strategy"
ULYSSES = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
ULYSSES_LEGACY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
FORWARD_PREFETCH = "actor_rollout_ref.actor.fsdp_config.forward_prefetch"
PARAM_OFFLOAD = "actor_rollout_ref.actor.fsdp_config.param_offload"
OPTIMIZER_OFFLOAD = "actor_rollout_ref.actor.fsdp_config.optimizer_offload"
MEGATRON_TP = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"
MEGATRON_PP = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"
MEGATRON_CP = "actor_rollout_ref.actor.megatron.context_parallel_size"
MEGATRON_EP = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
MEGATRON_VPP = "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"
USE_REMOVE_PADDING = "actor_rollout_ref.model.use_remove_padding"
GRADIENT_CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing"
ACTIVATION_OFFLOAD = "actor_rollout_ref.model.enable_activation_offload"

# the rollout (vLLM, SGLang, TensorRT-LLM)
ROLLOUT_N = "actor_rollout_ref.rollout.n"
ROLLOUT_NAME = "actor_rollout_ref.rollout.name"
ROLLOUT_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
ROLLOUT_DP = "actor_rollout_ref.rollout.data_parallel_size"
ROLLOUT_PP = "actor_rollout_ref.rollout.pipeline_model_parallel_size"
ROLLOUT_EP = "actor_rollout_ref.rollout.expert_parallel_size"
GPU_MEMORY = "actor_rollout_ref.rollout.gpu_memory_utilization"
TOKEN_BUDGET = "actor_rollout_ref.rollout.max_num_batched_tokens"
CHUNKED_PREFILL = "actor_rollout_ref.rollout.enable_chunked_prefill"
MAX_NUM_SEQS = "actor_rollout_ref.rollout.max_num_seqs"
ENFORCE_EAGER = "actor_rollout_ref.rollout.enforce_eager"
FREE_CACHE_ENGINE = "actor_rollout_ref.rollout.free_cache_engine"

# the log-prob passes (rollout and reference) and the critic
ROLLOUT_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
ROLLOUT_LOG_PROB_DYNAMIC = "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"
ROLLOUT_LOG_PROB_TOKENS = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_LOG_PROB_MICRO = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"

# the algorithm
ADV_ESTIMATOR = "algorithm.adv_estimator"
LAM = "algorithm.lam"
USE_KL_IN_REWARD = "algorithm.use_kl_in_reward"
KL_CTRL_TYPE = "algorithm.kl_ctrl.type"
KL_CTRL_COEF = "algorithm.kl_ctrl.kl_coef"
KL_CTRL_TARGET = "algorithm.kl_ctrl.target_kl"
KL_CTRL_HORIZON = "algorithm.kl_ctrl.horizon"
