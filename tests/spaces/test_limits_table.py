"""Table-driven checks of the derived limits and of check_config: accept/reject per rule."""

from __future__ import annotations

import re
from typing import Any

import pytest

from verl_sweep import verl_knowledge as L
from verl_sweep.spaces import limits as SL
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import merge

pytestmark = pytest.mark.fast

M7 = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7)
M7_LONG = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7, max_prompt_length=2048,
                     max_response_length=6144)
M05 = ModelFacts(hidden_size=896, num_attention_heads=14, n_params_b=0.5, max_prompt_length=512,
                 max_response_length=512)
M32 = ModelFacts(hidden_size=5120, num_attention_heads=40, n_params_b=32)
H8x80 = HardwareFacts(gpus_per_node=8, gpu_memory_gb=80)
H4x24 = HardwareFacts(gpus_per_node=4, gpu_memory_gb=24)
H1x80 = HardwareFacts(gpus_per_node=1, gpu_memory_gb=80)
H2n8x80 = HardwareFacts(gpus_per_node=8, nodes=2, gpu_memory_gb=80)
GRPO, PPO = Algorithm.GRPO, Algorithm.PPO

OK_GRPO: dict[str, Any] = {
    L.ROLLOUT_NAME: "vllm", L.ADV_ESTIMATOR: "grpo", L.ROLLOUT_N: 4, L.TRAIN_BATCH: 1024, L.MINI_BATCH: 256,
}
OK_PPO: dict[str, Any] = {L.ROLLOUT_NAME: "vllm", L.ADV_ESTIMATOR: "gae"}

