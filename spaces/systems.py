"""Stage 0 of the method: the parallel layout and memory knobs, scored on speed."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from verl_sweep.spaces import bounds as B
from verl_sweep import verl_knowledge as E  # E, L and M name one package: verl's knowledge
from verl_sweep import verl_knowledge as L
from verl_sweep import verl_knowledge as M
from verl_sweep.spaces.base import Moves, Space, SpaceError, check_options, where_or
from verl_sweep.spaces.batching import static_batching_fill
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.oom import hardware_tag, oom_ceiling, study_trials
from verl_sweep.verl_knowledge import Config, get, merge

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)


MAX_TOKEN_LEN_CHOICES = (2048, 4096, 8192, 16384, 32768)
#: static micro-batches (sequences a forward/backward pass) tried for the actor update and
#: the log-prob passes; each stage keeps those that divide its per-GPU batch
MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: the log-prob passes (forward only) may take this many times the update's token limit
LOG_PROB_TOKEN_FACTORS = (1, 2, 4)
MAX_NUM_SEQS_CHOICES = (128, 256, 512, 1024, 2048)
ROLLOUT_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
REF_LOG_PROB_MICRO = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
ROLLOUT_LOG_PROB_DYNAMIC = "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"
REF_LOG_PROB_DYNAMIC = "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"
ROLLOUT_LOG_PROB_TOKENS = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_LOG_PROB_TOKENS = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
DEPRECATED_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size"
DEPRECATED_LOG_PROB_MICRO = "actor_rollout_ref.rollout.log_prob_micro_batch_size"
DEPRECATED_CRITIC_MICRO = "critic.ppo_micro_batch_size"
MAX_NUM_SEQS = "actor_rollout_ref.rollout.max_num_seqs"
ENFORCE_EAGER = "actor_rollout_ref.rollout.enforce_eager"
FREE_CACHE_ENGINE = "actor_rollout_ref.rollout.free_cache_engine"
#: a starting point's estimated peak stays within this share of the usable memory (the
#: estimate's own error, and the allocator's fragmentation at larger passes)
FIT_HEADROOM = 0.8


def _base_value(base: Config, key: str) -> Any:
    return base.get(key, L.VERL_DEFAULTS.get(key))


def effective(config: Config, key: str) -> Any:
    """The value verl runs ``config`` with for ``key``: its own, else what verl's config makes
    of it (the log-prob passes follow the update's dynamic batching and token limit), else
    verl's default."""
    if key in config:
        return config[key]
    if key in (ROLLOUT_LOG_PROB_DYNAMIC, REF_LOG_PROB_DYNAMIC):
        return bool(L.setting(config, L.USE_DYNAMIC_BSZ))
    if key in (ROLLOUT_LOG_PROB_TOKENS, REF_LOG_PROB_TOKENS):
        return L.setting(config, L.MAX_TOKEN_LEN)
    return _base_value(config, key)


def _divisors(total: int, candidates: tuple[int, ...], keep: Any, *, deprecated_set: bool) -> list[int | None]:
    """The candidates that divide ``total``, with ``keep`` (the base's value) if it divides
    too. A base that leaves the size unset keeps that choice (None, first: the incumbent's);
    one that sets verl's older global key instead (``…micro_batch_size``) may not get the
    per-GPU key as well, which verl refuses: only None then."""
    if deprecated_set:
        return [None]
    values = {c for c in candidates if total % c == 0}
    if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1 and total % keep == 0:
        values.add(keep)
    return ([None] if keep is None else []) + sorted(values)


def rollout_expert_parallel(base: Config, tp: int) -> Config:
    """verl 0.9.1's RolloutConfig wants EP = TP × DP once rollout expert parallelism is on (not
    for trtllm): a layout that changes the rollout TP moves EP with it."""
    ep = L.setting(base, E.ROLLOUT_EP)
    if not L.is_int(ep) or ep <= 1 or L.setting(base, L.ROLLOUT_NAME) == "trtllm":
        return {}
    return {E.ROLLOUT_EP: tp * L.int_setting(base, L.ROLLOUT_DP)}


class SystemsSpace(Space):
    """Stage 0: the parallel layout and memory knobs (docs/method.md §2); speed only.

    Conditional, so only valid combinations are asked: the dynamic-batch token limit only with dynamic batching (and per
    Ulysses size, so that limit × ulysses ≥ prompt + response always holds), static micro-batches only without it (per
    Ulysses size, dividing the per-GPU batch), rollout TP and Ulysses sizes only among the values that fit the heads,
    the GPUs, the base's mini-batch and the token budget. A knob with one valid value (the layout on one GPU) is set,
    not asked: a sampler would spend nothing on it, and a reader of the trial sees only what was searched.

    Besides the layout, what decides a small model's step time is host work per pass (on one
    H200 with a 0.36B model, verl's quickstart settings left the GPU idle ~80% of a step): the
    micro-batches of the update and the log-prob passes (or dynamic batching with token
    limits for each), swept by default where the layout has one choice. vLLM's sequences per
    batch, CUDA graphs (``enforce_eager``) and whether the engine frees its cache between
    phases are swept when the stage lists them (see ``kept`` below).
    """

    kind = "systems"
    moves = Moves.SPEED
    #: the stage ends with a local search around the sampler's leader (``follow_up_points``)
    n_follow_ups = 16
    follow_ups_per_round = 4
    follow_ups_last = True
    LISTS = (
        "rollout_tp", "ulysses", "strategy", "forward_prefetch", "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu", "gradient_checkpointing", "activation_offload",
        "micro_batch", "log_prob_micro_batch", "log_prob_token_factor", "max_num_seqs", "enforce_eager",
        "free_cache_engine",
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
        # pool holds the base's token budget within the memory range: each TP with its own
        # memory floor (a tuned base's larger budget raises it), never the worst one for all.
        dp_r, pp = L.int_setting(base, L.ROLLOUT_DP), L.int_setting(base, L.ROLLOUT_PP)
        self.floors = M.rollout_memory_floors(model, hardware, base, self.memory)
        tps = list(self.floors)
        self.lines.append(
            f"systems: rollout TP ∈ {tps} (divides GPUs/node and heads; TP·DP {dp_r}·PP {pp} divides "
            f"{hardware.n_gpus} GPUs; memory floor per TP, the pool holding token budget "
            f"{max(L.int_setting(base, L.TOKEN_BUDGET), model.max_seq_len):,}: "
            + ", ".join(f"TP {t} ≥ {f:g}" for t, f in self.floors.items()) + ")"
        )
        # Ulysses: valid sizes that keep the base's static mini-batch valid.
        mini = L.int_setting(base, L.MINI_BATCH)
        sps = [
            s for s in L.ulysses_sizes(model, hardware).value
            if L.mini_batch_problem(mini, {**base, L.ULYSSES: s, L.ULYSSES_LEGACY: s}, hardware) is None
        ]
        self.lines.append(f"systems: ulysses ∈ {sps} ({L.ulysses_sizes(model, hardware).lines[0]}; keeps mini-batch {mini} valid)")
        # Sequences a step: the update's per-GPU batch is the mini-batch's, the log-prob
        # passes' the train batch's; vLLM's sequences a batch beyond one replica's share of the
        # step's sequences cannot matter.
        n = L.int_setting(base, L.ROLLOUT_N)
        train = L.int_setting(base, L.TRAIN_BATCH)
        dps = {s: max(1, hardware.n_gpus // s) for s in sps}
        self.micro_choices = {
            s: _divisors(mini * n // dps[s], MICRO_BATCH_CHOICES, _base_value(base, L.MICRO_BATCH),
                         deprecated_set=base.get(DEPRECATED_MICRO) is not None)
            for s in sps if (mini * n) % dps[s] == 0}
        self.log_prob_choices = {
            s: _divisors(train * n // dps[s], MICRO_BATCH_CHOICES, _base_value(base, ROLLOUT_LOG_PROB_MICRO),
                         deprecated_set=base.get(DEPRECATED_LOG_PROB_MICRO) is not None)
            for s in sps if (train * n) % dps[s] == 0}
        replicas = max(1, hardware.n_gpus // (max(tps) if tps else 1) // dp_r // pp)  # fewest replicas, most each
        per_replica = -(-train * n // replicas)
        seqs = sorted({v for v in MAX_NUM_SEQS_CHOICES if v < per_replica}
                      | {next((v for v in MAX_NUM_SEQS_CHOICES if v >= per_replica), MAX_NUM_SEQS_CHOICES[-1])})
        base_seqs = _base_value(base, MAX_NUM_SEQS)
        if isinstance(base_seqs, int) and not isinstance(base_seqs, bool) and base_seqs not in seqs:
            seqs = sorted({*seqs, base_seqs})
        self.lines.append(
            f"systems: static micro-batches divide the per-GPU batch (update: mini {mini} × n {n} ÷ DP; log-prob: "
            f"train {train} × n {n} ÷ DP); vLLM max_num_seqs ∈ {seqs} (≥ {per_replica} sequences a replica "
            "cannot matter)"
        )
        defaults: dict[str, list[Any]] = {
            "rollout_tp": tps,
            "ulysses": sps,
            "strategy": ["fsdp", "fsdp2"],
            "forward_prefetch": [False, True],
            # verl 0.9.1 reads the critic's older global micro-batch into its per-GPU one too,
            # and refuses the pair once batching is static: such a base keeps dynamic batching
            "use_dynamic_bsz": [True] if base.get(DEPRECATED_CRITIC_MICRO) is not None else [False, True],
            "ppo_max_token_len_per_gpu": list(MAX_TOKEN_LEN_CHOICES),
            "gradient_checkpointing": [True, False],
            "activation_offload": [False, True],
            "micro_batch": _union(self.micro_choices),
            "log_prob_micro_batch": _union(self.log_prob_choices),
            "log_prob_token_factor": list(LOG_PROB_TOKEN_FACTORS),
            "max_num_seqs": seqs,
            "enforce_eager": [False, True],
            "free_cache_engine": [True, False],
        }
        # Knobs that keep the base's value unless the stage lists them. vLLM's own, always:
        # present in every trial, they cost a many-knob sampler its grip on the layout (the
        # simulated benchmark lost 2 of 10 runs on two worlds). The passes' batching, where the
        # layout has choices: there the layout is stage 0's subject (seed 000), and the
        # batching knobs beside it cost 3 of 10 runs on a simulated world; with one layout
        # (one GPU) the batching is what is left to search.
        kept: dict[str, Any] = {name: _base_value(base, key) for name, key in (
            ("max_num_seqs", MAX_NUM_SEQS), ("enforce_eager", ENFORCE_EAGER), ("free_cache_engine", FREE_CACHE_ENGINE))}
        if len(tps) > 1 or len(sps) > 1:
            limit, log_prob_limit = base.get(L.MAX_TOKEN_LEN), base.get(ROLLOUT_LOG_PROB_TOKENS)
            factor = (log_prob_limit // limit if isinstance(limit, int) and isinstance(log_prob_limit, int) and limit
                      and log_prob_limit % limit == 0 else 1)
            kept.update(micro_batch=_base_value(base, L.MICRO_BATCH), log_prob_token_factor=factor,
                        log_prob_micro_batch=_base_value(base, ROLLOUT_LOG_PROB_MICRO))
        self.choices: dict[str, list[Any]] = {}
        for name in self.LISTS:
            valid = defaults[name]
            asked = options.get(name, valid)
            if name not in options and name in kept:
                asked = [kept[name]] if kept[name] in valid else valid
            if not isinstance(asked, list) or not asked:
                raise SpaceError(f"{where}.{name}: must be a non-empty list, but got {asked!r}. List the values to try.")
            for i, value in enumerate(asked):
                if value not in valid or isinstance(value, bool) != isinstance(valid[0], bool):
                    raise SpaceError(
                        f"{where}.{name}[{i}]: must be one of {valid}, but got {value!r}. Pick from those."
                    )
            self.choices[name] = [v for v in valid if v in asked]
        self.micro_choices = {s: [v for v in values if v in self.choices["micro_batch"]]
                              for s, values in self.micro_choices.items()}
        self.log_prob_choices = {s: [v for v in values if v in self.choices["log_prob_micro_batch"]]
                                 for s, values in self.log_prob_choices.items()}
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
        config: Config = {L.ROLLOUT_TP: _pick(trial, "rollout_tp", c["rollout_tp"])}
        config.update(rollout_expert_parallel(base, config[L.ROLLOUT_TP]))
        strategy = _pick(trial, "strategy", c["strategy"])
        config[L.STRATEGY] = strategy
        # verl 0.9.1 prefetches under FSDP1 and FSDP2 alike (verl/utils/fsdp_utils.py, apply_fsdp2).
        config[L.FORWARD_PREFETCH] = _pick(trial, "forward_prefetch", c["forward_prefetch"])
        sp = _pick(trial, "ulysses", c["ulysses"])
        config[L.ULYSSES] = sp
        config[L.ULYSSES_LEGACY] = sp  # the ref policy follows the actor-level key
        if sp > 1:
            config[L.USE_REMOVE_PADDING] = True
        dynamic = _pick(trial, "use_dynamic_bsz", c["use_dynamic_bsz"])
        config[L.USE_DYNAMIC_BSZ] = dynamic
        if dynamic:
            limit = _pick(trial, f"ppo_max_token_len_per_gpu_sp{sp}", self.token_lens[sp])
            config[L.MAX_TOKEN_LEN] = limit
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
            if self.micro_choices.get(sp):
                micro = _pick(trial, f"micro_batch_sp{sp}", self.micro_choices[sp])
                if micro is not None:
                    config[L.MICRO_BATCH] = micro
            if self.log_prob_choices.get(sp):
                log_prob = _pick(trial, f"log_prob_micro_batch_sp{sp}", self.log_prob_choices[sp])
                if log_prob is not None:
                    config[ROLLOUT_LOG_PROB_MICRO] = config[REF_LOG_PROB_MICRO] = log_prob
            if L.setting(base, L.USE_DYNAMIC_BSZ):
                # the base batched dynamically and set no micro-batches, which verl needs once
                # batching is static (its validate_config refuses the config without them)
                config.update(static_batching_fill({**base, **config}, self.hardware, algorithm=self.algorithm))
        config[L.GRADIENT_CHECKPOINTING] = _pick(trial, "gradient_checkpointing", c["gradient_checkpointing"])
        config[L.ACTIVATION_OFFLOAD] = _pick(trial, "activation_offload", c["activation_offload"])
        config[MAX_NUM_SEQS] = _pick(trial, "max_num_seqs", c["max_num_seqs"])
        config[ENFORCE_EAGER] = _pick(trial, "enforce_eager", c["enforce_eager"])
        config[FREE_CACHE_ENGINE] = _pick(trial, "free_cache_engine", c["free_cache_engine"])
        # Asked last: its floor (the pool must hold the token budget at this TP) and its ceiling
        # (OOMs of this same layout, and the memory estimate) depend on the knobs chosen above.
        low = self.floors[config[L.ROLLOUT_TP]]
        fit = M.fitting_fraction(self.model, self.hardware, merge(base, config), base=base) if self.fits_memory else 1.0
        config[L.GPU_MEMORY] = trial.suggest_float("gpu_memory_utilization", low, max(low, min(self._memory_high(trial), fit)))
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
        dynamic = bool(L.setting(base, L.USE_DYNAMIC_BSZ))
        wanted: list[tuple[str, Any, list[Any]]] = [
            ("rollout_tp", L.setting(base, L.ROLLOUT_TP), c["rollout_tp"]),
            ("strategy", L.setting(base, L.STRATEGY), c["strategy"]),
            ("ulysses", sp, c["ulysses"]),
            ("use_dynamic_bsz", dynamic, c["use_dynamic_bsz"]),
            ("gradient_checkpointing", bool(L.setting(base, L.GRADIENT_CHECKPOINTING)), c["gradient_checkpointing"]),
            ("activation_offload", bool(L.setting(base, L.ACTIVATION_OFFLOAD)), c["activation_offload"]),
            ("max_num_seqs", _base_value(base, MAX_NUM_SEQS), c["max_num_seqs"]),
            ("enforce_eager", bool(_base_value(base, ENFORCE_EAGER)), c["enforce_eager"]),
            ("free_cache_engine", bool(_base_value(base, FREE_CACHE_ENGINE)), c["free_cache_engine"]),
        ]
        wanted.append(("forward_prefetch", bool(L.setting(base, L.FORWARD_PREFETCH)), c["forward_prefetch"]))
        if dynamic:
            limit = L.setting(base, L.MAX_TOKEN_LEN)
            wanted.append((f"ppo_max_token_len_per_gpu_sp{sp}", limit, self.token_lens.get(sp, [])))
            log_prob_limit = base.get(ROLLOUT_LOG_PROB_TOKENS, limit)
            factor = log_prob_limit // limit if isinstance(log_prob_limit, int) and isinstance(limit, int) and limit else None
            if factor is None or factor * limit != log_prob_limit or base.get(REF_LOG_PROB_TOKENS, log_prob_limit) != log_prob_limit:
                return None
            wanted.append(("log_prob_token_factor", factor, c["log_prob_token_factor"]))
        else:
            if self.micro_choices.get(sp):
                wanted.append((f"micro_batch_sp{sp}", _base_value(base, L.MICRO_BATCH), self.micro_choices[sp]))
            if self.log_prob_choices.get(sp):
                log_prob = _base_value(base, ROLLOUT_LOG_PROB_MICRO)
                ref = _base_value(base, REF_LOG_PROB_MICRO)
                if ref is not None and ref != log_prob and self._uses_ref(base):
                    return None  # two log-prob micro-batches: not a point of this space
                wanted.append((f"log_prob_micro_batch_sp{sp}", log_prob, self.log_prob_choices[sp]))
        params: dict[str, Any] = {}
        for name, value, valid in wanted:
            if value not in valid:
                return None
            if len(valid) > 1:  # a knob with one value is set, not asked (see suggest)
                params[name] = value
        memory = L.setting(base, L.GPU_MEMORY)
        own_tp = L.setting(base, L.ROLLOUT_TP)
        if not isinstance(memory, (int, float)) or own_tp not in self.floors \
                or not self.floors[own_tp] <= memory <= self.memory.high:
            return None
        params["gpu_memory_utilization"] = float(memory)
        return params

    def starting_points(self, base: Config, n: int) -> list[dict[str, Any]]:
        """The fewest, largest passes that fit: when host work per pass sets the pace (on one
        H200 a 0.36B model's update took 128 passes of ~0.5 s, each ~30 ms of arithmetic),
        a step shrinks with the number of passes, and memory is what bounds their size. From
        the incumbent's layout and memory fraction: gradient checkpointing on, CUDA graphs on,
        vLLM's batch as large as can matter, and the largest micro-batches (static), then the
        largest token limits (dynamic batching), whose estimated peak stays within
        ``FIT_HEADROOM`` of the usable memory (``verl_sweep.verl_knowledge.memory``).

        Only where the layout has one choice (one GPU): there the batching is the whole
        search; where layouts differ, the sampler's own first draws over them do better."""
        incumbent = self.incumbent_params(base)
        if incumbent is None or n < 1 or len(self.choices["rollout_tp"]) > 1 or len(self.choices["ulysses"]) > 1:
            return []
        sp = L.ulysses_size(base)
        common = {**incumbent}
        for name, value in (("gradient_checkpointing", True), ("activation_offload", False),
                            ("max_num_seqs", self.choices["max_num_seqs"][-1]), ("enforce_eager", False),
                            ("free_cache_engine", True)):
            if len(self.choices[name]) > 1 and value in self.choices[name]:
                common[name] = value
        for stale in [k for k in common if k.startswith(("micro_batch_sp", "log_prob_micro_batch_sp",
                                                          "ppo_max_token_len_per_gpu_sp", "log_prob_token_factor"))]:
            del common[stale]
        points: list[dict[str, Any]] = []
        variants: list[tuple[bool, list[tuple[str, list[Any]]]]] = [
            (False, [(f"micro_batch_sp{sp}", self.micro_choices.get(sp, [])),
                     (f"log_prob_micro_batch_sp{sp}", self.log_prob_choices.get(sp, []))]),
            (True, [(f"ppo_max_token_len_per_gpu_sp{sp}", self.token_lens.get(sp, [])),
                    ("log_prob_token_factor", self.choices["log_prob_token_factor"])]),
        ]
        for dynamic, knobs in variants:
            if dynamic not in self.choices["use_dynamic_bsz"]:
                continue
            point = {**common}
            if len(self.choices["use_dynamic_bsz"]) > 1:
                point["use_dynamic_bsz"] = dynamic
            grown = self._grown(point, dict(knobs), base)
            if grown is not None and grown != incumbent and grown not in points:
                points.append(grown)
        return points[:n]

    def _grown(self, point: dict[str, Any], knobs: Mapping[str, list[Any]], base: Config, *,
               limit_gb: float | None = None) -> dict[str, Any] | None:
        """``point`` with the batching ``knobs`` each at its smallest value, then each grown as
        far as the memory estimate says it fits; None when it does not fit at the smallest."""
        sized = [(name, [v for v in values if v is not None]) for name, values in knobs.items()]
        if any(not values for _, values in sized):
            return None
        point = {**point, **{name: values[0] for name, values in sized}}
        for name, values in sized:
            for value in reversed(values):
                if self._fits({**point, name: value}, base, limit_gb=limit_gb):
                    point[name] = value
                    break
        return point if self._fits(point, base, limit_gb=limit_gb) else None

    def _branch(self, sp: int, dynamic: bool) -> dict[str, list[Any]]:
        """The batching knobs asked under Ulysses size ``sp`` with dynamic batching on or off,
        and their valid values (a knob with one value is set, not asked)."""
        knobs = ({f"ppo_max_token_len_per_gpu_sp{sp}": self.token_lens.get(sp, []),
                  "log_prob_token_factor": self.choices["log_prob_token_factor"]} if dynamic else
                 {f"micro_batch_sp{sp}": self.micro_choices.get(sp, []),
                  f"log_prob_micro_batch_sp{sp}": self.log_prob_choices.get(sp, [])})
        return {name: values for name, values in knobs.items() if len(values) > 1}

    def _branch_of(self, params: Mapping[str, Any]) -> dict[str, list[Any]]:
        """``_branch`` at the Ulysses size and batching mode of the point ``params``."""
        return self._branch(params.get("ulysses", self.choices["ulysses"][0]),
                            params.get("use_dynamic_bsz", self.choices["use_dynamic_bsz"][0]))

    def _values(self, name: str) -> list[Any]:
        """The valid values of the sampler's parameter ``name``, in their order."""
        if name in self.choices:
            return self.choices[name]
        stem, _, sp = name.rpartition("_sp")
        by_ulysses = {"ppo_max_token_len_per_gpu": self.token_lens, "micro_batch": self.micro_choices,
                      "log_prob_micro_batch": self.log_prob_choices}.get(stem, {})
        return by_ulysses.get(int(sp), []) if sp.isdigit() else []

    def follow_up_points(self, base: Config, readings: Sequence[tuple[dict[str, Any], float]],
                         n: int) -> list[dict[str, Any]]:
        """The stage's last trials: a local search around the config that read fastest. Each
        knob one notch either way (memory ±0.05), a Ulysses or batching-mode move carrying the
        batching knobs over; a move the memory estimate says no longer fits takes the batching
        knobs down until it does (checkpointing off costs activation memory: in the simulated
        benchmark 1 run in 10 on three worlds ended with it on, where it off with a smaller
        token limit was 5-8% faster, a pair of moves no single knob makes). Untried points only,
        the knob values that read faster in the draws so far first."""
        finished = [(params, eta) for params, eta in readings if math.isfinite(eta) and eta > 0]
        if not finished:
            return []
        best = max(finished, key=lambda r: r[1])[0]
        tried = [params for params, _ in readings]
        # The leader ran: a point estimated no larger than it fits as well as it did.
        limit = max(self._headroom_gb(), self._peak_gb(best, base) or 0.0)

        def mean_eta(name: str, value: Any) -> float | None:
            etas = [eta for params, eta in finished if params.get(name) == value]
            return sum(etas) / len(etas) if etas else None

        moves: list[tuple[float, dict[str, Any]]] = []
        # A move that failed (out of memory, where the estimate let it through) again with
        # smaller passes: first, as the failure says its memory, not the move, was short. Not
        # a memory fraction's failure: the fraction's own OOM ceiling (``_memory_high``) rules
        # those out, and smaller passes do not make room for a larger vLLM pool.
        batching = self._branch_of(best)
        for params, eta in readings:
            moved = [k for k in params if params.get(k) != best.get(k) and k not in batching]
            if eta == 0 and len(moved) == 1 and moved != ["gpu_memory_utilization"] and set(params) == set(best):
                smaller = self._smaller(params, [k for k in batching if k in params])
                if smaller is not None and smaller not in tried:
                    moves.append((math.inf, smaller))
        for name, value in best.items():
            if name == "gpu_memory_utilization":
                continue
            values = self._values(name)
            if value not in values:
                continue
            here = mean_eta(name, value) or 0.0
            i = values.index(value)
            for new in (values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)):
                point = self._moved(best, name, new, base, limit)
                if point is not None and point not in tried and all(point != p for _, p in moves):
                    moves.append(((mean_eta(name, new) or here) - here, point))
        tp = best.get("rollout_tp", self.choices["rollout_tp"][0])
        memory = best.get("gpu_memory_utilization")
        if isinstance(memory, float):
            for new_memory in (memory - 0.05, memory + 0.05):
                new_memory = round(min(self.memory.high, max(self.floors[tp], new_memory)), 3)
                point = {**best, "gpu_memory_utilization": new_memory}
                if new_memory != memory and point not in tried and self._fits(point, base, limit_gb=limit):
                    moves.append((0.0, point))
        moves.sort(key=lambda m: -m[0])  # stable: equal estimates keep the knobs' order
        return [point for _, point in moves[:n]]

    def _moved(self, best: dict[str, Any], name: str, new: Any, base: Config, limit_gb: float) -> dict[str, Any] | None:
        """``best`` with knob ``name`` at ``new``: the batching knobs carried to the new branch,
        the memory at least the new TP's floor, and shrunk to fit; None when nothing fits."""
        point = {**best, name: new}
        sp = point.get("ulysses", self.choices["ulysses"][0])
        knobs = self._branch_of(point)
        if name in ("ulysses", "use_dynamic_bsz"):
            old = {k: v for k, v in best.items() if k in self._branch_of(best)}
            for k in old:
                del point[k]
            carried = {k: v for k, v in ((k.rpartition("_sp")[0] + f"_sp{sp}" if "_sp" in k else k, v)
                                         for k, v in old.items()) if k in knobs and v in knobs[k]}
            missing = {k: values for k, values in knobs.items() if k not in carried}
            point.update(carried)
            grown = self._grown(point, missing, base, limit_gb=limit_gb) if missing else point
            if grown is None:
                return None
            point = grown
        if name == "rollout_tp" and isinstance(point.get("gpu_memory_utilization"), float):
            point["gpu_memory_utilization"] = max(self.floors[new], point["gpu_memory_utilization"])
        shrinkable = [k for k in knobs if k != name and k in point]
        while not self._fits(point, base, limit_gb=limit_gb):
            smaller = self._smaller(point, shrinkable)
            if smaller is None:
                return None
            point = smaller
        return point

    def _smaller(self, point: dict[str, Any], knobs: Sequence[str]) -> dict[str, Any] | None:
        """``point`` with the batching knob furthest up its range a notch down (None: none can go)."""
        lower = [(k, self._values(k).index(point[k])) for k in knobs if point.get(k) in self._values(k)]
        lower = [(k, i) for k, i in lower if i > 0 and self._values(k)[i - 1] is not None]
        if not lower:
            return None
        k, i = max(lower, key=lambda ki: ki[1])
        return {**point, k: self._values(k)[i - 1]}

    def _fits(self, params: dict[str, Any], base: Config, *, limit_gb: float | None = None) -> bool:
        """Whether the estimated peak of the point stays within ``limit_gb`` (by default
        ``FIT_HEADROOM`` of the usable memory); a point verl-sweep cannot build does not fit."""
        peak = self._peak_gb(params, base)
        return peak is not None and peak <= (self._headroom_gb() if limit_gb is None else limit_gb)

    def _headroom_gb(self) -> float:  # the default limit of ``_fits``
        return FIT_HEADROOM * M.usable_gb(self.hardware)

    def _config_of(self, params: dict[str, Any], base: Config) -> Config | None:
        """The config of the point ``params`` (None: verl-sweep cannot build it)."""
        import optuna

        try:
            with warnings.catch_warnings():  # a fraction over its ceiling: the estimate says so
                warnings.simplefilter("ignore", UserWarning)
                return merge(base, self.suggest(optuna.trial.FixedTrial(params), base))
        except (KeyError, ValueError):
            return None

    def _peak_gb(self, params: dict[str, Any], base: Config) -> float | None:
        """The point's estimated peak GPU memory (0: not estimated; None: it cannot be built)."""
        config = self._config_of(params, base)
        found = None if config is None else M.estimate(self.model, self.hardware, config)
        return None if config is None else 0.0 if found is None else found.peak_gb

    def fitted(self, params: dict[str, Any], base: Config) -> dict[str, Any] | None:
        """The point with its memory fraction lowered to where the estimate fits (the sampler's
        own ceiling, ``fitting_fraction``); None when even the layout's floor does not fit."""
        config = self._config_of(params, base) if self.fits_memory else None
        if config is None or "gpu_memory_utilization" not in params:
            return params
        fit = M.fitting_fraction(self.model, self.hardware, config, base=base)
        if params["gpu_memory_utilization"] <= fit:
            return params
        return {**params, "gpu_memory_utilization": fit} if fit >= self.floors[config[L.ROLLOUT_TP]] else None

    @staticmethod
    def _uses_ref(base: Config) -> bool:
        return bool(L.setting(base, L.USE_KL_LOSS) or L.setting(base, L.USE_KL_IN_REWARD))

    def explain(self) -> list[str]:
        return list(self.lines)


def _union(by_ulysses: Mapping[int, list[Any]]) -> list[Any]:
    values = {v for choices in by_ulysses.values() for v in choices}
    return ([None] if None in values else []) + sorted(v for v in values if v is not None)


def _pick(trial: "optuna.trial.BaseTrial", name: str, choices: list[Any]) -> Any:
    """A categorical knob: asked of the sampler only when it has more than one valid value."""
    return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, choices)
