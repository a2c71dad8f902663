"""The method's limits on the knobs (docs/method.md §1): the token budget's safe range and the
valid mini-batches, each a :class:`~verl_sweep.verl_knowledge.Limit` with its arithmetic, so
``verl-sweep validate`` can show *why* a bound is what it is. verl's own rules are
:mod:`verl_sweep.verl_knowledge`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from verl_sweep.spaces.base import SpaceError
from verl_sweep.verl_knowledge import (GPU_MEMORY, MICRO_BATCH, MINI_BATCH, ROLLOUT_N, ROLLOUT_TP, TRAIN_BATCH, Algorithm,
                                       HardwareFacts, Limit, ModelFacts, data_parallel_ranks, expert_split,
                                       int_setting, kv_arithmetic, mini_batch_problem, setting, tokens_in, weights_gb)

SEED_FRACTION = 0.65  # docs/method.md §1 step 3
MIN_TOKEN_BUDGET = 2048


def round_down_2sf(value: int) -> int:
    """Round down to two significant figures: 106,496 → 100,000; 91,136 → 91,000."""
    if value < 100:
        return value
    scale = 10 ** (int(math.log10(value)) - 1)
    return (value // scale) * scale


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    floor: int
    seed: int
    memory_cap: int
    bound: int
    suggested_max: int
    lines: tuple[str, ...]


def token_budget(model: ModelFacts, hardware: HardwareFacts, config: Mapping[str, Any]) -> TokenBudget:
    """The safe range for ``rollout.max_num_batched_tokens`` (docs/method.md §1 step 3)."""
    gb = hardware.gpu_memory_gb
    fraction = float(setting(config, GPU_MEMORY))
    tp = int(setting(config, ROLLOUT_TP))
    split = expert_split(config)
    seed = tokens_in(model, gb * SEED_FRACTION)
    on_gpu_gb = weights_gb(model, tp, split)
    pool_gb = gb * fraction - on_gpu_gb
    memory_cap = max(0, tokens_in(model, pool_gb))
    bound = min(seed, memory_cap)
    floor = max(MIN_TOKEN_BUDGET, model.max_seq_len)
    suggested = max(floor, round_down_2sf(bound)) if bound >= floor else bound
    experts = (f" + experts {model.expert_params_b:g}B × 2 bytes ÷ TP·DP {split}" if model.expert_params_b else "")
    dense = model.n_params_b - model.expert_params_b
    lines = (
        f"seed = {gb:g} GB × {SEED_FRACTION} ÷ {kv_arithmetic(model)} = {seed:,} tokens",
        f"vLLM pool = {gb:g} GB × gpu_memory_utilization {fraction:g} − weights "
        f"({dense:g}B × 2 bytes ÷ rollout TP {tp}{experts} = {on_gpu_gb:.3g} GB) = {pool_gb:.3g} GB "
        f"→ {memory_cap:,} tokens",
        f"bound = min({seed:,}, {memory_cap:,}) = {bound:,}; suggested max (2 significant "
        f"figures, rounded down) = {suggested:,}",
        f"floor = max({MIN_TOKEN_BUDGET}, prompt {model.max_prompt_length} + response "
        f"{model.max_response_length}) = {floor:,}",
    )
    return TokenBudget(floor, seed, memory_cap, bound, suggested, lines)


def valid_mini_batches(
    config: Mapping[str, Any], hardware: HardwareFacts, *, low: int, high: int
) -> Limit:
    """Every valid ``ppo_mini_batch_size`` in ``[low, high]``."""
    train_batch = setting(config, TRAIN_BATCH)
    if isinstance(train_batch, int) and not isinstance(train_batch, bool):
        high = min(high, train_batch)  # a mini-batch is part of the train batch
    if high - low > 1 << 21:
        raise SpaceError(f"{MINI_BATCH}: the range [{low}, {high}] must span at most {1 << 21:,} sizes, "
                         "but it spans more. Start from a mini-batch of at most 1,048,576.")
    values = [m for m in range(max(1, low), high + 1) if mini_batch_problem(m, config, hardware) is None]
    n = int_setting(config, ROLLOUT_N)
    dp = data_parallel_ranks(config, hardware)
    micro = setting(config, MICRO_BATCH)
    lines = (
        f"mini-batch ∈ [{low}, {high}], ≤ train_batch_size {setting(config, TRAIN_BATCH)}, "
        f"mini × n {n} divisible by DP ranks {dp}"
        + (f", per-GPU mini divisible by micro {micro}" if micro else ""),
        f"valid values ({len(values)}): {short_list(values)}",
    )
    return Limit(values, lines)


def short_list(values: list[Any]) -> str:
    """At most twelve values: the first five, an ellipsis and the last three."""
    if len(values) <= 12:
        return ", ".join(map(str, values))
    return ", ".join(map(str, values[:5])) + ", …, " + ", ".join(map(str, values[-3:]))


def require_gae(algorithm: Algorithm, *, where: str = "lam") -> None:
    """A λ stage needs GAE: SpaceError for any other algorithm."""
    if algorithm is not Algorithm.PPO:
        raise SpaceError(
            f"{where}: λ only matters with GAE (algorithm ppo), but got algorithm "
            f"{algorithm.value}. Remove the lam stage, or use algorithm: ppo."
        )
