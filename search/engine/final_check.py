"""The overall gain: the final config against the user's own baseline, measured.

Every stage's η is against its own incumbent; their product is no measurement of the whole.
After the last stage the driver runs the final check, the Optuna study ``<study>.final`` in the
same storage: the baseline and the final config side by side on ``final_check.runs`` seeds
that no stage used, on learning probes, and their paired η (``verl_sweep.objectives.score.paired_eta``)
is the gain against the baseline, with its interval.

The baseline's runs need not run at its own, slowest layout: the speed stages change how fast
a step runs, not what it learns. Where they changed the layout and their probes of the
baseline and of their choice share seeds, the baseline's runs are its learning at that layout
(the first learning stage's incumbent, ~2.5 times cheaper on the demo), each step re-timed by
the phase ratios those probes measured (``verl_sweep.objectives.retime``); otherwise the
baseline itself runs. A study with no learning stage (a run too short for learning probes)
tuned speed alone: its check runs speed probes and its η is the throughput gain, what its
stages measured (a learning probe would not fit the run). Its runs are queued once, when the
study is created, so a resume runs only what is missing; a run its dead driver left RUNNING is
queued again. Skipped with ``final_check: false``, and when the final config is the baseline.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import optuna
from optuna.trial import TrialState

from verl_sweep.launchers.base import LauncherError, NoCapacityError, RunSpec
from verl_sweep.launchers.run_dir import RunDir
from verl_sweep.objectives.metrics import StepMetrics, read_all
from verl_sweep.objectives.probe import Probe, ProbeOutcome, ProbeSettings, ProbeState, score_steps
from verl_sweep.objectives.retime import PhaseRatios, retimed, time_ratio
from verl_sweep.objectives.score import Eta, Metric, Score, ScoreError, eta as eta_of, paired_eta
from verl_sweep.search.database import liveness
from verl_sweep.search.database.study_root import stored_stage_result, stored_study
from verl_sweep.search.database.records import (Assignment, Decision, Role, StageStudyAttrs, TrialRecord,
                                                carried_attrs, eta_attrs, outcome_attrs, owner_attrs, reason_attrs,
                                                records, set_attrs, stage_study_name, started_attrs, stored_score)
from verl_sweep.search.spec.study_file import FINAL_STAGE, StudySpec
from verl_sweep.verl_knowledge import Config, merge, to_overrides

if TYPE_CHECKING:
    from verl_sweep.launchers.base import Launcher
    from verl_sweep.search.engine.events import StudyListener

#: the study's attributes: the config its incumbent runs (the baseline, or its learning at the
#: speed stages' layout), the final config, the result once measured, and the phase ratios that
#: re-time the incumbent's runs to the baseline's layout (absent: they are the baseline's own)
_BASELINE, _FINAL, _RESULT, _RETIME = "baseline_config", "final_config", "result", "retime"
#: a re-timed run's seconds over its own: what prices a full run of the baseline (``status``)
BASELINE_TIME_RATIO = "baseline_time_ratio"
#: where the final config is the baseline's learning at the speed stages' layout (no learning
#: stage changed it), its run's own re-timed score: the baseline's run on that seed
BASELINE_SCORE = "baseline_score"
#: a learning stage's run carried into the check (no GPU time of its own): the baseline's
#: seconds a step it stands for, its own re-timed (``status`` prices R from it)
BASELINE_STEP_S = "baseline_step_s"


def final_study_name(spec: StudySpec) -> str:
    return f"{spec.name}.{FINAL_STAGE}"


def final_seeds(spec: StudySpec) -> list[int]:
    """Fresh seeds: above every seed the stages run on."""
    start = max(spec.seeds) + 1
    return [start + i for i in range(spec.final_check.runs)]


def skip_reason(spec: StudySpec, final: Config) -> str | None:
    """Why no final check runs, or None."""
    if not spec.final_check.enabled:
        return "final_check: false in the study file"
    if final == spec.baseline_config():
        return "the final config is the baseline (no stage found a better one)"
    return None


def final_probe(spec: StudySpec, *, slow_start: bool = False) -> ProbeSettings:
    """The final check's probes: learning probes at the length the learning stages ran
    (``slow_start``: lengthened after a slow start), or, in a study with no learning stage,
    speed probes scored on throughput."""
    from verl_sweep.search.method.run_length import probe_horizon, study_run_length
    from verl_sweep.search.method.stage import stages_of

    probe = spec.probe
    if any(stage.learns for stage in stages_of(spec)):
        steps = probe.steps * (probe.slow_start_factor if slow_start else 1)
        return ProbeSettings(steps=steps, metric=Metric.REWARD_RATE, warmup_steps=probe.warmup_steps,
                             hang_timeout_s=probe.hang_timeout_s, health_screen=True, n_gpus=spec.hardware.n_gpus,
                             horizon_steps=probe_horizon(study_run_length(spec).steps, steps))
    return ProbeSettings(steps=probe.speed_steps, metric=Metric.THROUGHPUT, warmup_steps=probe.speed_warmup_steps,
                         hang_timeout_s=probe.hang_timeout_s, health_screen=False, n_gpus=spec.hardware.n_gpus,
                         settle_tolerance=probe.speed_settle_tolerance)


def speed_layout(storage: optuna.storages.BaseStorage, spec: StudySpec) -> tuple[Config, PhaseRatios] | None:
    """The baseline's learning at the layout the speed stages chose (the config the chain held
    when its first learning stage opened), and how much slower each phase of a step runs at
    the baseline's own layout: the two configs' speed probes on the same seeds and steps. None
    where no speed stage came first or changed the config, or no probes of both share a seed."""
    from verl_sweep.search.method.stage import stages_of

    first = next((i for i, stage in enumerate(stages_of(spec)) if stage.learns), 0)
    baseline = spec.baseline_config()
    results = [stored_stage_result(storage, spec, settings) for settings in spec.stages[:first]]
    last = results[-1] if results else None
    if last is None or any(r is None or r.decision is Decision.SKIPPED for r in results):
        return None
    fast = last.config
    if fast == baseline:
        return None
    # The faster config's run that won it its stage was picked for being fast: its steps read
    # high by their luck. Its confirmations and later runs were not; they count first.
    slow: dict[tuple[int, int], StepMetrics] = {}
    fast_runs: dict[bool, dict[tuple[int, int], StepMetrics]] = {True: {}, False: {}}  # picked, not
    for settings in spec.stages[:first]:
        study = stored_study(storage, stage_study_name(spec, settings))
        base = StageStudyAttrs.of(study.user_attrs).base_config if study is not None else None
        if study is None or base is None:
            continue
        for t in records(study.get_trials(deepcopy=False)):
            config = merge(base, t.overrides)
            if (t.state != TrialState.COMPLETE or t.run_dir is None or t.seed is None or t.carried_from
                    or config not in (baseline, fast)):  # a carried copy is its earlier stage's run
                continue
            into = slow if config == baseline else fast_runs[t.role is Role.CANDIDATE]
            end = t.probe.get("last_step") or 0  # where it settled
            for step in read_all(RunDir(Path(t.run_dir)).metrics):
                if spec.probe.speed_warmup_steps < step.step <= end:
                    into.setdefault((t.seed, step.step), step)
    ratios = PhaseRatios.of(slow, fast_runs[False]) or PhaseRatios.of(slow, {**fast_runs[True], **fast_runs[False]})
    return None if ratios is None else (fast, ratios)


def baseline_learning_step_s(storage: optuna.storages.BaseStorage, spec: StudySpec) -> float | None:
    """The baseline's seconds a training step over a learning probe, before the final check
    measures it: the first learning stage's own incumbent runs (the baseline's learning from
    step 1, at the speed stages' layout where they changed it, each step then re-timed to the
    baseline's layout). A speed probe's few steps read the step before the responses lengthen;
    these read a probe's whole length. None where none finished or their steps are not here."""
    from verl_sweep.search.method.run_cost import probe_step_s
    from verl_sweep.search.method.stage import stages_of

    first = next((i for i, stage in enumerate(stages_of(spec)) if stage.learns), None)
    study = None if first is None else stored_study(storage, stage_study_name(spec, spec.stages[first]))
    base = StageStudyAttrs.of(study.user_attrs).base_config if study is not None else None
    if study is None or base is None:
        return None
    layout = speed_layout(storage, spec)
    if layout is not None and layout[0] == base:
        ratios: PhaseRatios | None = layout[1]
    elif base == spec.baseline_config():
        ratios = None  # no speed stage changed the config: its runs are the baseline's own
    else:
        return None
    times = []
    for t in records(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))):
        step_s = probe_step_s(t.probe, spec.hardware.n_gpus)
        if t.role is not Role.INCUMBENT or t.carried_from or t.run_dir is None or step_s is None:
            continue
        if ratios is not None:
            steps = read_all(RunDir(Path(t.run_dir)).metrics)
            if not steps:
                continue  # its run directory is on another machine
            step_s *= time_ratio(retimed(steps, ratios), steps)
        times.append(step_s)
    return sum(times) / len(times) if times else None


