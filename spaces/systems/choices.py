"""What each knob of the systems stage may take, for one model, hardware and base config:
worked out once when the space is built, with the lines that explain it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_sweep.spaces import bounds as B
from verl_sweep import verl_knowledge as V
from verl_sweep.spaces.base import SpaceError, check_options
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.spaces.oom import hardware_tag
from verl_sweep.verl_knowledge import Config, get
from verl_sweep.spaces.systems.keys import (
    DEPRECATED_CRITIC_MICRO, DEPRECATED_LOG_PROB_MICRO, DEPRECATED_MICRO, ENFORCE_EAGER, FREE_CACHE_ENGINE,
    MAX_NUM_SEQS, ROLLOUT_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_TOKENS, base_value)
from verl_sweep.spaces.systems.knobs import PER_ULYSSES, KnobTable

MAX_TOKEN_LEN_CHOICES = (2048, 4096, 8192, 16384, 32768)
#: static micro-batches (sequences a forward/backward pass) tried for the actor update and
#: the log-prob passes; each stage keeps those that divide its per-GPU batch
MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: the log-prob passes (forward only) may take this many times the update's token limit
LOG_PROB_TOKEN_FACTORS = (1, 2, 4)
MAX_NUM_SEQS_CHOICES = (128, 256, 512, 1024, 2048)
#: the stage options that list a knob's values, in the order the space checks them
LISTS = (
    "rollout_tp", "ulysses", "strategy", "forward_prefetch", "use_dynamic_bsz",
    "ppo_max_token_len_per_gpu", "gradient_checkpointing", "activation_offload",
    "micro_batch", "log_prob_micro_batch", "log_prob_token_factor", "max_num_seqs", "enforce_eager",
    "free_cache_engine",
)
OPTIONS = frozenset({"gpu_memory_utilization", *LISTS})


@dataclass(frozen=True)
class SystemsChoices:
    """The valid values of every knob (``choices``: by stage option; the batching knobs' per
    Ulysses size: ``micro_choices``, ``log_prob_choices``, ``token_lens``), the memory range
    and each rollout TP's floor in it, and the parameter table (``knobs``)."""

    model: ModelFacts
    hardware: HardwareFacts
    algorithm: Algorithm
    hardware_tag: str
    memory: B.ParamBound
    floors: dict[int, float]
    choices: dict[str, list[Any]]
    micro_choices: dict[int, list[Any]]
    log_prob_choices: dict[int, list[Any]]
    token_lens: dict[int, list[Any]]
    knobs: KnobTable
    lines: list[str]


