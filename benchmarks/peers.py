"""The HPO peers verl-sweep is measured against: each searches :class:`benchmarks.joint.FairJointSpace`
with its own ask/tell loop, on the same ReplayLauncher (simulator, noise, probe code, η-free
reward rate) and until the same GPU-hour budget is spent.

What each is given:

- ``random``: Optuna's RandomSampler, full-length probes.
- ``tpe``: Optuna's multivariate TPE, full-length probes.
- ``gp``: Optuna's GPSampler, full-length probes (it has no multi-fidelity of its own).
- ``bohb``: BOHB-style: Optuna's multivariate TPE with its HyperbandPruner on probe length
  (the running reward rate reported every ``REPORT_EVERY`` steps; min resource 50 steps).
- ``smac``: SMAC3's MultiFidelityFacade (Hyperband) with seeds as instances. SMAC's
  Successive Halving takes either instances or real-valued budgets, not both: its fidelity is
  the number of seeds a config is raced on (1 → 3), each a full-length probe, as SMAC races
  algorithm configurations over instances. Probe length is not its fidelity.
- ``dehb``: DEHB with probe length as its fidelity (50 → 500 steps, η = 3).

Every probe runs on a fresh seed from the study's seeds (the repetition's shift applied), in
turn; the simulator pairs noise by seed, so two configs on one seed share their noise. A probe
that fails (OOM, hang, divergence) scores 0. The objective is the probe's reward gain per
simulated hour of training (the same score as verl-sweep's probes, not divided by an
incumbent: the peers need no baseline runs). The choice reported at each point is the
peer's own incumbent: Optuna's best COMPLETE trial (a full-length probe), SMAC's
``intensifier.get_incumbent()``, DEHB's ``get_incumbents()``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

from benchmarks.joint import FairJointSpace
from benchmarks.methods import POLL_S, Trace, finish_trace, gpu_hours, launcher_startup_s
from verl_sweep.launchers.base import RunSpec
from verl_sweep.launchers.replay import ReplayLauncher
from verl_sweep.objectives.probe import Probe, ProbeSettings, ProbeState
from verl_sweep.search.spec.study_file import StudySpec
from verl_sweep.verl_knowledge import Config, merge, to_overrides

logger = logging.getLogger(__name__)

PEERS = ("random", "tpe", "gp", "bohb", "smac", "dehb")
REPORT_EVERY = 25
MIN_STEPS = 50


class BudgetSpent(Exception):
    """The GPU-hour budget is spent: the peer's loop ends."""


class Evaluator:
    """Runs probes for a peer and keeps its trace: (GPU-hours spent, config chosen)."""

    def __init__(self, spec: StudySpec, launcher: ReplayLauncher, space: FairJointSpace, *,
                 budget_gpu_h: float, name: str) -> None:
        self.spec, self.launcher, self.space = spec, launcher, space
        self.budget_gpu_h = budget_gpu_h
        self.name = name
        self.base = spec.baseline_config()
        self.n = 0
        self.points: list[tuple[float, Config]] = [(0.0, dict(self.base))]
        self.stopped_early: set[str] = set()

    def spent(self) -> float:
        return gpu_hours(self.launcher)

    def seed(self, index: int) -> int:
        return self.spec.seeds[index % len(self.spec.seeds)]

    def probe(self, values: dict[str, Any], *, steps: int, seed: int | None = None,
              report: Callable[[int, float], bool] | None = None) -> float | None:
        """One probe of ``values`` to ``steps`` steps; its reward rate per hour (0 when it
        failed), or None when ``report`` (step, running rate) asked to stop it (pruned).
        Raises BudgetSpent when the budget was spent before it could start."""
        if self.spent() >= self.budget_gpu_h:
            raise BudgetSpent()
        self.n += 1
        config = merge(self.base, self.space.to_config(values))
        config = merge(config, {"data.seed": self.seed(self.n) if seed is None else seed})
        run = RunSpec(run_id=f"{self.name}.p{self.n:04d}", overrides=tuple(to_overrides(config)),
                      n_gpus=self.spec.hardware.n_gpus)  # fmt: skip
        # A peer reads only the rate, which the bootstrap leaves as it is (to rounding): no resamples.
        settings = ProbeSettings(steps=steps, warmup_steps=self.spec.probe.warmup_steps,
                                 hang_timeout_s=self.spec.probe.hang_timeout_s, n_gpus=self.spec.hardware.n_gpus,
                                 n_boot=0)  # fmt: skip
        probe = Probe(self.launcher, run, settings)
        probe.start()
        next_report = REPORT_EVERY
        while True:
            outcome = probe.poll()
            if outcome is not None:
                break
            if report is not None and probe.follower is not None and probe.follower.last_step >= next_report:
                step = min(probe.follower.last_step, steps)
                next_report = (step // REPORT_EVERY + 1) * REPORT_EVERY
                score = probe.running_score()
                if score is not None and report(step, score.rate * 3600.0):
                    probe.stop(ProbeState.PRUNED, "pruned by the peer")
                    self.stopped_early.add(run.run_id)
                    return None
            self.launcher.wait(POLL_S)
        if outcome.state is ProbeState.COMPLETE and outcome.score is not None:
            return outcome.score.rate * 3600.0
        if outcome.state is ProbeState.STOPPED:
            self.stopped_early.add(run.run_id)
        return 0.0

    def choose(self, values: dict[str, Any] | None) -> None:
        if values is None:
            return
        config = merge(self.base, self.space.to_config(values))
        if config != self.points[-1][1]:
            self.points.append((self.spent(), config))

    def trace(self) -> Trace:
        return finish_trace(Trace(self.points), self.launcher, self.spec.probe.steps, launcher_startup_s(self.launcher),
                            self.stopped_early)  # fmt: skip


# -- Optuna peers ------------------------------------------------------------------------------


def cpu_gp_sampler(**kwargs: Any) -> Any:
    """Optuna's GPSampler, as is, minus one wrapper. Optuna 5.0 runs its fit and acquisition
    search inside ``with torch.device("cpu")`` (its issue #6113: a user's CUDA default
    device); here the default device is the CPU already, and that context's TorchFunctionMode
    sits in front of each of the GP's many small torch calls: popping it gives the same
    suggestions in less CPU time (docs/method.md, Evidence)."""
    import optuna
    import torch.overrides

    class CpuGPSampler(optuna.samplers.GPSampler):
        def _sample_relative_impl(self, *args: Any) -> Any:
            with torch.overrides._pop_mode_temporarily():
                return super()._sample_relative_impl(*args)

    return CpuGPSampler(**kwargs)


def run_optuna(ev: Evaluator, method: str, seed: int) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    steps = ev.spec.probe.steps
    pruner: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
    if method == "random":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.RandomSampler(seed=seed)
    elif method == "tpe":
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)
    elif method == "gp":
        sampler = cpu_gp_sampler(seed=seed, n_startup_trials=8)
    elif method == "bohb":
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8)
        pruner = optuna.pruners.HyperbandPruner(min_resource=MIN_STEPS, max_resource=steps, reduction_factor=3)
    else:
        raise ValueError(f"method must be one of {PEERS}, but got {method!r}.")
    # A fixed name: HyperbandPruner picks each trial's bracket from a hash of the study name,
    # and create_study's default name is a fresh UUID, so BOHB differed from run to run.
    study = optuna.create_study(study_name=f"{method}-{seed}", direction="maximize", sampler=sampler, pruner=pruner)
    baseline = ev.space.params_for(ev.base)
    if baseline is not None:  # every peer starts from the study's baseline, as verl-sweep does
        study.enqueue_trial(baseline)
    while True:
        trial = study.ask()
        values = ev.space.suggest_values(trial)

        def report(step: int, rate: float) -> bool:
            trial.report(rate, step)
            return trial.should_prune()

        try:
            value = ev.probe(values, steps=steps, report=report if method == "bohb" else None)
        except BudgetSpent:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
        complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if complete:
            best = max(complete, key=lambda t: t.value if t.value is not None else -1.0)
            ev.choose(dict(best.params))


