"""Stage 0 of the method: the parallel layout and memory knobs, scored on speed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

from spaces import bounds as B
from spaces import engines as E
from spaces import limits as L
from spaces.base import Space, SpaceError, check_options, where_or
from spaces.batching import static_batching_fill
from spaces.facts import Algorithm, HardwareFacts, ModelFacts
from spaces.oom import hardware_tag, oom_ceiling, study_trials
from spaces.overrides import Config, get

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)


MAX_TOKEN_LEN_CHOICES = (2048, 4096, 8192, 16384, 32768)


def rollout_expert_parallel(base: Config, tp: int) -> Config:
    """verl 0.9.1's RolloutConfig wants EP = TP × DP once rollout expert parallelism is on (not
    for trtllm): a layout that changes the rollout TP moves EP with it."""
    ep = L.setting(base, E.ROLLOUT_EP)
    if not L._is_int(ep) or ep <= 1 or L.setting(base, L.ROLLOUT_NAME) == "trtllm":
        return {}
    return {E.ROLLOUT_EP: tp * L._int_setting(base, L.ROLLOUT_DP)}


def rollout_memory_floors(model: ModelFacts, hardware: HardwareFacts, base: Config,
                          memory: B.ParamBound) -> dict[int, float]:
    """Each rollout TP that fits, with the lowest memory fraction its vLLM pool holds the base's
    token budget at (never below ``memory.low``). A TP whose floor is above ``memory.high``
    does not fit, except the base's own TP: the run holds it, so its floor is at most the
    base's fraction (the estimate is the one that is short). Each layout keeps its own floor:
    the worst TP's floor is not applied to the others."""
    dp_r, pp = L._int_setting(base, L.ROLLOUT_DP), L._int_setting(base, L.ROLLOUT_PP)
    budget = max(L._int_setting(base, L.TOKEN_BUDGET), model.max_seq_len)
    own_tp, own_memory = L.setting(base, L.ROLLOUT_TP), L.setting(base, L.GPU_MEMORY)
    floors: dict[int, float] = {}
    sizes = L.rollout_tp_sizes(model, hardware).value
    if L._is_int(own_tp) and own_tp not in sizes:  # a run's own TP across nodes: verl ran it
        sizes = sorted({*sizes, own_tp})
    for tp in sizes:
        if hardware.n_gpus % (tp * dp_r * pp):
            continue
        floor = max(memory.low, L.memory_fraction_for(model, hardware, budget, tp, data_parallel=dp_r))
        if tp == own_tp and isinstance(own_memory, (int, float)) and memory.contains(own_memory):
            floor = min(floor, float(own_memory))
        if floor <= memory.high or tp == own_tp:
            floors[tp] = min(floor, memory.high)
    return floors


