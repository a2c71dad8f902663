"""verl's config rules: what verl refuses (or silently changes), checked on a CPU before launch.

:func:`check_config` runs the rules that verl itself only finds once the GPUs are allocated
(docs/method.md §3); :func:`type_problems`, :func:`doubts` and :func:`notes` say what is of the
wrong kind, likely not meant, or unread. The layout arithmetic they share (data-parallel ranks,
the sizes that divide the model and the GPUs) returns a :class:`Limit`: the value and the lines
behind it, so ``verl-sweep validate`` can show *why*.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from verl_sweep.verl_knowledge import engines as E
from verl_sweep.verl_knowledge.defaults import VERL_DEFAULTS, int_setting, is_int, setting
from verl_sweep.verl_knowledge.facts import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge.keys import (ADV_ESTIMATOR, ACTIVATION_OFFLOAD, CHUNKED_PREFILL, FORWARD_PREFETCH,
                                            GLOBAL_MICRO_BATCH, GPU_MEMORY, GRADIENT_CHECKPOINTING, KL_CTRL_COEF,
                                            KL_CTRL_HORIZON, KL_CTRL_TARGET, KL_CTRL_TYPE, KL_LOSS_COEF, LAM, LR,
                                            MAX_PROMPT, MAX_RESPONSE, MAX_TOKEN_LEN, MICRO_BATCH, MINI_BATCH,
                                            N_GPUS_PER_NODE, NNODES, ROLLOUT_DP, ROLLOUT_EP, ROLLOUT_N, ROLLOUT_NAME,
                                            ROLLOUT_PP, ROLLOUT_TP, STRATEGY, TOKEN_BUDGET, TRAIN_BATCH, ULYSSES,
                                            ULYSSES_LEGACY, USE_DYNAMIC_BSZ, USE_KL_IN_REWARD, USE_KL_LOSS,
                                            USE_REMOVE_PADDING)
from verl_sweep.verl_knowledge.overrides import get

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


@dataclasses.dataclass(frozen=True)
class Limit:
    """A derived value and the arithmetic that produced it (for ``verl-sweep validate``)."""

    value: Any
    lines: tuple[str, ...]


def ulysses_size(config: Mapping[str, Any]) -> int:
    """The effective Ulysses size: verl copies the deprecated actor-level key when > 1."""
    legacy = int_setting(config, ULYSSES_LEGACY)
    return legacy if legacy > 1 else int_setting(config, ULYSSES)


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
    train = int_setting(config, TRAIN_BATCH)
    n = int_setting(config, ROLLOUT_N)
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
    if is_int(legacy) and legacy > 0 and value % legacy and not setting(config, USE_DYNAMIC_BSZ):
        return f"{MINI_BATCH}={value}: must be divisible by {GLOBAL_MICRO_BATCH} ({legacy}), as verl checks"
    return None


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
    for keys, fits, kind in ((_INTEGER_KEYS, is_int, "an integer"),
                             (_NUMBER_KEYS, lambda v: is_int(v) or isinstance(v, float), "a number"),
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
    if not is_int(n) or n < 1:
        problems.append(f"{ROLLOUT_N}={n}: must be an integer ≥ 1")
        n = 1

    # Memory fraction: verl does not range-check it.
    fraction = setting(config, GPU_MEMORY)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        problems.append(f"{GPU_MEMORY}={fraction}: must lie in (0, 1]")

    # Rollout layout: TP·DP·PP must divide the GPU count; TP must divide the heads.
    tp, dp_r, pp = (setting(config, k) for k in (ROLLOUT_TP, ROLLOUT_DP, ROLLOUT_PP))
    heads = int(model.num_attention_heads or 1)
    if all(is_int(v) and v >= 1 for v in (tp, dp_r, pp)):
        world = tp * dp_r * pp
        if n_gpus % world:
            problems.append(
                f"{ROLLOUT_TP}={tp}: rollout TP·DP·PP ({tp}·{dp_r}·{pp} = {world}) must divide the "
                f"GPU count ({n_gpus})"
            )
        if heads % tp:
            problems.append(f"{ROLLOUT_TP}={tp}: must divide the attention heads ({heads})")
        ep = get(config, ROLLOUT_EP)
        if is_int(ep) and ep > 1 and name != "trtllm" and ep != tp * dp_r:
            # verl 0.9.1's RolloutConfig asserts it when it is built (the run's first seconds)
            problems.append(f"{ROLLOUT_EP}={ep}: rollout expert parallelism must equal rollout TP × DP "
                            f"({tp} × {dp_r} = {tp * dp_r}) in verl 0.9.1")
        if pp > 1:
            # verl 0.9.1's RolloutConfig: no engine implements rollout pipeline parallelism yet.
            problems.append(f"{ROLLOUT_PP}={pp}: rollout pipeline parallelism > 1 is not implemented for vllm/sglang/trtllm in verl 0.9.1")
    else:
        problems.append(f"{ROLLOUT_TP}={tp}: rollout TP, DP and PP must be integers ≥ 1 (DP={dp_r}, PP={pp})")

    # Ulysses (FSDP): divides heads and the sequence, needs remove-padding, and leaves whole DP ranks.
    for key in (ULYSSES, ULYSSES_LEGACY):
        raw = setting(config, key)
        if not is_int(raw) or raw < 1:
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
    if not is_int(mini) or not is_int(train):
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
        if E.engine(config) == "megatron" and is_int(micro) and micro >= 1:  # verl's validate_config
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
        if not is_int(limit) or limit * split < longest:
            problems.append(
                f"{MAX_TOKEN_LEN}={limit}: with dynamic batching, max token len × {split_name} ({split}) must "
                f"be ≥ the longest prompt + response ({longest})"
            )

    # In-reward KL controller: adaptive needs a positive horizon.
    if setting(config, USE_KL_IN_REWARD) and setting(config, KL_CTRL_TYPE) == "adaptive":
        horizon = setting(config, KL_CTRL_HORIZON)
        if not is_int(horizon) or horizon <= 0:
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
    if not is_int(budget) or budget < 1:
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
    if adv in E.GROUP_ESTIMATORS and is_int(n) and n == 1 and not get(config, "distillation.enabled"):
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

