"""The systems stage's parameter table: every name the space can ask is built by the table
and read back to the same knob, Ulysses size and valid values."""

from __future__ import annotations

from typing import Any

import optuna
import pytest

from verl_sweep import verl_knowledge as L
from verl_sweep.spaces import build_space
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts, merge
from verl_sweep.spaces.systems import Knob, SystemsSpace

pytestmark = pytest.mark.fast

optuna.logging.set_verbosity(optuna.logging.WARNING)

MODEL_7B = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7)
QWEN_05B = ModelFacts(hidden_size=896, num_attention_heads=14, n_params_b=0.358, max_prompt_length=256,
                      max_response_length=1024, num_hidden_layers=24, num_key_value_heads=2, intermediate_size=4864,
                      vocab_size=320)
A100x8 = HardwareFacts(gpus_per_node=8, gpu_memory_gb=80)
H200 = HardwareFacts(gpus_per_node=1, gpu_memory_gb=141)
GRPO_BASE: dict[str, Any] = {
    L.TRAIN_BATCH: 1024, L.MINI_BATCH: 512, L.ROLLOUT_N: 4, L.ROLLOUT_NAME: "vllm", L.ADV_ESTIMATOR: "grpo",
    L.GPU_MEMORY: 0.9, L.ROLLOUT_TP: 4, L.MICRO_BATCH: 8,
}
QUICKSTART: dict[str, Any] = {
    L.TRAIN_BATCH: 64, L.MINI_BATCH: 16, L.MICRO_BATCH: 4, L.ROLLOUT_N: 8, L.ROLLOUT_NAME: "vllm",
    L.ADV_ESTIMATOR: "grpo", L.ROLLOUT_TP: 1, L.GPU_MEMORY: 0.4, L.USE_REMOVE_PADDING: False,
}
#: every knob listed, so each is asked where it has more than one value
LISTED = {"micro_batch": [4, 8, 16], "log_prob_micro_batch": [8, 32], "max_num_seqs": [256, 512],
          "enforce_eager": [False, True], "free_cache_engine": [True, False], "log_prob_token_factor": [1, 2, 4]}
SPACES = {
    "8 GPUs, several Ulysses sizes": (MODEL_7B, A100x8, GRPO_BASE, LISTED),
    "8 GPUs, defaults": (MODEL_7B, A100x8, GRPO_BASE, {}),
    "one GPU": (QWEN_05B, H200, QUICKSTART, {k: v for k, v in LISTED.items() if "micro" not in k}),
    "dynamic base": (MODEL_7B, A100x8, merge(GRPO_BASE, {L.USE_DYNAMIC_BSZ: True, L.MAX_TOKEN_LEN: 8192}), {}),
}


def _space(case: str) -> tuple[SystemsSpace, dict[str, Any]]:
    model, hardware, base, options = SPACES[case]
    space = build_space("systems", model=model, hardware=hardware, algorithm=Algorithm.GRPO, base=base, options=options)
    assert isinstance(space, SystemsSpace)
    return space, base


def _asked(space: SystemsSpace, base: dict[str, Any]) -> dict[str, optuna.distributions.BaseDistribution]:
    """Every parameter the space asks in 200 random draws, with its distribution."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    asked: dict[str, optuna.distributions.BaseDistribution] = {}
    for _ in range(200):
        trial = study.ask()
        space.suggest(trial, base)
        asked.update(trial.distributions)
        study.tell(trial, 1.0)
    return asked


@pytest.mark.parametrize("case", sorted(SPACES))
def test_every_asked_name_round_trips_through_the_table(case: str) -> None:
    space, base = _space(case)
    table = space.declared.knobs
    asked = _asked(space, base)
    for name, distribution in asked.items():
        knob = table.knob(name)
        assert knob is not None, name
        assert table.name(knob.key, knob.sp) == name
        if isinstance(distribution, optuna.distributions.CategoricalDistribution):
            assert list(distribution.choices) == table.values(name), name
    per_ulysses = {table.knob(name).sp for name in asked if table.knob(name).sp is not None}  # type: ignore[union-attr]
    if case == "8 GPUs, several Ulysses sizes":
        assert per_ulysses == set(space.choices["ulysses"]) and len(per_ulysses) > 1


@pytest.mark.parametrize("case", sorted(SPACES))
def test_the_table_builds_each_name_once_and_reads_it_back(case: str) -> None:
    space, _ = _space(case)
    table = space.declared.knobs
    knobs = list(table)
    assert len({k.name for k in knobs}) == len(knobs)
    for knob in knobs:
        assert table.knob(knob.name) == knob and table.name(knob.key, knob.sp) == knob.name
        if knob.sp is not None:  # a per-size knob moves to another size and back
            for sp in space.choices["ulysses"]:
                assert table.knob(table.moved_to(knob.name, sp)) == Knob(table.name(knob.key, sp), knob.key, sp)
            assert table.moved_to(table.moved_to(knob.name, 1), knob.sp) == knob.name
    assert table.knob("micro_batch_sp3") is None and table.values("no_such_knob") == []


def test_stored_names_are_unchanged() -> None:
    """Studies store these names: the table must keep spelling them so."""
    space, _ = _space("8 GPUs, several Ulysses sizes")
    table = space.declared.knobs
    assert table.name("micro_batch", 2) == "micro_batch_sp2"
    assert table.name("log_prob_micro_batch", 4) == "log_prob_micro_batch_sp4"
    assert table.name("ppo_max_token_len_per_gpu", 1) == "ppo_max_token_len_per_gpu_sp1"
    assert table.name("log_prob_token_factor", 2) == "log_prob_token_factor"  # one knob for every size
    assert table.batching(2, dynamic=True) == ["ppo_max_token_len_per_gpu_sp2", "log_prob_token_factor"]
    assert table.batching(2, dynamic=False) == ["micro_batch_sp2", "log_prob_micro_batch_sp2"]


def test_the_incumbent_and_every_follow_up_use_the_tables_names() -> None:
    """A Ulysses move carries the batching knobs over to the new size's names."""
    space, base = _space("8 GPUs, defaults")
    table = space.declared.knobs
    leader = {"rollout_tp": 4, "strategy": "fsdp2", "forward_prefetch": False, "ulysses": 2, "use_dynamic_bsz": True,
              "ppo_max_token_len_per_gpu_sp2": 8192, "gradient_checkpointing": True, "activation_offload": False,
              "gpu_memory_utilization": 0.8}
    points = space.follow_up_points(base, [(leader, 1.0)], 16)
    moved = [p for p in points if p.get("ulysses") == 1]
    assert moved and moved[0]["ppo_max_token_len_per_gpu_sp1"] == 8192 and "ppo_max_token_len_per_gpu_sp2" not in moved[0]
    incumbent = space.incumbent_params(base)
    assert incumbent is not None
    for point in [incumbent, *points]:
        assert all(table.knob(name) is not None for name in point), point
        space.suggest(optuna.trial.FixedTrial(point), base)  # a point of the space