class SystemsSpace(Space):
    """Stage 0: the parallel layout and memory knobs (docs/method.md §2); speed only.

    Conditional, so only valid combinations are asked: the
    dynamic-batch token limit only with dynamic batching (and per Ulysses size, so that
    limit × ulysses ≥ prompt + response always holds), rollout TP and Ulysses sizes only
    among the values that fit the heads, the GPUs, the base's mini-batch and the token budget.
    """

    kind = "systems"
    LISTS = (
        "rollout_tp", "ulysses", "strategy", "forward_prefetch", "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu", "gradient_checkpointing", "activation_offload",
    )
    OPTIONS = frozenset({"gpu_memory_utilization", *LISTS})

    def __init__(self, *, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
                 base: Config, options: Mapping[str, Any], where: str = "") -> None:
        where = where_or(where, "systems")
        check_options(options, self.OPTIONS, where)
        self.model, self.hardware = model, hardware
        self.hardware_tag = hardware_tag(hardware)
        sub = options.get("gpu_memory_utilization", {})
        if not isinstance(sub, Mapping):
            raise SpaceError(f"{where}.gpu_memory_utilization: must be a mapping like {{low: .., high: ..}}, but got {sub!r}. Use a mapping.")
        check_options(sub, B.BOUND_OPTIONS, f"{where}.gpu_memory_utilization")
        self.algorithm = algorithm
        self.memory = B.GPU_MEMORY_UTILIZATION.including(get(base, L.GPU_MEMORY)).narrowed(
            sub, where=f"{where}.gpu_memory_utilization")
        self.lines: list[str] = [f"systems: {L.GPU_MEMORY} — {self.memory.describe()}"]

        # Rollout TP: divides GPUs/node and heads, TP·DP·PP divides the GPUs, and the vLLM
        # pool holds the base's token budget within the memory range. On a tuned base (a
        # systems stage after the token budget stage) the memory floor rises instead, so that
        # every layout the space proposes still holds that budget.
        dp_r, pp = L._int_setting(base, L.ROLLOUT_DP), L._int_setting(base, L.ROLLOUT_PP)
        self.floors = rollout_memory_floors(model, hardware, base, self.memory)
        tps = list(self.floors)
        self.lines.append(
            f"systems: rollout TP ∈ {tps} (divides GPUs/node and heads; TP·DP {dp_r}·PP {pp} divides "
            f"{hardware.n_gpus} GPUs; memory floor per TP, the pool holding token budget "
            f"{max(L._int_setting(base, L.TOKEN_BUDGET), model.max_seq_len):,}: "
            + ", ".join(f"TP {t} ≥ {f:g}" for t, f in self.floors.items()) + ")"
        )
        # Ulysses: valid sizes that keep the base's static mini-batch valid.
        mini = L._int_setting(base, L.MINI_BATCH)
        sps = [
            s for s in L.ulysses_sizes(model, hardware).value
            if L.mini_batch_problem(mini, {**base, L.ULYSSES: s, L.ULYSSES_LEGACY: s}, hardware) is None
        ]
        self.lines.append(f"systems: ulysses ∈ {sps} ({L.ulysses_sizes(model, hardware).lines[0]}; keeps mini-batch {mini} valid)")
        defaults: dict[str, list[Any]] = {
            "rollout_tp": tps,
            "ulysses": sps,
            "strategy": ["fsdp", "fsdp2"],
            "forward_prefetch": [False, True],
            "use_dynamic_bsz": [False, True],
            "ppo_max_token_len_per_gpu": list(MAX_TOKEN_LEN_CHOICES),
            "gradient_checkpointing": [True, False],
            "activation_offload": [False, True],
        }
        self.choices: dict[str, list[Any]] = {}
        for name in self.LISTS:
            valid = defaults[name]
            asked = options.get(name, valid)
            if not isinstance(asked, list) or not asked:
                raise SpaceError(f"{where}.{name}: must be a non-empty list, but got {asked!r}. List the values to try.")
            for i, value in enumerate(asked):
                if value not in valid or isinstance(value, bool) != isinstance(valid[0], bool):
                    raise SpaceError(
                        f"{where}.{name}[{i}]: must be one of {valid}, but got {value!r}. Pick from those."
                    )
            self.choices[name] = [v for v in valid if v in asked]
        # Per Ulysses size, the dynamic-batch limits that cover the longest sequence.
        self.token_lens = {
            s: [t for t in self.choices["ppo_max_token_len_per_gpu"] if t * s >= model.max_seq_len]
            for s in self.choices["ulysses"]
        }
        self.lines.append(
            f"systems: with dynamic batching, ppo_max_token_len_per_gpu × ulysses ≥ {model.max_seq_len}: "
            + ", ".join(f"ulysses {s}: {v}" for s, v in self.token_lens.items())
        )
        if True in self.choices["use_dynamic_bsz"] and not all(self.token_lens.values()):
            raise SpaceError(
                f"{where}.ppo_max_token_len_per_gpu: must hold a value ≥ {model.max_seq_len} ÷ ulysses "
                f"for every ulysses size, but got {self.choices['ppo_max_token_len_per_gpu']}. Add a larger limit."
            )

    def suggest(self, trial: "optuna.trial.BaseTrial", base: Config) -> Config:
        c = self.choices
        config: Config = {L.ROLLOUT_TP: trial.suggest_categorical("rollout_tp", c["rollout_tp"])}
        config.update(rollout_expert_parallel(base, config[L.ROLLOUT_TP]))
        strategy = trial.suggest_categorical("strategy", c["strategy"])
        config[L.STRATEGY] = strategy
        # verl 0.9.1 prefetches under FSDP1 and FSDP2 alike (verl/utils/fsdp_utils.py, apply_fsdp2).
        config[L.FORWARD_PREFETCH] = trial.suggest_categorical("forward_prefetch", c["forward_prefetch"])
        sp = trial.suggest_categorical("ulysses", c["ulysses"])
        config[L.ULYSSES] = sp
        config[L.ULYSSES_LEGACY] = sp  # the ref policy follows the actor-level key
        if sp > 1:
            config[L.USE_REMOVE_PADDING] = True
        dynamic = trial.suggest_categorical("use_dynamic_bsz", c["use_dynamic_bsz"])
        config[L.USE_DYNAMIC_BSZ] = dynamic
        if dynamic:
            config[L.MAX_TOKEN_LEN] = trial.suggest_categorical(f"ppo_max_token_len_per_gpu_sp{sp}", self.token_lens[sp])
        else:  # verl needs micro-batch sizes under static batching; the base may have none
            config.update(static_batching_fill({**base, **config}, self.hardware, algorithm=self.algorithm))
        config[L.GRADIENT_CHECKPOINTING] = trial.suggest_categorical("gradient_checkpointing", c["gradient_checkpointing"])
        config[L.ACTIVATION_OFFLOAD] = trial.suggest_categorical("activation_offload", c["activation_offload"])
        # Asked last: its floor (the pool must hold the token budget at this TP) and its ceiling
        # (OOMs of this same layout) depend on the layout chosen above.
        low = self.floors[config[L.ROLLOUT_TP]]
        config[L.GPU_MEMORY] = trial.suggest_float("gpu_memory_utilization", low, max(low, self._memory_high(trial)))
        return config

    def _memory_high(self, trial: "optuna.trial.BaseTrial") -> float:
        """Below the smallest memory fraction that ran out of memory with this same layout
        (every other knob equal). An OOM of another layout says nothing about the fraction:
        it may come from training (a large token limit without checkpointing), and capping
        every layout by it kept a study from ever trying the fractions that were fastest."""
        def layout(params: Mapping[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in params.items() if k != "gpu_memory_utilization"}

        mine = layout(trial.params)
        same = [t for t in study_trials(trial) if layout(t.params) == mine]
        ceiling = oom_ceiling(same, "gpu_memory_utilization", hardware=self.hardware_tag)
        if ceiling is not None and ceiling <= self.memory.high:
            return max(self.memory.low, ceiling - 0.01)
        return self.memory.high

    def incumbent_params(self, base: Config) -> dict[str, Any] | None:
        c = self.choices
        sp = L.ulysses_size(base)
        params: dict[str, Any] = {
            "rollout_tp": L.setting(base, L.ROLLOUT_TP),
            "strategy": L.setting(base, L.STRATEGY),
            "ulysses": sp,
            "use_dynamic_bsz": bool(L.setting(base, L.USE_DYNAMIC_BSZ)),
            "gradient_checkpointing": bool(L.setting(base, L.GRADIENT_CHECKPOINTING)),
            "activation_offload": bool(L.setting(base, L.ACTIVATION_OFFLOAD)),
        }
        for name, value in params.items():
            if value not in c[name]:
                return None
        memory = L.setting(base, L.GPU_MEMORY)
        if not isinstance(memory, (int, float)) or not self.floors[params["rollout_tp"]] <= memory <= self.memory.high:
            return None
        params["gpu_memory_utilization"] = float(memory)
        prefetch = bool(L.setting(base, L.FORWARD_PREFETCH))
        if prefetch not in c["forward_prefetch"]:
            return None
        params["forward_prefetch"] = prefetch
        if params["use_dynamic_bsz"]:
            limit = L.setting(base, L.MAX_TOKEN_LEN)
            if limit not in self.token_lens.get(sp, []):
                return None
            params[f"ppo_max_token_len_per_gpu_sp{sp}"] = limit
        return params

    def explain(self) -> list[str]:
        return list(self.lines)

    @property
    def speed_only(self) -> bool:
        return True
