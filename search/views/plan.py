"""What a study will do before it runs: the knobs each stage searches, how many probes of how
many steps, and an estimate of their GPU-hours at the baseline's speed, also in R (one full
run of the baseline at that speed: its own length, else 2,000 steps assumed).

The speed is an estimate from the model's size and the tokens a step moves (nothing has run
yet): model FLOPs (6 × active parameters a trained token, 2 × a token each log-prob pass
and generated token) at a fraction of an H100's dense bf16 peak. It is labelled as such
wherever it is printed; the study's own systems stage measures the real speed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep.verl_knowledge import Config, get

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
TRAIN_EFFICIENCY = 0.40  # model FLOPs utilisation of the update and log-prob passes
GENERATION_EFFICIENCY = 0.10  # decoding is bound by memory bandwidth, not FLOPs
MEAN_RESPONSE_FRACTION = 0.5  # a response's mean length as a fraction of the maximum
ACTIVE_EXPERT_FRACTION = 0.1  # of a MoE model's routed experts, the share a token uses
PAYBACK_RUNS = 3  # the full runs a study should pay for itself within
SETTLED_SCORED_STEPS = 3  # a speed probe's usual scored steps before two agree within the tolerance


@dataclasses.dataclass(frozen=True)
class StagePlan:
    name: str
    space: str
    probes: int  # the budget (incumbent runs included)
    confirmations: int  # up to this many re-runs on top
    steps: int
    #: a speed probe's most steps where it ends once its tokens/s settles (``steps`` is then
    #: the usual length), else 0
    most_steps: int = 0
    #: incumbent runs the previous stage already made (same config, seeds and probe length):
    #: copied, not run (``StageStudy.enqueue_initial``)
    carried: int = 0
    #: the probes it runs when its stop rule ends it as early as it can (None: its budget)
    fewest: int | None = None

    @property
    def new(self) -> int:
        """The probes it runs at most, before confirmations: its budget less the carried runs."""
        return self.probes - self.carried


def active_params_b(spec: StudySpec) -> float:
    model = spec.model
    return model.n_params_b - model.expert_params_b * (1 - ACTIVE_EXPERT_FRACTION)


def step_seconds(spec: StudySpec, base: Config) -> tuple[float, str]:
    """An estimated training-step time at the baseline, and how it was estimated."""
    prompts = get(base, "data.train_batch_size", 1024)
    n = get(base, "actor_rollout_ref.rollout.n", 1)
    prompts = prompts if isinstance(prompts, int) and prompts > 0 else 1024
    n = n if isinstance(n, int) and n > 0 else 1
    response = spec.model.max_response_length * MEAN_RESPONSE_FRACTION
    tokens = prompts * n * (spec.model.max_prompt_length + response)
    generated = prompts * n * response
    passes = 6 + 2 + (2 if get(base, "actor_rollout_ref.actor.use_kl_loss") or get(base, "algorithm.use_kl_in_reward") else 0)
    if spec.algorithm.value == "ppo":
        passes += 6 + 2  # the critic's update and values
    active = active_params_b(spec) * 1e9
    gpus = spec.hardware.n_gpus
    train_s = passes * active * tokens / (gpus * PEAK_FLOPS * TRAIN_EFFICIENCY)
    gen_s = 2 * active * generated / (gpus * PEAK_FLOPS * GENERATION_EFFICIENCY)
    how = (f"{prompts:,} prompts × n {n} × ({spec.model.max_prompt_length} + ~{response:.0f} tokens) over {gpus} GPUs, "
           f"{active / 1e9:.3g}B active parameters, {TRAIN_EFFICIENCY:.0%}/{GENERATION_EFFICIENCY:.0%} of an H100's "
           "bf16 peak (training/generation)")
    return train_s + gen_s, how


def stage_plans(spec: StudySpec) -> list[StagePlan]:
    from verl_sweep.search.method.stage import Stage

    plans: list[StagePlan] = []
    repeats = spec.probe.incumbent_repeats
    for index, stage in enumerate(spec.stages):
        plan = Stage.of(spec, index)
        steps, most = plan.probe_steps, 0
        settled = spec.probe.speed_warmup_steps + SETTLED_SCORED_STEPS
        if not plan.learns and spec.probe.speed_settle_tolerance > 0 and settled < steps:
            steps, most = settled, steps
        # A learning stage after another of the same probe length starts from that stage's
        # runs of its winner: the incumbent's runs are carried over, not run again.
        # (Not in train mode: each stage's incumbent branches anew from the chain's checkpoint.)
        carried = repeats if plan.learns and not plan.branches and index > 0 and Stage.of(spec, index - 1).learns \
            and Stage.of(spec, index - 1).probe_steps == plan.probe_steps else 0
        # Its stop rule ends it once that many candidates in a row did not beat the best.
        candidates = stage.budget.max_trials - repeats
        fewest = repeats - carried + min(stage.stop.stable_trials, candidates)
        plans.append(StagePlan(stage.name, stage.space, stage.budget.max_trials,
                               stage.confirm_top * max(0, stage.confirm_max_runs - 1), steps, most, carried,
                               fewest if fewest < stage.budget.max_trials - carried else None))
    return plans


def closing_plan(spec: StudySpec) -> StagePlan | None:
    """What the study runs after its last stage: in search mode, the final check's probes (the
    baseline and the final config on each of its seeds, at the length ``final_probe`` gives;
    None when the study file turns it off); in train mode, the continuation (the chain's config
    from the last branch's end to the run's)."""
    from verl_sweep.objectives.score import Metric
    from verl_sweep.search.engine.final_check import final_probe
    from verl_sweep.search.method.run_length import study_run_length
    from verl_sweep.search.method.stage import branch_lengths
    from verl_sweep.search.spec.study_file import FINAL_STAGE

    if spec.train is not None:
        chain = sum(branch_lengths(spec))
        rest = (study_run_length(spec).steps or 0) - chain
        return StagePlan("train", "the chain's config to the run's end", 1, 0, rest) if rest > 0 else None
    if not spec.final_check.enabled:
        return None
    probe = final_probe(spec)
    what = "final config against the baseline" + ("" if probe.metric is Metric.REWARD_RATE else ", on throughput")
    return StagePlan(FINAL_STAGE, what, 2 * spec.final_check.runs, 0, probe.steps)


def _span(low: float, high: float, fmt: Callable[[float], str]) -> str:
    """"low-high", or one figure where both print the same."""
    a, b = fmt(low), fmt(high)
    return a if a == b else f"{a}-{b}"


def _gpu_h(x: float) -> str:
    return f"{x:,.0f}"


def plan_lines(spec: StudySpec, base: Config) -> list[str]:
    """The lines ``validate`` and ``init`` end with: each stage's probes and estimated
    GPU-hours, the total, each also in R (one full run of the baseline: its own length, else
    2,000 steps assumed, at the same estimated step time: a stage's R is its probes' steps ÷
    the run's, whatever the step time)."""
    from verl_sweep.search.method.run_length import study_run_length
    from verl_sweep.search.views.status import r_number

    plans = stage_plans(spec)
    if not plans:
        return ["no stage to run"]
    final = closing_plan(spec)
    if final is not None:
        plans.append(final)
    step_s, how = step_seconds(spec, base)
    gpus = spec.hardware.n_gpus
    run = study_run_length(spec)
    r_steps = run.steps or 1  # never None: full_run_length assumes 2,000 steps for an unknown run

    def hours(steps: int) -> float:
        return steps * step_s * gpus / 3600

    length = (f"{r_steps:,} steps assumed (set run_steps: learning probes are judged over the run)" if run.assumed
              else f"{r_steps:,} steps ({run.how})")
    lines = [f"plan: R is one full run of the baseline: {length}, ~{_gpu_h(hours(r_steps))} GPU-h at ~{step_s:.0f} s a step"]
    for p in plans:
        low, high = _low(p) * p.steps, (p.new + p.confirmations) * p.steps
        more = f" (+ up to {p.confirmations} confirmation run{'s' * (p.confirmations != 1)})" if p.confirmations else ""
        steps = f"~{p.steps} steps (until tokens/s settles, ≤{p.most_steps})" if p.most_steps else f"{p.steps} steps"
        count = f"{p.fewest}-{p.new}" if p.fewest is not None else f"{p.new}"
        carried = f" and {p.carried} incumbent runs carried over" if p.carried else ""
        lines.append(f"plan: {p.name} ({p.space}) {count} probe{'s' * (count != '1')} × {steps}{more}{carried}: "
                     f"~{_span(hours(low), hours(high), _gpu_h)} GPU-h = {_span(low / r_steps, high / r_steps, r_number)} R")
    if final is None and spec.train is None:
        lines.append("plan: no final check (final_check: false): the overall gain against the baseline is not measured")
    probes = sum(p.new for p in plans)
    confirmations = sum(p.confirmations for p in plans)
    low = sum(_low(p) * p.steps for p in plans)
    high = sum((p.new + p.confirmations) * p.steps for p in plans)
    lines.append(f"plan: up to {probes} probes (+ {confirmations} confirmation runs) on {gpus} GPUs each: "
                 f"ESTIMATE {_gpu_h(hours(low))}-{_gpu_h(hours(high))} GPU-hours = "
                 f"{_span(low / r_steps, high / r_steps, r_number)} R at ~{step_s:.0f} s a step "
                 f"(R: {r_steps:,} steps{' assumed' if run.assumed else ''})")
    if spec.train is None:
        lines.append(payback_line(low / r_steps, PAYBACK_RUNS))
    else:
        cap = spec.train.max_cost_r
        total = f"{_span(low / r_steps, high / r_steps, r_number)} R at the baseline's speed"
        lines.append("plan: train mode: the study is the run, " + (f"{total} all told" if cap is None else
                     f"at most ~{cap:g} R all told (train.max_cost_r: a learning stage runs what room is left, or is "
                     f"skipped; {total} without the cap)") + ", against one run of the baseline")
    lines.append(f"plan: ~{step_s:.0f} s a step is an estimate: {how}")
    lines.append("plan: learning probes are priced at the baseline's speed: they run at the speed the speed stages "
                 "find, and pruning stops many early")
    return lines


def _low(plan: StagePlan) -> int:
    """The probes a stage runs at the least: as few as its stop rule allows."""
    return plan.fewest if plan.fewest is not None else plan.new


def eta_to_pay_back(cost_r: float, runs: int) -> float | None:
    """The gain η at which a study of ``cost_r`` full runs pays for itself within ``runs`` full
    runs (each saves R × (1 − 1/η)), or None where no gain can: the study costs ≥ ``runs`` R."""
    if cost_r >= runs:
        return None
    return 1.0 / (1.0 - cost_r / runs)


def payback_line(cost_r: float, runs: int) -> str:
    """What the study must find to pay for itself within ``runs`` full runs, at its lower estimate."""
    from verl_sweep.search.views.status import r_number

    eta = eta_to_pay_back(cost_r, runs)
    if eta is None:
        return (f"plan: payback: at {r_number(cost_r)} R no gain pays the study back within {runs} full runs "
                f"(each saves under 1 R)")
    return (f"plan: payback: within {runs} full runs if the winner reaches η ≥ {eta:.2f} "
            f"(each run then saves ≥ {r_number(cost_r / runs)} R)")
