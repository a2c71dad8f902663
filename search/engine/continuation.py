"""Train mode's last run: the chain's config trains on from the chain's last checkpoint to the
run's end, and its last checkpoint is the model (``verl_sweep.search.engine.chain``).

The Optuna study ``<study>.train`` in the study's storage holds it, one trial an attempt. It
saves every ``train.branch_steps`` steps; an attempt after a stop (Ctrl-C, a crash, a failed
run) goes on from the last checkpoint an earlier attempt saved, so a resume loses at most
that many steps. Only the driver runs it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from verl_sweep.launchers.base import Branch, NoCapacityError, RunSpec
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.launchers.verl_checkpoints import TRACKER
from verl_sweep.objectives.probe import Probe, ProbeOutcome, ProbeSettings, ProbeState
from verl_sweep.objectives.score import Metric
from verl_sweep.search.database.study_root import stored_study
from verl_sweep.search.database.records import (ChainPoint, Role, TrialRecord, outcome_attrs, reason_attrs, records,
                                                set_attrs, started_attrs)
from verl_sweep.search.spec.errors import BadInputError, SweepError
from verl_sweep.search.engine.chain import carried_kl
from verl_sweep.search.method.run_length import run_steps_of
from verl_sweep.verl_knowledge import Config, merge, to_overrides

if TYPE_CHECKING:
    from verl_sweep.launchers.base import Launcher
    from verl_sweep.search.engine.events import StudyListener
    from verl_sweep.search.spec.study_file import StudySpec

#: the continuation's study beside the stages' (``<study>.train``)
TRAIN_STAGE = "train"
#: the reason of an attempt its driver stopped (Ctrl-C, SIGTERM, an error elsewhere)
STOPPED = "its driver stopped"
#: the study's attributes: the config, the chain point it starts from, the model once trained
_CONFIG, _START, _MODEL = "config", "start", "model"


def continuation_study_name(spec: StudySpec) -> str:
    return f"{spec.name}.{TRAIN_STAGE}"


@dataclasses.dataclass(frozen=True)
class TrainedModel:
    """The train mode's result: the checkpoint at the run's last step, and the run that left it."""

    step: int
    step_dir: str
    trial: int

    @classmethod
    def of(cls, attr: dict[str, Any]) -> TrainedModel:
        return cls(int(attr["step"]), str(attr["step_dir"]), int(attr["trial"]))


def stored_model(storage: optuna.storages.BaseStorage, spec: StudySpec) -> tuple[TrainedModel | None, list[TrialRecord]]:
    """The trained model (None until the continuation finished) and its attempts ([] before it opened)."""
    study = stored_study(storage, continuation_study_name(spec))
    if study is None:
        return None, []
    attr = study.user_attrs.get(_MODEL)
    return (TrainedModel.of(attr) if attr else None), records(study.get_trials(deepcopy=False))


def stored_start(storage: optuna.storages.BaseStorage, spec: StudySpec) -> ChainPoint | None:
    """The chain point the continuation started from (None before it opened)."""
    study = stored_study(storage, continuation_study_name(spec))
    attr = None if study is None else study.user_attrs.get(_START)
    return None if attr is None else ChainPoint(**attr)


class Continuation:
    """The continuation as the driver follows it; ``tick`` until it returns False."""

    def __init__(self, spec: StudySpec, study: optuna.Study, launcher: Launcher, console: StudyListener) -> None:
        self.spec = spec
        self.study = study
        self.launcher = launcher
        self.console = console
        self.config: Config = study.user_attrs[_CONFIG]
        self.start_point = ChainPoint(**study.user_attrs[_START])
        self.run_steps = run_steps_of(spec)
        self.active: tuple[optuna.trial.Trial, Probe, ChainPoint] | None = None

    @classmethod
    def open(cls, storage: optuna.storages.BaseStorage, spec: StudySpec, config: Config, point: ChainPoint,
             launcher: Launcher, console: StudyListener) -> Continuation | None:
        """Create or join ``<study>.train``; None once the model is trained."""
        study = optuna.create_study(study_name=continuation_study_name(spec), storage=storage, direction="maximize",
                                    load_if_exists=True)
        if _MODEL in study.user_attrs:
            return None
        if _CONFIG not in study.user_attrs:
            study.set_user_attr(_CONFIG, config)
            study.set_user_attr(_START, dataclasses.asdict(point))
        for t in records(study.get_trials(deepcopy=False)):  # an attempt a killed driver left RUNNING
            if t.state == TrialState.RUNNING:
                set_attrs(optuna.trial.Trial(study, t.frozen._trial_id), reason_attrs(STOPPED))
                study.tell(t.number, state=TrialState.FAIL)
                # Its run may live on (verl under the local launcher does): it would train beside
                # the next attempt and hold the GPUs it needs.
                launcher.cleanup_leftover(Path(t.run_dir or ""))
        run = cls(spec, study, launcher, console)
        start = run.resume_point()
        console.note(f"train: the chain's config trains on from step {start.step} to step {run.run_steps}"
                     + (f" (from {start.step_dir})" if start.step_dir else ""))
        return run

    def resume_point(self) -> ChainPoint:
        """The latest checkpoint an earlier attempt saved (verl's tracker names it), else the chain's."""
        best = self.start_point
        for t in records(self.study.get_trials(deepcopy=False)):
            if not t.run_dir:
                continue
            files = RunDir(Path(t.run_dir))
            step = _tracked_step(files)
            if step is not None and step > best.step:
                best = ChainPoint(step=step, step_dir=str(files.step_dir(step)), stage=TRAIN_STAGE, trial=t.number)
        return best

    def tick(self) -> bool:
        """Start the run if none is going, follow it; False once the model is trained."""
        if self.active is None:
            start = self.resume_point()
            if start.step >= self.run_steps:  # an attempt saved the last checkpoint, its driver died before noting it
                return self._adopt(start)
            if not self._start(start):
                return True
        assert self.active is not None
        trial, probe, start = self.active
        outcome = probe.poll()
        if outcome is None:
            return True
        self.active = None
        set_attrs(trial, outcome_attrs(probe=outcome.summary(), score=None, gpu=outcome.gpu))
        # Its score is a note, not a verdict: a run that saved the run's last checkpoint trained the
        # model, scored or not (a continuation of a few steps has too few to score).
        if outcome.state is ProbeState.COMPLETE or self.resume_point().step >= self.run_steps:
            return self._finish(trial, probe, outcome, start)
        set_attrs(trial, reason_attrs(outcome.reason))
        self.study.tell(trial, state=TrialState.FAIL)
        # A driver's stop is no failure of the run: only runs that failed count against the retries.
        attempts = sum(1 for t in records(self.study.get_trials(deepcopy=False))
                       if t.state == TrialState.FAIL and not (t.reason or "").startswith(STOPPED))
        self.console.trial_finished(self.study, trial.number, Role.CANDIDATE, {}, state="failed", reason=outcome.reason,
                                    requeued=attempts <= self.spec.probe.max_retries, stderr_tail=outcome.stderr_tail)
        if attempts > self.spec.probe.max_retries:
            raise SweepError(f"train: the continuation failed {attempts} times (last: {outcome.reason}); fix the cause "
                             f"and resume: it goes on from step {self.resume_point().step}")
        return True

    def _start(self, start: ChainPoint) -> bool:
        if self.launcher.free_slots() < 1:
            return False
        trial = self.study.ask()
        seed = self.spec.seeds[0]
        # The run ends at run_steps, where verl saves its last checkpoint (save_freq > 0).
        config = merge(self.config, {"data.seed": seed, "trainer.total_training_steps": self.run_steps})
        config = merge(config, carried_kl(start, config, self.config))
        run_id = f"{continuation_study_name(self.spec)}.t{trial.number:04d}"
        # Saved by a run of this very config (the last learning stage's choice): the same lr.
        assert self.spec.train is not None
        branch = Branch(resume_from=start.step_dir, save_every=self.spec.train.branch_steps)
        spec = RunSpec(run_id=run_id, overrides=tuple(to_overrides(config)), n_gpus=self.spec.hardware.n_gpus,
                       metadata={"study": self.spec.name, "stage": TRAIN_STAGE, "trial": str(trial.number)},
                       branch=branch)
        settings = ProbeSettings(steps=self.run_steps, metric=Metric.REWARD_RATE, warmup_steps=start.step,
                                 hang_timeout_s=self.spec.probe.hang_timeout_s, health_screen=False,
                                 n_gpus=self.spec.hardware.n_gpus, n_boot=0)
        probe = Probe(self.launcher, spec, settings)
        try:
            handle = probe.start()
        except NoCapacityError:
            self.study.tell(trial, state=TrialState.FAIL)
            return False
        except BaseException:
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        set_attrs(trial, started_attrs(role=Role.CANDIDATE, seed=seed, overrides={}, run_id=run_id,
                                       run_dir=str(handle.run_dir)))
        self.active = (trial, probe, start)
        self.console.trial_started(TRAIN_STAGE, trial.number, Role.CANDIDATE, {})
        return True

    def _finish(self, trial: optuna.trial.Trial, probe: Probe, outcome: ProbeOutcome, start: ChainPoint) -> bool:
        """The model: the run's last checkpoint (verl saves at its last step, the run's end or
        the end of its epochs, whichever comes first)."""
        files = RunDir(probe.handle.run_dir) if probe.handle is not None else None
        step = _tracked_step(files) if files is not None else None
        if files is None or step is None or step <= start.step:
            raise SweepError(f"train: the continuation finished at step {outcome.last_step} but saved no checkpoint "
                             f"in {files.checkpoints if files else 'its run directory'}; resume to run it again")
        self.study.tell(trial, outcome.score.rate if outcome.score is not None else 0.0)
        self.console.trial_finished(self.study, trial.number, Role.CANDIDATE, {}, state="complete")
        return self._adopt(ChainPoint(step=step, step_dir=str(files.step_dir(step)), stage=TRAIN_STAGE, trial=trial.number))

    def _adopt(self, point: ChainPoint) -> bool:
        """``point``'s checkpoint is the model; False: the continuation is done."""
        assert point.step_dir is not None and point.trial is not None
        model = TrainedModel(point.step, point.step_dir, point.trial)
        self.study.set_user_attr(_MODEL, dataclasses.asdict(model))
        self.console.note(f"train: the model is trained to step {model.step}: {model.step_dir}")
        return False

    def abandon(self, *, why: str) -> None:
        """Stop the run (Ctrl-C, SIGTERM, an error): the next attempt goes on from its last checkpoint."""
        if self.active is None:
            return
        trial, probe, _ = self.active
        self.active = None
        try:
            if probe.handle is not None:
                self.launcher.cancel(probe.handle)
            set_attrs(trial, reason_attrs(f"{STOPPED} ({why})"))
            self.study.tell(trial, state=TrialState.FAIL)
        except Exception:  # noqa: BLE001 - best effort on the way out; the next open fails what is left
            pass


def _tracked_step(files: RunDir) -> int | None:
    """The step of a run's last complete checkpoint: verl's tracker names it once the folder is written."""
    try:
        step = int((files.checkpoints / TRACKER).read_text())
    except (OSError, ValueError):
        return None
    return step if files.step_dir(step).is_dir() else None
