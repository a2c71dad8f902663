"""The verl config keys the systems stage sets (verl's own, from ``verl_knowledge``, and the
deprecated spellings it clears), and what a config means for a key it leaves unset."""

from __future__ import annotations

from typing import Any

from verl_sweep import verl_knowledge as V
from verl_sweep.verl_knowledge import (  # verl's keys, re-exported for the systems stage
    ENFORCE_EAGER, FREE_CACHE_ENGINE, MAX_NUM_SEQS, REF_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_DYNAMIC, ROLLOUT_LOG_PROB_MICRO,
    ROLLOUT_LOG_PROB_TOKENS, Config)

REF_LOG_PROB_DYNAMIC = "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"
REF_LOG_PROB_TOKENS = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
DEPRECATED_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size"
DEPRECATED_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size"
DEPRECATED_CRITIC_MICRO = "critic.ppo_micro_batch_size"


def base_value(base: Config, key: str) -> Any:
    """``base``'s own value for ``key``, else verl's default."""
    return base.get(key, V.VERL_DEFAULTS.get(key))


def effective(config: Config, key: str) -> Any:
    """The value verl runs ``config`` with for ``key``: its own, else what verl's config makes
    of it (the log-prob passes follow the update's dynamic batching and token limit), else
    verl's default."""
    if key in config:
        return config[key]
    if key in (ROLLOUT_LOG_PROB_DYNAMIC, REF_LOG_PROB_DYNAMIC):
        return bool(V.setting(config, V.USE_DYNAMIC_BSZ))
    if key in (ROLLOUT_LOG_PROB_TOKENS, REF_LOG_PROB_TOKENS):
        return V.setting(config, V.MAX_TOKEN_LEN)
    return base_value(config, key)


def rollout_expert_parallel(base: Config, tp: int) -> Config:
    """verl 0.9.1's RolloutConfig wants EP = TP × DP once rollout expert parallelism is on (not
    for trtllm): a layout that changes the rollout TP moves EP with it."""
    ep = V.setting(base, V.ROLLOUT_EP)
    if not V.is_int(ep) or ep <= 1 or V.setting(base, V.ROLLOUT_NAME) == "trtllm":
        return {}
    return {V.ROLLOUT_EP: tp * V.int_setting(base, V.ROLLOUT_DP)}
