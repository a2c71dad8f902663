"""Every config a stage can propose composes and validates in verl: many drawn per stage.

A dozen of verl's example scripts that span what the corpus holds (FSDP, Megatron, VeOmni;
vLLM and SGLang; GRPO, RLOO, REINFORCE++, GAE; dense and MoE; static and dynamic batching;
text and vision), each made a study by ``init``; from each stage of each study
``N_PER_STAGE`` configs are drawn (Optuna's random sampler, conditional parameters included),
so that each stage kind gets 30 or more, and each goes through the rules and verl's compose and
validation. About 0.2-0.4 s a config after verl's import, ~300 configs: 1-2 minutes.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest

from support import verl_examples as V
from verl_sweep.search.spec.study_file import load_study
from verl_sweep.search.commands.validate import sample_configs
from verl_sweep.spaces import build_space
from verl_sweep import verl_knowledge as L
from verl_sweep.verl_knowledge import check_config
from verl_sweep.verl_knowledge import VerlValidator, verl_available

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.verl, pytest.mark.timeout(900),
              pytest.mark.skipif(not verl_available(), reason="verl is not installed")]

#: configs drawn from each stage of each study below
N_PER_STAGE = 4
#: the least each stage kind must get across the studies
MIN_PER_KIND = 30

STUDIES = [
    "examples/grpo_trainer/run_qwen3_8b_fsdp.sh",                      # FSDP, vLLM, dynamic batching, KL loss
    "examples/ppo_trainer/run_qwen3_8b_fsdp.sh",                       # GAE: critic, λ stage
    "examples/ppo_trainer/run_qwen3_8b_megatron.sh",                   # GAE on Megatron
    "examples/grpo_trainer/run_qwen3_8b_megatron.sh",                  # Megatron TP 2 × PP 2
    "examples/grpo_trainer/run_qwen3_30b_a3b_fsdp.sh",                 # MoE on FSDP
    "examples/ascend_extras/grpo_trainer/run_qwen3_30b_a3b_megatron.sh",  # Megatron MoE, SGLang, static batching
    "examples/grpo_trainer/run_qwen3_30b_veomni.sh",                   # VeOmni: no systems stage
    "examples/rloo_trainer/run_qwen3_8b_fsdp.sh",                      # RLOO
    "examples/reinforce_plus_plus_trainer/run_qwen3_8b_fsdp.sh",       # REINFORCE++
    "examples/grpo_trainer/run_qwen2_5_vl_7b_fsdp.sh",                 # vision-language
    "examples/grpo_trainer/run_qwen2_5_32b_fsdp.sh",                   # 32B, static batching
    "examples/grpo_trainer/run_deepseek_v3_671b_megatron.sh",          # 671B MoE over 32+ GPUs
]


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    root = tmp_path_factory.mktemp("stage-configs")
    hub = V.hf_cache(root)
    specs = []
    for script in STUDIES:
        outcome = V.init_and_validate(script, hub, root, with_verl=False)
        assert outcome.accepted and outcome.study is not None, (script, outcome.line)
        specs.append(load_study(outcome.study))
    return specs


def test_many_configs_of_every_stage_validate_in_verl(studies: list[Any]) -> None:
    per_kind: collections.Counter[str] = collections.Counter()
    with VerlValidator() as verl:
        for spec in studies:
            base = spec.baseline_config()
            facts = {"model": spec.model, "hardware": spec.hardware, "algorithm": spec.algorithm}
            assert verl.validate(base) == [], spec.name
            for index, stage in enumerate(spec.stages):
                space = build_space(stage.space, base=base, options=stage.params, **facts)
                for config in sample_configs(space, base, N_PER_STAGE, seed=17 + index):
                    where = (spec.name, stage.name, {k: v for k, v in config.items() if base.get(k) != v})
                    assert check_config(config, **facts) == [], where
                    assert verl.validate(config) == [], where
                    if L.setting(base, L.ROLLOUT_NAME) == "sglang":  # a knob SGLang never reads
                        assert config.get(L.TOKEN_BUDGET) == base.get(L.TOKEN_BUDGET), where
                    per_kind[stage.space] += 1
    assert all(n >= MIN_PER_KIND for kind, n in per_kind.items() if kind != "lam"), per_kind
    assert per_kind["lam"] >= 2 * N_PER_STAGE and set(per_kind) >= {"systems", "token_budget", "mini_batch", "kl", "lr",
                                                                  "polish"}, per_kind


def test_the_kl_stage_switches_on_what_verl_needs_with_it(studies: list[Any]) -> None:
    """KL switched on over a base without it: verl then builds a reference policy, and under
    static batching wants its log-prob micro-batch; the stage gives it."""
    spec = next(s for s in studies if "32b" in s.name)
    ref_micro = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
    base = {**{k: v for k, v in spec.baseline_config().items() if k != ref_micro}, L.USE_KL_LOSS: False}
    assert L.setting(base, L.USE_DYNAMIC_BSZ) is False
    space = build_space("kl", model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm, base=base, options={})
    [config] = sample_configs(space, base, 1)
    assert config[L.USE_KL_LOSS] is True
    assert config[ref_micro] == base["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]
    with VerlValidator() as verl:
        assert verl.validate(config) == []
