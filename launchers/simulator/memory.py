"""GPU memory of a simulated verl run, and the failures it decides: OOM in the rollout engine
(token budget activations, no room for the KV cache, a memory fraction over the limit) or in
training (FSDP states + micro-batch activations), and hangs (an Ulysses size that does not
divide the heads, the landscape's NCCL traps)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from verl_sweep.launchers.simulator.outcomes import Failure, number, value

GIB = 1024.0**3


def memory_gb(model: Mapping[str, Any], mem: Mapping[str, Any], gpu: float, config: Mapping[str, Any]) -> dict[str, float]:
    """Peak GPU memory (GiB) of each phase and the limits it is held against, from a landscape's
    ``model`` and ``memory`` sections on GPUs of ``gpu`` GiB."""
    g = lambda key: value(config, key)  # noqa: E731
    n_gpus = int(g("trainer.n_gpus_per_node")) * int(g("trainer.nnodes"))
    tp = int(g("actor_rollout_ref.rollout.tensor_model_parallel_size"))
    pp = int(g("actor_rollout_ref.rollout.pipeline_model_parallel_size"))
    params_b = number(model, "n_params_b")
    hidden = number(model, "hidden_size")
    layers = number(model, "num_layers")
    vocab = number(model, "vocab_size")
    budget = float(g("actor_rollout_ref.rollout.max_num_batched_tokens"))
    frac = float(g("actor_rollout_ref.rollout.gpu_memory_utilization"))
    # The source's rule: a batched token costs hidden/8 KiB in the engine.
    budget_gb = budget * hidden / 8.0 * 1024.0 / GIB
    weights_gb = params_b * 2.0 / (tp * pp)
    # FSDP: bf16 params + fp32 grads/master/Adam = 16 bytes/param, sharded over all GPUs.
    params_bytes, optim_bytes = 4.0, 12.0
    if bool(g("actor_rollout_ref.actor.fsdp_config.param_offload")):
        params_bytes = 0.5
    if bool(g("actor_rollout_ref.actor.fsdp_config.optimizer_offload")):
        optim_bytes = 0.5
    states_gb = params_b * 1e9 * (params_bytes + optim_bytes) / n_gpus / GIB
    sp = int(g("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"))
    if bool(g("actor_rollout_ref.actor.use_dynamic_bsz")):
        micro_tokens = float(g("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"))
    else:
        micro = g("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") or 1
        seq = float(g("data.max_prompt_length")) + float(g("data.max_response_length"))
        micro_tokens = float(micro) * seq / sp
    ckpt = bool(g("actor_rollout_ref.model.enable_gradient_checkpointing"))
    # Korthikanti et al.: ~34·hidden bytes/token/layer without recomputation.
    per_token = (2.0 * layers + 34.0) * hidden if ckpt else 34.0 * hidden * layers
    if bool(g("actor_rollout_ref.model.enable_activation_offload")):
        per_token *= 0.3
    act_gb = micro_tokens * (per_token + 4.0 * vocab) / GIB
    return {
        "rollout_gb": weights_gb + budget_gb,
        "rollout_limit_gb": gpu * number(mem, "budget_oom_fraction") + weights_gb,
        "kv_gb": frac * gpu - weights_gb,
        "kv_min_gb": number(mem, "kv_min_gb"),
        "reserved_gb": frac * gpu,
        "reserved_limit_gb": gpu * number(mem, "max_utilization"),
        "train_gb": states_gb + act_gb + number(mem, "train_overhead_gb"),
        "train_limit_gb": gpu * 0.97,
        "act_gb": act_gb,
    }


def failure(model: Mapping[str, Any], mem_section: Mapping[str, Any], fail: Mapping[str, Any], gpu: float,
            config: Mapping[str, Any]) -> Failure | None:
    """The failure ``config`` runs into (OOM, a hang), None when it runs; ``fail``: the
    landscape's ``failures`` section."""
    g = lambda key: value(config, key)  # noqa: E731
    after = int(fail.get("oom_after_steps", 0))
    mem = memory_gb(model, mem_section, gpu, config)
    sp = int(g("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"))
    heads = int(number(model, "num_attention_heads"))
    if heads % sp:
        return Failure("hang", f"ulysses size {sp} does not divide {heads} attention heads", 1,
                       "Watchdog caught collective operation timeout")  # fmt: skip
    for trap in fail.get("nccl_traps", []) or []:
        if all(_matches(g(k), v) for k, v in dict(trap.get("when", {})).items()):
            return Failure("hang", str(trap.get("reason", "NCCL trap")), int(trap.get("at_step", 1)),
                           "Watchdog caught collective operation timeout")  # fmt: skip
    if mem["kv_gb"] < mem["kv_min_gb"]:
        return Failure("oom", "no room for the KV cache", 0,
                       "ValueError: No available memory for the cache blocks. Try increasing "
                       "`gpu_memory_utilization` when initializing the engine.")  # fmt: skip
    if mem["reserved_gb"] > mem["reserved_limit_gb"]:
        return Failure("oom", "engine wake-up over the memory fraction", 1 + after,
                       _oom_text(mem["reserved_gb"] - mem["reserved_limit_gb"] + 1.0, gpu))  # fmt: skip
    if mem["rollout_gb"] > mem["rollout_limit_gb"]:
        return Failure("oom", "token budget activations", 1 + after,
                       _oom_text(mem["rollout_gb"] - mem["rollout_limit_gb"] + 0.5, gpu))  # fmt: skip
    if mem["train_gb"] > mem["train_limit_gb"]:
        return Failure("oom", "actor micro-batch activations", 1 + after,
                       _oom_text(mem["act_gb"] / 4.0, gpu))  # fmt: skip
    return None


def _oom_text(tried_gb: float, gpu_gb: float) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {max(0.02, tried_gb):.2f} GiB. "
        f"GPU 0 has a total capacity of {gpu_gb * 0.99:.2f} GiB of which 312.19 MiB is free. "
        "Including non-PyTorch memory, this process has "
        f"{gpu_gb * 0.98:.2f} GiB memory in use."
    )


def _matches(value: Any, expected: Any) -> bool:
    """A trap condition: a scalar means equality; ``{min: x}`` / ``{max: y}`` a range."""
    if isinstance(expected, Mapping):
        try:
            v = float(value)
        except (TypeError, ValueError):
            return False
        return v >= float(expected.get("min", -math.inf)) and v <= float(expected.get("max", math.inf))
    return bool(value == expected)
