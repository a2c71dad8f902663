"""The micro-batch sizes verl needs once a stage changes how the actor batches or switches a KL
term on (``verl.utils.config.validate_config``: with the actor's dynamic batching off, the
actor, the rollout's log-prob pass, the reference (when a KL term needs one) and the critic
each need a micro-batch size)."""

from __future__ import annotations

from typing import Any, Mapping

from verl_sweep.verl_knowledge import (MICRO_BATCH, MINI_BATCH, ROLLOUT_N, USE_DYNAMIC_BSZ, USE_KL_IN_REWARD, USE_KL_LOSS,
                                       Algorithm, HardwareFacts, data_parallel_ranks, get, int_setting, setting)

ROLLOUT_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
REF_LOG_PROB_MICRO = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"


def uses_reference(config: Mapping[str, Any]) -> bool:
    """verl builds a reference policy for a KL loss or an in-reward KL."""
    return bool(setting(config, USE_KL_LOSS)) or bool(setting(config, USE_KL_IN_REWARD))


def static_batching_fill(config: Mapping[str, Any], hardware: HardwareFacts, *, algorithm: Algorithm) -> dict[str, Any]:
    """The micro-batch sizes verl requires once the actor batches statically (its
    ``validate_config``: the actor's, the rollout's log-prob one, the reference's when a KL term
    needs it, the critic's), for those the config leaves unset: the largest of 4, 2, 1 that
    divides the per-GPU mini-batch. {} under dynamic batching or when all are set."""
    if setting(config, USE_DYNAMIC_BSZ):
        return {}
    mini, n = int_setting(config, MINI_BATCH), int_setting(config, ROLLOUT_N)
    per_gpu = max(1, mini * n // data_parallel_ranks(config, hardware))
    micro = next(m for m in (4, 2, 1) if per_gpu % m == 0)
    wanted = {MICRO_BATCH: "actor_rollout_ref.actor.ppo_micro_batch_size",
              ROLLOUT_LOG_PROB_MICRO: "actor_rollout_ref.rollout.log_prob_micro_batch_size"}
    if uses_reference(config):
        wanted[REF_LOG_PROB_MICRO] = "actor_rollout_ref.ref.log_prob_micro_batch_size"
    if algorithm is Algorithm.PPO:
        wanted[CRITIC_MICRO] = "critic.ppo_micro_batch_size"
    return {key: micro for key, old in wanted.items() if get(config, key) is None and get(config, old) is None}


def reference_fill(config: Mapping[str, Any]) -> dict[str, Any]:
    """What verl needs to switch a KL term on over ``config`` (a reference policy): under
    static batching the reference's log-prob micro-batch, taken from the rollout's (or the
    actor's) where the config has none. {} when nothing is missing."""
    if setting(config, USE_DYNAMIC_BSZ) or get(config, REF_LOG_PROB_MICRO) is not None \
            or get(config, "actor_rollout_ref.ref.log_prob_micro_batch_size") is not None:
        return {}
    micro = get(config, ROLLOUT_LOG_PROB_MICRO) or get(config, MICRO_BATCH) or 1
    return {REF_LOG_PROB_MICRO: micro}
