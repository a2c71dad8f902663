"""Facts about the model, the hardware and the algorithm that the safe bounds are derived from.

These are the study file's ``model``, ``hardware`` and ``algorithm`` sections; ``search``
reuses these models so there is one definition of each field.
"""

from __future__ import annotations

import enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator


class Algorithm(str, enum.Enum):
    GRPO = "grpo"
    PPO = "ppo"  # PPO with GAE and a critic

    @property
    def adv_estimator(self) -> str:
        return "grpo" if self is Algorithm.GRPO else "gae"


class ModelFacts(BaseModel):
    """What the bounds need to know about the model. ``config_json`` names a local HF
    config.json; the study loader (``search/spec/study_file.py``) reads it and fills in the sizes it
    has before this model validates them, so they are held to the same types and bounds."""

    # Strict: YAML and JSON type their values, so `true` or "4096" is no integer here.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    config_json: Path | None = Field(
        default=None, description="A local HF config.json to read hidden size and heads from."
    )
    hidden_size: StrictInt | None = Field(default=None, ge=64, le=1_000_000)
    num_attention_heads: StrictInt | None = Field(default=None, ge=1, le=10_000)
    n_params_b: StrictFloat = Field(gt=0, le=10_000, description="Parameter count in billions.")
    #: the parameters in routed experts (MoE), in billions: vLLM splits them over TP × DP ranks
    expert_params_b: StrictFloat = Field(default=0.0, ge=0, le=10_000)
    #: what the KV cache holds per token: layers × 2 × KV heads × head dim (× dtype bytes)
    head_dim: StrictInt | None = Field(default=None, ge=1, le=100_000)
    #: layers that keep a KV cache, where fewer than all (hybrid linear-attention models)
    kv_cache_layers: StrictInt | None = Field(default=None, ge=1, le=10_000)
    #: multi-head latent attention: the cached vector's width (kv_lora_rank + rope dim)
    kv_lora_dim: StrictInt | None = Field(default=None, ge=1, le=100_000)
    max_prompt_length: StrictInt = Field(default=1024, ge=1, le=10_000_000)
    max_response_length: StrictInt = Field(default=1024, ge=1, le=10_000_000)
    #: the shape the memory pre-flight computes with (``verl_sweep.verl_knowledge.memory``); a config.json fills
    #: them in, and without them they are inferred from the parameter count
    num_hidden_layers: StrictInt | None = Field(default=None, ge=1, le=100_000)
    num_key_value_heads: StrictInt | None = Field(default=None, ge=1, le=10_000)
    intermediate_size: StrictInt | None = Field(default=None, ge=1, le=10_000_000)
    vocab_size: StrictInt | None = Field(default=None, ge=1, le=100_000_000)

    @model_validator(mode="after")
    def _sizes_known(self) -> "ModelFacts":
        if self.hidden_size is None or self.num_attention_heads is None:
            raise ValueError(
                "needs hidden_size and num_attention_heads, or a config_json that has them"
            )
        return self

    @model_validator(mode="after")
    def _experts_within(self) -> "ModelFacts":
        if self.expert_params_b > self.n_params_b:
            raise ValueError(f"expert_params_b must be ≤ n_params_b ({self.n_params_b:g}), but got "
                             f"{self.expert_params_b:g}. Fix the model facts.")
        return self

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_length + self.max_response_length

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int | None:
        """Bytes of KV cache one token takes in the rollout engine, from the real shape; None
        when the facts lack the layers (the token budget then falls back to the method's
        hidden ÷ 8 rule)."""
        layers = self.kv_cache_layers or self.num_hidden_layers
        if layers is None:
            return None
        if self.kv_lora_dim:
            return layers * self.kv_lora_dim * dtype_bytes
        kv_heads = self.num_key_value_heads or self.num_attention_heads or 1
        head_dim = self.head_dim or int(self.hidden_size or 0) // int(self.num_attention_heads or 1)
        return layers * 2 * kv_heads * head_dim * dtype_bytes


class HardwareFacts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    gpus_per_node: StrictInt = Field(ge=1, le=64)
    nodes: StrictInt = Field(default=1, ge=1, le=10_000)
    gpu_memory_gb: StrictFloat = Field(gt=0, le=10_000)

    @property
    def n_gpus(self) -> int:
        return self.gpus_per_node * self.nodes
