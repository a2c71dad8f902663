"""Override parsing and verl-style config checks for the simulated verl process.

Kept to the standard library plus ``yaml`` because thousands of simulated probes start in
tests. Config dicts are flat: dotted verl key → value, ``+``/``++`` prefixes kept as given.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

# verl 0.9.1 defaults of every key the simulator reads (from _generated_ppo_trainer.yaml), so
# the dynamics do not depend on whether verl is installed. A copy of verl_knowledge's table on
# purpose: the simulator stands in for verl, so verl-sweep's own table must not decide what it runs.
DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "algorithm.lam": 1.0,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.seed": None,
    "actor_rollout_ref.nccl_timeout": 600,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.strategy": "fsdp",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": 1,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": False,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.enable_activation_offload": False,
    "actor_rollout_ref.rollout.name": "???",
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.max_num_batched_tokens": 8192,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.data_parallel_size": 1,
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
    "trainer.total_training_steps": None,
    "trainer.total_epochs": 30,
    "trainer.logger": ["console", "wandb"],
    "trainer.val_before_train": True,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.save_freq": -1,
    "trainer.resume_mode": "auto",
    "trainer.resume_from_path": None,
    "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
}

ROLLOUT_NAMES = ("vllm", "sglang", "trtllm")
ADV_ESTIMATORS = (
    "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo",
    "opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
    "tir_optimal_token_baseline", "gdpo",
)  # fmt: skip
LOGGER_PATH_KEY = "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"


class ConfigError(Exception):
    """A config verl would refuse (at compose time or when its workers start)."""


def parse_override(item: str) -> tuple[str, Any]:
    """``"key=value"`` → (key, value), typing the value the way Hydra's grammar does."""
    if "=" not in item:
        raise ConfigError(f"Error parsing override '{item}': expected key=value")
    key, raw = item.split("=", 1)
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return key, raw[1:-1].replace("\\'", "'").replace("\\\\", "\\")
    value = _yaml_value(raw) if raw else ""
    # The cache hands every caller the same object: a list or a map is copied (scalars cannot change).
    return key, copy.deepcopy(value) if isinstance(value, (list, dict, set)) else value


@functools.lru_cache(maxsize=4096)
def _yaml_value(raw: str) -> Any:
    """A value typed by YAML, remembered: a replayed benchmark parses the same few hundred
    override values for every probe (a YAML parse is ~0.1 ms; 4,000 a repetition)."""
    import yaml

    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """An argv override list → flat config (later items win, ``+`` prefixes kept)."""
    config: dict[str, Any] = {}
    for item in items:
        key, value = parse_override(item)
        for existing in [k for k in config if k.lstrip("+") == key.lstrip("+")]:
            del config[existing]
        config[key] = value
    return config


def get(config: Mapping[str, Any], key: str) -> Any:
    """The value of a dotted key: given (with or without ``+``) or verl's default."""
    for k in (key, "+" + key, "++" + key):
        if k in config:
            return config[k]
    return DEFAULTS.get(key)


def verl_config_path() -> Path | None:
    """verl's generated trainer config, found without importing verl (which takes seconds)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "trainer/config/_generated_ppo_trainer.yaml"
    return path if path.is_file() else None


def _load_verl_tree() -> dict[str, Any] | None:
    if os.environ.get("VERL_SIM_SKIP_KEY_CHECK") == "1":
        return None
    path = verl_config_path()
    return None if path is None else _verl_tree_at(path)


@functools.lru_cache(maxsize=2)
def _verl_tree_at(path: Path) -> dict[str, Any] | None:
    """Read once a process: the replay launcher checks every run's keys (5 ms a parse)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as f:
        tree = yaml.load(f, Loader=loader)
    return tree if isinstance(tree, dict) else None


def _lookup(tree: Mapping[str, Any], dotted: str) -> tuple[bool, bool]:
    """(exists, parent_is_mapping) for a dotted key in a nested config tree."""
    node: Any = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping):
            return False, False
        if part not in node:
            return False, i == len(parts) - 1
        node = node[part]
    return True, True


def check_keys(config: Mapping[str, Any]) -> None:
    """Hydra's compose-time rules against verl's real config (skipped when verl is absent)."""
    tree = _load_verl_tree()
    if tree is None:
        return
    for key in config:
        bare = key.lstrip("+")
        if bare.startswith("hydra.") or key.startswith("~"):
            continue
        exists, _ = _lookup(tree, bare)
        if key.startswith("++"):
            continue
        if key.startswith("+"):
            if exists:
                raise ConfigError(
                    f"Could not append to config. An item is already at '{bare}'."
                )
            continue
        if not exists:
            leaf = bare.rsplit(".", 1)[-1]
            raise ConfigError(
                f"Could not override '{bare}'.\nTo append to your config use +{bare}=...\n"
                f"Key '{leaf}' is not in struct\n    full_key: {bare}\n    object_type=dict"
            )


