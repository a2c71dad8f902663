"""Limits derived from the model, the hardware and the base config, with their arithmetic.

Each function returns a :class:`Limit`: the value and the lines of arithmetic behind it, so
``verl-sweep validate`` can show *why* a bound is what it is. :func:`check_config` runs the
rules that verl itself only finds once the GPUs are allocated (docs/method.md §3), on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from verl_sweep.spaces import engines as E
from verl_sweep.spaces.base import SpaceError
from verl_sweep.spaces.facts import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.overrides import get

# verl 0.9.1 config paths (docs/method.md §3)
TRAIN_BATCH = "data.train_batch_size"
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
MICRO_BATCH = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
#: older verl's micro-batch over all GPUs, which verl still reads (and checks the mini-batch against)
GLOBAL_MICRO_BATCH = "actor_rollout_ref.actor.ppo_micro_batch_size"
ROLLOUT_N = "actor_rollout_ref.rollout.n"
ROLLOUT_NAME = "actor_rollout_ref.rollout.name"
ROLLOUT_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"
ROLLOUT_DP = "actor_rollout_ref.rollout.data_parallel_size"
ROLLOUT_PP = "actor_rollout_ref.rollout.pipeline_model_parallel_size"
GPU_MEMORY = "actor_rollout_ref.rollout.gpu_memory_utilization"
TOKEN_BUDGET = "actor_rollout_ref.rollout.max_num_batched_tokens"
CHUNKED_PREFILL = "actor_rollout_ref.rollout.enable_chunked_prefill"
LR = "actor_rollout_ref.actor.optim.lr"
LAM = "algorithm.lam"
ADV_ESTIMATOR = "algorithm.adv_estimator"
USE_KL_IN_REWARD = "algorithm.use_kl_in_reward"
KL_CTRL_TYPE = "algorithm.kl_ctrl.type"
KL_CTRL_COEF = "algorithm.kl_ctrl.kl_coef"
KL_CTRL_TARGET = "algorithm.kl_ctrl.target_kl"
KL_CTRL_HORIZON = "algorithm.kl_ctrl.horizon"
USE_KL_LOSS = "actor_rollout_ref.actor.use_kl_loss"
KL_LOSS_COEF = "actor_rollout_ref.actor.kl_loss_coef"
ULYSSES = "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"
ULYSSES_LEGACY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
USE_REMOVE_PADDING = "actor_rollout_ref.model.use_remove_padding"
USE_DYNAMIC_BSZ = "actor_rollout_ref.actor.use_dynamic_bsz"
MAX_TOKEN_LEN = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
GRADIENT_CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing"
ACTIVATION_OFFLOAD = "actor_rollout_ref.model.enable_activation_offload"
STRATEGY = "actor_rollout_ref.actor.strategy"
FORWARD_PREFETCH = "actor_rollout_ref.actor.fsdp_config.forward_prefetch"
N_GPUS_PER_NODE = "trainer.n_gpus_per_node"
NNODES = "trainer.nnodes"
MAX_PROMPT = "data.max_prompt_length"
MAX_RESPONSE = "data.max_response_length"

#: verl 0.9.1's values when the base config is silent (docs/method.md §3)
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
}

#: adv_estimator values registered in verl 0.9.1 (verl.trainer.ppo.core_algos.AdvantageEstimator)
KNOWN_ADV_ESTIMATORS = frozenset(
    {
        "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo",
        "opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
        "tir_optimal_token_baseline", "gdpo",
    }
)
ROLLOUT_NAMES = frozenset({"vllm", "sglang", "trtllm"})
MAX_ULYSSES = 4  # docs/method.md §2: min(4, GPUs); 8 saturated PCIe on 13B
SEED_FRACTION = 0.65  # docs/method.md §1 step 3
MIN_TOKEN_BUDGET = 2048


@dataclasses.dataclass(frozen=True)
class Limit:
    """A derived value and the arithmetic that produced it (for ``verl-sweep validate``)."""

    value: Any
    lines: tuple[str, ...]


def setting(config: Mapping[str, Any], key: str) -> Any:
    """The config's value for ``key``, or verl's default when the config is silent."""
    return get(config, key, VERL_DEFAULTS.get(key))


def ulysses_size(config: Mapping[str, Any]) -> int:
    """The effective Ulysses size: verl copies the deprecated actor-level key when > 1."""
    legacy = _int_setting(config, ULYSSES_LEGACY)
    return legacy if legacy > 1 else _int_setting(config, ULYSSES)


def round_down_2sf(value: int) -> int:
    """Round down to two significant figures: 106,496 → 100,000; 91,136 → 91,000."""
    if value < 100:
        return value
    scale = 10 ** (int(math.log10(value)) - 1)
    return (value // scale) * scale


def _tokens_for_gb(gb: float, hidden_size: int) -> int:
    # The seed formula's unit: (GB × 1024²) ÷ (hidden ÷ 8) tokens.
    return int(gb * 1024**2 / (hidden_size / 8))


def _gb_for_tokens(tokens: int, hidden_size: int) -> float:
    return tokens * (hidden_size / 8) / 1024**2


def bytes_per_token(model: ModelFacts) -> int:
    """What one token of the rollout's KV cache takes: from the real shape (layers × 2 × KV
    heads × head dim × 2 bytes) when the facts have it, else the method's hidden ÷ 8 rule
    (hidden × 128 bytes: about 3.6× the real cache of Qwen3-8B)."""
    real = model.kv_bytes_per_token()
    return real if real else int(model.hidden_size or 0) * 128


def kv_arithmetic(model: ModelFacts) -> str:
    """How ``bytes_per_token`` was found, for the explain lines."""
    if model.kv_bytes_per_token() is None:
        return f"(hidden {model.hidden_size} ÷ 8) KiB a token (the method's rule; no layer facts)"
    layers = model.kv_cache_layers or model.num_hidden_layers
    if model.kv_lora_dim:
        return f"KV {bytes_per_token(model):,} B a token ({layers} layers × latent {model.kv_lora_dim} × 2 B)"
    kv_heads = model.num_key_value_heads or model.num_attention_heads
    head_dim = model.head_dim or int(model.hidden_size or 0) // int(model.num_attention_heads or 1)
    return f"KV {bytes_per_token(model):,} B a token ({layers} layers × 2 × {kv_heads} KV heads × {head_dim} × 2 B)"


def _tokens_in(model: ModelFacts, gb: float) -> int:
    return int(gb * 1024**3 / bytes_per_token(model)) if gb > 0 else 0


def _weights_gb(model: ModelFacts, tp: int, expert_split: int | None = None) -> float:
    """bf16 weights (2 bytes a parameter) on one rollout GPU: the dense part split over TP,
    a MoE model's routed experts over TP × DP (``expert_split``)."""
    dense = model.n_params_b - model.expert_params_b
    return dense * 2 / tp + model.expert_params_b * 2 / (expert_split or tp)