# (id, model, hardware, algorithm, config on top of the OK base, expected problem regex or None)
CASES: list[tuple[str, ModelFacts, HardwareFacts, Algorithm, dict[str, Any], str | None]] = [
    ("grpo-ok", M7, H8x80, GRPO, {}, None),
    ("ppo-ok", M7, H8x80, PPO, {}, None),
    ("grpo-n1-runs", M7, H8x80, GRPO, {L.ROLLOUT_N: 1}, None),  # verl runs it (test_doubts_are_warnings)
    ("grpo-default-n", M7, H8x80, GRPO, {L.ROLLOUT_N: None}, r"must be an integer ≥ 1"),
    ("ppo-n1-ok", M7, H8x80, PPO, {L.ROLLOUT_N: 1}, None),
    ("grpo-n2-ok", M7, H8x80, GRPO, {L.ROLLOUT_N: 2}, None),
    ("no-rollout-name", M7, H8x80, GRPO, {L.ROLLOUT_NAME: None}, r"rollout\.name=None: must be one of"),
    ("hf-rollout-gone", M7, H8x80, GRPO, {L.ROLLOUT_NAME: "hf"}, r"rollout\.name=hf: must be one of"),
    ("sglang-ok", M7, H8x80, GRPO, {L.ROLLOUT_NAME: "sglang"}, None),
    ("unknown-adv", M7, H8x80, GRPO, {L.ADV_ESTIMATOR: "grpoo"}, r"adv_estimator=grpoo: must be one of verl's"),
    ("adv-mismatch", M7, H8x80, GRPO, {L.ADV_ESTIMATOR: "gae"}, r"adv_estimator=gae: runs the ppo \(GAE with a critic\) chain, but the study's algorithm is grpo"),
    ("mem-0", M7, H8x80, GRPO, {L.GPU_MEMORY: 0.0}, r"gpu_memory_utilization=0\.0: must lie in \(0, 1\]"),
    ("mem-1.2", M7, H8x80, GRPO, {L.GPU_MEMORY: 1.2}, r"gpu_memory_utilization=1\.2: must lie in \(0, 1\]"),
    ("mem-1-ok", M7, H8x80, GRPO, {L.GPU_MEMORY: 1.0}, None),
    ("tp2-on-1gpu", M7, H1x80, GRPO, {L.TRAIN_BATCH: 8, L.MINI_BATCH: 8},
     r"rollout TP·DP·PP \(2·1·1 = 2\) must divide the GPU count \(1\)"),
    ("tp1-on-1gpu-ok", M7, H1x80, GRPO, {L.TRAIN_BATCH: 8, L.MINI_BATCH: 8, L.ROLLOUT_TP: 1}, None),
    ("tp3-on-8", M7, H8x80, GRPO, {L.ROLLOUT_TP: 3}, r"must divide the GPU count \(8\)"),
    ("tp-heads", M05, H8x80, GRPO, {L.ROLLOUT_TP: 4}, r"tensor_model_parallel_size=4: must divide the attention heads \(14\)"),
    ("tp-dp-pp", M7, H8x80, GRPO, {L.ROLLOUT_TP: 4, L.ROLLOUT_PP: 2, L.ROLLOUT_DP: 2}, r"\(4·2·2 = 16\)"),
    ("tp4-pp2", M7, H8x80, GRPO, {L.ROLLOUT_TP: 4, L.ROLLOUT_PP: 2}, r"rollout pipeline parallelism > 1 is not implemented"),
    ("tp4-dp2-ok", M7, H8x80, GRPO, {L.ROLLOUT_TP: 4, L.ROLLOUT_DP: 2}, None),
    ("tp8-two-nodes-ok", M7, H2n8x80, GRPO, {L.ROLLOUT_TP: 8}, None),
    ("ulysses-heads", M05, H8x80, GRPO, {L.ULYSSES: 4, L.USE_REMOVE_PADDING: True},
     r"attention heads \(14\) must be divisible by the ulysses size"),
    ("ulysses-padding", M7, H8x80, GRPO, {L.ULYSSES: 2, L.USE_REMOVE_PADDING: False}, r"ulysses > 1 needs .*use_remove_padding=true"),
    ("ulysses-ok", M7, H8x80, GRPO, {L.ULYSSES: 4, L.USE_REMOVE_PADDING: True}, None),
    ("ulysses-legacy-key", M7, H8x80, GRPO, {L.ULYSSES_LEGACY: 2, L.USE_REMOVE_PADDING: False}, r"ulysses > 1 needs"),
    ("ulysses-default-padding-ok", M7, H8x80, GRPO, {L.ULYSSES: 2}, None),
    ("ulysses-gpus", M7, H4x24, GRPO, {L.ULYSSES: 8, L.USE_REMOVE_PADDING: True}, r"must divide the GPU count \(4\)"),
    ("mini>train", M7, H8x80, GRPO, {L.MINI_BATCH: 2048}, r"ppo_mini_batch_size=2048: must be ≤ data\.train_batch_size \(1024\)"),
    ("mini-dp", M7, H8x80, PPO, {L.MINI_BATCH: 250}, r"mini × rollout\.n \(250 × 1 = 250\) must be divisible by the data-parallel ranks \(8 GPUs ÷ ulysses 1 = 8\)"),
    ("mini-dp-n4-ok", M7, H8x80, GRPO, {L.MINI_BATCH: 250}, None),
    ("mini-dp-ulysses-ok", M7, H8x80, PPO, {L.MINI_BATCH: 252, L.ULYSSES: 4, L.USE_REMOVE_PADDING: True}, None),
    ("micro-divides", M7, H8x80, GRPO, {L.MICRO_BATCH: 48}, r"per-GPU mini-batch \(256 × 4 ÷ 8 = 128\) must be divisible by .*ppo_micro_batch_size_per_gpu \(48\)"),
    ("micro-ok", M7, H8x80, GRPO, {L.MICRO_BATCH: 16}, None),
    ("micro-ignored-dynamic", M7, H8x80, GRPO, {L.MICRO_BATCH: 48, L.USE_DYNAMIC_BSZ: True}, None),
    ("train-batch-gpus", M7, H8x80, PPO, {L.TRAIN_BATCH: 1020, L.MINI_BATCH: 256}, r"train batch × rollout\.n \(1020\) must be divisible by the GPU count \(8\)"),
    ("dyn-too-short", M7_LONG, H8x80, GRPO, {L.USE_DYNAMIC_BSZ: True, L.MAX_TOKEN_LEN: 4096}, r"ppo_max_token_len_per_gpu=4096: .* ≥ the longest prompt \+ response \(8192\)"),
    ("dyn-ulysses-ok", M7_LONG, H8x80, GRPO, {L.USE_DYNAMIC_BSZ: True, L.MAX_TOKEN_LEN: 4096, L.ULYSSES: 2, L.USE_REMOVE_PADDING: True}, None),
    ("dyn-default-ok", M7_LONG, H8x80, GRPO, {L.USE_DYNAMIC_BSZ: True}, None),
    ("adaptive-horizon-0", M7, H8x80, PPO, {L.USE_KL_IN_REWARD: True, L.KL_CTRL_TYPE: "adaptive", L.KL_CTRL_HORIZON: 0}, r"horizon=0: adaptive KL control needs horizon > 0"),
    ("adaptive-ok", M7, H8x80, PPO, {L.USE_KL_IN_REWARD: True, L.KL_CTRL_TYPE: "adaptive"}, None),
    ("horizon-0-unused", M7, H8x80, PPO, {L.KL_CTRL_TYPE: "adaptive", L.KL_CTRL_HORIZON: 0}, None),
    ("kl-type-bad", M7, H8x80, PPO, {L.KL_CTRL_TYPE: "pid"}, r"kl_ctrl\.type=pid: must be fixed or adaptive"),
    ("lam-on-grpo-harmless", M7, H8x80, GRPO, {L.LAM: 0.95}, None),  # unread by GRPO: a note (test below)
    ("lam-out-of-range", M7, H8x80, PPO, {L.LAM: 1.5}, r"algorithm\.lam=1\.5: must lie in \[0, 1\]"),
    ("rloo-grpo-chain-ok", M7, H8x80, GRPO, {L.ADV_ESTIMATOR: "rloo"}, None),
    ("rloo-n1-runs", M7, H8x80, GRPO, {L.ADV_ESTIMATOR: "rloo", L.ROLLOUT_N: 1}, None),
    ("remax-n1-ok", M7, H8x80, GRPO, {L.ADV_ESTIMATOR: "remax", L.ROLLOUT_N: 1}, None),  # not group-relative
    ("rloo-on-ppo-chain", M7, H8x80, PPO, {L.ADV_ESTIMATOR: "rloo"}, r"runs the grpo \(every critic-free estimator\) chain"),
    ("megatron-strategy-and-dp-engine", M7, H8x80, GRPO, {L.STRATEGY: "megatron", "model_engine": "dp"}, r"strategy=megatron: needs model_engine=megatron, but the config chooses model_engine=dp"),
    ("megatron-dp-arithmetic", M7, H8x80, GRPO, {"model_engine": "megatron", L.MINI_BATCH: 251,
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 1}, r"8 GPUs ÷ \(Megatron TP 1 · PP 1 · CP 1\) = 8"),
    ("megatron-no-ulysses-rule", M05, H8x80, GRPO, {"model_engine": "megatron", L.ULYSSES: 4, L.MICRO_BATCH: 4}, None),
    ("megatron-static-needs-micro", M05, H8x80, GRPO, {"model_engine": "megatron", L.GLOBAL_MICRO_BATCH: 64},
     r"ppo_micro_batch_size_per_gpu: must be set for Megatron with static batching .* \(the older "
     r"actor_rollout_ref\.actor\.ppo_micro_batch_size=64 is not read there\)"),
    ("global-micro-divides-mini", M7, H8x80, GRPO, {L.GLOBAL_MICRO_BATCH: 48},
     r"ppo_mini_batch_size=256: must be divisible by actor_rollout_ref\.actor\.ppo_micro_batch_size \(48\)"),
    ("lam-ppo-ok", M7, H8x80, PPO, {L.LAM: 0.95}, None),
    ("lam-out-of-range", M7, H8x80, PPO, {L.LAM: 1.5}, r"algorithm\.lam=1\.5: must lie in \[0, 1\]"),
    ("prefetch-fsdp2-ok", M7, H8x80, GRPO, {L.STRATEGY: "fsdp2", L.FORWARD_PREFETCH: True}, None),  # verl 0.9.1 prefetches under FSDP2 too
    ("prefetch-fsdp-ok", M7, H8x80, GRPO, {L.FORWARD_PREFETCH: True}, None),
    ("chunked-off", M7_LONG, H8x80, GRPO, {L.CHUNKED_PREFILL: False}, None),  # budget = max_model_len: nothing raised
    ("chunked-off-short", M7_LONG, H8x80, GRPO, {L.CHUNKED_PREFILL: False, L.TOKEN_BUDGET: 4096}, r"with chunked prefill off verl raises it to max_model_len \(8192\)"),
    ("gpus-per-node-mismatch", M7, H8x80, GRPO, {L.N_GPUS_PER_NODE: 4}, r"trainer\.n_gpus_per_node=4: must equal the hardware's gpus_per_node \(8\)"),
    ("32b-ok", M32, H8x80, GRPO, {L.ROLLOUT_TP: 8}, None),
]


