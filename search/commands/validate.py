"""``verl-sweep validate``: the study file, its bounds and the configs its spaces can produce,
checked without launching anything (our rules, then verl's own config and validation)."""

from __future__ import annotations

import logging
from typing import Any

from verl_sweep.launchers import LAUNCHERS
from verl_sweep.search.method.preflight import memory_refusal
from verl_sweep.search.method.stage import Stage, branch_lengths
from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.views.trackers import tracker_lines
from verl_sweep.spaces import SpaceError
from verl_sweep.verl_knowledge import Config, check_config, merge

logger = logging.getLogger(__name__)

#: how many configs per stage are sampled for verl's own validation (besides its two extremes):
#: composed from the baseline with Hydra's override step, ~0.15 s each
N_SAMPLES_PER_STAGE = 8


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
    (the first and last choice of a categorical), each end taken from the range the space
    asks for at that point (a memory floor that depends on the TP chosen before it)."""
    return [merge(base, space.suggest(_CornerTrial(end), base)) for end in (0, -1)]


class _CornerTrial:
    """A trial that answers every question with one end of the range asked: what the space
    proposes at its corners, conditional parameters included."""

    def __init__(self, end: int) -> None:
        self.end = end
        self.params: dict[str, Any] = {}

    def _answer(self, name: str, value: Any) -> Any:
        self.params[name] = value
        return value

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self._answer(name, list(choices)[self.end])

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int:
        return self._answer(name, low if self.end == 0 else low + ((high - low) // step) * step)

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False) -> float:
        return self._answer(name, low if self.end == 0 else high)


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


def baseline_warnings(spec: StudySpec, base: Config) -> list[str]:
    """Baseline values outside the method's safe bounds, one line each. They are accepted (verl's
    own examples start from lr 1e-5, KL 0.02, a memory fraction of 0.25): the stage that tunes
    the knob searches the safe range widened to hold the baseline (``ParamBound.including``),
    so the search starts where the user is and may move into the safe range."""
    from verl_sweep.spaces import SAFE_BOUNDS, token_budget
    from verl_sweep.verl_knowledge import get

    warnings = []
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
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not bound.contains(value) \
                and key not in spec.unsafe_baseline:
            if name == "kl" and value <= 0:
                warnings.append(f"baseline.{key}={value} is KL off in effect; the kl stage tries "
                                f"{bound.describe()} against it")
                continue
            widened = bound.including(value)
            warnings.append(f"baseline.{key}={value} lies outside the safe bound ({bound.describe()}): accepted; the "
                            f"search spans the safe range and the baseline, [{widened.low:g}, {widened.high:g}]")
    tokens = get(base, "actor_rollout_ref.rollout.max_num_batched_tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        limit = token_budget(spec.model, spec.hardware, base)
        if tokens > limit.bound:
            warnings.append(f"baseline.actor_rollout_ref.rollout.max_num_batched_tokens={tokens:,} is above the memory "
                            f"bound {limit.bound:,} verl-sweep estimates: accepted; the token budget stage searches up "
                            "to the baseline")
    return warnings


#: what a refusal of the memory pre-flight tells the user to do
def memory_problems(spec: StudySpec, base: Config, lines: list[str]) -> list[str]:
    """The memory pre-flight of the baseline: its estimate goes to the report lines, and
    ``memory_refusal`` is the problem, on every launcher. A baseline the estimate puts over
    the usable share of the GPU but not beyond what it may reach is a warning (it is the
    user's own run, and verl's own examples run where the estimate says they cannot: LoRA,
    offload and MoE are beyond it); the stages' configs may then reach its peak."""
    from verl_sweep.verl_knowledge import estimate, fit_problem

    found = estimate(spec.model, spec.hardware, base)
    if found is None:
        return []
    lines.append("baseline memory per GPU (estimate):")
    lines += [f"  {line}" for line in found.lines]
    refusal = memory_refusal(spec)
    if refusal is not None:
        return [refusal]
    problem = fit_problem(spec.model, spec.hardware, base)
    if problem is not None:
        lines.append(f"warning: baseline: {problem} (an estimate, over the user's own run: configs up to its peak are "
                     "not refused before launch)")
    return []


def one_line(problems: list[str], study_file: object) -> str:
    """What ``run`` says of a file it refuses: the first problem, and how many more there are
    (``validate`` lists them all, one line each)."""
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more problem{'s' * (more > 1)}: `verl-sweep validate {study_file}` "
                          "lists them)" if more else "")


