"""Every config the default stages can produce is accepted by the real verl 0.9.1; bad ones are not."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import optuna
import pytest

from verl_sweep.spaces import build_space
from verl_sweep import verl_knowledge as L
from verl_sweep.verl_knowledge import Algorithm, HardwareFacts, ModelFacts
from verl_sweep.verl_knowledge import merge
from verl_sweep.verl_knowledge import VerlValidator, key_for, validate_with_verl, verl_available, verl_version

# Before verl (and huggingface_hub) is imported: nothing in these tests may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.verl, pytest.mark.timeout(180)]
optuna.logging.set_verbosity(optuna.logging.WARNING)

needs_verl = pytest.mark.skipif(not verl_available(), reason="verl is not installed")

MODEL = ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7)
HARDWARE = HardwareFacts(gpus_per_node=8, gpu_memory_gb=80)


def make_tiny_model(directory: Path) -> Path:
    """A model directory verl's critic check can read offline: config.json + a WordLevel tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"w{i}": 4 + i for i in range(60)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 4096,
    }))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 4096,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
    }))
    return directory


@pytest.fixture(scope="module")
def validator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VerlValidator, str]]:
    if not verl_available():
        pytest.skip("verl is not installed")
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    with VerlValidator() as v:
        yield v, str(model_dir)


def grpo_base(model_dir: str) -> dict[str, Any]:
    """Like the demo study: 7B, 8×80 GB, GRPO n=4, train batch 1024, mini 256."""
    return {
        "trainer.n_gpus_per_node": 8,
        "trainer.nnodes": 1,
        "actor_rollout_ref.model.path": model_dir,
        "critic.model.path": model_dir,
        L.ROLLOUT_NAME: "vllm",
        L.ADV_ESTIMATOR: "grpo",
        L.ROLLOUT_N: 4,
        L.TRAIN_BATCH: 1024,
        L.MINI_BATCH: 256,
        L.MICRO_BATCH: 4,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 8,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 8,
        L.ROLLOUT_TP: 4,
        L.GPU_MEMORY: 0.6,
        L.MAX_PROMPT: 1024,
        L.MAX_RESPONSE: 1024,
    }


def ppo_base(model_dir: str) -> dict[str, Any]:
    return merge(grpo_base(model_dir), {
        L.ADV_ESTIMATOR: "gae", L.ROLLOUT_N: 1, "critic.ppo_micro_batch_size_per_gpu": 4,
    })


def stage_configs(kind: str, algorithm: Algorithm, base: dict[str, Any], n_samples: int) -> list[dict[str, Any]]:
    """Every discrete choice of the stage (enumerated) plus sampled continuous values."""
    space = build_space(kind, model=MODEL, hardware=HARDWARE, algorithm=algorithm, base=base, options={})
    configs: list[dict[str, Any]] = []
    if kind == "mini_batch":
        configs = [space.suggest(optuna.trial.FixedTrial({"mini_batch": m}), base) for m in space.choices]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    for _ in range(n_samples):
        trial = study.ask()
        configs.append(space.suggest(trial, base))
        study.tell(trial, 0.0)
    unique = {json.dumps(c, sort_keys=True): c for c in configs}
    return [merge(base, c) for c in unique.values()]


@needs_verl
def test_every_default_stage_config_is_accepted_grpo(validator: tuple[VerlValidator, str]) -> None:
    v, model_dir = validator
    base = grpo_base(model_dir)
    configs = [base]
    for kind, n in (("systems", 24), ("mini_batch", 0), ("kl", 3), ("token_budget", 3), ("lr", 3), ("polish", 3)):
        configs += stage_configs(kind, Algorithm.GRPO, base, n)
    for config in configs:
        assert L.check_config(config, model=MODEL, hardware=HARDWARE, algorithm=Algorithm.GRPO) == [], config
        assert v.validate(config) == [], config
    assert len(configs) >= 40


@needs_verl
def test_every_default_stage_config_is_accepted_ppo(validator: tuple[VerlValidator, str]) -> None:
    v, model_dir = validator
    base = ppo_base(model_dir)
    configs = [base]
    for kind, n in (("mini_batch", 0), ("kl", 8), ("lam", 3), ("lr", 2), ("polish", 2)):
        configs += stage_configs(kind, Algorithm.PPO, base, n)
    assert {c.get(L.KL_CTRL_TYPE) for c in configs} >= {"fixed", "adaptive"}
    for config in configs:
        assert L.check_config(config, model=MODEL, hardware=HARDWARE, algorithm=Algorithm.PPO) == [], config
        assert v.validate(config) == [], config