@pytest.mark.parametrize("name, model, hardware, algorithm, changes, expected", CASES, ids=[c[0] for c in CASES])
def test_check_config_rule(
    name: str, model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm,
    changes: dict[str, Any], expected: str | None,
) -> None:
    base = OK_GRPO if algorithm is GRPO else OK_PPO
    config = {k: v for k, v in merge(base, changes).items() if v is not None or k == L.ROLLOUT_NAME}
    if changes.get(L.ROLLOUT_N, 0) is None:
        config[L.ROLLOUT_N] = None
    problems = L.check_config(config, model=model, hardware=hardware, algorithm=algorithm)
    if expected is None:
        assert problems == [], problems
    else:
        assert len(problems) >= 1 and any(re.search(expected, p) for p in problems), problems


def test_harmless_settings_are_notes() -> None:
    config = merge(OK_GRPO, {L.LAM: 0.95, L.KL_CTRL_COEF: 0.05})
    assert L.check_config(config, model=M7, hardware=H8x80, algorithm=GRPO) == []
    found = L.notes(config, algorithm=GRPO)
    assert any(re.search(r"algorithm\.lam=0\.95 is read only by GAE; grpo leaves it unused", n) for n in found)
    assert any(re.search(r"kl_ctrl\.kl_coef=0\.05 is unused: algorithm\.use_kl_in_reward is off", n) for n in found)
    assert L.notes(merge(OK_PPO, {L.LAM: 0.95}), algorithm=PPO) == []


