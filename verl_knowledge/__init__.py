"""What verl-sweep knows about verl 0.9.1, in one place: its config keys and defaults, its
config format and Hydra overrides, its rules, its engines, a model's memory on its GPUs, its
parallel-layout templates, and checks by verl's own code (verl imported lazily).

It imports no other package of ours; ``spaces`` and ``launchers`` may import it. Other modules
use the names below, never its modules' own.
"""

from __future__ import annotations

from verl_sweep.verl_knowledge.defaults import VERL_DEFAULTS, int_setting, is_int, setting
from verl_sweep.verl_knowledge.engines import (CRITIC_ESTIMATOR, ENGINES, GROUP_ESTIMATORS, SEARCHED_ENGINES, engine,
                                               engine_problem, implied_engine, megatron_layout, positive_int,
                                               sequence_split)
from verl_sweep.verl_knowledge.facts import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge.keys import (ACTIVATION_OFFLOAD, ADV_ESTIMATOR, CHUNKED_PREFILL, CRITIC_MICRO,
                                            ENFORCE_EAGER, FORWARD_PREFETCH, FREE_CACHE_ENGINE, GLOBAL_MICRO_BATCH,
                                            GPU_MEMORY, GRADIENT_CHECKPOINTING, KL_CTRL_COEF, KL_CTRL_HORIZON,
                                            KL_CTRL_TARGET, KL_CTRL_TYPE, KL_LOSS_COEF, LAM, LR, MAX_NUM_SEQS,
                                            MAX_PROMPT, MAX_RESPONSE, MAX_TOKEN_LEN, MEGATRON_CP, MEGATRON_EP,
                                            MEGATRON_PP, MEGATRON_TP, MEGATRON_VPP, MICRO_BATCH, MINI_BATCH,
                                            MODEL_ENGINE, N_GPUS_PER_NODE, NNODES, OPTIMIZER_OFFLOAD, PARAM_OFFLOAD,
                                            REF_LOG_PROB_MICRO, ROLLOUT_DP, ROLLOUT_EP, ROLLOUT_LOG_PROB_DYNAMIC,
                                            ROLLOUT_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_TOKENS, ROLLOUT_N, ROLLOUT_NAME,
                                            ROLLOUT_PP, ROLLOUT_TP, STRATEGY, TOKEN_BUDGET, TRAIN_BATCH, ULYSSES,
                                            ULYSSES_LEGACY, USE_DYNAMIC_BSZ, USE_KL_IN_REWARD, USE_KL_LOSS,
                                            USE_REMOVE_PADDING)
from verl_sweep.verl_knowledge.memory import (USABLE_FRACTION, FractionRange, MemoryEstimate, baseline_allowance,
                                              bytes_per_token, estimate, expert_split, fit_limit_gb, fit_problem,
                                              fitting_fraction, kv_arithmetic, memory_fraction_for,
                                              over_limit_problem, rollout_memory_floors, tokens_in, usable_gb,
                                              weights_gb)
from verl_sweep.verl_knowledge.model_config import facts_from_config, language_config
from verl_sweep.verl_knowledge.overrides import (Config, OverrideError, VerlConfigError, check_key, format_value, get,
                                                 merge, nest, parse_overrides, to_overrides)
from verl_sweep.verl_knowledge.rules import (KNOWN_ADV_ESTIMATORS, MAX_ULYSSES, ROLLOUT_NAMES, Limit, check_config,
                                             data_parallel_ranks, doubts, kl_keys, kl_keys_in_use, mini_batch_problem,
                                             notes, rollout_tp_sizes, type_problems, ulysses_size, ulysses_sizes)
from verl_sweep.verl_knowledge.templates import Template, template_for
from verl_sweep.verl_knowledge.verl_check import (VerlValidator, key_for, validate_with_verl, verl_available,
                                                  verl_config_available, verl_version)
from verl_sweep.verl_knowledge.verl_messages import missing_config_packages

__all__ = [
    # verl's config: flat dotted keys, their Hydra overrides, verl's defaults
    "Config", "OverrideError", "VerlConfigError", "check_key", "format_value", "get", "merge", "nest",
    "parse_overrides", "to_overrides",
    "VERL_DEFAULTS", "int_setting", "is_int", "setting",
    # the keys (verl 0.9.1's config paths)
    "ACTIVATION_OFFLOAD", "ADV_ESTIMATOR", "CHUNKED_PREFILL", "CRITIC_MICRO", "ENFORCE_EAGER", "FORWARD_PREFETCH",
    "FREE_CACHE_ENGINE", "GLOBAL_MICRO_BATCH", "GPU_MEMORY", "GRADIENT_CHECKPOINTING", "KL_CTRL_COEF",
    "KL_CTRL_HORIZON", "KL_CTRL_TARGET", "KL_CTRL_TYPE", "KL_LOSS_COEF", "LAM", "LR", "MAX_NUM_SEQS", "MAX_PROMPT",
    "MAX_RESPONSE", "MAX_TOKEN_LEN", "MEGATRON_CP", "MEGATRON_EP", "MEGATRON_PP", "MEGATRON_TP", "MEGATRON_VPP",
    "MICRO_BATCH", "MINI_BATCH", "MODEL_ENGINE", "N_GPUS_PER_NODE", "NNODES", "OPTIMIZER_OFFLOAD", "PARAM_OFFLOAD",
    "REF_LOG_PROB_MICRO", "ROLLOUT_DP", "ROLLOUT_EP", "ROLLOUT_LOG_PROB_DYNAMIC", "ROLLOUT_LOG_PROB_MICRO",
    "ROLLOUT_LOG_PROB_TOKENS", "ROLLOUT_N", "ROLLOUT_NAME", "ROLLOUT_PP", "ROLLOUT_TP", "STRATEGY", "TOKEN_BUDGET",
    "TRAIN_BATCH", "ULYSSES", "ULYSSES_LEGACY", "USE_DYNAMIC_BSZ", "USE_KL_IN_REWARD", "USE_KL_LOSS",
    "USE_REMOVE_PADDING",
    # the model, the hardware, the algorithm (a config.json read into the model's facts)
    "Algorithm", "HardwareFacts", "ModelFacts", "facts_from_config", "language_config",
    # the rules verl applies, and the layout arithmetic they share
    "KNOWN_ADV_ESTIMATORS", "MAX_ULYSSES", "ROLLOUT_NAMES", "Limit", "check_config", "data_parallel_ranks", "doubts",
    "kl_keys", "kl_keys_in_use", "mini_batch_problem", "notes", "rollout_tp_sizes", "type_problems",
    "ulysses_size", "ulysses_sizes",
    # the training engines
    "CRITIC_ESTIMATOR", "ENGINES", "GROUP_ESTIMATORS", "SEARCHED_ENGINES", "engine", "engine_problem",
    "implied_engine", "megatron_layout", "positive_int", "sequence_split",
    # the memory model: KV cache and weights, and a config's estimated peak per GPU
    "USABLE_FRACTION", "FractionRange", "MemoryEstimate", "baseline_allowance", "bytes_per_token", "estimate",
    "expert_split", "fit_limit_gb", "fit_problem", "fitting_fraction", "kv_arithmetic", "memory_fraction_for",
    "over_limit_problem", "rollout_memory_floors", "tokens_in", "usable_gb", "weights_gb",
    # the parallel-layout templates
    "Template", "template_for",
    # verl's own checks and messages
    "VerlValidator", "key_for", "missing_config_packages", "validate_with_verl", "verl_available",
    "verl_config_available", "verl_version",
]