def kept_runs(storage: optuna.storages.BaseStorage, spec: StudySpec, final: Config,
              probe: ProbeSettings) -> list[tuple[TrialRecord, list[StepMetrics]]]:
    """The learning stages' finished runs of ``final``, one a seed, with their steps up to the
    check's probe length (runs that stopped short of it left out). Where no learning stage
    changed the config they are its incumbent runs: the baseline's learning at the speed
    stages' layout, already run."""
    from verl_sweep.search.method.stage import stages_of

    runs: dict[int, tuple[TrialRecord, list[StepMetrics]]] = {}
    for settings, stage in zip(spec.stages, stages_of(spec)):
        study = stored_study(storage, stage_study_name(spec, settings)) if stage.learns else None
        base = StageStudyAttrs.of(study.user_attrs).base_config if study is not None else None
        if study is None or base is None:
            continue
        for t in records(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))):
            if (t.carried_from or t.run_dir is None or t.seed is None or t.seed in runs or t.score is None
                    or merge(base, t.overrides) != final):
                continue
            steps = [m for m in read_all(RunDir(Path(t.run_dir)).metrics) if 1 <= m.step <= probe.steps]
            if steps and max(m.step for m in steps) >= probe.steps:
                runs[t.seed] = (t, steps)
    return [runs[seed] for seed in sorted(runs)]


