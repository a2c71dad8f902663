"""A Hugging Face ``config.json`` → the model facts the bounds use (``verl_sweep.verl_knowledge.facts.ModelFacts``).

Pure arithmetic on the mapping (no file or network access): the shape fields, the parameter
count (estimated from the shapes; MoE experts counted apart, since vLLM splits them over its
expert/data-parallel ranks), and what the KV cache holds per token. Multimodal configs keep
the language model under ``text_config`` (Qwen-VL, Qwen3.5, GLM-4V) or ``llm_config``;
their vision tower is left out of the count (a few hundred million parameters).
"""

from __future__ import annotations

from typing import Any, Mapping

#: where a multimodal config keeps its language model
_NESTED = ("text_config", "llm_config", "language_config")


def language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The mapping that holds the language model's shape (the config itself, or a nested one)."""
    if isinstance(config.get("hidden_size"), int):
        return config
    for key in _NESTED:
        nested = config.get(key)
        if isinstance(nested, Mapping) and isinstance(nested.get("hidden_size"), int):
            return nested
    return config


def _int(config: Mapping[str, Any], *keys: str, default: int = 0) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def kv_cache_layers(config: Mapping[str, Any]) -> int:
    """Layers that keep a KV cache: all of them, but only the full-attention layers of a hybrid
    model (linear attention / Mamba layers keep a fixed-size state instead)."""
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    types = config.get("layer_types")
    if isinstance(types, list) and types and all(isinstance(t, str) for t in types):
        full = sum(1 for t in types if "linear" not in t and "mamba" not in t)
        return full or layers
    interval = _int(config, "full_attention_interval")
    if interval > 1:
        return max(1, layers // interval)
    return layers


def facts_from_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelFacts fields a config.json implies ({} for a mapping without a hidden size)."""
    c = language_config(config)
    hidden = _int(c, "hidden_size", "n_embd", "d_model")
    if not hidden:
        return {}
    heads = _int(c, "num_attention_heads", "n_head")
    kv_heads = _int(c, "num_key_value_heads", "num_query_groups", default=heads)
    layers = _int(c, "num_hidden_layers", "n_layer", "num_layers")
    head_dim = _int(c, "head_dim", "kv_channels", default=hidden // heads if heads else 0)
    facts: dict[str, Any] = {"hidden_size": hidden, "num_attention_heads": heads}
    if layers:
        facts["num_hidden_layers"] = layers
        facts["num_key_value_heads"] = kv_heads
        facts["head_dim"] = head_dim
        cached = kv_cache_layers(c)
        if cached != layers:
            facts["kv_cache_layers"] = cached
        if _int(c, "kv_lora_rank"):  # multi-head latent attention caches one compressed vector
            facts["kv_lora_dim"] = _int(c, "kv_lora_rank") + _int(c, "qk_rope_head_dim")
        for key in ("intermediate_size", "vocab_size"):  # the memory pre-flight's (verl_sweep.verl_knowledge.memory)
            if _int(c, key):
                facts[key] = _int(c, key)
        total, experts = parameter_count(c)
        facts["n_params_b"] = round(total / 1e9, 2)
        if experts:
            facts["expert_params_b"] = round(experts / 1e9, 2)
    return facts


def parameter_count(c: Mapping[str, Any]) -> tuple[int, int]:
    """(all parameters, those in routed experts), estimated from the shapes: embeddings,
    attention (GQA or MLA), gated MLPs, routed and shared experts. Norms and biases are left
    out (well under 1%)."""
    hidden = _int(c, "hidden_size")
    heads = _int(c, "num_attention_heads")
    kv_heads = _int(c, "num_key_value_heads", default=heads)
    layers = _int(c, "num_hidden_layers")
    head_dim = _int(c, "head_dim", default=hidden // heads if heads else 0)
    vocab = _int(c, "vocab_size")
    tied = bool(c.get("tie_word_embeddings", False))
    embeddings = vocab * hidden * (1 if tied else 2)
    if _int(c, "kv_lora_rank"):
        rope, nope, v = _int(c, "qk_rope_head_dim"), _int(c, "qk_nope_head_dim"), _int(c, "v_head_dim")
        q_lora, kv_lora = _int(c, "q_lora_rank"), _int(c, "kv_lora_rank")
        q = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
        attention = q + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * hidden
    else:
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    n_experts = _int(c, "num_experts", "n_routed_experts", "num_local_experts")
    dense_mlp = 3 * hidden * _int(c, "intermediate_size")
    expert_mlp = 3 * hidden * _int(c, "moe_intermediate_size", default=_int(c, "intermediate_size"))
    shared = 3 * hidden * (_int(c, "shared_expert_intermediate_size")
                           or _int(c, "n_shared_experts") * _int(c, "moe_intermediate_size"))
    dense_layers = min(layers, _int(c, "first_k_dense_replace")) if n_experts else layers
    moe_layers = layers - dense_layers
    experts = moe_layers * n_experts * expert_mlp
    total = embeddings + layers * attention + dense_layers * dense_mlp + experts + moe_layers * (shared + hidden * n_experts)
    return total, experts
