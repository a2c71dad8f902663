"""Parallel-layout templates (docs/method.md §2) as base configs, by model size and GPU count.

``template_for(model, hardware, algorithm)`` returns a :class:`Template`: flat verl overrides
plus the reasons, already checked by :func:`verl_sweep.verl_knowledge.rules.check_config` (a template that
breaks a rule is a bug, so building it raises VerlConfigError). The study's own base config is
merged *over* a template: the user's settings win.

- ≤ 7B: FSDP; rollout TP 4 (or the largest valid ≤ 4), memory fraction 0.6; no rollout
  pipeline: verl 0.9.1 has ``rollout.pipeline_model_parallel_size`` but its RolloutConfig
  rejects > 1 for vllm, sglang and trtllm (docs/method.md §2's "pipeline 2" cannot be expressed),
  dynamic batching with ``ppo_max_token_len_per_gpu`` 4096 (raised so that limit × ulysses
  covers prompt + response), gradient checkpointing, Ulysses min(4, GPUs) where valid.
- 7B-32B: FSDP with parameter offload, rollout TP up to 8, same batching.
- ≥ 32B: Megatron (``model_engine=megatron``; ``actor.megatron.{tensor,pipeline,context}_
  model_parallel_size``), static batching with micro-batch 1.
"""

from __future__ import annotations

import dataclasses
import math

from verl_sweep.verl_knowledge import keys as K
from verl_sweep.verl_knowledge import rules as L
from verl_sweep.verl_knowledge.facts import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge.keys import (MEGATRON_CP, MEGATRON_PP, MEGATRON_TP, MODEL_ENGINE, PARAM_OFFLOAD,
                                            REF_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_MICRO)
from verl_sweep.verl_knowledge.overrides import Config, VerlConfigError
SMALL_MAX_B = 7.0
LARGE_MIN_B = 32.0


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    config: Config
    lines: tuple[str, ...]


def _largest(values: list[int], cap: int) -> int:
    fitting = [v for v in values if v <= cap]
    return max(fitting) if fitting else 1


def _common(model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm) -> Config:
    config: Config = {
        K.N_GPUS_PER_NODE: hardware.gpus_per_node,
        K.NNODES: hardware.nodes,
        K.ROLLOUT_NAME: "vllm",
        K.ADV_ESTIMATOR: algorithm.adv_estimator,
        K.MAX_PROMPT: model.max_prompt_length,
        K.MAX_RESPONSE: model.max_response_length,
        K.CHUNKED_PREFILL: True,
    }
    if algorithm is Algorithm.GRPO:
        config[K.ROLLOUT_N] = 4  # GRPO needs a group; the study's base may set its own n
    return config


def template_for(model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm) -> Template:
    """The docs/method.md §2 layout for this model size and GPU count, checked by check_config."""
    config = _common(model, hardware, algorithm)
    lines: list[str] = []
    tps = L.rollout_tp_sizes(model, hardware).value
    if model.n_params_b >= LARGE_MIN_B:
        name = "megatron"
        heads = int(model.num_attention_heads or 1)
        mtp = _largest([t for t in tps if heads % t == 0], 8)
        mpp = 2 if hardware.n_gpus % (mtp * 2) == 0 and hardware.n_gpus >= 16 else 1
        config.update({
            MODEL_ENGINE: "megatron", MEGATRON_TP: mtp, MEGATRON_PP: mpp, MEGATRON_CP: 1,
            K.ROLLOUT_TP: _largest(tps, 8), K.GPU_MEMORY: 0.6, K.USE_DYNAMIC_BSZ: False,
            K.MICRO_BATCH: 1, ROLLOUT_LOG_PROB_MICRO: 1, REF_LOG_PROB_MICRO: 1,
        })
        lines.append(f"≥{LARGE_MIN_B:g}B: Megatron TP {mtp} × PP {mpp} (DP {hardware.n_gpus // (mtp * mpp)}), rollout TP {config[K.ROLLOUT_TP]}")
    else:
        small = model.n_params_b <= SMALL_MAX_B
        name = "fsdp-small" if small else "fsdp-offload"
        tp = _largest(tps, 4 if small else 8)
        pp = 1  # see the module docstring: rollout PP > 1 is rejected by verl 0.9.1
        sps = L.ulysses_sizes(model, hardware).value
        sp = _largest(sps, min(L.MAX_ULYSSES, hardware.n_gpus))
        token_len = max(4096, 2 ** math.ceil(math.log2(math.ceil(model.max_seq_len / sp))))
        config.update({
            K.ROLLOUT_TP: tp, K.ROLLOUT_PP: pp, K.GPU_MEMORY: 0.6,
            K.USE_DYNAMIC_BSZ: True, K.MAX_TOKEN_LEN: token_len,
            K.GRADIENT_CHECKPOINTING: True, K.STRATEGY: "fsdp2", K.ULYSSES: sp,
            K.ULYSSES_LEGACY: sp, K.USE_REMOVE_PADDING: True,
        })
        if not small:
            config[PARAM_OFFLOAD] = True
        lines.append(
            f"{'≤' if small else '>'}{SMALL_MAX_B:g}B: FSDP2{'' if small else ' + param offload'}, rollout TP {tp} × PP {pp}, "
            f"memory fraction 0.6, dynamic batching {token_len} tokens/GPU × ulysses {sp} ≥ {model.max_seq_len}"
        )
    problems = L.check_config(config, model=model, hardware=hardware, algorithm=algorithm)
    if problems:
        raise VerlConfigError(
            f"template {name} must pass the config rules for this model and hardware, but got "
            f"{problems[0]}. Set the layout in the study's base config instead."
        )
    return Template(name, config, tuple(lines))