def expert_split(config: Mapping[str, Any]) -> int:
    """Rollout ranks that share a MoE model's experts: TP × DP (verl 0.9.1's rollout config:
    with EP 1 they are split TP × DP ways, with EP > 1 as whole experts, EP = TP × DP)."""
    return _int_setting(config, ROLLOUT_TP) * _int_setting(config, ROLLOUT_DP)


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
    seed = _tokens_in(model, gb * SEED_FRACTION)
    weights_gb = _weights_gb(model, tp, split)
    pool_gb = gb * fraction - weights_gb
    memory_cap = max(0, _tokens_in(model, pool_gb))
    bound = min(seed, memory_cap)
    floor = max(MIN_TOKEN_BUDGET, model.max_seq_len)
    suggested = max(floor, round_down_2sf(bound)) if bound >= floor else bound
    experts = (f" + experts {model.expert_params_b:g}B × 2 bytes ÷ TP·DP {split}" if model.expert_params_b else "")
    dense = model.n_params_b - model.expert_params_b
    lines = (
        f"seed = {gb:g} GB × {SEED_FRACTION} ÷ {kv_arithmetic(model)} = {seed:,} tokens",
        f"vLLM pool = {gb:g} GB × gpu_memory_utilization {fraction:g} − weights "
        f"({dense:g}B × 2 bytes ÷ rollout TP {tp}{experts} = {weights_gb:.3g} GB) = {pool_gb:.3g} GB "
        f"→ {memory_cap:,} tokens",
        f"bound = min({seed:,}, {memory_cap:,}) = {bound:,}; suggested max (2 significant "
        f"figures, rounded down) = {suggested:,}",
        f"floor = max({MIN_TOKEN_BUDGET}, prompt {model.max_prompt_length} + response "
        f"{model.max_response_length}) = {floor:,}",
    )
    return TokenBudget(floor, seed, memory_cap, bound, suggested, lines)


