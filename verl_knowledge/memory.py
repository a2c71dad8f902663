"""The memory pre-flight: a config's peak GPU memory per GPU, estimated before launch.

On a real node a probe that runs out of memory costs minutes of start-up; so does one that
never could have fit. ``estimate`` adds up, per GPU and per phase of a colocated verl step
(FSDP actor + vLLM on the same GPUs), what each part holds:

- rollout: vLLM's share (``gpu_memory_utilization`` × the GPU, weights and KV cache inside it)
  beside the actor's resident states (fp32 parameters and Adam moments, sharded over the
  data-parallel ranks, unless offloaded) and the reference model's bf16 weights;
- update: the actor's parameters, gradients and Adam moments (16 bytes a parameter ÷ DP),
  one micro-batch's activations (all of them, or with gradient checkpointing each layer's
  input plus one layer's working set) and its logits; vLLM's share stays unless
  ``free_cache_engine`` lets it sleep;
- the log-prob passes: forward only, one layer's working set and the logits;
- each process's CUDA context (the trainer's and vLLM's).

The peak is the larger phase. Its terms carry their arithmetic (``lines``) so ``validate``
can show why a config cannot fit. FSDP only: other engines get no estimate (None).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Protocol

from verl_sweep.verl_knowledge import rules as L
from verl_sweep.verl_knowledge.defaults import VERL_DEFAULTS, int_setting, is_int, setting
from verl_sweep.verl_knowledge.facts import HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge.keys import (ACTIVATION_OFFLOAD, FREE_CACHE_ENGINE, GPU_MEMORY, GRADIENT_CHECKPOINTING,
                                            MAX_TOKEN_LEN, MICRO_BATCH, OPTIMIZER_OFFLOAD, PARAM_OFFLOAD, ROLLOUT_DP,
                                            ROLLOUT_LOG_PROB_DYNAMIC, ROLLOUT_LOG_PROB_MICRO, ROLLOUT_LOG_PROB_TOKENS,
                                            ROLLOUT_PP, ROLLOUT_TP, STRATEGY, TOKEN_BUDGET, USE_DYNAMIC_BSZ,
                                            USE_KL_IN_REWARD, USE_KL_LOSS)

GB = 1024**3
#: a CUDA context and the allocator's slack, per process on a GPU (the trainer's and vLLM's)
CONTEXT_GB = 0.75
#: what a sleeping vLLM engine keeps (its CUDA graphs' pool and context), ``free_cache_engine``
SLEEPING_VLLM_GB = 1.0
#: bytes a parameter the FSDP actor holds: fp32 parameters (verl loads the trained model in
#: fp32), fp32 gradients, Adam's two fp32 moments
PARAM_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
#: the share of the GPU a config may plan to use: the method's guard keeps 5 GB free on an
#: 80 GB GPU (docs/method.md §1)
USABLE_FRACTION = 0.94


class FractionRange(Protocol):
    """The memory fractions a stage may search (``spaces.bounds.ParamBound`` is one)."""

    @property
    def low(self) -> float: ...

    @property
    def high(self) -> float: ...

    def contains(self, value: Any) -> bool: ...


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


def tokens_in(model: ModelFacts, gb: float) -> int:
    """The KV cache tokens ``gb`` of vLLM's pool holds."""
    return int(gb * 1024**3 / bytes_per_token(model)) if gb > 0 else 0


def weights_gb(model: ModelFacts, tp: int, expert_split: int | None = None) -> float:
    """bf16 weights (2 bytes a parameter) on one rollout GPU: the dense part split over TP,
    a MoE model's routed experts over TP × DP (``expert_split``)."""
    dense = model.n_params_b - model.expert_params_b
    return dense * 2 / tp + model.expert_params_b * 2 / (expert_split or tp)


def expert_split(config: Mapping[str, Any]) -> int:
    """Rollout ranks that share a MoE model's experts: TP × DP (verl 0.9.1's rollout config:
    with EP 1 they are split TP × DP ways, with EP > 1 as whole experts, EP = TP × DP)."""
    return int_setting(config, ROLLOUT_TP) * int_setting(config, ROLLOUT_DP)


def memory_fraction_for(model: ModelFacts, hardware: HardwareFacts, tokens: int, tp: int, *,
                        data_parallel: int = 1) -> float:
    """The smallest ``gpu_memory_utilization`` whose vLLM pool holds ``tokens`` (the inverse
    of ``token_budget``'s pool) at rollout TP ``tp``, rounded up to 0.01."""
    needed_gb = tokens * bytes_per_token(model) / 1024**3 + weights_gb(model, tp, tp * data_parallel)
    return math.ceil(needed_gb / hardware.gpu_memory_gb * 100 - 1e-9) / 100




