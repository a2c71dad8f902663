"""A stage as every part of verl-sweep reads it, worked out once.

``Stage.of(spec, index)`` builds it from the study file (``slow_start``: a learning stage
after a slow start, whose probes run ``probe.slow_start_factor`` times longer);
``Stage.stored`` from a stage study's stored probe length (status, the report). It says what
its knobs move (its space's ``moves``: read here and nowhere else), what it scores, how long
its probes run and which steps they leave out, when its pruner may act, the pruner itself,
what its budget is and what it costs. The policy, the stage study, the trial runner,
``validate``, ``status`` and the report ask it; none of them works these out again.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from verl_sweep.objectives.probe import ProbeSettings
from verl_sweep.objectives.score import MIN_RUNNING_STEPS, Metric
from verl_sweep.search.method.pruning import Pace, build_pruner, reports_to_prune
from verl_sweep.search.method.run_length import probe_horizon, study_run_length
from verl_sweep.spaces import Moves, build_space, space_class
from verl_sweep.spaces.stages import KL_PARAMS, LRSpace, MiniBatchSpace

if TYPE_CHECKING:
    import optuna

    from verl_sweep.search.spec.study_file import Budget, StageSettings, StudySpec
    from verl_sweep.spaces.base import Space
    from verl_sweep.verl_knowledge import Config


#: candidates that start slower and may end higher: one that changes the KL pull, or a coupled
#: move of the mini-batch and lr both (fewer updates per step at a larger lr; docs/method.md,
#: Evidence)
PACE = Pace(alone=KL_PARAMS, together=(MiniBatchSpace.param, LRSpace.param))


@dataclasses.dataclass(frozen=True)
class Stage:
    """Stage ``index`` of ``spec``; ``stretch``: how many times the study's probe length its
    learning probes run (1 unless a slow start was seen before it); ``start_step``: in train
    mode, the chain's step its learning probes branch from (they run steps ``start_step + 1 ..
    start_step + branch_steps``)."""

    spec: StudySpec
    index: int
    moves: Moves
    stretch: int = 1
    start_step: int = 0

    @classmethod
    def of(cls, spec: StudySpec, index: int, *, slow_start: bool = False, start_step: int = 0) -> Stage:
        """From the study file. Raises SpaceError for a space kind that is not registered."""
        settings = spec.stages[index]
        stage = cls(spec, index, space_class(settings.space, where=f"stages[{index}]").moves)
        if stage.branches:  # a branch's length is fixed
            return dataclasses.replace(stage, start_step=start_step)
        if slow_start and stage.may_be_stretched:
            return dataclasses.replace(stage, stretch=spec.probe.slow_start_factor)
        return stage

    @classmethod
    def stored(cls, spec: StudySpec, index: int, probe_steps: int | None, start_step: int = 0) -> Stage:
        """As its stored study ran it (``probe_steps``: the length stored when it opened; None
        before it opened): probes longer than the study's were stretched by a slow start."""
        stage = cls.of(spec, index, start_step=start_step)
        if probe_steps and stage.may_be_stretched and probe_steps > spec.probe.steps:
            return dataclasses.replace(stage, stretch=probe_steps // spec.probe.steps)
        return stage

    # -- what the study file says ---------------------------------------------------------------
    @property
    def settings(self) -> StageSettings:
        return self.spec.stages[self.index]

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def budget(self) -> Budget:
        return self.settings.budget

    @property
    def where(self) -> str:
        """The study-file field of the stage, for error messages."""
        return f"stages[{self.index}]"

    def build_space(self, base: Config, *, build: Callable[..., Space] = build_space) -> Space:
        """The stage's space on ``base`` (the chain's config); raises SpaceError."""
        spec = self.spec
        return build(self.settings.space, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                     base=base, options=self.settings.params, where=self.where, baseline=spec.baseline_config())

    # -- what it measures -----------------------------------------------------------------------
    @property
    def learns(self) -> bool:
        """Its knobs move learning (alone or with speed): full probes, scored on reward per
        second, screened for divergence; a slow start before it lengthens them."""
        return self.moves is not Moves.SPEED

    @property
    def metric(self) -> Metric:
        return Metric.REWARD_RATE if self.learns else Metric.THROUGHPUT

    @property
    def branches(self) -> bool:
        """A learning stage of a train-mode study: its runs branch from the chain's checkpoint."""
        return self.learns and self.spec.train is not None

    @property
    def may_be_stretched(self) -> bool:
        """A learning stage at the study's probe length (not one with probe_steps of its own,
        nor a train-mode branch)."""
        return self.learns and not self.settings.probe_steps and not self.branches

    @property
    def may_stretch(self) -> bool:
        """A learning stage at the study's probe length whose slow start would lengthen the
        later ones."""
        return self.may_be_stretched and self.stretch == 1 and self.spec.probe.slow_start_factor > 1

    @property
    def probe_steps(self) -> int:
        """Its probes' length: its own (a train-mode branch's too), a train-mode branch's,
        else the study's (the speed length for a speed stage), × ``stretch``."""
        if self.settings.probe_steps:
            return self.settings.probe_steps
        if self.branches:
            assert self.spec.train is not None
            return self.spec.train.branch_steps
        if not self.learns:
            return self.spec.probe.speed_steps
        return self.spec.probe.steps * self.stretch

    @property
    def warmup_steps(self) -> int:
        """Steps at a probe's start that its score leaves out."""
        return self.spec.probe.warmup_steps if self.learns else self.spec.probe.speed_warmup_steps

    @property
    def probe(self) -> ProbeSettings:
        """How its probes run and are scored: a branch's steps come after ``start_step``, and
        its score places them there (read to the run's end, as every learning probe's)."""
        last = self.start_step + self.probe_steps
        return ProbeSettings(steps=last, metric=self.metric, warmup_steps=self.start_step + self.warmup_steps,
                             hang_timeout_s=self.spec.probe.hang_timeout_s, health_screen=self.learns,
                             n_gpus=self.spec.hardware.n_gpus,
                             settle_tolerance=0.0 if self.learns else self.spec.probe.speed_settle_tolerance,
                             horizon_steps=self.horizon_steps if self.learns and not self.mid_chain else None,
                             plateau_screen=not self.mid_chain,
                             estimator="ols" if self.mid_chain else "curve")

    @property
    def mid_chain(self) -> bool:
        """A train-mode branch from a checkpoint, mid-run: scored on a line over its own window
        (a saturating curve fitted from the run's start cannot be read off a window late on it:
        its chord swings with the guessed ceiling), no horizon (its window's rate at the chain's
        reward level already tells a higher ceiling: a curve that has further to rise rises
        faster there), never called stuck (near its ceiling it is flat from its first step)."""
        return self.branches and self.start_step > 0

    @property
    def horizon_steps(self) -> int | None:
        """The step its learning probes' rates are read to (``probe_horizon``), counted from
        the step they start at."""
        run_steps = study_run_length(self.spec).steps
        if run_steps is None:
            return None
        horizon = probe_horizon(max(run_steps - self.start_step, self.probe_steps), self.probe_steps)
        return None if horizon is None else self.start_step + horizon

    # -- pruning ----------------------------------------------------------------------------------
    @property
    def report_every(self) -> int:
        """Its probes report a running rate every this many steps."""
        return self._pruning_steps()[0]

    @property
    def prune_from(self) -> int:
        """No pruning before this step."""
        return self.start_step + self._pruning_steps()[1]

    @property
    def late_prune_from(self) -> int:
        """No pruning before this step for a candidate that changes the KL pull, or the
        mini-batch and lr both (``verl_sweep.search.method.pruning``): three quarters of the probe, where a
        stretched probe's pruning starts too."""
        return self.start_step + self.probe_steps * 3 // 4 if self.learns else 0

    def _pruning_steps(self) -> tuple[int, int]:
        """Speed probes are short and steady from step to step, so the 500-step settings would
        never act on them: they report every tenth of the probe and may stop from its middle.
        Probes lengthened after a slow start report ``stretch`` times less often and are not
        pruned before three quarters of their length: before the reward bends, a running rate
        ranks configs by early speed, which is what the longer probe is there to look past."""
        pruner = self.settings.pruner
        if not self.learns:
            return max(1, self.probe_steps // 10), self.probe_steps // 2
        if pruner.warmup_steps is None:
            # A rate read to the run's horizon from less than half a probe extrapolates a curve
            # that has not bent yet: not before the probe's middle (docs/method.md, Evidence).
            start = self.probe_steps // 2
        else:
            start = pruner.warmup_steps * self.stretch
        if self.stretch > 1:
            return pruner.interval_steps * self.stretch, max(start, self.probe_steps * 3 // 4)
        return pruner.interval_steps, start

    def pruner(self) -> optuna.pruners.BasePruner:
        """Its pruner, built from its settings (Optuna does not store pruners: every process
        that opens the stage builds it again)."""
        return build_pruner(self.settings.pruner, prune_from=self.prune_from, late_from=self.late_prune_from,
                            pace=PACE)

    def first_prune_step(self) -> int | None:
        """The earliest step at which its pruner can stop a candidate (None: no pruner). It
        needs a running rate (MIN_RUNNING_STEPS scored steps after the warm-up), a report at
        or after the pruning start, and ``patience`` reports in a row below the bar."""
        if self.settings.pruner.name == "none":
            return None
        interval = self.report_every
        earliest = max(self.prune_from, self.start_step + self.warmup_steps + MIN_RUNNING_STEPS)
        first_report = -(-earliest // interval) * interval
        return first_report + (reports_to_prune(self.settings.pruner) - 1) * interval

    # -- checks -----------------------------------------------------------------------------------
    def probe_length_problem(self) -> str | None:
        """A probe too short to be scored after its warm-up: every run of the stage would fail
        (docs/method.md, Evidence)."""
        need, steps, warmup = self.metric.min_steps, self.probe_steps, self.warmup_steps
        if steps - warmup >= need:
            return None
        field = (f"{self.where}.probe_steps" if self.settings.probe_steps else "train.branch_steps" if self.branches
                 else "probe.steps" if self.learns else "probe.speed_steps")
        return (f"{field}: a probe of stage {self.name} must score at least {need} steps after its warm-up "
                f"({warmup}), but {steps} steps leave {max(steps - warmup, 0)}. Raise it to at least {warmup + need}.")

    def pruner_reach_warning(self) -> str | None:
        """A pruner that cannot act before the probe ends: it would cost nothing, and do nothing
        (a probe that reports once, at its last step)."""
        step = self.first_prune_step()
        if step is None or step < self.start_step + self.probe_steps:
            return None
        pruner = self.settings.pruner
        return (f"{self.where}.pruner: stage {self.name}'s pruner can first stop a candidate at step {step} "
                f"(warm-up {self.prune_from}, a report every {pruner.interval_steps}, patience {pruner.patience}), "
                f"but its probes end at step {self.probe_steps}: it will never prune. Lower pruner.warmup_steps or "
                "lengthen the probes.")

    # -- cost -------------------------------------------------------------------------------------
    @property
    def max_probes(self) -> int:
        """Probes its budget allows: the budget's trials and one confirmation of each of the
        top ``confirm_top`` (failures queued again and extra confirmations come on top)."""
        return self.budget.max_trials + self.settings.confirm_top

    def cost_estimate_gpu_h(self, *, step_s: float, startup_s: float = 0.0) -> float:
        """GPU-hours its budget costs at ``step_s`` seconds a step and ``startup_s`` a probe's
        start: ``max_probes`` full probes on the study's GPUs (pruning spends less)."""
        probe_s = startup_s + self.probe_steps * step_s
        return self.max_probes * probe_s * self.spec.hardware.n_gpus / 3600.0


def space_learns(space: str) -> bool:
    """Whether a stage on the space kind ``space`` moves learning (``Stage.learns``), before
    any study exists (init picks a short run's stages with it). Raises SpaceError."""
    return space_class(space).moves is not Moves.SPEED


def stages_of(spec: StudySpec) -> list[Stage]:
    """Every stage of the study as the study file defines it (no slow start)."""
    return [Stage.of(spec, index) for index in range(len(spec.stages))]


def branch_lengths(spec: StudySpec) -> list[int]:
    """Train mode: the steps each learning stage's branches take the chain on, in order."""
    return [stage.probe_steps for stage in stages_of(spec) if stage.branches]