def memory_fraction_for(model: ModelFacts, hardware: HardwareFacts, tokens: int, tp: int, *,
                        data_parallel: int = 1) -> float:
    """The smallest ``gpu_memory_utilization`` whose vLLM pool holds ``tokens`` (the inverse
    of ``token_budget``'s pool) at rollout TP ``tp``, rounded up to 0.01."""
    needed_gb = tokens * bytes_per_token(model) / 1024**3 + _weights_gb(model, tp, tp * data_parallel)
    return math.ceil(needed_gb / hardware.gpu_memory_gb * 100 - 1e-9) / 100


def _int_setting(config: Mapping[str, Any], key: str) -> int:
    # A malformed value is reported by check_config; the arithmetic falls back to verl's default.
    value = setting(config, key)
    return value if _is_int(value) and value >= 1 else int(VERL_DEFAULTS[key])


def data_parallel_ranks(config: Mapping[str, Any], hardware: HardwareFacts) -> int:
    """The actor's data-parallel ranks: GPUs ÷ Ulysses under FSDP, GPUs ÷ (TP·PP·CP) under
    Megatron (veomni and torchtitan lay out their own meshes: GPUs)."""
    kind = E.engine(config)
    if kind == "megatron":
        tp, pp, cp = E.megatron_layout(config)
        return max(1, hardware.n_gpus // (tp * pp * cp))
    if kind != "dp":
        return hardware.n_gpus
    return max(1, hardware.n_gpus // ulysses_size(config))


def _dp_arithmetic(config: Mapping[str, Any], hardware: HardwareFacts) -> str:
    dp = data_parallel_ranks(config, hardware)
    if E.engine(config) == "megatron":
        tp, pp, cp = E.megatron_layout(config)
        return f"{hardware.n_gpus} GPUs ÷ (Megatron TP {tp} · PP {pp} · CP {cp}) = {dp}"
    if E.engine(config) != "dp":
        return f"{hardware.n_gpus} GPUs = {dp}"
    return f"{hardware.n_gpus} GPUs ÷ ulysses {ulysses_size(config)} = {dp}"


def mini_batch_problem(value: int, config: Mapping[str, Any], hardware: HardwareFacts) -> str | None:
    """Why ``value`` is not a valid ``ppo_mini_batch_size`` for this config, or None."""
    train = _int_setting(config, TRAIN_BATCH)
    n = _int_setting(config, ROLLOUT_N)
    dp = data_parallel_ranks(config, hardware)
    micro = setting(config, MICRO_BATCH)
    if value < 1:
        return f"{MINI_BATCH}={value}: must be ≥ 1"
    if value > train:
        return f"{MINI_BATCH}={value}: must be ≤ {TRAIN_BATCH} ({train})"
    if (value * n) % dp:
        return (
            f"{MINI_BATCH}={value}: mini × rollout.n ({value} × {n} = {value * n}) must be divisible "
            f"by the data-parallel ranks ({_dp_arithmetic(config, hardware)})"
        )
    per_gpu = value * n // dp
    if micro is not None and int(micro) > 0 and per_gpu % int(micro):
        return (
            f"{MINI_BATCH}={value}: per-GPU mini-batch ({value} × {n} ÷ {dp} = {per_gpu}) must be "
            f"divisible by {MICRO_BATCH} ({micro})"
        )
    legacy = get(config, GLOBAL_MICRO_BATCH)
    if _is_int(legacy) and legacy > 0 and value % legacy and not setting(config, USE_DYNAMIC_BSZ):
        return f"{MINI_BATCH}={value}: must be divisible by {GLOBAL_MICRO_BATCH} ({legacy}), as verl checks"
    return None


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
    n = _int_setting(config, ROLLOUT_N)
    dp = data_parallel_ranks(config, hardware)
    micro = setting(config, MICRO_BATCH)
    lines = (
        f"mini-batch ∈ [{low}, {high}], ≤ train_batch_size {setting(config, TRAIN_BATCH)}, "
        f"mini × n {n} divisible by DP ranks {dp}"
        + (f", per-GPU mini divisible by micro {micro}" if micro else ""),
        f"valid values ({len(values)}): {_short_list(values)}",
    )
    return Limit(values, lines)


def _short_list(values: list[Any]) -> str:
    if len(values) <= 12:
        return ", ".join(map(str, values))
    return ", ".join(map(str, values[:5])) + ", …, " + ", ".join(map(str, values[-3:]))


def ulysses_sizes(model: ModelFacts, hardware: HardwareFacts) -> Limit:
    """Ulysses sizes that divide the heads, the max sequence length and the GPU count, ≤ min(4, GPUs)."""
    heads = int(model.num_attention_heads or 1)
    cap = min(MAX_ULYSSES, hardware.n_gpus)
    values = [
        s for s in range(1, cap + 1)
        if heads % s == 0 and model.max_seq_len % s == 0 and hardware.n_gpus % s == 0
    ]
    lines = (
        f"ulysses ≤ min({MAX_ULYSSES}, {hardware.n_gpus} GPUs) = {cap}, dividing heads {heads}, "
        f"max seq len {model.max_seq_len} and the GPU count: {values}",
    )
    return Limit(values, lines)


def rollout_tp_sizes(model: ModelFacts, hardware: HardwareFacts) -> Limit:
    """Rollout TP sizes that divide the GPUs of a node and the attention heads."""
    heads = int(model.num_attention_heads or 1)
    values = [
        t for t in range(1, hardware.gpus_per_node + 1)
        if hardware.gpus_per_node % t == 0 and heads % t == 0
    ]
    lines = (f"rollout TP divides {hardware.gpus_per_node} GPUs/node and heads {heads}: {values}",)
    return Limit(values, lines)


def kl_keys(algorithm: Algorithm) -> tuple[str, str]:
    """(switch, coefficient) that the algorithm reads: GRPO the KL loss, PPO the in-reward KL."""
    if algorithm is Algorithm.GRPO:
        return USE_KL_LOSS, KL_LOSS_COEF
    return USE_KL_IN_REWARD, KL_CTRL_COEF


def kl_keys_in_use(algorithm: Algorithm, config: Mapping[str, Any]) -> tuple[str, str]:
    """The KL term the config already has on (an in-reward KL in a GRPO-style config, say),
    else the algorithm's own (``kl_keys``): a KL stage tunes the key the run reads."""
    if get(config, USE_KL_IN_REWARD) is True and get(config, USE_KL_LOSS) is not True:
        return USE_KL_IN_REWARD, KL_CTRL_COEF
    if get(config, USE_KL_LOSS) is True and get(config, USE_KL_IN_REWARD) is not True:
        return USE_KL_LOSS, KL_LOSS_COEF
    return kl_keys(algorithm)


def require_gae(algorithm: Algorithm, *, where: str = "lam") -> None:
    if algorithm is not Algorithm.PPO:
        raise SpaceError(
            f"{where}: λ only matters with GAE (algorithm ppo), but got algorithm "
            f"{algorithm.value}. Remove the lam stage, or use algorithm: ppo."
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: the keys the rules compute with, by the kind of value each must hold
_INTEGER_KEYS = (TRAIN_BATCH, MINI_BATCH, MICRO_BATCH, ROLLOUT_N, ROLLOUT_TP, ROLLOUT_DP, ROLLOUT_PP, TOKEN_BUDGET,
                 KL_CTRL_HORIZON, ULYSSES, ULYSSES_LEGACY, MAX_TOKEN_LEN, N_GPUS_PER_NODE, NNODES, MAX_PROMPT,
                 MAX_RESPONSE)
_NUMBER_KEYS = (GPU_MEMORY, LR, LAM, KL_CTRL_COEF, KL_CTRL_TARGET)
_BOOL_KEYS = (CHUNKED_PREFILL, USE_KL_IN_REWARD, USE_KL_LOSS, USE_REMOVE_PADDING, USE_DYNAMIC_BSZ,
              GRADIENT_CHECKPOINTING, ACTIVATION_OFFLOAD, FORWARD_PREFETCH)
_STRING_KEYS = (ROLLOUT_NAME, ADV_ESTIMATOR, KL_CTRL_TYPE, STRATEGY)


def type_problems(config: Mapping[str, Any]) -> list[str]:
    """Values of the wrong kind for the keys the rules (and the spaces) compute with: the
    rules would otherwise raise on them. Checked first; [] when every set value has its kind."""
    problems = []
    for keys, fits, kind in ((_INTEGER_KEYS, _is_int, "an integer"),
                             (_NUMBER_KEYS, lambda v: _is_int(v) or isinstance(v, float), "a number"),
                             (_BOOL_KEYS, lambda v: isinstance(v, bool), "true or false"),
                             (_STRING_KEYS, lambda v: isinstance(v, str), "a string")):
        for key in keys:
            value = get(config, key)
            if value is not None and not fits(value):
                problems.append(f"{key}={value!r}: must be {kind}")
    return problems


def check_config(
    config: Mapping[str, Any],
    *,
    model: ModelFacts,
    hardware: HardwareFacts,
    algorithm: Algorithm,
) -> list[str]:
    """Rules that verl only finds on the GPU (docs/method.md §3); one message per problem, [] when fine.

    Each message names the key, the value and the rule. Values the config leaves out take
    verl's defaults (:data:`VERL_DEFAULTS`).
    """
    problems = type_problems(config)
    if problems:
        return problems  # the rules below compute with these values
    n_gpus = hardware.n_gpus
    gpn = get(config, N_GPUS_PER_NODE)
    if gpn is not None and int(gpn) != hardware.gpus_per_node:
        problems.append(
            f"{N_GPUS_PER_NODE}={gpn}: must equal the hardware's gpus_per_node ({hardware.gpus_per_node})"
        )
    nnodes = get(config, NNODES)
    if nnodes is not None and int(nnodes) != hardware.nodes:
        problems.append(f"{NNODES}={nnodes}: must equal the hardware's nodes ({hardware.nodes})")

    # Rollout engine name: "???" in verl, mandatory since 0.6.
    name = setting(config, ROLLOUT_NAME)
    if name is None or name not in ROLLOUT_NAMES:
        unset = f"; older releases defaulted to vllm: add {ROLLOUT_NAME}=vllm" if name is None else ""
        problems.append(f"{ROLLOUT_NAME}={name}: must be one of {sorted(ROLLOUT_NAMES)} (mandatory since verl 0.6{unset})")

    # Advantage estimator: verl fails only inside the trainer on an unknown name. GAE is the
    # PPO chain (a critic); every other estimator runs critic-free, the GRPO-style chain.
    adv = setting(config, ADV_ESTIMATOR)
    if adv not in KNOWN_ADV_ESTIMATORS:
        problems.append(f"{ADV_ESTIMATOR}={adv}: must be one of verl's estimators {sorted(KNOWN_ADV_ESTIMATORS)}")
    elif (adv == E.CRITIC_ESTIMATOR) != (algorithm is Algorithm.PPO):
        chain = "ppo (GAE with a critic)" if adv == E.CRITIC_ESTIMATOR else "grpo (every critic-free estimator)"
        problems.append(f"{ADV_ESTIMATOR}={adv}: runs the {chain} chain, but the study's algorithm is {algorithm.value}")
    engine_problem = E.engine_problem(config)
    if engine_problem:
        problems.append(engine_problem)

    # Group size: a group estimator's advantage is relative within the prompt's group.
    n = setting(config, ROLLOUT_N)
    if not _is_int(n) or n < 1:
        problems.append(f"{ROLLOUT_N}={n}: must be an integer ≥ 1")
        n = 1

    # Memory fraction: verl does not range-check it.
    fraction = setting(config, GPU_MEMORY)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        problems.append(f"{GPU_MEMORY}={fraction}: must lie in (0, 1]")

    # Rollout layout: TP·DP·PP must divide the GPU count; TP must divide the heads.
    tp, dp_r, pp = (setting(config, k) for k in (ROLLOUT_TP, ROLLOUT_DP, ROLLOUT_PP))
    heads = int(model.num_attention_heads or 1)
    if all(_is_int(v) and v >= 1 for v in (tp, dp_r, pp)):
        world = tp * dp_r * pp
        if n_gpus % world:
            problems.append(
                f"{ROLLOUT_TP}={tp}: rollout TP·DP·PP ({tp}·{dp_r}·{pp} = {world}) must divide the "
                f"GPU count ({n_gpus})"
            )
        if heads % tp:
            problems.append(f"{ROLLOUT_TP}={tp}: must divide the attention heads ({heads})")
        ep = get(config, E.ROLLOUT_EP)
        if _is_int(ep) and ep > 1 and name != "trtllm" and ep != tp * dp_r:
            # verl 0.9.1's RolloutConfig asserts it when it is built (the run's first seconds)
            problems.append(f"{E.ROLLOUT_EP}={ep}: rollout expert parallelism must equal rollout TP × DP "
                            f"({tp} × {dp_r} = {tp * dp_r}) in verl 0.9.1")
        if pp > 1:
            # verl 0.9.1's RolloutConfig: no engine implements rollout pipeline parallelism yet.
            problems.append(f"{ROLLOUT_PP}={pp}: rollout pipeline parallelism > 1 is not implemented for vllm/sglang/trtllm in verl 0.9.1")
    else:
        problems.append(f"{ROLLOUT_TP}={tp}: rollout TP, DP and PP must be integers ≥ 1 (DP={dp_r}, PP={pp})")

    # Ulysses (FSDP): divides heads and the sequence, needs remove-padding, and leaves whole DP ranks.
    for key in (ULYSSES, ULYSSES_LEGACY):
        raw = setting(config, key)
        if not _is_int(raw) or raw < 1:
            problems.append(f"{key}={raw}: must be an integer ≥ 1")
    sp = ulysses_size(config)
    if E.engine(config) == "dp":
        if heads % sp:
            problems.append(f"{ULYSSES}={sp}: attention heads ({heads}) must be divisible by the ulysses size")
        if n_gpus % sp:
            problems.append(f"{ULYSSES}={sp}: must divide the GPU count ({n_gpus})")
        if sp > 1 and not setting(config, USE_REMOVE_PADDING):
            problems.append(f"{ULYSSES}={sp}: ulysses > 1 needs {USE_REMOVE_PADDING}=true")
    else:
        sp = 1

    # Batch sizes (static batching only; with dynamic batching verl splits by tokens).
    dynamic = bool(setting(config, USE_DYNAMIC_BSZ))
    mini = setting(config, MINI_BATCH)
    train = setting(config, TRAIN_BATCH)
    if not _is_int(mini) or not _is_int(train):
        problems.append(f"{MINI_BATCH}={mini}: mini-batch and {TRAIN_BATCH} ({train}) must be integers")
    elif not dynamic:
        problem = mini_batch_problem(mini, config, hardware)
        if problem:
            problems.append(problem)
        minimal, what = n_gpus, f"the GPU count ({n_gpus})"
        micro = setting(config, MICRO_BATCH)
        if E.engine(config) == "megatron" and micro is None:  # verl's validate_config multiplies by it
            legacy = get(config, GLOBAL_MICRO_BATCH)
            problems.append(f"{MICRO_BATCH}: must be set for Megatron with static batching (verl's validate_config "
                            "multiplies by it, and fails with a TypeError without it), but it is not"
                            + (f" (the older {GLOBAL_MICRO_BATCH}={legacy} is not read there)" if legacy else "")
                            + f". Set {MICRO_BATCH}, or {USE_DYNAMIC_BSZ}=True")
        if E.engine(config) == "megatron" and _is_int(micro) and micro >= 1:  # verl's validate_config
            dp = data_parallel_ranks(config, hardware)
            minimal, what = dp * micro, f"Megatron DP {dp} × micro-batch {micro} ({dp * micro})"
        if minimal and (train * n) % minimal:
            problems.append(
                f"{TRAIN_BATCH}={train}: train batch × rollout.n ({train * n}) must be divisible by {what}"
            )
    if dynamic:
        limit = setting(config, MAX_TOKEN_LEN)
        longest = model.max_seq_len
        split, split_name = E.sequence_split(config)
        if not _is_int(limit) or limit * split < longest:
            problems.append(
                f"{MAX_TOKEN_LEN}={limit}: with dynamic batching, max token len × {split_name} ({split}) must "
                f"be ≥ the longest prompt + response ({longest})"
            )

    # In-reward KL controller: adaptive needs a positive horizon.
    if setting(config, USE_KL_IN_REWARD) and setting(config, KL_CTRL_TYPE) == "adaptive":
        horizon = setting(config, KL_CTRL_HORIZON)
        if not _is_int(horizon) or horizon <= 0:
            problems.append(f"{KL_CTRL_HORIZON}={horizon}: adaptive KL control needs horizon > 0")
    kl_type = setting(config, KL_CTRL_TYPE)
    if kl_type not in ("fixed", "adaptive"):
        problems.append(f"{KL_CTRL_TYPE}={kl_type}: must be fixed or adaptive")

    # λ is read only by GAE (a λ in a GRPO config is unread, harmless: see ``notes``).
    lam = get(config, LAM)
    if lam is not None and (isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1):
        problems.append(f"{LAM}={lam}: must lie in [0, 1]")

    # Token budget: chunked prefill off raises it to max_model_len (silently changes the knob).
    budget = setting(config, TOKEN_BUDGET)
    if not _is_int(budget) or budget < 1:
        problems.append(f"{TOKEN_BUDGET}={budget}: must be an integer ≥ 1")
    elif not setting(config, CHUNKED_PREFILL) and budget < model.max_seq_len:
        problems.append(
            f"{TOKEN_BUDGET}={budget}: with chunked prefill off verl raises it to max_model_len "
            f"({model.max_seq_len}); set {CHUNKED_PREFILL}=true or a budget ≥ {model.max_seq_len}"
        )
    return problems


def doubts(config: Mapping[str, Any]) -> list[str]:
    """Settings verl runs but that are likely not what the user meant: one warning line each."""
    found = []
    n = setting(config, ROLLOUT_N)
    adv = setting(config, ADV_ESTIMATOR)
    if adv in E.GROUP_ESTIMATORS and _is_int(n) and n == 1 and not get(config, "distillation.enabled"):
        # verl runs it: a group of one has mean 0 and std 1, so the advantage is the score itself
        found.append(f"{ROLLOUT_N}=1: {adv} compares a response with the others of its prompt's group, but with one "
                     "there is none and verl uses the score itself; set rollout.n ≥ 2 for the algorithm as meant")
    return found


def notes(config: Mapping[str, Any], *, algorithm: Algorithm) -> list[str]:
    """Settings verl accepts but does not read for this config: harmless, said once, not refused."""
    found = []
    lam = get(config, LAM)
    if algorithm is not Algorithm.PPO and lam is not None and lam != VERL_DEFAULTS[LAM]:
        found.append(f"{LAM}={lam} is read only by GAE; {setting(config, ADV_ESTIMATOR)} leaves it unused")
    if get(config, USE_KL_IN_REWARD) is not True and get(config, KL_CTRL_COEF) not in (None, VERL_DEFAULTS[KL_CTRL_COEF]):
        found.append(f"{KL_CTRL_COEF}={get(config, KL_CTRL_COEF)} is unused: {USE_KL_IN_REWARD} is off")
    if get(config, USE_KL_LOSS) is not True and get(config, KL_LOSS_COEF) not in (None, VERL_DEFAULTS[KL_LOSS_COEF]):
        found.append(f"{KL_LOSS_COEF}={get(config, KL_LOSS_COEF)} is unused: {USE_KL_LOSS} is off")
    return found