def test_doubts_are_warnings() -> None:
    """A group estimator with one response a prompt: verl runs it (a group of one has mean 0, so
    the advantage is the raw score), so it is a warning, not a refusal; not under distillation."""
    for adv in ("grpo", "rloo", "gdpo"):
        [doubt] = L.doubts(merge(OK_GRPO, {L.ADV_ESTIMATOR: adv, L.ROLLOUT_N: 1}))
        assert re.search(rf"rollout\.n=1: {adv} compares a response with the others .* set rollout\.n ≥ 2", doubt)
    assert L.doubts(merge(OK_GRPO, {L.ADV_ESTIMATOR: "remax", L.ROLLOUT_N: 1})) == []
    assert L.doubts(merge(OK_GRPO, {L.ROLLOUT_N: 1, "distillation.enabled": True})) == []
    assert L.doubts(OK_GRPO) == []


def test_case_count() -> None:
    assert len(CASES) >= 40


# Token budget arithmetic: (model, hardware, memory fraction, TP) → (seed, cap, bound, suggested)
BUDGETS = [
    # docs/method.md §1: 7B hidden 4096 on an 80 GB A100 → 106,496 → 100,000 (when memory leaves room)
    (M7, H8x80, 0.9, 4, 106_496, 140_288, 106_496, 100_000),
    (M7, H8x80, 0.6, 4, 106_496, 91_136, 91_136, 91_000),  # the template's fraction caps it
    (M7, H8x80, 0.5, 2, 106_496, 67_584, 67_584, 67_000),  # verl's defaults
    (M05, H4x24, 0.5, 1, 146_051, 102_985, 102_985, 100_000),  # hidden 896: 112 "bytes" a token
]


@pytest.mark.parametrize("model, hardware, fraction, tp, seed, cap, bound, suggested", BUDGETS)
def test_token_budget_arithmetic(
    model: ModelFacts, hardware: HardwareFacts, fraction: float, tp: int, seed: int, cap: int, bound: int, suggested: int,
) -> None:
    budget = SL.token_budget(model, hardware, {L.GPU_MEMORY: fraction, L.ROLLOUT_TP: tp})
    assert (budget.seed, budget.memory_cap, budget.bound) == (seed, cap, bound)
    assert budget.suggested_max == suggested
    assert budget.suggested_max <= budget.bound
    assert f"{seed:,}" in budget.lines[0]


def test_token_budget_defaults_and_floor() -> None:
    budget = SL.token_budget(M7_LONG, H8x80, {})  # silent base → verl defaults 0.5 / TP 2
    assert "gpu_memory_utilization 0.5" in budget.lines[1] and "rollout TP 2" in budget.lines[1]
    assert budget.floor == 8192


@pytest.mark.parametrize("value, rounded", [(106_496, 100_000), (91_136, 91_000), (2048, 2000), (99, 99), (1_234_567, 1_200_000)])
def test_round_down_two_significant_figures(value: int, rounded: int) -> None:
    assert SL.round_down_2sf(value) == rounded