def check_config(config: Mapping[str, Any]) -> None:
    """Every check verl makes before (or just as) its workers start; raises ``ConfigError``."""
    check_keys(config)
    name = get(config, "actor_rollout_ref.rollout.name")
    if name in (None, "???"):
        raise ConfigError(
            "Missing mandatory value: actor_rollout_ref.rollout.name\n"
            "    full_key: actor_rollout_ref.rollout.name"
        )
    if name not in ROLLOUT_NAMES:
        raise ConfigError(
            f"ValueError: Unknown rollout name {name!r}; supported: {', '.join(ROLLOUT_NAMES)}"
        )
    adv = get(config, "algorithm.adv_estimator")
    if adv not in ADV_ESTIMATORS:
        raise ConfigError(f"NotImplementedError: Unknown advantage estimator: {adv}")
    n = _int(config, "actor_rollout_ref.rollout.n")
    if n < 1 or (adv == "grpo" and n < 2):
        raise ConfigError(
            f"AssertionError: GRPO needs actor_rollout_ref.rollout.n >= 2 (a group per prompt), got {n}"
        )
    mem = _num(config, "actor_rollout_ref.rollout.gpu_memory_utilization")
    if not 0.0 < mem <= 1.0:
        raise ConfigError(
            f"ValueError: gpu_memory_utilization must be in (0, 1], got {mem}"
        )
    n_gpus = _int(config, "trainer.n_gpus_per_node") * _int(config, "trainer.nnodes")
    tp, dp, pp = (
        _int(config, f"actor_rollout_ref.rollout.{k}_size")
        for k in ("tensor_model_parallel", "data_parallel", "pipeline_model_parallel")
    )
    if n_gpus < 1 or tp < 1 or dp < 1 or pp < 1 or n_gpus % (tp * dp * pp):
        raise ConfigError(
            f"AssertionError: rollout world size {tp}*{dp}*{pp} (tp*dp*pp) must divide the "
            f"{n_gpus} GPUs (trainer.n_gpus_per_node * trainer.nnodes)"
        )
    batch = _int(config, "data.train_batch_size")
    mini = _int(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    if mini < 1 or batch < mini:
        raise ConfigError(
            f"AssertionError: train_batch_size ({batch}) must be >= ppo_mini_batch_size ({mini})"
        )
    sp = _int(config, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size")
    if sp < 1 or n_gpus % sp:
        raise ConfigError(
            f"AssertionError: ulysses_sequence_parallel_size ({sp}) must divide the {n_gpus} GPUs"
        )
    per_gpu = mini * n // (n_gpus // sp)  # verl: mini × n ÷ data-parallel ranks, floored
    if per_gpu < 1:
        raise ConfigError(
            f"AssertionError: ppo_mini_batch_size ({mini}) * rollout.n ({n}) // "
            f"{n_gpus // sp} data-parallel ranks must be > 0, got {per_gpu}"
        )
    micro = get(config, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    dynamic = bool(get(config, "actor_rollout_ref.actor.use_dynamic_bsz"))
    if micro is not None and not dynamic:
        if int(micro) < 1 or per_gpu % int(micro):
            raise ConfigError(
                f"AssertionError: ppo_mini_batch_size per GPU ({per_gpu}) must be divisible by "
                f"ppo_micro_batch_size_per_gpu ({micro})"
            )
    if (get(config, "algorithm.kl_ctrl.type") == "adaptive"
            and _num(config, "algorithm.kl_ctrl.horizon") <= 0):  # fmt: skip
        raise ConfigError("AssertionError: horizon must be larger than 0")
    for key in ("actor_rollout_ref.rollout.max_num_batched_tokens", "actor_rollout_ref.actor.optim.lr"):
        if _num(config, key) <= 0:
            raise ConfigError(f"ValueError: {key} must be > 0, got {get(config, key)}")
    steps = get(config, "trainer.total_training_steps")
    if steps is not None and int(steps) < 1:
        raise ConfigError(f"ValueError: trainer.total_training_steps must be >= 1, got {steps}")


def _num(config: Mapping[str, Any], key: str) -> float:
    value = get(config, key)
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"ValueError: {key} must be a number, got {value!r}") from e


def _int(config: Mapping[str, Any], key: str) -> int:
    value = _num(config, key)
    if value != int(value):
        raise ConfigError(f"ValueError: {key} must be an integer, got {value!r}")
    return int(value)


def logger_path(config: Mapping[str, Any]) -> str | None:
    """Where verl's file logger writes: the Ray env-var override, else the process env."""
    loggers = get(config, "trainer.logger")
    if isinstance(loggers, str):
        loggers = [loggers]
    if "file" not in (loggers or []):
        return None
    path = get(config, LOGGER_PATH_KEY)
    return str(path) if path else os.environ.get("VERL_FILE_LOGGER_PATH")
