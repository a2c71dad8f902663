"""A systems point: asked of the sampler knob by knob (only valid combinations), turned into
verl overrides, and the incumbent's point read back from its config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from verl_sweep import verl_knowledge as V
from verl_sweep.spaces.batching import static_batching_fill
from verl_sweep.spaces.oom import TrialHistory, asked_range, oom_ceiling, trial_history
from verl_sweep.verl_knowledge import Config, merge
from verl_sweep.spaces.systems.choices import SystemsChoices
from verl_sweep.spaces.systems.keys import (
    ENFORCE_EAGER, FREE_CACHE_ENGINE, MAX_NUM_SEQS, REF_LOG_PROB_DYNAMIC, REF_LOG_PROB_MICRO, REF_LOG_PROB_TOKENS,
    ROLLOUT_LOG_PROB_DYNAMIC, ROLLOUT_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_TOKENS, base_value, rollout_expert_parallel)
from verl_sweep.spaces.systems.knobs import MEMORY

if TYPE_CHECKING:
    import optuna


def suggest(s: SystemsChoices, trial: "optuna.trial.BaseTrial", base: Config, *, fits_memory: bool) -> Config:
    """The overrides of the point ``trial`` asks for. The order of the questions is part of
    the contract: a sampler's draws (and stored studies) depend on it."""
    c, names = s.choices, s.knobs
    config: Config = {V.ROLLOUT_TP: _pick(trial, "rollout_tp", c["rollout_tp"])}
    config.update(rollout_expert_parallel(base, config[V.ROLLOUT_TP]))
    strategy = _pick(trial, "strategy", c["strategy"])
    config[V.STRATEGY] = strategy
    # verl 0.9.1 prefetches under FSDP1 and FSDP2 alike (verl/utils/fsdp_utils.py, apply_fsdp2).
    config[V.FORWARD_PREFETCH] = _pick(trial, "forward_prefetch", c["forward_prefetch"])
    sp = _pick(trial, "ulysses", c["ulysses"])
    config[V.ULYSSES] = sp
    config[V.ULYSSES_LEGACY] = sp  # the ref policy follows the actor-level key
    if sp > 1:
        config[V.USE_REMOVE_PADDING] = True
    dynamic = _pick(trial, "use_dynamic_bsz", c["use_dynamic_bsz"])
    config[V.USE_DYNAMIC_BSZ] = dynamic
    if dynamic:
        limit = _pick(trial, names.name("ppo_max_token_len_per_gpu", sp), s.token_lens[sp])
        config[V.MAX_TOKEN_LEN] = limit
        # The log-prob passes follow the update's switch (verl's oc.select) but may take
        # larger token limits: they keep no activations for a backward pass.
        factor = _pick(trial, "log_prob_token_factor", c["log_prob_token_factor"])
        for key in (ROLLOUT_LOG_PROB_DYNAMIC, REF_LOG_PROB_DYNAMIC):
            config[key] = True
        for key in (ROLLOUT_LOG_PROB_TOKENS, REF_LOG_PROB_TOKENS):
            config[key] = limit * factor
    else:
        for key in (ROLLOUT_LOG_PROB_DYNAMIC, REF_LOG_PROB_DYNAMIC):
            config[key] = False
        # None: the base's own (unset) choice, left as it is
        if s.micro_choices.get(sp):
            micro = _pick(trial, names.name("micro_batch", sp), s.micro_choices[sp])
            if micro is not None:
                config[V.MICRO_BATCH] = micro
        if s.log_prob_choices.get(sp):
            log_prob = _pick(trial, names.name("log_prob_micro_batch", sp), s.log_prob_choices[sp])
            if log_prob is not None:
                config[ROLLOUT_LOG_PROB_MICRO] = config[REF_LOG_PROB_MICRO] = log_prob
        if V.setting(base, V.USE_DYNAMIC_BSZ):
            # the base batched dynamically and set no micro-batches, which verl needs once
            # batching is static (its validate_config refuses the config without them)
            config.update(static_batching_fill({**base, **config}, s.hardware, algorithm=s.algorithm))
    config[V.GRADIENT_CHECKPOINTING] = _pick(trial, "gradient_checkpointing", c["gradient_checkpointing"])
    config[V.ACTIVATION_OFFLOAD] = _pick(trial, "activation_offload", c["activation_offload"])
    config[MAX_NUM_SEQS] = _pick(trial, "max_num_seqs", c["max_num_seqs"])
    config[ENFORCE_EAGER] = _pick(trial, "enforce_eager", c["enforce_eager"])
    config[FREE_CACHE_ENGINE] = _pick(trial, "free_cache_engine", c["free_cache_engine"])
    # Asked last: its floor (the pool must hold the token budget at this TP) and its ceiling
    # (OOMs of this same layout, and the memory estimate) depend on the knobs chosen above.
    low = s.floors[config[V.ROLLOUT_TP]]
    fit = V.fitting_fraction(s.model, s.hardware, merge(base, config), base=base) if fits_memory else 1.0
    history = trial_history(trial)
    high = max(low, min(_memory_high(s, trial, history), fit))
    config[V.GPU_MEMORY] = trial.suggest_float(MEMORY, *asked_range(history.fixed, MEMORY, low, high))
    return config


