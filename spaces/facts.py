"""Facts about the model, the hardware and the algorithm that the safe bounds are derived from.

These are the study file's ``model``, ``hardware`` and ``algorithm`` sections; ``search``
reuses these models so there is one definition of each field.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Algorithm(str, enum.Enum):
    GRPO = "grpo"
    PPO = "ppo"  # PPO with GAE and a critic

    @property
    def adv_estimator(self) -> str:
        return "grpo" if self is Algorithm.GRPO else "gae"


class ModelFacts(BaseModel):
    """What the bounds need to know about the model (or read from a local HF config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config_json: Path | None = Field(
        default=None, description="A local HF config.json to read hidden size and heads from."
    )
    hidden_size: int | None = Field(default=None, ge=64, le=1_000_000)
    num_attention_heads: int | None = Field(default=None, ge=1, le=10_000)
    n_params_b: float = Field(gt=0, le=10_000, description="Parameter count in billions.")
    max_prompt_length: int = Field(default=1024, ge=1, le=10_000_000)
    max_response_length: int = Field(default=1024, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _read_config_json(self) -> "ModelFacts":
        if self.config_json is not None and (
            self.hidden_size is None or self.num_attention_heads is None
        ):
            try:
                data = json.loads(Path(self.config_json).read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {self.config_json}: {e}") from e
            object.__setattr__(self, "hidden_size", self.hidden_size or data.get("hidden_size"))
            object.__setattr__(
                self,
                "num_attention_heads",
                self.num_attention_heads or data.get("num_attention_heads"),
            )
        if self.hidden_size is None or self.num_attention_heads is None:
            raise ValueError(
                "needs hidden_size and num_attention_heads, or a config_json that has them"
            )
        return self

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_length + self.max_response_length


class HardwareFacts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus_per_node: int = Field(ge=1, le=64)
    nodes: int = Field(default=1, ge=1, le=10_000)
    gpu_memory_gb: float = Field(gt=0, le=10_000)

    @property
    def n_gpus(self) -> int:
        return self.gpus_per_node * self.nodes