def _carried(spec: StudySpec, probe: ProbeSettings, ratios: PhaseRatios, source: TrialRecord,
             steps: list[StepMetrics]) -> tuple[float, dict[str, Any]] | None:
    """A learning stage's run of the final config as the check's run of it on its seed (its η
    and attributes), its steps re-timed the baseline's run there; None where it cannot be scored."""
    from verl_sweep.search.method.run_cost import probe_step_s

    slow = retimed(steps, ratios)
    try:
        own, baseline = score_steps(probe, steps), score_steps(probe, slow)
    except ScoreError:
        return None
    e = paired_eta([(source.seed, own)], [(source.seed, baseline)])
    ratio = time_ratio(slow, steps)
    attrs = carried_attrs(source, eta=(e.value, e.low, e.high), role=Role.CANDIDATE, score=dataclasses.asdict(own))
    attrs.update({BASELINE_SCORE: dataclasses.asdict(baseline), BASELINE_TIME_RATIO: ratio})
    step_s = probe_step_s(source.probe, spec.hardware.n_gpus)
    if step_s is not None:
        attrs[BASELINE_STEP_S] = step_s * ratio
    return e.value, attrs


@dataclasses.dataclass(frozen=True)
class Overall:
    """η of the final config against the baseline over ``n_pairs`` paired seeds."""

    eta: float
    low: float
    high: float
    n_pairs: int

    def to_attr(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, attr: dict[str, Any]) -> Overall:
        return cls(float(attr["eta"]), float(attr["low"]), float(attr["high"]), int(attr["n_pairs"]))


def stored_overall(storage: optuna.storages.BaseStorage, spec: StudySpec) -> tuple[Overall | None, list[TrialRecord]]:
    """The stored result (None until measured) and the final check's trials ([] before it opened)."""
    study = stored_study(storage, final_study_name(spec))
    if study is None:
        return None, []
    attr = study.user_attrs.get(_RESULT)
    return (Overall.of(attr) if attr else None), records(study.get_trials(deepcopy=False))


def own_baseline_runs(trials: Sequence[TrialRecord]) -> list[tuple[int | None, Score]]:
    """The baseline's runs a final config's runs carry (``BASELINE_SCORE``): its own, re-timed."""
    return [(t.seed, score) for t in trials if t.role is Role.CANDIDATE and t.state == TrialState.COMPLETE
            and (score := stored_score(t.frozen.user_attrs, BASELINE_SCORE)) is not None]