def test_ulysses_and_tp_sizes() -> None:
    assert L.ulysses_sizes(M7, H8x80).value == [1, 2, 4]
    assert L.ulysses_sizes(M05, H8x80).value == [1, 2]  # 14 heads
    assert L.ulysses_sizes(M7, H1x80).value == [1]
    assert L.rollout_tp_sizes(M7, H8x80).value == [1, 2, 4, 8]
    assert L.rollout_tp_sizes(M05, H8x80).value == [1, 2]
    assert L.kl_keys(GRPO) == (L.USE_KL_LOSS, L.KL_LOSS_COEF)
    assert L.kl_keys(PPO) == (L.USE_KL_IN_REWARD, L.KL_CTRL_COEF)


def test_valid_mini_batches_lists_exactly_the_valid_values() -> None:
    values = SL.valid_mini_batches({L.ROLLOUT_N: 1}, H8x80, low=384, high=640).value
    assert values == list(range(384, 641, 8))
    assert SL.valid_mini_batches({L.TRAIN_BATCH: 500}, H8x80, low=384, high=640).value == list(range(384, 501, 8))


QWEN3_8B = ModelFacts(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36,
                      head_dim=128, n_params_b=8.19, max_prompt_length=1024, max_response_length=2048)
QWEN3_30B_A3B = ModelFacts(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48,
                           head_dim=128, n_params_b=30.53, expert_params_b=28.99, max_prompt_length=1024,
                           max_response_length=2048)


def test_the_token_budget_charges_the_real_kv_cache() -> None:
    """36 layers × 2 × 8 KV heads × 128 × 2 B = 147,456 B a token for Qwen3-8B; the method's
    hidden ÷ 8 KiB rule charged 524,288 (3.6×)."""
    assert QWEN3_8B.kv_bytes_per_token() == 147_456
    assert L.bytes_per_token(M7) == 524_288 and round(524_288 / 147_456, 1) == 3.6
    budget = SL.token_budget(QWEN3_8B, H8x80, {L.GPU_MEMORY: 0.6, L.ROLLOUT_TP: 2})
    assert budget.memory_cap == int((80 * 0.6 - 8.19) * 1024**3 / 147_456)
    assert "KV 147,456 B a token (36 layers × 2 × 8 KV heads × 128 × 2 B)" in budget.lines[0]


def test_moe_experts_are_split_over_rollout_tp_and_dp() -> None:
    """Qwen3-30B-A3B at rollout TP 1 on 80 GB: 61 GB of weights on one GPU leave no pool at 0.6
    (the old bound: 0); with DP 8 (EP = TP × DP) the experts are spread over 8 GPUs."""
    one = SL.token_budget(QWEN3_30B_A3B, H8x80, {L.GPU_MEMORY: 0.6, L.ROLLOUT_TP: 1})
    spread = SL.token_budget(QWEN3_30B_A3B, H8x80, {L.GPU_MEMORY: 0.6, L.ROLLOUT_TP: 1, L.ROLLOUT_DP: 8,
                                                   "actor_rollout_ref.rollout.expert_parallel_size": 8})
    assert one.memory_cap == 0 and spread.memory_cap > 200_000
    assert "experts 28.99B × 2 bytes ÷ TP·DP 8" in spread.lines[1]
    assert L.check_config({**OK_GRPO, L.ROLLOUT_TP: 1, L.ROLLOUT_DP: 8, "actor_rollout_ref.rollout.expert_parallel_size": 4},
                          model=QWEN3_30B_A3B, hardware=H8x80, algorithm=GRPO) == [
        "actor_rollout_ref.rollout.expert_parallel_size=4: rollout expert parallelism must equal rollout TP × DP "
        "(1 × 8 = 8) in verl 0.9.1"]


def test_each_rollout_tp_keeps_its_own_memory_floor() -> None:
    """The floor of the worst TP is not every layout's: TP 1 needs a larger fraction than TP 8
    to hold 32B's weights and the budget, and each layout is offered from its own floor."""
    from verl_sweep.spaces import bounds as B
    from verl_sweep.verl_knowledge import rollout_memory_floors

    floors = rollout_memory_floors(M32, H8x80, {**OK_GRPO, L.TOKEN_BUDGET: 60_000, L.ROLLOUT_TP: 8, L.GPU_MEMORY: 0.9},
                                   B.GPU_MEMORY_UTILIZATION)
    assert floors[8] < floors[4] < floors[2] and 1 not in floors  # 64 GB of weights on one GPU: no fraction holds it
    assert floors == {2: 0.86, 4: 0.66, 8: 0.56}  # (60,000 × 640 KiB + 32B × 2 B ÷ TP) ÷ 80 GB, rounded up
