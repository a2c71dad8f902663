"""Megatron: seed 000's template (7B on 8 GPUs, actor TP 4 × PP 2, memory 0.6) validates, and its
systems stage proposes only Megatron layouts that verl composes and validates."""

from __future__ import annotations

import os
import re
from typing import Any

import optuna
import pytest

from verl_sweep.search.spec.study_file import parse_study
from verl_sweep.search.commands.validate import sample_configs, validate_study
from verl_sweep.spaces import build_space
from verl_sweep import verl_knowledge as L
from verl_sweep.verl_knowledge import MEGATRON_CP, MEGATRON_PP, MEGATRON_TP
from verl_sweep.spaces.megatron import MegatronSystemsSpace, layout_problem
from verl_sweep.verl_knowledge import VerlValidator, verl_available

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.verl, pytest.mark.timeout(600)]
optuna.logging.set_verbosity(optuna.logging.WARNING)

#: how many systems configs are drawn and checked by verl (~0.2 s each after the first)
N_SYSTEMS_SAMPLES = 40


def seed_000_study(**baseline: Any) -> Any:
    """Qwen2.5-7B (its config.json's shape), GRPO on one node of 8 × 80 GB, Megatron TP 4 × PP 2."""
    return parse_study({
        "name": "megatron7b",
        "model": {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
                  "head_dim": 128, "n_params_b": 7.62},
        "hardware": {"gpus_per_node": 8, "gpu_memory_gb": 80},
        "algorithm": "grpo",
        "baseline": {
            "actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B-Instruct",
            "actor_rollout_ref.actor.strategy": "megatron",
            MEGATRON_TP: 4, MEGATRON_PP: 2,
            "data.train_batch_size": 256, "data.max_prompt_length": 1024, "data.max_response_length": 1024,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 64, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,
            "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.n": 4,
            "actor_rollout_ref.rollout.tensor_model_parallel_size": 4,
            "actor_rollout_ref.rollout.gpu_memory_utilization": 0.6,
            **baseline,
        },
    })


def test_the_data_parallel_size_is_gpus_over_tp_pp_cp() -> None:
    spec = seed_000_study()
    base = spec.baseline_config()
    assert base["model_engine"] == "megatron"  # the strategy chooses the trainer config it needs
    assert L.data_parallel_ranks(base, spec.hardware) == 1  # 8 GPUs ÷ (4 · 2 · 1)
    assert layout_problem(8, 1, 1, model=spec.model, hardware=spec.hardware, base=base) is not None  # 4 KV heads
    assert re.search(r"PP 3 must divide the layers \(28\)",
                     layout_problem(1, 3, 1, model=spec.model, hardware=spec.hardware, base=base) or "")


@pytest.mark.skipif(not verl_available(), reason="verl is not installed")
def test_seed_000_template_validates_and_its_systems_stage_proposes_only_megatron_layouts() -> None:
    spec = seed_000_study()
    problems, lines = validate_study(spec, n_samples=2)  # the systems stage's depth: the samples below
    assert problems == [], problems
    assert any("systems (Megatron): actor layouts TP×PP×CP, DP = 8 GPUs ÷ (TP·PP·CP)" in line for line in lines)
    base = spec.baseline_config()
    space = build_space("systems", model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm, base=base,
                        options={})
    assert isinstance(space, MegatronSystemsSpace)
    assert "tp4-pp2-cp1" in space.choices["layouts"] and space.incumbent_params(base) is not None
    assert not any(name.startswith("tp8") for name in space.choices["layouts"])
    configs = sample_configs(space, base, N_SYSTEMS_SAMPLES, seed=3)
    layouts = set()
    with VerlValidator() as verl:
        assert verl.validate(base) == []
        for config in configs:
            assert not any("fsdp_config" in key or "ulysses" in key for key in config), config
            layouts.add((config[MEGATRON_TP], config[MEGATRON_PP], config.get(MEGATRON_CP, 1)))
            assert L.check_config(config, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm) == [], config
            assert verl.validate(config) == [], config
    assert len(layouts) >= 4, layouts


def test_a_megatron_export_composes_with_hydra(tmp_path: Any) -> None:
    """The exported YAML chooses model_engine in its defaults list, as ppo_megatron_trainer does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from verl_sweep.search.views.export import to_yaml

    if not verl_available():
        pytest.skip("verl is not installed")
    spec = seed_000_study()
    (tmp_path / "best.yaml").write_text(to_yaml(spec, [], spec.baseline_config()))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose("best")
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 4
