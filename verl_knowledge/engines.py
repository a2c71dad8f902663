"""Which training engine a verl 0.9.1 config uses, and the facts that differ by engine.

verl 0.9.1 picks the actor/ref/critic configs through the ``model_engine`` config group
(``dp`` = FSDP/FSDP2, ``megatron``, ``veomni``, ``torchtitan``); ``--config-name
ppo_megatron_trainer`` is ``ppo_trainer`` with ``model_engine: megatron``. ``actor.strategy``
then follows the engine (fsdp/fsdp2 under dp). The advantage estimators are verl's own list.
"""

from __future__ import annotations

from typing import Any, Mapping

from verl_sweep.verl_knowledge.keys import MEGATRON_CP, MEGATRON_PP, MEGATRON_TP, MODEL_ENGINE, STRATEGY
from verl_sweep.verl_knowledge.overrides import get

#: the model_engine group's options in verl 0.9.1 (trainer/config/model_engine/*.yaml)
ENGINES = ("dp", "megatron", "veomni", "torchtitan")
#: engines whose layout verl-sweep can search in stage 0 (the systems stages)
SEARCHED_ENGINES = ("dp", "megatron")

#: estimators that compare a response with the others of its prompt's group (rollout.n ≥ 2)
GROUP_ESTIMATORS = frozenset({
    "grpo", "grpo_vectorized", "grpo_passk", "gdpo", "rloo", "rloo_vectorized", "opo", "gpg",
    "reinforce_plus_plus_baseline", "optimal_token_baseline", "tir_optimal_token_baseline",
})
#: the estimator that needs a critic (verl.trainer.ppo.utils.need_critic)
CRITIC_ESTIMATOR = "gae"


def engine(config: Mapping[str, Any]) -> str:
    """The config's training engine: its ``model_engine``, else the one its actor strategy
    names (a strategy alone does not switch verl's config group: the check for that is
    ``engine_problem``), else ``dp``."""
    chosen = get(config, MODEL_ENGINE)
    if isinstance(chosen, str) and chosen in ENGINES:
        return chosen
    strategy = get(config, STRATEGY)
    if isinstance(strategy, str) and strategy in ENGINES[1:]:
        return strategy
    return "dp"


def implied_engine(config: Mapping[str, Any]) -> dict[str, Any]:
    """``model_engine`` for a config that names an engine only by its actor strategy
    (``actor.strategy: megatron``): verl composes the FSDP actor config unless the group is
    chosen, so the study composes (and launches) against the trainer config the strategy uses,
    as ``--config-name ppo_megatron_trainer`` would."""
    strategy = get(config, STRATEGY)
    if get(config, MODEL_ENGINE) is None and isinstance(strategy, str) and strategy in ENGINES[1:]:
        return {MODEL_ENGINE: strategy}
    return {}


def engine_problem(config: Mapping[str, Any]) -> str | None:
    """A strategy that names another engine than the config group composes (verl 0.9.1 then
    fails at compose: ``actor.megatron`` is not in the FSDP actor config), or None."""
    chosen = get(config, MODEL_ENGINE)
    strategy = get(config, STRATEGY)
    if chosen is not None and chosen not in ENGINES:
        return f"{MODEL_ENGINE}={chosen}: must be one of verl's engines {', '.join(ENGINES)}"
    if isinstance(strategy, str) and strategy in ENGINES[1:] and chosen is not None and chosen != strategy:
        return (f"{STRATEGY}={strategy}: needs {MODEL_ENGINE}={strategy}, but the config chooses {MODEL_ENGINE}="
                f"{chosen}, whose actor config has no actor_rollout_ref.actor.{strategy}.*. Make them agree")
    return None


def positive_int(config: Mapping[str, Any], key: str) -> int:
    """The config's count at ``key``; 1 where it is unset or not a count (verl's default)."""
    value = get(config, key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def sequence_split(config: Mapping[str, Any]) -> tuple[int, str]:
    """How many ranks share one sequence under the actor's engine (verl multiplies the dynamic
    batch's ``ppo_max_token_len_per_gpu`` by it: ``workers/engine/utils.py``), and its name:
    Ulysses under FSDP, CP under Megatron, VeOmni's Ulysses, TorchTitan's TP."""
    kind = engine(config)
    if kind == "megatron":
        return positive_int(config, MEGATRON_CP), "Megatron CP"
    if kind == "veomni":
        return positive_int(config, "actor_rollout_ref.actor.veomni.ulysses_parallel_size"), "VeOmni ulysses"
    if kind == "torchtitan":
        return positive_int(config, "actor_rollout_ref.actor.torchtitan.tensor_parallel_size"), "TorchTitan TP"
    legacy = positive_int(config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    return (legacy if legacy > 1 else positive_int(config, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"),
            "ulysses")


def megatron_layout(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """The actor's Megatron (TP, PP, CP); 1 where unset (verl's defaults)."""
    return positive_int(config, MEGATRON_TP), positive_int(config, MEGATRON_PP), positive_int(config, MEGATRON_CP)
