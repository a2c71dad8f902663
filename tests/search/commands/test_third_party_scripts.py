"""Launch scripts of public projects built on verl (tests/data/third-party-scripts, provenance
in its PROVENANCE.md) through ``init`` + ``validate``, played as their users run them: each is
accepted, or refused in one line whose reason is the true one (most were written for verl
releases whose keys 0.9.1 no longer has: the line names the first such key, and the key verl
0.9.1 has in its place where there is one). Never a traceback, never a cascade of lines."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from support import REPO
from support import verl_examples as V
from verl_sweep.verl_knowledge import verl_available

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.verl, pytest.mark.timeout(300),
              pytest.mark.skipif(not verl_available(), reason="verl is not installed")]

SCRIPTS = REPO / "tests" / "data" / "third-party-scripts"
#: config.json stand-ins of the models these scripts name that verl's examples do not
CONFIGS = SCRIPTS / "model-configs"


@dataclasses.dataclass(frozen=True)
class Case:
    script: str
    #: the phrase the refusal line holds; "" when the study is accepted
    refused_with: str
    #: what the script's README asks the user to export before it runs
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    #: a model directory the script names that is not here: its config.json's stand-in
    model_config: str | None = None


CASES = [
    Case("tinyzero/train_tiny_zero.sh", "the + adds a key, but verl already has trainer.val_before_train",
         {"N_GPUS": "2", "BASE_MODEL": "Qwen/Qwen2.5-3B", "DATA_DIR": "data/countdown", "ROLLOUT_TP_SIZE": "2",
          "EXPERIMENT_NAME": "countdown-qwen2.5-3b"}),
    Case("tinyzero/run_deepseek_megatron.sh", "the + adds a key, but verl already has trainer.val_before_train"),
    Case("tinyzero/run_deepseek7b_llm.sh", "but it runs main_ppo_split.py instead"),
    Case("search-r1/train_ppo.sh", "the + adds a key, but verl already has trainer.val_before_train"),
    Case("search-r1/train_grpo_multinode_32b.sh", "the + adds a key, but verl already has trainer.val_before_train"),
    Case("search-r1/train_grpo_format.sh", "runs verl.trainer.main_ppo_format, which verl 0.9.1 does not have"),
    Case("rllm/deepscaler_1.5b_8k.sh", "the + adds a key, but verl already has trainer.val_before_train"),
    Case("rllm/deepcoder_14b_coding_16k.sh", "the + adds a key, but verl already has trainer.val_before_train"),
    Case("prime/run_prime_main.sh", "fsdp_config.grad_offload: verl has no such key"),
    Case("simplerl-reason/train_grpo_math_tune_ray.sh", "TO_BE_FILLED/Qwen2.5-Math-7B: init reads the model's config.json"),
    Case("simplerl-reason/train_grpo_math_tune_ray.sh", "fsdp_config.grad_offload: verl has no such key", model_config="Qwen--Qwen2.5-Math-7B.json"),
    Case("simplerl-reason/run_qwen_gsm8k_function_rm_grpo.sh", "but it is 1 (trainer.total_training_steps = 1)"),
    Case("logic-rl/main_grpo.sh", "fsdp_config.grad_offload: verl has no such key", model_config="Qwen--Qwen2.5-7B-Instruct.json"),
    Case("logic-rl/train_ppo_3B_4gpu.sh", "leaves it empty ($BASE_MODEL is not set)"),
    Case("ragen/train_all.sh", "but it runs train.py instead"),
    # written for these tests: the same shapes with keys verl 0.9.1 has
    Case("own/tinyzero_shape.sh", ""),
    Case("own/ray_submit_nohup.sh", ""),
    Case("own/args_and_tabs.sh", ""),
    Case("own/commented_out_lines.sh", "are a command of their own"),
    Case("own/own_config_dir.sh", "must be verl's own config directory"),
]


def play(case: Case, hub: Path, out_dir: Path) -> V.Outcome:
    config = None
    if case.model_config:
        config = next(p for p in (CONFIGS / case.model_config, V.CONFIGS / case.model_config) if p.is_file())
    return V.init_and_validate(case.script, hub, out_dir, root=SCRIPTS, environment=case.environment,
                               model_config=config, n_samples=0)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return V.hf_cache(tmp_path_factory.mktemp("hf"), CONFIGS)


def test_every_script_is_listed() -> None:
    on_disk = sorted(p.relative_to(SCRIPTS).as_posix() for p in SCRIPTS.rglob("*.sh"))
    assert on_disk == sorted({c.script for c in CASES})


@pytest.mark.parametrize("case", CASES, ids=[c.script + (f"+{c.model_config}" if c.model_config else "") for c in CASES])
def test_init_and_validate(case: Case, hub: Path, tmp_path: Path) -> None:
    outcome = play(case, hub, tmp_path)
    if not case.refused_with:
        assert outcome.accepted, outcome.line
        return
    assert not outcome.accepted, f"{case.script} is accepted now: update its case"
    assert "\n" not in outcome.line and case.refused_with in outcome.line, outcome.line