@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated GB per GPU: the peak, each phase, and the arithmetic behind them."""

    peak_gb: float
    rollout_gb: float
    update_gb: float
    log_prob_gb: float
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Shape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int


def _shape(model: ModelFacts) -> _Shape:
    """The model's sizes, from its config.json where the study read one; a shape the facts
    leave out is inferred from the parameter count (a dense decoder: 12 h² a layer)."""
    hidden = int(model.hidden_size or 0)
    intermediate = int(getattr(model, "intermediate_size", None) or 4 * hidden)
    vocab = int(getattr(model, "vocab_size", None) or 128_000)
    layers = getattr(model, "num_hidden_layers", None)
    if not layers:
        per_layer = 4 * hidden * hidden + 3 * hidden * intermediate
        layers = max(1, round((model.n_params_b * 1e9 - vocab * hidden) / per_layer))
    return _Shape(int(layers), hidden, intermediate, vocab)


def _flag(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, VERL_DEFAULTS.get(key, default))
    return bool(value)


def _int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, VERL_DEFAULTS.get(key))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def estimate(model: ModelFacts, hardware: HardwareFacts, config: Mapping[str, Any]) -> MemoryEstimate | None:
    """Peak GPU memory per GPU of ``config`` (flat verl overrides), or None for an engine this
    model does not cover (Megatron and others: not FSDP)."""
    strategy = setting(config, STRATEGY)
    if strategy not in ("fsdp", "fsdp2") or config.get("model_engine", "fsdp") not in ("fsdp", None):
        return None
    fraction_set = setting(config, GPU_MEMORY)
    if L.type_problems(config) or isinstance(fraction_set, bool) or not isinstance(fraction_set, (int, float)):
        return None  # a malformed config: the config rules say what is wrong with it
    s = _shape(model)
    params = model.n_params_b * 1e9
    sp = L.ulysses_size(config)
    dp = max(1, hardware.n_gpus // sp)
    seq = model.max_seq_len
    fraction = float(fraction_set)
    vllm_gb = fraction * hardware.gpu_memory_gb
    param_offload = _flag(config, PARAM_OFFLOAD, False)
    optimizer_offload = _flag(config, OPTIMIZER_OFFLOAD, False)
    uses_ref = bool(setting(config, USE_KL_LOSS) or setting(config, USE_KL_IN_REWARD))
    ref_gb = 2 * params / dp / GB if uses_ref else 0.0
    states_gb = (PARAM_BYTES + GRAD_BYTES + ADAM_BYTES) * params / dp / GB
    resident_gb = ((0 if param_offload else PARAM_BYTES) + (0 if optimizer_offload else ADAM_BYTES)) * params / dp / GB
    contexts_gb = 2 * CONTEXT_GB
    lines = [f"model: {s.layers} layers, hidden {s.hidden}, intermediate {s.intermediate}, vocab {s.vocab:,}; "
             f"{model.n_params_b:g}B parameters over DP {dp} ({hardware.n_gpus} GPUs ÷ ulysses {sp})"]

    rollout_gb = vllm_gb + resident_gb + ref_gb + contexts_gb
    lines.append(f"rollout = vLLM {fraction:g} × {hardware.gpu_memory_gb:g} GB ({vllm_gb:.1f}) + actor resident "
                 f"{resident_gb:.1f} (fp32 params{' offloaded' if param_offload else ''}, Adam"
                 f"{' offloaded' if optimizer_offload else ''}) + ref {ref_gb:.1f} + contexts {contexts_gb:.1f} "
                 f"= {rollout_gb:.1f} GB")

    # One micro-batch of the update: its tokens, and what each token keeps for the backward.
    if setting(config, USE_DYNAMIC_BSZ):
        tokens = _int(config, MAX_TOKEN_LEN, 16384)
        how = f"dynamic batching, {tokens:,} tokens"
    else:
        micro = _int(config, MICRO_BATCH, 1)
        tokens = micro * seq  # padded to the longest prompt + response without padding removal
        how = f"micro-batch {micro} × {seq} tokens"
    tokens = math.ceil(tokens / sp)  # Ulysses splits each sequence over its ranks
    layer_bytes = 2 * (6 * s.hidden + 4 * s.intermediate)  # bf16 tensors a token keeps in one layer
    checkpointing = bool(setting(config, GRADIENT_CHECKPOINTING))
    offload = bool(setting(config, ACTIVATION_OFFLOAD))
    if checkpointing:
        kept = 0 if offload else tokens * s.layers * 2 * s.hidden  # each layer's input
        activations_gb = (kept + tokens * layer_bytes) / GB
        act_how = f"checkpointing{' + offload' if offload else ''}: inputs {kept / GB:.1f} + one layer"
    else:
        activations_gb = tokens * s.layers * layer_bytes / GB
        act_how = "all layers"
    logits_gb = tokens * s.vocab * (2 + 4 + 4) / GB  # bf16 logits, fp32 log-softmax and its gradient
    vllm_in_update = SLEEPING_VLLM_GB if _flag(config, FREE_CACHE_ENGINE, True) else vllm_gb
    update_gb = states_gb + ref_gb + activations_gb + logits_gb + vllm_in_update + contexts_gb
    lines.append(f"update = actor states {states_gb:.1f} (16 B/param) + ref {ref_gb:.1f} + activations "
                 f"{activations_gb:.1f} ({how}, {act_how}) + logits {logits_gb:.1f} + vLLM "
                 f"{'asleep' if vllm_in_update == SLEEPING_VLLM_GB else 'awake'} {vllm_in_update:.1f} + contexts "
                 f"{contexts_gb:.1f} = {update_gb:.1f} GB")

    if _flag(config, ROLLOUT_LOG_PROB_DYNAMIC, bool(setting(config, USE_DYNAMIC_BSZ))):
        lp_tokens = _int(config, ROLLOUT_LOG_PROB_TOKENS, _int(config, MAX_TOKEN_LEN, 16384))
    else:
        lp_tokens = _int(config, ROLLOUT_LOG_PROB_MICRO, 1) * seq
    lp_tokens = math.ceil(lp_tokens / sp)
    lp_work_gb = lp_tokens * (layer_bytes + s.vocab * (2 + 4)) / GB
    log_prob_gb = (PARAM_BYTES * params / dp / GB + ref_gb + lp_work_gb + vllm_in_update + contexts_gb
                   + (0 if optimizer_offload else ADAM_BYTES * params / dp / GB))
    lines.append(f"log-prob = actor params + Adam {log_prob_gb - ref_gb - lp_work_gb - vllm_in_update - contexts_gb:.1f} "
                 f"+ ref {ref_gb:.1f} + one pass ({lp_tokens:,} tokens) {lp_work_gb:.1f} + vLLM {vllm_in_update:.1f} "
                 f"+ contexts {contexts_gb:.1f} = {log_prob_gb:.1f} GB")
    peak = max(rollout_gb, update_gb, log_prob_gb)
    lines.append(f"peak = max({rollout_gb:.1f}, {update_gb:.1f}, {log_prob_gb:.1f}) = {peak:.1f} GB per GPU")
    return MemoryEstimate(round(peak, 2), round(rollout_gb, 2), round(update_gb, 2), round(log_prob_gb, 2),
                          tuple(lines))


def baseline_allowance(model: ModelFacts, hardware: HardwareFacts, baseline: Mapping[str, Any]) -> float:
    """The baseline's estimated peak when the baseline certainly fits where it runs by the one
    term the estimate cannot get wrong (the rollout's bf16 weights within vLLM's share): a
    user's run that verl runs today is evidence the estimate is short (LoRA, offload, MoE),
    so configs up to its peak are not refused. 0 when the weights alone cannot fit."""
    found = estimate(model, hardware, baseline)
    if found is None:
        return 0.0
    tp = int_setting(baseline, ROLLOUT_TP)
    weights_gb = model.n_params_b * 2 / tp
    share_gb = float(setting(baseline, GPU_MEMORY)) * hardware.gpu_memory_gb
    return found.peak_gb if weights_gb < share_gb else 0.0


def usable_gb(hardware: HardwareFacts) -> float:
    return USABLE_FRACTION * hardware.gpu_memory_gb


def fit_limit_gb(model: ModelFacts, hardware: HardwareFacts, baseline: Mapping[str, Any]) -> float:
    """The most GB per GPU a config of a study from ``baseline`` may be estimated at: the GPU's
    memory, or the baseline's own estimated peak where ``baseline_allowance`` grants it (the
    estimate is then known to be short for this run). Beyond it a config cannot fit: the
    baseline is refused before any probe starts, and no stage proposes such a config."""
    return max(hardware.gpu_memory_gb, baseline_allowance(model, hardware, baseline))


def fitting_fraction(model: ModelFacts, hardware: HardwareFacts, config: Mapping[str, Any], *,
                     base: Mapping[str, Any]) -> float:
    """The largest memory fraction at which ``config`` (its other knobs as they are) stays
    within the GPU's memory by the estimate, or within the peak of ``base``, the stage's base
    config, where that is higher (the base runs, or the pre-flight refuses the study before any
    probe starts). vLLM's share is in the rollout phase, and in the update and log-prob phases
    where the engine stays awake. Each phase is affine in the fraction, so two estimates give
    the line (then checked: the estimates are rounded to 0.01 GB); 1 where there is no
    estimate, 0 where no fraction fits (the other knobs alone are over)."""
    limit_gb = max(hardware.gpu_memory_gb, getattr(estimate(model, hardware, base), "peak_gb", 0.0))
    at = [estimate(model, hardware, {**config, GPU_MEMORY: f}) for f in (0.0, 1.0)]
    if at[0] is None or at[1] is None:
        return 1.0
    high = 1.0
    for name in ("rollout_gb", "update_gb", "log_prob_gb"):
        fixed, slope = getattr(at[0], name), getattr(at[1], name) - getattr(at[0], name)
        if slope > 0:
            high = min(high, (limit_gb - fixed) / slope)
        elif fixed > limit_gb:
            return 0.0
    high = max(0.0, math.floor(high * 1000) / 1000)
    while high > 0 and getattr(estimate(model, hardware, {**config, GPU_MEMORY: high}), "peak_gb", 0.0) > limit_gb:
        high = round(high - 0.001, 3)
    return high


def _phase(found: MemoryEstimate) -> tuple[str, float, str]:
    """The phase that sets the peak: its name, its GB per GPU and its arithmetic line."""
    name, gb = max((("rollout", found.rollout_gb), ("update", found.update_gb), ("log-prob", found.log_prob_gb)),
                   key=lambda p: p[1])
    return name, gb, next(line for line in found.lines if line.startswith(name))


def over_limit_problem(model: ModelFacts, hardware: HardwareFacts, config: Mapping[str, Any], *,
                       limit_gb: float) -> str | None:
    """Why ``config`` cannot fit by the estimate: one line naming the phase that sets its peak
    and its arithmetic, when the peak exceeds ``limit_gb`` (``fit_limit_gb``); else None (also
    for a config with no estimate)."""
    found = estimate(model, hardware, config)
    if found is None or found.peak_gb <= limit_gb:
        return None
    phase, gb, detail = _phase(found)
    over = (f"the GPU's {hardware.gpu_memory_gb:g} GB" if limit_gb <= hardware.gpu_memory_gb
            else f"{limit_gb:.1f} GB (the baseline's own estimate, on {hardware.gpu_memory_gb:g} GB GPUs)")
    return (f"estimated peak GPU memory must fit {over}, but the {phase} phase is estimated at {gb:.1f} GB per GPU "
            f"({detail})")


def fit_problem(model: ModelFacts, hardware: HardwareFacts, config: Mapping[str, Any], *,
                allowance_gb: float = 0.0) -> str | None:
    """Why ``config`` cannot fit its GPUs by the estimate (one line with the arithmetic), or None.
    ``allowance_gb``: a peak known to run (the baseline's estimate, where the baseline is the
    user's own run): a config estimated at no more than it is not refused."""
    found = estimate(model, hardware, config)
    if found is None or found.peak_gb <= max(usable_gb(hardware), allowance_gb):
        return None
    _, _, detail = _phase(found)
    return (f"estimated peak GPU memory {found.peak_gb:.1f} GB per GPU must fit {USABLE_FRACTION:g} × "
            f"{hardware.gpu_memory_gb:g} GB = {usable_gb(hardware):.1f} GB, but the {detail}")


def rollout_memory_floors(model: ModelFacts, hardware: HardwareFacts, base: Mapping[str, Any],
                          memory: FractionRange) -> dict[int, float]:
    """Each rollout TP that fits, with the lowest memory fraction its vLLM pool holds the base's
    token budget at (never below ``memory.low``). A TP whose floor is above ``memory.high``
    does not fit, except the base's own TP: the run holds it, so its floor is at most the
    base's fraction (the estimate is the one that is short). Each layout keeps its own floor:
    the worst TP's floor is not applied to the others."""
    dp_r, pp = int_setting(base, ROLLOUT_DP), int_setting(base, ROLLOUT_PP)
    budget = max(int_setting(base, TOKEN_BUDGET), model.max_seq_len)
    own_tp, own_memory = setting(base, ROLLOUT_TP), setting(base, GPU_MEMORY)
    floors: dict[int, float] = {}
    sizes = L.rollout_tp_sizes(model, hardware).value
    if is_int(own_tp) and own_tp not in sizes:  # a run's own TP across nodes: verl ran it
        sizes = sorted({*sizes, own_tp})
    for tp in sizes:
        if hardware.n_gpus % (tp * dp_r * pp):
            continue
        floor = max(memory.low, memory_fraction_for(model, hardware, budget, tp, data_parallel=dp_r))
        if tp == own_tp and isinstance(own_memory, (int, float)) and memory.contains(own_memory):
            floor = min(floor, float(own_memory))
        if floor <= memory.high or tp == own_tp:
            floors[tp] = min(floor, memory.high)
    return floors