BAD = [
    ("unknown key", {"actor_rollout_ref.actor.optim.learning_rate": 1e-6}, r"optim\.learning_rate: verl has no key 'learning_rate' under actor_rollout_ref\.actor\.optim", None),
    ("typo", {"actor_rollout_ref.actor.ppo_mini_batch_sizee": 256}, r"did you mean `ppo_mini_batch_size`\?", None),
    ("+key on a key verl has", {"+actor_rollout_ref.actor.optim.lr": 1e-6}, r"the \+ adds a key, but verl already has actor_rollout_ref\.actor\.optim\.lr .*Write actor_rollout_ref\.actor\.optim\.lr without the \+", None),
    ("mini > train", {L.MINI_BATCH: 2048}, r"train_batch_size \(1024\) must be >= actor\.ppo_mini_batch_size \(2048\)", r"must be ≤ data\.train_batch_size"),
    ("micro missing", {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None}, r"Please set at least one of 'actor_rollout_ref\.rollout\.log_prob_micro_batch_size'", None),
    ("unknown estimator", {L.ADV_ESTIMATOR: "grpoo"}, r"Unknown advantage estimator simply: grpoo", r"must be one of verl's estimators"),
    ("adaptive horizon 0", {L.ADV_ESTIMATOR: "gae", "critic.ppo_micro_batch_size_per_gpu": 4, L.USE_KL_IN_REWARD: True, L.KL_CTRL_TYPE: "adaptive", L.KL_CTRL_HORIZON: 0}, r"horizon must be larger than 0", r"needs horizon > 0"),
    ("ulysses without remove padding", {L.ULYSSES_LEGACY: 2, L.USE_REMOVE_PADDING: False}, r"you must enable `use_remove_padding`", r"needs .*use_remove_padding=true"),
    ("GRPO n=1: verl runs it (a warning of ours)", {L.ROLLOUT_N: 1}, None, None),
    ("memory fraction 1.5: only ours", {L.GPU_MEMORY: 1.5}, None, r"must lie in \(0, 1\]"),
]


@needs_verl
@pytest.mark.parametrize("name, changes, verl_says, we_say", BAD, ids=[b[0] for b in BAD])
def test_bad_configs_are_rejected(
    validator: tuple[VerlValidator, str], name: str, changes: dict[str, Any], verl_says: str | None, we_say: str | None,
) -> None:
    v, model_dir = validator
    config = merge(grpo_base(model_dir), changes)
    algorithm = Algorithm.PPO if config[L.ADV_ESTIMATOR] == "gae" else Algorithm.GRPO
    ours = L.check_config(config, model=MODEL, hardware=HARDWARE, algorithm=algorithm)
    theirs = v.validate(config)
    assert not any("To append" in p for p in theirs)  # never Hydra's advice to add a +
    if verl_says is not None:
        assert len(theirs) == 1 and __import__("re").search(verl_says, theirs[0]), theirs
    else:
        assert theirs == []  # verl only finds these on the GPU: that is why check_config exists
    if we_say is not None:
        assert any(__import__("re").search(we_say, p) for p in ours), ours


@needs_verl
def test_validate_with_verl_one_shot(tmp_path: Path) -> None:
    base = grpo_base(str(make_tiny_model(tmp_path / "m")))
    assert validate_with_verl(base) == []
    assert validate_with_verl(merge(base, {L.MINI_BATCH: 4096}))


def test_version_and_moved_keys() -> None:
    if verl_available():
        assert verl_version() == "0.9.1"
    assert key_for("grad_clip", "0.7.2") == "actor_rollout_ref.actor.grad_clip"
    assert key_for("grad_clip", "0.9.1") == "actor_rollout_ref.actor.optim.clip_grad"
    assert key_for("lr_scheduler", "0.5.0") == "actor_rollout_ref.actor.optim.warmup_style"
    assert key_for("lr_scheduler", "0.9.1") == "actor_rollout_ref.actor.optim.lr_scheduler_type"
    assert key_for("reward_manager", "0.7.0") == "reward_model.reward_manager"
    assert key_for("reward_manager", "0.7.1") == "reward.reward_manager.name"
    assert key_for("reward_function_path", "0.10.0rc1") == "reward.custom_reward_function.path"
    with pytest.raises(KeyError, match=r"name must be one of .*, but got 'clip'"):
        key_for("clip")