def measure(trials: Sequence[TrialRecord], retime: PhaseRatios | None = None) -> Overall | None:
    """Paired η of the final config's runs against the baseline's (None without a pair), its
    interval widened by the uncertainty of the ratios (``retime``) its baseline runs were re-timed by."""
    def runs(role: Role) -> list[tuple[int | None, Score]]:
        return [(t.seed, t.score) for t in trials
                if t.role is role and t.state == TrialState.COMPLETE and t.score is not None]

    final, baseline = runs(Role.CANDIDATE), runs(Role.INCUMBENT) + own_baseline_runs(trials)
    pairs = {s for s, _ in final} & {s for s, _ in baseline}
    if not pairs:
        return None
    e = paired_eta(final, baseline)
    if retime is not None:
        e = retime.widen(e)
    return Overall(e.value, e.low, e.high, len(pairs))


@dataclasses.dataclass
class _Active:
    trial: optuna.trial.Trial
    probe: Probe
    role: Role
    seed: int
    overrides: Config
    outcome: ProbeOutcome | None = None


class FinalCheck:
    """The final check as this driver follows it; ``tick`` until it returns False."""

    def __init__(self, spec: StudySpec, study: optuna.Study, launcher: Launcher, console: StudyListener,
                 probe: ProbeSettings) -> None:
        self.spec = spec
        self.study = study
        self.launcher = launcher
        self.console = console
        self.baseline: Config = study.user_attrs[_BASELINE]  # what its incumbent runs
        self.final: Config = study.user_attrs[_FINAL]
        retime = study.user_attrs.get(_RETIME)
        self.retime = None if retime is None else PhaseRatios.from_attr(retime)
        #: no learning stage changed the config: the final config's runs, re-timed, are the baseline's
        self.own_baseline = self.retime is not None and self.final == self.baseline
        self.probe = probe
        self.active: dict[int, _Active] = {}

    @classmethod
    def open(cls, storage: optuna.storages.BaseStorage, spec: StudySpec, final: Config, launcher: Launcher,
             console: StudyListener, *, probe: ProbeSettings) -> FinalCheck | None:
        """Create or join ``<study>.final``; None when it is skipped or already measured."""
        why = skip_reason(spec, final)
        if why is not None:
            console.note(f"final check skipped: {why}")
            return None
        name = final_study_name(spec)
        study = optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
        if _RESULT in study.user_attrs:
            return None
        if _FINAL not in study.user_attrs:
            baseline = spec.baseline_config()
            layout = speed_layout(storage, spec) if probe.metric is Metric.REWARD_RATE else None
            # no learning stage changed the config: it is the baseline's learning at the speed stages' layout
            kept = layout[1] if layout is not None and layout[0] == final else None
            if not study.get_trials(deepcopy=False):  # (else a driver stopped after queuing the runs)
                found = [] if kept is None else [_carried(spec, probe, kept, source, steps)
                                                 for source, steps in kept_runs(storage, spec, final, probe)]
                carried = [e for e in found if e is not None]
                if len(carried) >= spec.final_check.runs:
                    # its runs there are the final config's, and re-timed the baseline's: nothing runs
                    for value, attrs in carried:
                        study.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, value=value,
                                                                  user_attrs=attrs))
                else:  # the final config's runs alone where they are the baseline's learning too
                    roles = (Role.CANDIDATE,) if kept is not None else (Role.INCUMBENT, Role.CANDIDATE)
                    for seed in final_seeds(spec):  # paired: the baseline's run, then the final config's, on each seed
                        for role in roles:
                            study.enqueue_trial({}, user_attrs=Assignment(role=role, seed=seed).user_attrs())
            if layout is not None:
                baseline = layout[0]
                study.set_user_attr(_RETIME, layout[1].to_attr())
            study.set_user_attr(_BASELINE, baseline)
            study.set_user_attr(_FINAL, final)
        check = cls(spec, study, launcher, console, probe)
        check._requeue_orphans()
        copies = [t for t in check._trials() if t.carried_from is not None]
        if copies and check.retime is not None:
            seeds = ", ".join(str(t.seed) for t in copies)
            console.note(f"final check: no learning stage changed the config, so its runs there (seeds {seeds}) are "
                         f"the final config's and, their steps re-timed to the baseline's layout "
                         f"(×{check.retime.step:.2f} a step at the start), the baseline's: nothing runs")
            for t in copies:
                assert t.eta is not None and t.eta_interval is not None  # carried_attrs stores them
                console.trial_finished(study, t.number, Role.CANDIDATE, {}, eta=t.eta, interval=t.eta_interval)
            return check
        seeds = ", ".join(str(s) for s in final_seeds(spec))
        kind = ("probes" if probe.metric is Metric.REWARD_RATE
                else "speed probes, on throughput: the study has no learning stage")
        how = "" if check.retime is None else (
            f"; the baseline's learning runs at the speed stages' layout, its steps re-timed to its own "
            f"(×{check.retime.step:.2f} a step at the start)")
        if check.own_baseline:
            how += "; no learning stage changed it, so the final config's runs, re-timed, are the baseline's"
        console.note(f"final check: the final config against the baseline on fresh seeds {seeds} "
                     f"({probe.steps}-step {kind}{how})")
        return check

    def _trials(self) -> list[TrialRecord]:
        return records(self.study.get_trials(deepcopy=False))

    def _requeue_orphans(self) -> None:
        """Runs a stopped driver left RUNNING (only this driver runs the final check): closed,
        what their runs left alive killed, and queued again."""
        for t in self._trials():
            if t.state == TrialState.RUNNING and t.number not in self.active:
                self.study.tell(t.number, state=TrialState.FAIL)
                self.launcher.cleanup_leftover(Path(t.run_dir or ""))
                liveness.requeue(self.study, t.frozen, reason="its driver stopped")

    def tick(self) -> bool:
        """Start what is queued, follow the runs, tell the finished; False once it is measured."""
        trials = self._trials()
        waiting = sum(1 for t in trials if t.state == TrialState.WAITING)
        while waiting and self.launcher.free_slots() > 0:
            if not self._start():
                break
            waiting -= 1
        for item in self.active.values():
            if item.outcome is None:
                item.outcome = item.probe.poll()
        # The baseline's runs first; the final config's wait for all of them (paired η).
        for item in sorted(self.active.values(), key=lambda i: i.role is not Role.INCUMBENT):
            if item.outcome is None:
                continue
            baseline, pending = self._baseline_runs()
            if item.role is Role.CANDIDATE and pending and item.outcome.state is ProbeState.COMPLETE:
                continue
            self._tell(item, item.outcome, baseline)
            del self.active[item.trial.number]
            break  # read the trials again before the next
        if self.active or any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in self._trials()):
            return True
        self._finish()
        return False

    def _baseline_runs(self) -> tuple[list[tuple[int | None, Score]], bool]:
        """The baseline's finished runs (seed, score), and whether any is still to come."""
        mine = [t for t in self._trials() if t.role is Role.INCUMBENT]
        done = [(t.seed, t.score) for t in mine if t.state == TrialState.COMPLETE and t.score is not None]
        pending = any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in mine)
        return done, pending

    def _start(self) -> bool:
        trial = self.study.ask()
        assignment = Assignment.of(trial.user_attrs)
        role, seed = assignment.role or Role.CANDIDATE, assignment.seed or final_seeds(self.spec)[0]
        overrides = {} if role is Role.INCUMBENT else {k: v for k, v in self.final.items() if self.baseline.get(k) != v}
        config = merge(self.baseline, overrides, {"data.seed": seed})
        run_id = f"{self.spec.name}.{FINAL_STAGE}.t{trial.number:04d}"
        spec = RunSpec(run_id=run_id, overrides=tuple(to_overrides(config)), n_gpus=self.spec.hardware.n_gpus,
                       metadata={"study": self.spec.name, "stage": FINAL_STAGE, "trial": str(trial.number)})
        probe = Probe(self.launcher, spec, self.probe)
        try:
            handle = probe.start()
        except (NoCapacityError, LauncherError) as e:
            self.study.tell(trial, state=TrialState.FAIL)
            liveness.requeue(self.study, self.study._storage.get_trial(trial._trial_id), reason=str(e)[:200])
            if isinstance(e, NoCapacityError):
                return False
            raise
        set_attrs(trial, owner_attrs(liveness.owner_record()))
        set_attrs(trial, started_attrs(role=role, seed=seed, overrides=overrides, run_id=run_id,
                                       run_dir=str(handle.run_dir)))
        self.active[trial.number] = _Active(trial, probe, role, seed, overrides)
        self.console.trial_started(FINAL_STAGE, trial.number, role, overrides)
        return True

    def _tell(self, item: _Active, outcome: ProbeOutcome, baseline: list[tuple[int | None, Score]]) -> None:
        trial = item.trial
        if item.role is Role.INCUMBENT and self.retime is not None:
            outcome, ratio = self._at_baseline_layout(item, outcome)
            if ratio is not None:
                set_attrs(trial, {BASELINE_TIME_RATIO: ratio})
        elif self.own_baseline:  # the final config's run is the baseline's learning: re-timed, its run too
            own, ratio = self._at_baseline_layout(item, outcome)
            if own.score is not None and own.state is ProbeState.COMPLETE:
                set_attrs(trial, {BASELINE_SCORE: dataclasses.asdict(own.score), BASELINE_TIME_RATIO: ratio})
                baseline = [*baseline, (item.seed, own.score)]
        set_attrs(trial, outcome_attrs(probe=outcome.summary(),
                                       score=None if outcome.score is None else dataclasses.asdict(outcome.score),
                                       gpu=outcome.gpu))
        if outcome.state is ProbeState.COMPLETE and outcome.score is not None and math.isfinite(outcome.score.rate):
            score = outcome.score
            e: Eta | None
            if item.role is Role.INCUMBENT:  # against the baseline's mean, itself included
                e = eta_of(score, [s for _, s in baseline] + [score])
            else:  # against the baseline's run on the same seed
                e = paired_eta([(item.seed, score)], baseline) if baseline else None
            if e is None:  # every baseline run failed: nothing to pair with
                self.study.tell(trial, score.rate)
                self.console.trial_finished(self.study, trial.number, item.role, item.overrides, state="complete",
                                            reason="no baseline run to compare with")
                return
            set_attrs(trial, eta_attrs(e.value, e.low, e.high))
            self.study.tell(trial, e.value)
            self.console.trial_finished(self.study, trial.number, item.role, item.overrides, eta=e.value,
                                        interval=(e.low, e.high))
            return
        set_attrs(trial, reason_attrs(outcome.reason))
        self.study.tell(trial, state=TrialState.FAIL)
        attempt = Assignment.of(trial.user_attrs).attempt or 0
        failure = outcome.failure
        retried = False
        if failure is not None and failure.retryable and attempt < self.spec.probe.max_retries:
            again = Assignment(role=item.role, seed=item.seed, attempt=attempt + 1)
            frozen = self.study._storage.get_trial(trial._trial_id)
            retried = liveness.requeue(self.study, frozen, reason=outcome.reason, assignment=again) is not None
        self.console.trial_finished(self.study, trial.number, item.role, item.overrides, state="failed",
                                    reason=outcome.reason + (" (queued again)" if retried else ""), requeued=retried,
                                    stderr_tail=outcome.stderr_tail)

    def _at_baseline_layout(self, item: _Active, outcome: ProbeOutcome) -> tuple[ProbeOutcome, float | None]:
        """A run of the baseline's learning at the speed stages' layout, scored with its steps
        as long as the baseline's layout takes (``self.retime``), and its seconds over its own
        (None where it did not finish or cannot be scored so)."""
        assert self.retime is not None
        if outcome.state is not ProbeState.COMPLETE:
            return outcome, None
        steps = item.probe.steps
        slow = retimed(steps, self.retime)
        try:
            score = item.probe.score_of(slow)
        except ScoreError as e:
            return dataclasses.replace(outcome, state=ProbeState.FAILED, score=None,
                                       reason=f"cannot be scored at the baseline's layout: {e}"), None
        return dataclasses.replace(outcome, score=score), time_ratio(slow, steps)

    def _finish(self) -> None:
        trials = self._trials()
        overall = measure(trials, self.retime)
        if overall is None:
            self.console.note("final check: no seed has a finished run of both configs, so no overall η; "
                              f"the runs' reasons are in `verl-sweep status {self.spec.name}`")
            self.study.set_user_attr(_RESULT, None)
            return
        self.study.set_user_attr(_RESULT, overall.to_attr())
        on = "" if self.probe.metric is Metric.REWARD_RATE else " on throughput"
        self.console.note(f"overall gain (final check{on}, {overall.n_pairs} paired seeds): the final config against your "
                          f"baseline η {overall.eta:.3f} [{overall.low:.3f}, {overall.high:.3f}]")

    def abandon(self, *, why: str) -> None:
        """Stop this driver's runs and queue them again (Ctrl-C, SIGTERM, an error)."""
        for item in self.active.values():
            try:
                self.launcher.cancel(item.probe.handle)  # type: ignore[arg-type]
                self.study.tell(item.trial, state=TrialState.FAIL)
                liveness.requeue(self.study, self.study._storage.get_trial(item.trial._trial_id),
                                 reason=f"its driver stopped ({why})")
            except Exception:  # noqa: BLE001 - best effort on the way out; a resume re-queues the rest
                pass
        self.active.clear()
