"""``verl-sweep validate``: the study file, its bounds and the configs its spaces can produce,
checked without launching anything (our rules, then verl's own config and validation)."""

from __future__ import annotations

import logging
from typing import Any

from launchers import LAUNCHERS
from search.stage import Stage
from search.study_file import StudySpec
from spaces import SpaceError, build_space, check_config
from spaces.overrides import Config, merge

logger = logging.getLogger(__name__)

#: how many configs per stage are sampled for verl's own validation (besides its two extremes)
N_SAMPLES_PER_STAGE = 2


def sample_configs(space: Any, base: Config, n: int, seed: int = 0) -> list[Config]:
    """Configs the space can produce: Optuna's RandomSampler over the space, in memory."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs = []
    for _ in range(n):
        trial = study.ask()
        configs.append(merge(base, space.suggest(trial, base)))
        study.tell(trial, 0.0)
    return configs


def extreme_configs(space: Any, base: Config) -> list[Config]:
    """The space's corners: every parameter at its low end, then every one at its high end
    (the first and last choice of a categorical). Parameters that only some draws suggest
    are left to the samples."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    space.suggest(trial, base)
    distributions = dict(trial.distributions)
    study.tell(trial, 0.0)
    configs = []
    for end in (0, -1):
        params = {name: _end(distribution, end) for name, distribution in distributions.items()}
        try:
            configs.append(merge(base, space.suggest(optuna.trial.FixedTrial(params), base)))
        except (KeyError, ValueError):  # a parameter this corner needs that the first draw did not
            continue
    return configs


def _end(distribution: Any, end: int) -> Any:
    import optuna.distributions as d

    if isinstance(distribution, d.CategoricalDistribution):
        return distribution.choices[end]
    if end == 0:
        return distribution.low
    step = getattr(distribution, "step", None)
    if step:  # the last value on the grid
        return distribution.low + ((distribution.high - distribution.low) // step) * step
    return distribution.high


#: baseline keys held to the method's safe bounds (the KL key is checked where it is switched on)
_BASELINE_BOUNDS = {
    "actor_rollout_ref.actor.optim.lr": "lr",
    "algorithm.lam": "lam",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "gpu_memory_utilization",
}


def probes_per_gpu(spec: StudySpec) -> int:
    """How many probes share one GPU (the launcher's ``probes_per_gpu`` option where it has one,
    the local launcher's; 1 elsewhere)."""
    value = spec.launcher.options.get("probes_per_gpu", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def baseline_problems(spec: StudySpec, base: Config) -> list[str]:
    """Baseline values outside the safe bounds, and a token budget above the memory bound."""
    from spaces import SAFE_BOUNDS, token_budget
    from spaces.overrides import get

    problems = []
    keys = dict(_BASELINE_BOUNDS)
    if get(base, "actor_rollout_ref.actor.use_kl_loss"):
        keys["actor_rollout_ref.actor.kl_loss_coef"] = "kl"
    if get(base, "algorithm.use_kl_in_reward"):
        keys["algorithm.kl_ctrl.kl_coef"] = "kl"
    for key, name in keys.items():
        value = get(base, key)
        bound = SAFE_BOUNDS[name]
        if key == "algorithm.lam" and spec.algorithm.adv_estimator != "gae":
            continue
        if name == "gpu_memory_utilization":
            bound = bound.shared(probes_per_gpu(spec))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not bound.contains(value):
            if key in spec.unsafe_baseline:
                logger.warning("baseline.%s=%s lies outside the safe bound (%s); allowed by unsafe_baseline",
                               key, value, bound.describe())
                continue
            problems.append(f"baseline.{key}: must be within the safe bound ({bound.describe()}), but got {value}. "
                            "Start from a safe baseline.")
    tokens = get(base, "actor_rollout_ref.rollout.max_num_batched_tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        limit = token_budget(spec.model, spec.hardware, base)
        if tokens > limit.bound:
            problems.append(f"baseline.actor_rollout_ref.rollout.max_num_batched_tokens: must be ≤ the memory bound "
                            f"{limit.bound} (see `verl-sweep validate` for the arithmetic), but got {tokens}. Lower it.")
    return problems


def memory_problems(spec: StudySpec, base: Config, lines: list[str]) -> list[str]:
    """The memory pre-flight of the baseline: its estimate goes to the report lines; on real
    GPUs a baseline whose estimated peak cannot fit is refused with the arithmetic (on a
    simulator, only shown)."""
    from spaces.memory import estimate, fit_problem

    found = estimate(spec.model, spec.hardware, base)
    if found is None:
        return []
    lines.append("baseline memory per GPU (estimate):")
    lines += [f"  {line}" for line in found.lines]
    problem = fit_problem(spec.model, spec.hardware, base)
    if problem is None or not LAUNCHERS[spec.launcher.kind].real_gpus:  # a simulator decides its own OOMs
        return []
    return [f"baseline: {problem}. Lower the memory fraction or the micro-batch, switch gradient checkpointing "
            "or offload on, or declare larger GPUs."]


def one_line(problems: list[str], study_file: object) -> str:
    """What ``run`` says of a file it refuses: the first problem, and how many more there are
    (``validate`` lists them all, one line each)."""
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more problem{'s' * (more > 1)}: `verl-sweep validate {study_file}` "
                          "lists them)" if more else "")


def validate_study(spec: StudySpec, *, with_verl: bool = True) -> tuple[list[str], list[str]]:
    """Returns (problems, report lines). Problems are one line each; none means valid."""
    problems: list[str] = []
    lines: list[str] = []
    base = spec.baseline_config()
    facts: dict[str, Any] = {"model": spec.model, "hardware": spec.hardware, "algorithm": spec.algorithm}
    base_rules = check_config(base, **facts)
    problems += [f"baseline: {p}" for p in base_rules]
    from spaces.limits import type_problems

    if type_problems(base):  # the spaces compute with these values too: nothing more to check
        return problems, lines
    problems += baseline_problems(spec, base)
    problems += memory_problems(spec, base, lines)
    configs: list[tuple[str, Config]] = [("baseline", base)]
    for index, stage in enumerate(spec.stages):
        where = f"stages[{index}]"
        try:
            plan = Stage.of(spec, index)
            space = plan.build_space(base)
        except SpaceError as e:
            problems.append(str(e))
            continue
        problems += [p for p in [plan.probe_length_problem()] if p]
        warning = plan.pruner_reach_warning()
        if warning:
            logger.warning(warning)
        lines.append(f"stage {index + 1} {stage.name} ({stage.space}):")
        lines += [f"  {text}" for text in space.explain()]
        for config in extreme_configs(space, base) + sample_configs(space, base, N_SAMPLES_PER_STAGE, seed=index):
            for p in check_config(config, **facts):
                if p in base_rules:
                    continue  # the baseline's own problem, reported once
                problems.append(f"{where} ({stage.name}) would produce a config that breaks a rule: {p}")
            configs.append((stage.name, config))
    if with_verl and not problems:
        from spaces import verl_check

        if verl_check.verl_available():
            lines.append(f"checking {len(configs)} configs with verl {verl_check.verl_version()}'s own config and validation")
            # One Hydra initialisation for all of them; the baseline first: every stage's
            # configs hold it, so its problems would repeat once per stage.
            with verl_check.VerlValidator() as validator:
                for label, config in configs:
                    problems += [f"{label}: verl rejects the config: {p}" for p in validator.validate(config)]
                    if problems and label == "baseline":
                        break
        else:
            lines.append("verl is not installed here: checked with verl-sweep's rules only")
    return sorted(set(problems), key=problems.index), lines
