"""The peers that get verl-sweep's head start: the study's baseline and the method's bounds.

Each searches :class:`benchmarks.joint.FairJointSpace` (the same space, GPU-hour budget,
probes and noise as :mod:`benchmarks.peers`) and starts from the study's baseline:

- ``priorband``: NePS's PriorBand (``neps.algorithms.priorband``, Hyperband brackets, η 3)
  with the baseline as the prior of every parameter, at confidence "medium" (a truncated
  normal of standard deviation 0.5 on each parameter's unit range, NePS's
  ``PRIOR_CONFIDENCE_MAPPING``), and the prior evaluated first at full fidelity
  (``sample_prior_first="highest_fidelity"``). Its fidelity is the probe length (50 → 500
  steps), as DEHB's. Why "medium": the baseline is the config a user runs, not a tuned one;
  the bounds are the method's (±25% around the baseline's mini-batch, lr 5e-7 - 5e-6), and
  a best config may lie far from the baseline in a parameter's unit range (lr at the upper
  end, KL switched on, memory fraction high: docs/method.md, Evidence). A standard deviation
  of 0.25 ("high") would leave most of them in the tails; 0.75 ("low") is close to uniform and
  would throw the head start away.
- ``asha`` / ``st-bohb``: Syne Tune's ASHA (random search) or BOHB (kernel density
  estimates) on the running reward rate, reported every ``REPORT_EVERY`` steps, rungs from 50
  steps (η 3), the baseline in ``points_to_evaluate`` (evaluated first).
- ``optuna-gp``: one joint Optuna study with ``GPSampler``, the baseline enqueued first, and
  ``HyperbandPruner`` on the running rate (min 50 steps, η 3): the ablation of staging itself.

The choice reported at each point is the peer's best full-length (500-step) probe so far.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Literal

from benchmarks.joint import FairJointSpace, Param, cs_value as _cs
from benchmarks.peers import MIN_STEPS, BudgetSpent, Evaluator, cpu_gp_sampler

logger = logging.getLogger(__name__)

PRIOR_PEERS = ("priorband", "asha", "st-bohb", "optuna-gp")
#: NePS's prior confidence for the baseline (see the module docstring)
PRIOR_CONFIDENCE: Literal["low", "medium", "high"] = "medium"


class _Incumbent:
    """The best full-length probe so far: what the peer would hand over now."""

    def __init__(self, ev: Evaluator) -> None:
        self.ev = ev
        self.value = float("-inf")

    def offer(self, values: dict[str, Any], value: float | None, steps: int) -> None:
        if value is not None and steps >= self.ev.spec.probe.steps and value > self.value:
            self.value = value
            self.ev.choose(values)


def _neps_space(space: FairJointSpace, prior: dict[str, Any] | None, steps: int) -> Any:
    """The joint space as a NePS SearchSpace over its ConfigSpace names (an integer with a
    step as its index), the baseline as every parameter's prior; the probe length its fidelity."""
    import neps

    elements: dict[str, Any] = {}
    for p in space.params:
        name, centre, confidence = _cs_name(p), (prior or {}).get(_cs_name(p)), PRIOR_CONFIDENCE
        if p.kind == "cat":
            choices = [_cs(c) for c in p.choices]
            if len(choices) == 1:  # a knob the stage keeps at one value (NePS wants 2+ choices)
                elements[name] = neps.HPOConstant(choices[0])
            else:
                elements[name] = neps.HPOCategorical(choices=choices, prior=centre, prior_confidence=confidence)
        elif p.kind == "int" and p.step > 1:
            elements[name] = neps.HPOInteger(0, int((p.high - p.low) // p.step), prior=centre, prior_confidence=confidence)
        elif p.kind == "int":
            elements[name] = neps.HPOInteger(int(p.low), int(p.high), log=p.log, prior=centre, prior_confidence=confidence)
        else:
            elements[name] = neps.HPOFloat(float(p.low), float(p.high), log=p.log, prior=centre, prior_confidence=confidence)
    elements["steps"] = neps.HPOInteger(MIN_STEPS, steps, is_fidelity=True)
    return neps.SearchSpace(elements)


def _run_priorband(ev: Evaluator, seed: int) -> None:
    import numpy as np
    import torch
    from neps import AskAndTell, algorithms

    np.random.seed(seed)
    torch.manual_seed(seed)
    import random

    random.seed(seed)
    baseline = ev.space.params_for(ev.base)
    prior = ev.space.to_config_space_values(baseline) if baseline is not None else None
    optimizer = algorithms.priorband(_neps_space(ev.space, prior, ev.spec.probe.steps), eta=3,
                                     sample_prior_first="highest_fidelity" if prior else False)  # fmt: skip
    tuner = AskAndTell(optimizer, worker_id="bench")  # type: ignore[arg-type]
    best = _Incumbent(ev)
    while True:
        trial = tuner.ask()
        config = dict(trial.config)
        steps = int(config.pop("steps"))
        values = ev.space.from_config_space(config)
        try:
            value = ev.probe(values, steps=steps)
        except BudgetSpent:
            return
        tuner.tell(trial, {"objective_to_minimize": -float(value or 0.0)})
        best.offer(values, value, steps)


def _syne_space(space: FairJointSpace) -> dict[str, Any]:
    from syne_tune.config_space import choice, loguniform, randint, uniform

    out: dict[str, Any] = {}
    for p in space.params:
        if p.kind == "cat":
            out[_cs_name(p)] = choice([_cs(c) for c in p.choices])
        elif p.kind == "int" and p.step > 1:
            out[_cs_name(p)] = randint(0, int((p.high - p.low) // p.step))
        elif p.kind == "int":
            out[_cs_name(p)] = randint(int(p.low), int(p.high))
        else:
            out[_cs_name(p)] = (loguniform if p.log else uniform)(float(p.low), float(p.high))
    return out


def _run_syne(ev: Evaluator, method: str, seed: int) -> None:
    import numpy as np
    from syne_tune.backend.trial_status import Trial
    from syne_tune.optimizer.baselines import ASHA, BOHB
    from syne_tune.optimizer.scheduler import SchedulerDecision

    np.random.seed(seed)  # ASHA draws its bracket from numpy's global generator
    steps = ev.spec.probe.steps
    baseline = ev.space.params_for(ev.base)
    start = [ev.space.to_config_space_values(baseline)] if baseline is not None else None
    kwargs: dict[str, Any] = dict(metric="rate", do_minimize=False, time_attr="step", max_t=steps,
                                  grace_period=MIN_STEPS, reduction_factor=3, random_seed=seed,
                                  points_to_evaluate=start)  # fmt: skip
    scheduler = (ASHA if method == "asha" else BOHB)(_syne_space(ev.space), **kwargs)
    best = _Incumbent(ev)
    for number in range(100_000):
        suggestion = scheduler.suggest()
        if suggestion is None or suggestion.config is None:
            return
        trial = Trial(trial_id=number, config=dict(suggestion.config), creation_time=datetime.datetime.now())
        scheduler.on_trial_add(trial)
        values = ev.space.from_config_space(trial.config)

        def report(step: int, rate: float, trial: Trial = trial) -> bool:
            decision = scheduler.on_trial_result(trial, {"rate": rate, "step": step})
            return decision == SchedulerDecision.STOP and step < steps

        try:
            value = ev.probe(values, steps=steps, report=report)
        except BudgetSpent:
            return
        if value is not None:  # a stopped trial's last result is already in
            scheduler.on_trial_complete(trial, {"rate": float(value), "step": steps})
        best.offer(values, value, steps)


def _run_optuna_gp(ev: Evaluator, seed: int) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    steps = ev.spec.probe.steps
    study = optuna.create_study(study_name=f"optuna-gp-{seed}", direction="maximize",
                                sampler=cpu_gp_sampler(seed=seed, n_startup_trials=8),
                                pruner=optuna.pruners.HyperbandPruner(min_resource=MIN_STEPS, max_resource=steps,
                                                                      reduction_factor=3))  # fmt: skip
    baseline = ev.space.params_for(ev.base)
    if baseline is not None:
        study.enqueue_trial(baseline)
    best = _Incumbent(ev)
    while True:
        trial = study.ask()
        values = ev.space.suggest_values(trial)

        def report(step: int, rate: float, trial: optuna.Trial = trial) -> bool:
            trial.report(rate, step)
            return trial.should_prune()

        try:
            value = ev.probe(values, steps=steps, report=report)
        except BudgetSpent:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
        best.offer(values, value, steps)


RUNNERS: dict[str, Callable[[Evaluator, int], None]] = {
    "priorband": _run_priorband,
    "asha": lambda ev, seed: _run_syne(ev, "asha", seed),
    "st-bohb": lambda ev, seed: _run_syne(ev, "st-bohb", seed),
    "optuna-gp": _run_optuna_gp,
}


def _cs_name(p: Param) -> str:
    """A parameter's name in the ConfigSpace form (``FairJointSpace.to_config_space_values``)."""
    return p.name + "__index" if p.kind == "int" and p.step > 1 else p.name