def _memory_high(s: SystemsChoices, trial: "optuna.trial.BaseTrial", history: TrialHistory) -> float:
    """Below the smallest memory fraction that ran out of memory with this same layout
    (every other knob equal). An OOM of another layout says nothing about the fraction: it
    may come from training (a large token limit without checkpointing)."""
    def layout(params: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in params.items() if k != MEMORY}

    mine = layout(trial.params)
    same = [t for t in history.others if layout(t.params) == mine]
    ceiling = oom_ceiling(same, MEMORY, hardware=s.hardware_tag)
    if ceiling is not None and ceiling <= s.memory.high:
        return max(s.memory.low, ceiling - 0.01)
    return s.memory.high


def incumbent_params(s: SystemsChoices, base: Config) -> dict[str, Any] | None:
    """The point whose config is ``base``'s own (None: ``base`` is not a point of the space)."""
    c, names = s.choices, s.knobs
    sp = V.ulysses_size(base)
    dynamic = bool(V.setting(base, V.USE_DYNAMIC_BSZ))
    wanted: list[tuple[str, Any, list[Any]]] = [
        ("rollout_tp", V.setting(base, V.ROLLOUT_TP), c["rollout_tp"]),
        ("strategy", V.setting(base, V.STRATEGY), c["strategy"]),
        ("ulysses", sp, c["ulysses"]),
        ("use_dynamic_bsz", dynamic, c["use_dynamic_bsz"]),
        ("gradient_checkpointing", bool(V.setting(base, V.GRADIENT_CHECKPOINTING)), c["gradient_checkpointing"]),
        ("activation_offload", bool(V.setting(base, V.ACTIVATION_OFFLOAD)), c["activation_offload"]),
        ("max_num_seqs", base_value(base, MAX_NUM_SEQS), c["max_num_seqs"]),
        ("enforce_eager", bool(base_value(base, ENFORCE_EAGER)), c["enforce_eager"]),
        ("free_cache_engine", bool(base_value(base, FREE_CACHE_ENGINE)), c["free_cache_engine"]),
        ("forward_prefetch", bool(V.setting(base, V.FORWARD_PREFETCH)), c["forward_prefetch"]),
    ]
    if sp not in c["ulysses"]:
        return None  # a Ulysses size the space does not ask: no parameter names for it
    if dynamic:
        limit = V.setting(base, V.MAX_TOKEN_LEN)
        wanted.append((names.name("ppo_max_token_len_per_gpu", sp), limit, s.token_lens.get(sp, [])))
        log_prob_limit = base.get(ROLLOUT_LOG_PROB_TOKENS, limit)
        factor = log_prob_limit // limit if isinstance(log_prob_limit, int) and isinstance(limit, int) and limit else None
        if factor is None or factor * limit != log_prob_limit or base.get(REF_LOG_PROB_TOKENS, log_prob_limit) != log_prob_limit:
            return None
        wanted.append(("log_prob_token_factor", factor, c["log_prob_token_factor"]))
    else:
        if s.micro_choices.get(sp):
            wanted.append((names.name("micro_batch", sp), base_value(base, V.MICRO_BATCH), s.micro_choices[sp]))
        if s.log_prob_choices.get(sp):
            log_prob = base_value(base, ROLLOUT_LOG_PROB_MICRO)
            ref = base_value(base, REF_LOG_PROB_MICRO)
            if ref is not None and ref != log_prob and _uses_ref(base):
                return None  # two log-prob micro-batches: not a point of this space
            wanted.append((names.name("log_prob_micro_batch", sp), log_prob, s.log_prob_choices[sp]))
    params: dict[str, Any] = {}
    for name, value, valid in wanted:
        if value not in valid:
            return None
        if len(valid) > 1:  # a knob with one value is set, not asked (see suggest)
            params[name] = value
    memory = V.setting(base, V.GPU_MEMORY)
    own_tp = V.setting(base, V.ROLLOUT_TP)
    if not isinstance(memory, (int, float)) or own_tp not in s.floors \
            or not s.floors[own_tp] <= memory <= s.memory.high:
        return None
    params[MEMORY] = float(memory)
    return params


def _uses_ref(base: Config) -> bool:
    return bool(V.setting(base, V.USE_KL_LOSS) or V.setting(base, V.USE_KL_IN_REWARD))


def _pick(trial: "optuna.trial.BaseTrial", name: str, choices: list[Any]) -> Any:
    """A categorical knob: asked of the sampler only when it has more than one valid value."""
    return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, choices)
