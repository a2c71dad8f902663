"""verl 0.9.1's defaults: the one table of what verl runs with where a config is silent, and
reading a config's setting through it."""

from __future__ import annotations

from typing import Any, Mapping

from verl_sweep.verl_knowledge.keys import (ACTIVATION_OFFLOAD, ADV_ESTIMATOR, CHUNKED_PREFILL, ENFORCE_EAGER,
                                            FORWARD_PREFETCH, FREE_CACHE_ENGINE, GPU_MEMORY, GRADIENT_CHECKPOINTING,
                                            KL_CTRL_COEF, KL_CTRL_HORIZON, KL_CTRL_TARGET, KL_CTRL_TYPE, KL_LOSS_COEF,
                                            LAM, LR, MAX_NUM_SEQS, MAX_TOKEN_LEN, MICRO_BATCH, MINI_BATCH,
                                            REF_LOG_PROB_MICRO, ROLLOUT_DP, ROLLOUT_LOG_PROB_MICRO, ROLLOUT_N,
                                            ROLLOUT_NAME, ROLLOUT_PP, ROLLOUT_TP, STRATEGY, TOKEN_BUDGET, TRAIN_BATCH,
                                            ULYSSES, ULYSSES_LEGACY, USE_DYNAMIC_BSZ, USE_KL_IN_REWARD, USE_KL_LOSS,
                                            USE_REMOVE_PADDING)
from verl_sweep.verl_knowledge.overrides import get

#: verl 0.9.1's values when the config is silent (docs/method.md §3; rollout.yaml, ref.yaml)
VERL_DEFAULTS: dict[str, Any] = {
    TRAIN_BATCH: 1024,
    MINI_BATCH: 256,
    MICRO_BATCH: None,
    ROLLOUT_N: 1,
    ROLLOUT_NAME: None,  # "???" in verl: mandatory
    ROLLOUT_TP: 2,
    ROLLOUT_DP: 1,
    ROLLOUT_PP: 1,
    GPU_MEMORY: 0.5,
    TOKEN_BUDGET: 8192,
    CHUNKED_PREFILL: True,
    LR: 1e-6,
    LAM: 1.0,
    ADV_ESTIMATOR: "gae",
    USE_KL_IN_REWARD: False,
    KL_CTRL_TYPE: "fixed",
    KL_CTRL_COEF: 0.001,
    KL_CTRL_TARGET: 0.1,
    KL_CTRL_HORIZON: 10000,
    USE_KL_LOSS: False,
    KL_LOSS_COEF: 0.001,
    ULYSSES: 1,
    ULYSSES_LEGACY: 1,
    USE_REMOVE_PADDING: True,  # model.use_remove_padding is true in 0.9.1's model config
    USE_DYNAMIC_BSZ: False,
    MAX_TOKEN_LEN: 16384,
    GRADIENT_CHECKPOINTING: True,
    ACTIVATION_OFFLOAD: False,
    STRATEGY: "fsdp",
    FORWARD_PREFETCH: False,
    ROLLOUT_LOG_PROB_MICRO: None,
    REF_LOG_PROB_MICRO: None,
    MAX_NUM_SEQS: 256,
    ENFORCE_EAGER: False,
    FREE_CACHE_ENGINE: True,
}


def setting(config: Mapping[str, Any], key: str) -> Any:
    """The config's value for ``key``, or verl's default when the config is silent."""
    return get(config, key, VERL_DEFAULTS.get(key))


def is_int(value: Any) -> bool:
    """An integer, and not a bool (YAML's true is no batch size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_setting(config: Mapping[str, Any], key: str) -> int:
    """``setting`` for a count (≥ 1): a malformed value is reported by the config rules, so the
    arithmetic falls back to verl's default."""
    value = setting(config, key)
    return value if is_int(value) and value >= 1 else int(VERL_DEFAULTS[key])