def validate_study(spec: StudySpec, *, with_verl: bool = True,
                   n_samples: int = N_SAMPLES_PER_STAGE) -> tuple[list[str], list[str]]:
    """Returns (problems, report lines). Problems are one line each; none means valid.

    One cause, one error: a baseline that breaks a rule or that verl refuses is reported alone
    (every stage's configs hold it, so each would repeat it, or fail for its sake). A key verl
    does not have comes first: verl's launcher stops on it before anything else is read, and
    the rules would read the rest of the baseline as verl never would."""
    from verl_sweep.verl_knowledge import doubts, notes, type_problems

    problems: list[str] = []
    lines: list[str] = []
    base = spec.baseline_config()
    unknown = compose_problem(base) if with_verl else None
    if unknown:
        return [f"baseline: verl rejects the config: {unknown}"], lines
    facts: dict[str, Any] = {"model": spec.model, "hardware": spec.hardware, "algorithm": spec.algorithm}
    problems += [f"baseline: {p}" for p in check_config(base, **facts)]
    if problems or type_problems(base):
        return problems, lines
    lines += [f"warning: {w}" for w in baseline_warnings(spec, base)]
    lines += [f"warning: baseline {w}" for w in doubts(base)]
    lines += [f"note: baseline {n} (harmless)" for n in notes(base, algorithm=spec.algorithm)]
    lines += tracker_lines(spec.name, base) if spec.probe.trackers else []
    problems += memory_problems(spec, base, lines)
    if problems:  # the baseline's own: every stage's configs hold it
        return problems, lines
    spaces: list[tuple[int, Any, Any]] = []
    for index, stage in enumerate(spec.stages):
        where = f"stages[{index}]"
        try:
            plan = Stage.of(spec, index)
            space = plan.build_space(base).on_real_gpus(LAUNCHERS[spec.launcher.kind].real_gpus)
        except SpaceError as e:
            problems.append(str(e))
            continue
        problems += [p for p in [plan.probe_length_problem()] if p]
        warning = plan.pruner_reach_warning()
        if warning:
            logger.warning(warning)
        lines.append(f"stage {index + 1} {stage.name} ({stage.space}):")
        lines += [f"  {text}" for text in space.explain()]
        spaces.append((index, stage, space))
    problems += probe_fit_problems(spec, base, spaces, lines)
    problems += train_problems(spec)
    verl = None
    if with_verl and not problems:
        from verl_sweep.verl_knowledge import VerlValidator, verl_available, verl_version

        if verl_available():
            verl = VerlValidator()
        else:
            lines.append("verl is not installed here: checked with verl-sweep's rules only")
    with verl if verl is not None else _no_verl():
        if verl is not None:  # the baseline first: its problem would repeat once per stage config
            refused = verl.validate(base)
            if refused:
                return problems + [f"baseline: verl rejects the config: {p}" for p in refused], lines
        n_checked = 1
        for index, stage, space in spaces:
            where = f"stages[{index}]"
            for config in extreme_configs(space, base) + sample_configs(space, base, n_samples, seed=index):
                problems += [f"{where} ({stage.name}) would produce a config that breaks a rule: {p}"
                             for p in check_config(config, **facts)]
                if verl is not None and not problems:
                    problems += [f"{where} ({stage.name}): verl rejects a config it would produce: {p}"
                                 for p in verl.validate(config)]
                    n_checked += 1
        if verl is not None:
            lines.append(f"checked {n_checked} configs with verl {verl_version()}'s own config and validation "
                         f"(the baseline, each stage's extremes and {n_samples} samples)")
    if not problems:
        from verl_sweep.search.views.plan import plan_lines

        lines += plan_lines(spec, base)
    return sorted(set(problems), key=problems.index), lines


def compose_problem(base: Config) -> str | None:
    """Why verl's Hydra would refuse the baseline's keys, or None (also without verl here, and
    where a config package the baseline names is not here to say which keys it adds)."""
    from verl_sweep.verl_knowledge import VerlValidator, verl_config_available
    from verl_sweep.verl_knowledge import missing_config_packages

    # Hydra and verl's config files alone: a study refused for its own sake later pays no verl import
    if not verl_config_available() or missing_config_packages(base):
        return None
    with VerlValidator() as verl:
        return verl.compose_problem(base)


def probe_fit_problems(spec: StudySpec, base: Config, spaces: list[tuple[int, Any, Any]], lines: list[str]) -> list[str]:
    """Probes as long as the run itself are refused (each would end with the run, and every
    stage would find "no candidate finished"); learning probes over ¼ of it get a warning line."""
    import math

    from verl_sweep.search.method.run_length import MAX_PROBE_FRACTION, run_length

    run = run_length(base)
    if run.steps is None:
        return []
    cap = max(1, math.floor(run.steps * MAX_PROBE_FRACTION))
    problems = []
    for index, stage, space in spaces:
        planned = Stage.of(spec, index)
        steps = planned.probe_steps
        field = f"stages[{index}].probe_steps" if stage.probe_steps else ("probe.steps" if planned.learns else "probe.speed_steps")
        if steps >= run.steps:
            problems.append(f"{field}: probes of stage {stage.name} must be shorter than the run ({run.steps:,} steps: "
                            f"{run.how}), but are {steps:,} steps, each the whole run. Set it ≤ {cap:,} (¼ of the run).")
        elif steps > cap and planned.learns:
            lines.append(f"warning: {field}: stage {stage.name}'s probes ({steps:,} steps) are over ¼ of the run "
                         f"({run.steps:,} steps: {run.how}); a probe should look at the run's start")
    return problems


class _no_verl:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def train_problems(spec: Any) -> list[str]:
    """Train mode trains to the run's end: the run's length must be known, and its learning
    stages' branches must end before it."""
    if spec.train is None:
        return []
    from verl_sweep.search.method.run_length import run_steps_of

    try:
        run_steps = run_steps_of(spec)
    except BadInputError as e:
        return [str(e)]
    branching = branch_lengths(spec)
    if sum(branching) >= run_steps:
        lengths = str(branching[0]) if len(set(branching)) == 1 else "+".join(map(str, branching))
        return [f"train.branch_steps: {len(branching)} learning stages of {lengths} steps reach step "
                f"{sum(branching)}, but the run ends at step {run_steps}: lower branch_steps (or a stage's probe_steps) "
                "or raise run_steps"]
    return []
