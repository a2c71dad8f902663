"""Train mode's chain: the model the study trains while it tunes.

In train mode (``train:`` in the study file) the speed stages run as in search mode. Each
learning stage then branches every run of its own (the incumbent's and the candidates') from
the chain's checkpoint at the stage's start, ``train.branch_steps`` steps each; the first
learning stage's runs start from step 1. The config the stage chooses continues the chain:
its run on the first seed that reached the stage's end left the checkpoint the next stage
branches from. After the last stage the chain's config trains on to the run's end
(``verl_sweep.search.engine.continuation``), and that checkpoint is the model.

Everything here is read from the stored stage studies, so a resume and every worker compute
the same chain.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

from optuna.trial import TrialState

from verl_sweep.launchers.base import Branch
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.search.database.records import ChainPoint, Decision, StageStudyAttrs, TrialRecord
from verl_sweep.search.spec.errors import SweepError
from verl_sweep.objectives.metrics import KL_KEYS, REWARD_KL_COEF_KEY, read_all
from verl_sweep.verl_knowledge import (KL_CTRL_COEF, KL_CTRL_HORIZON, KL_CTRL_TARGET, KL_CTRL_TYPE, LR, ROLLOUT_N,
                                       TRAIN_BATCH, USE_KL_IN_REWARD, Config, int_setting, merge, setting)

if TYPE_CHECKING:
    import optuna

    from verl_sweep.search.method.run_cost import Projection
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.spec.study_file import StudySpec


def chain_point(storage: optuna.storages.BaseStorage, spec: StudySpec, index: int) -> ChainPoint:
    """Where the chain stands before stage ``index`` (``len(spec.stages)``: after the last):
    the checkpoint the last learning stage before it left at its end, or step 0 (from scratch)
    when no learning stage ran before it (none, or each skipped)."""
    from verl_sweep.search.engine.stage_study import StageStudy
    from verl_sweep.search.method.stage import Stage

    last = None  # the last learning stage before it that ran, and its stored study
    for earlier in range(index):
        plan = Stage.of(spec, earlier)
        if not plan.branches:
            continue
        stored = StageStudy.stored_stage(storage, spec, spec.stages[earlier])
        if stored is None or stored.result is None:
            raise SweepError(f"stage {plan.name} has no result yet, so the chain has no checkpoint to branch from; "
                             "run the stages in order (resume the study)")
        if stored.result.decision is not Decision.SKIPPED:
            last = (plan, stored, stored.result)
    if last is None:
        return ChainPoint(step=0)
    plan, stored, result = last  # only its trials are read: it branched from the point before it
    attrs = StageStudyAttrs.of(stored.study.user_attrs)
    start = attrs.branch.step if attrs.branch is not None else 0
    return _left_by(plan, stored.trials(), attrs, result.config, result.winner_trial, start + plan.probe_steps)


def _left_by(plan: Stage, trials: list[TrialRecord], attrs: StageStudyAttrs, chosen: Config, winner: int | None,
             step: int) -> ChainPoint:
    """The checkpoint at ``step`` of a run of ``chosen`` (the stage's choice) that got there:
    the winning trial's, else a finished run's on the first seed that has one (a run with no
    η, at the chain's ceiling, ran its window too)."""
    base = attrs.base_config or {}
    runs = [t for t in trials if t.run_dir and merge(base, t.overrides) == chosen]
    runs.sort(key=lambda t: (t.number != winner, t.state != TrialState.COMPLETE,
                             t.seed if t.seed is not None else 2**31, t.number))
    for t in runs:
        assert t.run_dir is not None
        step_dir = RunDir(Path(t.run_dir)).step_dir(step)
        if step_dir.is_dir():
            return ChainPoint(step=step, step_dir=str(step_dir), stage=plan.name, trial=t.number)
    raise SweepError(f"stage {plan.name}: no run of its chosen config left a checkpoint at step {step} "
                     f"({len(runs)} run(s) of it); the chain cannot go on. Check the runs' checkpoints "
                     "folders, or start the study again under a new name")


def branch_of(stage: Stage, point: ChainPoint, config: Config, chain_config: Config) -> Branch:
    """How a run of ``config`` in ``stage`` branches from ``point``: it saves at the stage's
    end, and trains at its own lr, not the checkpoint's (verl keeps the checkpoint's: the
    launcher rewrites the run's copy, docs/verl-resume.md §2). verl saves at the steps
    ``save_freq`` divides, counted from step 0, so a window that starts off its own length's
    grid (after a longer first stage) saves every gcd of its end and its length."""
    lr = setting(config, LR)
    changed = point.step_dir is not None and lr is not None and lr != setting(chain_config, LR)
    return Branch(resume_from=point.step_dir, save_every=math.gcd(point.step + stage.probe_steps, stage.probe_steps),
                  lr=float(lr) if changed else None)


#: the in-reward KL controller's settings: a run with the chain's own goes on with its controller
_KL_CONTROLLER = (USE_KL_IN_REWARD, KL_CTRL_TYPE, KL_CTRL_COEF, KL_CTRL_TARGET, KL_CTRL_HORIZON)


def carried_kl(point: ChainPoint, config: Config, chain_config: Config) -> Config:
    """The override that carries the chain's adaptive in-reward KL controller into a run of
    ``config`` resuming ``point``. verl keeps no controller in a checkpoint: a resumed run starts
    it again at ``algorithm.kl_ctrl.kl_coef`` (docs/verl-resume.md §7). A run with the chain's own
    controller settings starts it where the chain's run left it: the coefficient that run logged
    at the checkpoint's step, moved as verl's update moves it after that step. {} where nothing
    carries over: from scratch, no adaptive in-reward KL, settings the run changes (its own start
    is the change it tries), or no value logged at that step."""
    if point.step_dir is None or not setting(config, USE_KL_IN_REWARD) or setting(config, KL_CTRL_TYPE) != "adaptive":
        return {}
    if any(setting(config, key) != setting(chain_config, key) for key in _KL_CONTROLLER):
        return {}
    coef, kl = _logged_kl(point.step_dir, point.step)
    if coef is None or kl is None:
        return {}
    # core_algos.AdaptiveKLController.update, with n_steps the batch's responses
    error = min(max(kl / float(setting(config, KL_CTRL_TARGET)) - 1, -0.2), 0.2)
    responses = int_setting(config, TRAIN_BATCH) * int_setting(config, ROLLOUT_N)
    return {KL_CTRL_COEF: coef * (1 + error * responses / float(setting(config, KL_CTRL_HORIZON)))}


@functools.lru_cache(maxsize=8)
def _logged_kl(step_dir: str, step: int) -> tuple[float | None, float | None]:
    """The in-reward KL coefficient and KL that the run which saved ``step_dir`` logged at
    ``step`` (its metrics are final by then): read once for every run a stage branches there."""
    run = RunDir(Path(step_dir).parents[1])  # the run that saved <run>/checkpoints/global_step_N
    logged = next((m for m in read_all(run.metrics) if m.step == step), None) if run.metrics.is_file() else None
    return (None, None) if logged is None else (logged.get(REWARD_KL_COEF_KEY), logged.get(KL_KEYS[1]))


@dataclasses.dataclass(frozen=True)
class CapLimit:
    """What the cost cap leaves a learning stage: its most runs, the cap, and why the stage is
    skipped (None: it runs)."""

    max_runs: int
    cap: float
    skip: str | None


def fewest_runs(spec: StudySpec) -> int:
    """The fewest runs a learning stage decides on: the incumbent's and two candidates'."""
    return spec.probe.incumbent_repeats + 2


def cap_projection(storage: optuna.storages.BaseStorage, spec: StudySpec, index: int,
                   base: Config) -> Projection | None:
    """Train mode with ``train.max_cost_r``: the prices for learning stage ``index`` opened from
    ``base`` (``verl_sweep.search.method.run_cost``), from the stages before it only, so a
    resume or a worker prices it as its opening did; None without a cap or before any price."""
    from verl_sweep.search.method.run_length import run_steps_of
    from verl_sweep.search.engine.stage_study import StageStudy
    from verl_sweep.search.method.run_cost import StageCost, project
    from verl_sweep.search.method.stage import Stage

    plan = Stage.of(spec, index)
    if spec.train is None or spec.train.max_cost_r is None or not plan.branches:
        return None
    stages = []
    for earlier in range(index):
        stored = StageStudy.stored_stage(storage, spec, spec.stages[earlier])
        if stored is None:
            continue
        attrs = StageStudyAttrs.of(stored.study.user_attrs)
        skipped = stored.result is not None and stored.result.decision is Decision.SKIPPED
        stages.append(StageCost(trials=stored.trials(), base=attrs.base_config or {},
                                start_step=attrs.branch.step if attrs.branch is not None else 0,
                                ran_learning=Stage.of(spec, earlier).branches and not skipped,
                                probe_steps=attrs.probe_steps))
    return project(stages, cap=spec.train.max_cost_r, n_gpus=spec.hardware.n_gpus, run_steps=run_steps_of(spec),
                   chain_step=chain_point(storage, spec, index).step, base=base, branch_steps=plan.probe_steps)


def cap_limit(storage: optuna.storages.BaseStorage, spec: StudySpec, index: int, base: Config) -> CapLimit | None:
    """Train mode with ``train.max_cost_r``: learning stage ``index``'s most runs under the cap
    (at least its fewest: an opened stage decides on them), and why it is skipped when it is not
    opened yet and its fewest runs do not fit; None without a cap or before any price."""
    from verl_sweep.search.engine.stage_study import StageStudy

    projection = cap_projection(storage, spec, index, base)
    if projection is None:
        return None
    fewest, within = fewest_runs(spec), projection.runs_within()
    opened = StageStudy.stored_stage(storage, spec, spec.stages[index]) is not None
    # An opened stage runs on (its run limit holds it to the cap): only a new one is skipped.
    skip = projection.why_skipped(fewest) if within < fewest and not opened else None
    return CapLimit(max_runs=max(within, fewest), cap=projection.cap, skip=skip)