# -- SMAC3 ------------------------------------------------------------------------------------


def _run_smac(ev: Evaluator, seed: int) -> None:
    from ConfigSpace import Configuration
    from smac import MultiFidelityFacade, Scenario
    from smac.runhistory.dataclasses import TrialValue

    cs = ev.space.config_space(seed=seed)
    instances = [str(s) for s in ev.spec.seeds[:3]]  # seeds as instances: SMAC races over them
    with tempfile.TemporaryDirectory(prefix="vs-smac-") as tmp:
        scenario = Scenario(cs, deterministic=True, n_trials=100_000, instances=instances,
                            instance_features={i: [float(k)] for k, i in enumerate(instances)},
                            min_budget=1, max_budget=len(instances), seed=seed, output_directory=Path(tmp))  # fmt: skip
        intensifier = MultiFidelityFacade.get_intensifier(scenario, eta=3)
        baseline = ev.space.params_for(ev.base)
        extra = [Configuration(cs, values=ev.space.to_config_space_values(baseline))] if baseline is not None else []
        initial = MultiFidelityFacade.get_initial_design(scenario, n_configs=5, additional_configs=extra)
        smac = MultiFidelityFacade(scenario, target_function=lambda config, instance, seed, budget: 0.0,
                                   intensifier=intensifier, initial_design=initial, overwrite=True,
                                   logging_level=40)  # fmt: skip
        while True:
            info = smac.ask()
            values = ev.space.from_config_space(dict(info.config))
            try:
                value = ev.probe(values, steps=ev.spec.probe.steps, seed=int(info.instance))
            except BudgetSpent:
                return
            smac.tell(info, TrialValue(cost=-float(value or 0.0)))
            incumbent = smac.intensifier.get_incumbent()
            if incumbent is not None:
                ev.choose(ev.space.from_config_space(dict(incumbent)))


# -- DEHB -------------------------------------------------------------------------------------


def _run_dehb(ev: Evaluator, seed: int) -> None:
    from dehb import DEHB

    cs = ev.space.config_space(seed=seed)
    with tempfile.TemporaryDirectory(prefix="vs-dehb-") as tmp:
        dehb = DEHB(cs=cs, dimensions=len(list(cs.values())), min_fidelity=MIN_STEPS, max_fidelity=ev.spec.probe.steps,
                    eta=3, n_workers=1, seed=seed, output_path=tmp, save_freq=None, log_level="ERROR")  # fmt: skip
        while True:
            job = dehb.ask()
            values = ev.space.from_config_space(dict(job["config"]))
            start = ev.spent()
            try:
                value = ev.probe(values, steps=int(round(job["fidelity"])))
            except BudgetSpent:
                return
            dehb.tell(job, {"fitness": -float(value or 0.0), "cost": ev.spent() - start})
            incumbent, _ = dehb.get_incumbents()
            if incumbent is not None:
                ev.choose(ev.space.from_config_space(dict(incumbent)))


#: the peers of this module by name (Optuna's samplers are the rest: ``run_optuna``)
RUNNERS = {"smac": _run_smac, "dehb": _run_dehb}
