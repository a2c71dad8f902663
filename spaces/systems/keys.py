"""The verl config keys the systems stage sets beside those of ``limits``, verl's defaults for
them, and what a config means for a key it leaves unset."""

from __future__ import annotations

from typing import Any

from verl_sweep.spaces import engines as E
from verl_sweep.spaces import limits as L
from verl_sweep.spaces.overrides import Config

ROLLOUT_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
REF_LOG_PROB_MICRO = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
ROLLOUT_LOG_PROB_DYNAMIC = "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"
REF_LOG_PROB_DYNAMIC = "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"
ROLLOUT_LOG_PROB_TOKENS = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_LOG_PROB_TOKENS = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
DEPRECATED_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size"
DEPRECATED_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size"
DEPRECATED_CRITIC_MICRO = "critic.ppo_micro_batch_size"
MAX_NUM_SEQS = "actor_rollout_ref.rollout.max_num_seqs"
ENFORCE_EAGER = "actor_rollout_ref.rollout.enforce_eager"
FREE_CACHE_ENGINE = "actor_rollout_ref.rollout.free_cache_engine"
#: verl 0.9.1's defaults for the keys above (rollout.yaml, ref.yaml)
DEFAULTS: dict[str, Any] = {ROLLOUT_LOG_PROB_MICRO: None, REF_LOG_PROB_MICRO: None, MAX_NUM_SEQS: 256,
                            ENFORCE_EAGER: False, FREE_CACHE_ENGINE: True}


def base_value(base: Config, key: str) -> Any:
    """``base``'s own value for ``key``, else verl's default."""
    return base.get(key, L.VERL_DEFAULTS.get(key, DEFAULTS.get(key)))


def effective(config: Config, key: str) -> Any:
    """The value verl runs ``config`` with for ``key``: its own, else what verl's config makes
    of it (the log-prob passes follow the update's dynamic batching and token limit), else
    verl's default."""
    if key in config:
        return config[key]
    if key in (ROLLOUT_LOG_PROB_DYNAMIC, REF_LOG_PROB_DYNAMIC):
        return bool(L.setting(config, L.USE_DYNAMIC_BSZ))
    if key in (ROLLOUT_LOG_PROB_TOKENS, REF_LOG_PROB_TOKENS):
        return L.setting(config, L.MAX_TOKEN_LEN)
    return base_value(config, key)


def rollout_expert_parallel(base: Config, tp: int) -> Config:
    """verl 0.9.1's RolloutConfig wants EP = TP × DP once rollout expert parallelism is on (not
    for trtllm): a layout that changes the rollout TP moves EP with it."""
    ep = L.setting(base, E.ROLLOUT_EP)
    if not L._is_int(ep) or ep <= 1 or L.setting(base, L.ROLLOUT_NAME) == "trtllm":
        return {}
    return {E.ROLLOUT_EP: tp * L._int_setting(base, L.ROLLOUT_DP)}