TEMPLATE_CASES = [
    (ModelFacts(hidden_size=4096, num_attention_heads=32, n_params_b=7), HardwareFacts(gpus_per_node=8, gpu_memory_gb=80), Algorithm.GRPO, "fsdp-small"),
    (ModelFacts(hidden_size=5120, num_attention_heads=40, n_params_b=14), HardwareFacts(gpus_per_node=8, gpu_memory_gb=80), Algorithm.PPO, "fsdp-offload"),
    (ModelFacts(hidden_size=5120, num_attention_heads=40, n_params_b=32), HardwareFacts(gpus_per_node=8, nodes=2, gpu_memory_gb=80), Algorithm.GRPO, "megatron"),
]


@needs_verl
@pytest.mark.parametrize("model, hardware, algorithm, name", TEMPLATE_CASES, ids=[c[3] for c in TEMPLATE_CASES])
def test_templates_compose_and_validate(
    validator: tuple[VerlValidator, str], model: ModelFacts, hardware: HardwareFacts, algorithm: Algorithm, name: str,
) -> None:
    from verl_sweep.verl_knowledge import CRITIC_MICRO, template_for

    v, model_dir = validator
    template = template_for(model, hardware, algorithm)
    assert template.name == name
    config = merge(template.config, {"actor_rollout_ref.model.path": model_dir, "critic.model.path": model_dir,
                                     L.TRAIN_BATCH: 1024, L.MINI_BATCH: 256})
    if algorithm is Algorithm.PPO:
        config[CRITIC_MICRO] = 4
    assert L.check_config(config, model=model, hardware=hardware, algorithm=algorithm) == []
    assert v.validate(config) == [], config


@needs_verl
def test_plus_keys_behave_as_in_verl(validator: tuple[VerlValidator, str]) -> None:
    """Hydra 1.3.8's own rules, as verl's launcher applies them: `+key` adds a key; on a key verl
    leaves null it sets it; a mapping merges into verl's node; on a key with a value it is an
    error (one line, saying to drop the +), never Hydra's advice."""
    v, model_dir = validator
    base = grpo_base(model_dir)
    assert v.validate(merge(base, {"+actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend": "FLASH_ATTN"})) == []
    assert v.validate(merge(base, {"+ray_kwargs.ray_init.num_cpus": 16})) == []  # null in verl: set
    assert v.validate(merge(base, {"+actor_rollout_ref.rollout.engine_kwargs.sglang": {"attention_backend": "fa3",
                                                                                        "mem_fraction": 0.5}})) == []
    [problem] = v.validate(merge(base, {"+actor_rollout_ref.actor.optim.lr": 2e-6}))
    assert problem.startswith("+actor_rollout_ref.actor.optim.lr: the + adds a key, but verl already has") and "To append" not in problem


@needs_verl
def test_a_string_setting_takes_no_mapping(validator: tuple[VerlValidator, str]) -> None:
    """A mapping where verl's default is a string is refused; a list is not (data.train_files
    takes several files)."""
    v, model_dir = validator
    base = grpo_base(model_dir)
    files = "/data/gsm8k/train.parquet"
    assert v.validate(merge(base, {"data.train_files": [files, files]})) == []
    [problem] = v.validate(merge(base, {"data.train_files": {"a": files}}))
    assert problem.startswith("data.train_files: must be a single value")
    [problem] = v.validate(merge(base, {"actor_rollout_ref.model.path": {}}))
    assert problem.startswith("actor_rollout_ref.model.path: must be a single value")


@needs_verl
def test_a_hugging_face_id_is_never_looked_up_on_the_network(validator: tuple[VerlValidator, str]) -> None:
    """verl's critic check reads the critic model's config and tokenizer; an id that is no
    local directory is checked against a local stand-in, offline, with the config's own sizes."""
    v, model_dir = validator
    config = merge(ppo_base(model_dir), {"critic.model.path": "Some-Org/Not-Here-7B",
                                         "actor_rollout_ref.model.path": "Some-Org/Not-Here-7B"})
    assert v.validate(config) == []
    [problem] = v.validate(merge(config, {"critic.ppo_micro_batch_size_per_gpu": None}))
    assert "critic" in problem and "micro_batch" in problem  # the critic's own check still runs