def declare(*, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm, base: Config,
            options: Mapping[str, Any], where: str) -> SystemsChoices:
    """The choices of a systems stage over ``base``, narrowed to the stage's ``options``
    (SpaceError: an option outside what is valid)."""
    check_options(options, OPTIONS, where)
    sub = options.get("gpu_memory_utilization", {})
    if not isinstance(sub, Mapping):
        raise SpaceError(f"{where}.gpu_memory_utilization: must be a mapping like {{low: .., high: ..}}, but got {sub!r}. Use a mapping.")
    check_options(sub, B.BOUND_OPTIONS, f"{where}.gpu_memory_utilization")
    memory = B.GPU_MEMORY_UTILIZATION.including(get(base, V.GPU_MEMORY)).narrowed(
        sub, where=f"{where}.gpu_memory_utilization")
    lines: list[str] = [f"systems: {V.GPU_MEMORY} — {memory.describe()}"]

    # Rollout TP: divides GPUs/node and heads, TP·DP·PP divides the GPUs, and the vLLM
    # pool holds the base's token budget within the memory range: each TP with its own
    # memory floor (a tuned base's larger budget raises it), never the worst one for all.
    dp_r, pp = V.int_setting(base, V.ROLLOUT_DP), V.int_setting(base, V.ROLLOUT_PP)
    floors = V.rollout_memory_floors(model, hardware, base, memory)
    tps = list(floors)
    lines.append(
        f"systems: rollout TP ∈ {tps} (divides GPUs/node and heads; TP·DP {dp_r}·PP {pp} divides "
        f"{hardware.n_gpus} GPUs; memory floor per TP, the pool holding token budget "
        f"{max(V.int_setting(base, V.TOKEN_BUDGET), model.max_seq_len):,}: "
        + ", ".join(f"TP {t} ≥ {f:g}" for t, f in floors.items()) + ")"
    )
    # Ulysses: valid sizes that keep the base's static mini-batch valid.
    mini = V.int_setting(base, V.MINI_BATCH)
    sps = [
        s for s in V.ulysses_sizes(model, hardware).value
        if V.mini_batch_problem(mini, {**base, V.ULYSSES: s, V.ULYSSES_LEGACY: s}, hardware) is None
    ]
    lines.append(f"systems: ulysses ∈ {sps} ({V.ulysses_sizes(model, hardware).lines[0]}; keeps mini-batch {mini} valid)")
    # Sequences a step: the update's per-GPU batch is the mini-batch's, the log-prob
    # passes' the train batch's; vLLM's sequences a batch beyond one replica's share of the
    # step's sequences cannot matter.
    n = V.int_setting(base, V.ROLLOUT_N)
    train = V.int_setting(base, V.TRAIN_BATCH)
    dps = {s: max(1, hardware.n_gpus // s) for s in sps}
    micro_choices = {
        s: _divisors(mini * n // dps[s], MICRO_BATCH_CHOICES, base_value(base, V.MICRO_BATCH),
                     deprecated_set=base.get(DEPRECATED_MICRO) is not None)
        for s in sps if (mini * n) % dps[s] == 0}
    log_prob_choices = {
        s: _divisors(train * n // dps[s], MICRO_BATCH_CHOICES, base_value(base, ROLLOUT_LOG_PROB_MICRO),
                     deprecated_set=base.get(DEPRECATED_LOG_PROB_MICRO) is not None)
        for s in sps if (train * n) % dps[s] == 0}
    replicas = max(1, hardware.n_gpus // (max(tps) if tps else 1) // dp_r // pp)  # fewest replicas, most each
    per_replica = -(-train * n // replicas)
    seqs = sorted({v for v in MAX_NUM_SEQS_CHOICES if v < per_replica}
                  | {next((v for v in MAX_NUM_SEQS_CHOICES if v >= per_replica), MAX_NUM_SEQS_CHOICES[-1])})
    base_seqs = base_value(base, MAX_NUM_SEQS)
    if isinstance(base_seqs, int) and not isinstance(base_seqs, bool) and base_seqs not in seqs:
        seqs = sorted({*seqs, base_seqs})
    lines.append(
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
        "micro_batch": _union(micro_choices),
        "log_prob_micro_batch": _union(log_prob_choices),
        "log_prob_token_factor": list(LOG_PROB_TOKEN_FACTORS),
        "max_num_seqs": seqs,
        "enforce_eager": [False, True],
        "free_cache_engine": [True, False],
    }
    # Knobs that keep the base's value unless the stage lists them. vLLM's own, always: each
    # knob present in every trial costs a many-knob sampler its grip on the layout. The
    # passes' batching, where the layout has choices: there the layout is the stage's
    # subject; with one layout (one GPU) the batching is what is left to search.
    kept: dict[str, Any] = {name: base_value(base, key) for name, key in (
        ("max_num_seqs", MAX_NUM_SEQS), ("enforce_eager", ENFORCE_EAGER), ("free_cache_engine", FREE_CACHE_ENGINE))}
    if len(tps) > 1 or len(sps) > 1:
        limit, log_prob_limit = base.get(V.MAX_TOKEN_LEN), base.get(ROLLOUT_LOG_PROB_TOKENS)
        factor = (log_prob_limit // limit if isinstance(limit, int) and isinstance(log_prob_limit, int) and limit
                  and log_prob_limit % limit == 0 else 1)
        kept.update(micro_batch=base_value(base, V.MICRO_BATCH), log_prob_token_factor=factor,
                    log_prob_micro_batch=base_value(base, ROLLOUT_LOG_PROB_MICRO))
    choices: dict[str, list[Any]] = {}
    for name in LISTS:
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
        choices[name] = [v for v in valid if v in asked]
    micro_choices = {s: [v for v in values if v in choices["micro_batch"]] for s, values in micro_choices.items()}
    log_prob_choices = {s: [v for v in values if v in choices["log_prob_micro_batch"]]
                        for s, values in log_prob_choices.items()}
    # Per Ulysses size, the dynamic-batch limits that cover the longest sequence.
    token_lens = {
        s: [t for t in choices["ppo_max_token_len_per_gpu"] if t * s >= model.max_seq_len]
        for s in choices["ulysses"]
    }
    lines.append(
        f"systems: with dynamic batching, ppo_max_token_len_per_gpu × ulysses ≥ {model.max_seq_len}: "
        + ", ".join(f"ulysses {s}: {v}" for s, v in token_lens.items())
    )
    if True in choices["use_dynamic_bsz"] and not all(token_lens.values()):
        raise SpaceError(
            f"{where}.ppo_max_token_len_per_gpu: must hold a value ≥ {model.max_seq_len} ÷ ulysses "
            f"for every ulysses size, but got {choices['ppo_max_token_len_per_gpu']}. Add a larger limit."
        )
    per_ulysses = {"ppo_max_token_len_per_gpu": token_lens, "micro_batch": micro_choices,
                   "log_prob_micro_batch": log_prob_choices}
    knobs = KnobTable({k: v for k, v in choices.items() if k not in PER_ULYSSES}, per_ulysses, choices["ulysses"])
    return SystemsChoices(model=model, hardware=hardware, algorithm=algorithm, hardware_tag=hardware_tag(hardware),
                          memory=memory, floors=floors, choices=choices, micro_choices=micro_choices,
                          log_prob_choices=log_prob_choices, token_lens=token_lens, knobs=knobs, lines=lines)


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


def _union(by_ulysses: Mapping[int, list[Any]]) -> list[Any]:
    values = {v for choices in by_ulysses.values() for v in choices}
    return ([None] if None in values else []) + sorted(v for v in values if v is not None)
