"""The trial runner: starts, follows, reports, tells, releases and abandons one stage's runs in
this process.

Each trial is asked from Optuna (a point the proposer queued, else the sampler's draw),
admitted by the policy, turned into a run (``verl_sweep.objectives.probe.Probe`` through a
launcher), reported every few steps and told once its probe ends. What stops a run, and how an
ended one closes, the stopper decides (``verl_sweep.search.method.stopper``). A trial that cannot start is given back, its assignment queued again; on the way out
(Ctrl-C, SIGTERM, an error) every run of this process is stopped and its trial queued again.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import optuna
from optuna.trial import TrialState

from verl_sweep.launchers.base import LauncherError, NoCapacityError, RunSpec
from verl_sweep.search.engine.chain import branch_of, carried_kl
from verl_sweep.launchers.trackers import NO_TRACKERS
from verl_sweep.objectives.probe import Probe, ProbeOutcome, ProbeState
from verl_sweep.objectives.score import Score, ScoreError, eta as eta_of, paired_eta
from verl_sweep.objectives.utilisation import MIN_FREE_GB
from verl_sweep.search.database import liveness
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.method.policy import NO_RATIO, Skip, Start
from verl_sweep.search.method.stopper import CLOSED_ELSEWHERE, Running
from verl_sweep.search.database.records import (
    ChainPoint, Role, TrialRecord, eta_attrs, failure_attrs, outcome_attrs, owner_attrs, probe_rates_attrs,
    reason_attrs, set_attrs, skipped_attrs, started_attrs, stopped_attrs,
)
from verl_sweep.spaces import hardware_tag
from verl_sweep.spaces.base import SpaceError
from verl_sweep.verl_knowledge import baseline_allowance, estimate, fit_limit_gb, fit_problem, over_limit_problem
from verl_sweep.verl_knowledge import Config, merge, to_overrides

if TYPE_CHECKING:
    from verl_sweep.launchers.base import Launcher
    from verl_sweep.search.engine.events import StudyListener
    from verl_sweep.search.database.records import StageView
    from verl_sweep.search.method.policy import StagePolicy
    from verl_sweep.search.method.stopper import Stopper
    from verl_sweep.search.engine.stage_study import StageStudy
    from verl_sweep.search.spec.study_file import StudySpec
    from verl_sweep.spaces.base import Space

logger = logging.getLogger(__name__)


def tell(study: optuna.Study, trial: optuna.trial.Trial, value: float | None = None, *,
         state: TrialState | None = None) -> None:
    """``study.tell``, raising UpdateFinishedTrialError (as every other write to the trial does)
    when another process closed the trial meanwhile (a stage run ahead moved aside, a heartbeat
    that looked stale): Optuna's tell raises a ValueError then, "Cannot tell a FAIL trial"."""
    try:
        study.tell(trial, value, state=state)
    except ValueError:
        if not study._storage.get_trial(trial._trial_id).state.is_finished():
            raise
        raise optuna.exceptions.UpdateFinishedTrialError(
            f"trial {trial.number} was closed by another process") from None


@dataclasses.dataclass
class ActiveTrial:
    """A trial whose run this process follows."""

    trial: optuna.trial.Trial
    probe: Probe
    role: Role
    seed: int
    overrides: Config
    rerun_of: int | None
    next_report_step: int
    outcome: ProbeOutcome | None = None
    #: its running rates read to the probe's own last step, by step (``Score.probe_rate``)
    probe_rates: dict[int, float] = dataclasses.field(default_factory=dict)


class TrialRunner:
    """The runs of one stage that this process follows (``active``, by trial number)."""

    def __init__(self, launcher: Launcher, console: StudyListener, study: StageStudy, policy: StagePolicy,
                 stopper: Stopper, space: Space, base: Config, *, run_prefix: str,
                 branch: ChainPoint | None = None) -> None:
        """``branch``: train mode's checkpoint the stage's runs branch from."""
        self.stage = policy.stage
        self.branch = branch
        self.spec = policy.spec
        self.launcher = launcher
        self.console = console
        self.study = study
        self.policy = policy
        self.stopper = stopper
        self.space = space
        self.base = base
        self.run_prefix = run_prefix
        self.active: dict[int, ActiveTrial] = {}

    @property
    def stage_name(self) -> str:
        return self.stage.name

    # -- starting ---------------------------------------------------------------------------------
    def start_while(self, view: StageView, *, more: Callable[[StageView], bool]) -> StageView:
        """Start trials while a launcher slot is free (``start`` each); after each the
        stage is read again (``StageStudy.view``) and ``more`` (the proposer's) says whether
        another may start. Ends at the first that did not start; returns the view last read.
        Each start reads the stage once, after its ask, and the policy admits the trial on that
        view: with many workers, a view held from before starts nothing that the others have
        already filled the budget with."""
        while self.launcher.free_slots() > 0:
            started = self.start()
            view = self.study.view()
            if not started or not more(view):
                break
        return view

    def start(self) -> bool:
        """Ask Optuna for a trial (a queued point first, else the sampler draws), let the policy
        admit it on the stage read once, fresh (``StagePolicy.admit``), and launch its run;
        False when it did not start (skipped, given back, or closed by another process
        meanwhile). Raises on bad input or a launcher error (the trial given back first)."""
        study = self.study.study
        trial = study.ask()
        try:
            # Heartbeat and owner first: a trial without them could never be found stale.
            self.study.heartbeat([trial._trial_id])
            set_attrs(trial, owner_attrs(liveness.owner_record()))
            return self._start_asked(trial)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Closed by another process while starting (its stage moved aside): nothing to give back.
            self.study.stale = True
            return False
        except BaseException as e:
            if trial.number not in self.active:
                try:
                    self.release(trial, reason=f"could not start: {str(e)[:200] or type(e).__name__}")
                except Exception:  # noqa: BLE001 - the heartbeat closes it later
                    logger.warning("could not release trial %d", trial.number, exc_info=True)
            raise

    def _memory_allowance(self) -> float:
        """The baseline's estimated peak where the baseline is the user's run that fits
        (``verl_sweep.verl_knowledge.memory.baseline_allowance``), or where the pre-flight accepted it within the
        GPU's memory (configs up to the user's own run are not refused), computed once."""
        if not hasattr(self, "_allowance_gb"):
            model, hardware, baseline = self.spec.model, self.spec.hardware, self.spec.baseline_config()
            found = estimate(model, hardware, baseline)
            accepted = min(found.peak_gb, hardware.gpu_memory_gb) if found is not None else 0.0
            self._allowance_gb = max(baseline_allowance(model, hardware, baseline), accepted)
        return self._allowance_gb

    def _memory_problem(self, config: Config) -> str | None:
        """Why ``config`` must not start on real GPUs, by the memory estimate: beyond what any
        config of the study may reach (``verl_sweep.verl_knowledge.memory.fit_limit_gb``), or over the usable
        share of the GPU beyond the baseline's own peak. A simulator's own world decides what
        runs out of memory (the study's baseline is refused on every launcher before)."""
        if not self.launcher.real_gpus:
            return None
        model, hardware = self.spec.model, self.spec.hardware
        limit = fit_limit_gb(model, hardware, self.spec.baseline_config())
        problem = over_limit_problem(model, hardware, config, limit_gb=limit)
        return problem or fit_problem(model, hardware, config, allowance_gb=self._memory_allowance())

    def _skip(self, trial: optuna.trial.Trial, skip: Skip) -> bool:
        set_attrs(trial, skipped_attrs(skip.closed_as, skip.reason))
        tell(self.study.study, trial, state=TrialState.FAIL)
        self.study.stale = True
        return False

    def _start_asked(self, trial: optuna.trial.Trial) -> bool:
        view = self.study.view(fresh=True)  # the one read of this admission: it holds the asked trial
        decision = self.policy.admit(view, view.record(trial.number), datetime.datetime.now())
        if isinstance(decision, Skip):
            return self._skip(trial, decision)
        return self._launch(trial, view, decision)

    def _launch(self, trial: optuna.trial.Trial, view: StageView, decision: Start) -> bool:
        """Turn an admitted trial into a run: its parameters, seed, memory check and probe."""
        study, policy, base = self.study.study, self.policy, self.base
        role = decision.role
        try:
            overrides = self.space.suggest(trial, base) if (role is not Role.INCUMBENT or trial.params) else {}
        except SpaceError as e:
            tell(study, trial, state=TrialState.FAIL)
            self.study.stale = True
            raise BadInputError(f"stage {self.stage_name}: {e}") from None
        if role is Role.INCUMBENT:
            overrides = {k: v for k, v in overrides.items() if base.get(k) != v}
        seed = decision.seed if decision.seed is not None else policy.point_seed(view, trial.number, trial.params)
        config = merge(base, overrides, {"data.seed": seed})
        too_big = self._memory_problem(config)
        if too_big is not None:
            # Refused before launch: on a real node the probe would cost minutes of start-up
            # and then run out of memory. Infeasible, as a real OOM is (the sampler learns it).
            set_attrs(trial, failure_attrs("oom", hardware_tag(self.spec.hardware)))
            set_attrs(trial, reason_attrs(f"oom: memory pre-flight: {too_big}"))
            trial.set_constraint("oom", 1.0)
            tell(study, trial, state=TrialState.FAIL)
            self.study.stale = True
            self.console.trial_finished(study, trial.number, role, overrides, reason="oom: memory pre-flight: "
                                        + too_big, state="failed")
            return False
        run_id = f"{self.run_prefix}.t{trial.number:04d}"
        if self.branch is not None:
            config = merge(config, carried_kl(self.branch, config, base))
        spec = RunSpec(
            run_id=run_id,
            overrides=tuple(to_overrides(config)),
            n_gpus=self.spec.hardware.n_gpus,
            metadata={"study": self.spec.name, "stage": self.stage_name, "trial": str(trial.number),
                      **({} if self.spec.probe.trackers else NO_TRACKERS)},
            branch=branch_of(self.stage, self.branch, config, base) if self.branch is not None else None,
        )
        probe = Probe(self.launcher, spec, self.stage.probe)
        try:
            handle = probe.start()
        except NoCapacityError:
            self.release(trial, reason="no free launcher slot")
            return False
        except LauncherError as e:
            self.release(trial, reason=str(e))
            raise
        try:
            started = started_attrs(role=role, seed=seed, overrides=overrides, run_id=run_id, run_dir=str(handle.run_dir))
            held = trial.user_attrs  # a queued trial holds the role and seed it was queued with
            set_attrs(trial, {k: v for k, v in started.items() if k not in held or held[k] != v})
            self.study.heartbeat([trial._trial_id])
        except BaseException:
            self.launcher.cancel(handle)  # nobody would follow it: never leave it running
            raise
        self.active[trial.number] = ActiveTrial(trial, probe, role, seed, overrides, view.record(trial.number).rerun_of,
                                                next_report_step=self.stage.start_step + self.stage.report_every)
        self.study.refresh(trial._trial_id)  # the view held now has this run's parameters, seed and role
        self.console.trial_started(self.stage_name, trial.number, role, overrides)
        return True

    def release(self, trial: optuna.trial.Trial, *, reason: str) -> None:
        """Give back a trial we asked for but could not start (its assignment re-queued)."""
        record = self.study.record(trial._trial_id)
        if record.state.is_finished():
            return  # closed meanwhile by another process, which queued it again where needed
        tell(self.study.study, trial, state=TrialState.FAIL)
        liveness.requeue(self.study.study, record.frozen, reason=reason)
        self.study.stale = True

    def adopt_or_close_orphans(self) -> None:
        """Trials a dead driver left RUNNING: follow their run again where the launcher can
        re-attach (a Ray job outlives its submitter), else close them, kill what their run
        left behind, and queue them again."""
        study = self.study.study
        adopted, closed = [], []
        for frozen in liveness.orphaned_trials(study):
            record = TrialRecord.of(frozen)
            handle = self.launcher.reattach(record.run_id) if record.run_id else None
            outcome = None
            if handle is not None and record.run_id is not None:
                probe = Probe(self.launcher, RunSpec(run_id=record.run_id, overrides=(),
                                                     n_gpus=self.spec.hardware.n_gpus), self.stage.probe)
                probe.attach(handle)
                outcome = probe.poll()
                if outcome is not None and outcome.state is ProbeState.FAILED:
                    handle = None  # it died with its driver: nothing to follow
            if handle is not None:
                trial = optuna.trial.Trial(study, frozen._trial_id)  # a live handle to report and tell on
                set_attrs(trial, owner_attrs(liveness.owner_record()))
                self.study.heartbeat([frozen._trial_id])
                self.active[frozen.number] = ActiveTrial(
                    trial, probe, record.role, record.seed or 0, dict(record.overrides), record.rerun_of,
                    next_report_step=self.stage.start_step + self.stage.report_every, outcome=outcome,
                )
                adopted.append(frozen.number)
                continue
            if liveness.close_and_requeue(study, frozen, reason="its driver process died"):
                closed.append(frozen.number)
                self.launcher.cleanup_leftover(Path(record.run_dir or ""))
        if adopted:
            self.console.note(f"re-attached to the runs of trial(s) {', '.join(map(str, adopted))} left by a dead driver")
        if adopted or closed:
            self.study.stale = True
        if closed:
            self.console.note(
                f"closed {len(closed)} trial(s) left running by a dead driver and queued them again: "
                + ", ".join(map(str, closed))
            )

    # -- following --------------------------------------------------------------------------------
    def poll(self, trials: Sequence[TrialRecord]) -> None:
        """Follow each run: its probe's news (an end, or a report the pruner judges), then stop
        the runs that no longer count in ``trials`` (the stage as last read)."""
        for item in list(self.active.values()):
            if item.outcome is not None:
                continue
            outcome = item.probe.poll()
            if outcome is None:
                self._report(item)
            else:
                item.outcome = outcome
            self.console.trial_progress(self.stage_name, item.trial.number, item.probe)
        self.stop_runs_that_no_longer_count(trials)

    def heartbeat(self) -> None:
        self.study.heartbeat([item.trial._trial_id for item in self.active.values()])

    def stop_runs_that_no_longer_count(self, trials: Sequence[TrialRecord]) -> None:
        """Stop this worker's runs whose results could no longer count
        (``Stopper.no_longer_counting``)."""
        running = [Running(number, item.role, item.rerun_of) for number, item in self.active.items()
                   if item.outcome is None]
        for number, stop in self.stopper.no_longer_counting(running, trials).items():
            self.active[number].outcome = self.active[number].probe.stop(stop.state, reason=stop.reason)

    def _report(self, item: ActiveTrial) -> None:
        """Report the running rate every K steps; the stopper asks the pruner (candidates only)."""
        follower = item.probe.follower
        if follower is None or follower.last_step < item.next_report_step:
            return
        step = item.next_report_step
        item.next_report_step += self.stage.report_every
        score = item.probe.running_score()
        if score is None or not math.isfinite(score.rate):
            return
        try:
            item.trial.report(score.rate, step)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Closed meanwhile by another process (its heartbeat looked stale) and queued again
            # there: stop this run; tell_finished then drops the result instead of doubling it.
            item.outcome = item.probe.stop(CLOSED_ELSEWHERE.state, reason=CLOSED_ELSEWHERE.reason)
            return
        if score.probe_rate is not None and math.isfinite(score.probe_rate):
            item.probe_rates[step] = score.probe_rate
            set_attrs(item.trial, probe_rates_attrs(item.probe_rates))
        if item.role is Role.INCUMBENT:
            self.study.refresh(item.trial._trial_id)  # the pruner compares candidates with this curve
        stop = self.stopper.after_report(item.role, step, score.rate, item.trial.should_prune)
        if stop is not None:
            item.outcome = item.probe.stop(stop.state, reason=stop.reason)

    # -- telling ----------------------------------------------------------------------------------
    def tell_finished(self, trials: Sequence[TrialRecord]) -> bool:
        """Tell Optuna every finished probe it can; True when something was told. A told trial
        is read again into the stage's view (a failure queued again makes it read whole).

        Incumbent runs are told at once, with η against the incumbent runs told so far (so
        workers never wait on each other's incumbents); candidates wait until every incumbent
        run is told, then get η against their mean."""
        finished = [item for item in self.active.values() if item.outcome is not None]
        if not finished:
            return False
        told = False
        scores, complete = self.policy.incumbent_runs(trials)
        for item in sorted(finished, key=lambda i: i.role is not Role.INCUMBENT):
            outcome = item.outcome
            assert outcome is not None
            if outcome.state is ProbeState.COMPLETE and item.role is not Role.INCUMBENT and not complete:
                continue  # η needs every incumbent run; tell once they are done
            against = scores
            if item.role is Role.INCUMBENT and outcome.score is not None and outcome.state is ProbeState.COMPLETE:
                against = scores + [(item.seed, outcome.score)]
            try:
                if self._tell(item, outcome, against):
                    self.study.stale = True
                else:
                    self.study.refresh(item.trial._trial_id)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Closed meanwhile by another process (its heartbeat looked stale): its
                # assignment was queued again there, so this result is dropped, not doubled.
                self.console.note(f"{self.study.name}: trial {item.trial.number} was closed by another worker")
                self.study.stale = True
            del self.active[item.trial.number]
            told = True
            if item.role is Role.INCUMBENT:
                return told  # re-read before telling candidates against the new incumbent set
        return told

    def _tell(self, item: ActiveTrial, outcome: ProbeOutcome, incumbents: list[tuple[int | None, Score]]) -> bool:
        """Store the outcome and tell it; True when its assignment was queued again (a new trial)."""
        study, trial = self.study.study, item.trial
        set_attrs(trial, outcome_attrs(probe=outcome.summary(),
                                       score=None if outcome.score is None else dataclasses.asdict(outcome.score),
                                       gpu=outcome.gpu))
        if outcome.gpu is not None:
            free = outcome.gpu.get("min_free_gb")
            if free is not None:
                # The method's guard as a constraint: free GPU memory must stay above 5 GB.
                trial.set_constraint("free_gpu_memory", MIN_FREE_GB - float(free))
        console = self.console
        closes_as = self.stopper.closes_as(outcome)
        if closes_as == TrialState.COMPLETE:
            assert outcome.score is not None
            try:
                if item.role is Role.INCUMBENT and not outcome.score.rate > 0:
                    raise ScoreError(f"the incumbent's rate must be > 0 to form a ratio, but got {outcome.score.rate:.3g}")
                if item.role is Role.INCUMBENT:  # against the incumbent's mean, itself included
                    eta = eta_of(outcome.score, [score for _, score in incumbents])
                else:  # against the incumbent's run on the same seed where there is one
                    eta = paired_eta([(item.seed, outcome.score)], incumbents)
            except ScoreError as e:
                # A train-mode branch at the chain's ceiling: its incumbent's reward no longer
                # rises, and no ratio can be formed (a search-mode probe always rises).
                outcome = dataclasses.replace(outcome, reason=f"{NO_RATIO}: {e}")
                closes_as = TrialState.FAIL
        if closes_as == TrialState.COMPLETE:
            assert outcome.score is not None
            set_attrs(trial, eta_attrs(eta.value, eta.low, eta.high))
            study.tell(trial, eta.value, skip_if_finished=True)
            console.trial_finished(study, trial.number, item.role, item.overrides, eta=eta.value,
                                   interval=(eta.low, eta.high))
            return False
        set_attrs(trial, reason_attrs(outcome.reason))
        if closes_as == TrialState.PRUNED:
            tell(study, trial, state=TrialState.PRUNED)
            console.trial_finished(study, trial.number, item.role, item.overrides, reason=outcome.reason,
                                   state="pruned")
            return False
        failure = outcome.failure
        if failure is not None:
            oom = failure.value == "oom"
            # Out of memory is infeasible, not broken: a constraint the sampler and the spaces
            # can learn from (spaces keep later trials on this hardware below the value that ran out).
            set_attrs(trial, failure_attrs(failure.value, hardware_tag(self.spec.hardware) if oom else None))
            if oom:
                trial.set_constraint("oom", 1.0)
        record = self.study.record(trial._trial_id)
        tell(study, trial, state=TrialState.FAIL)
        again = self.stopper.retry(outcome, record)
        retried = again is not None and liveness.requeue(study, record.frozen, reason=outcome.reason,
                                                         assignment=again) is not None
        console.trial_finished(study, trial.number, item.role, item.overrides,
                               reason=outcome.reason + (" (queued again)" if retried else ""), state="failed",
                               requeued=retried, stderr_tail=outcome.stderr_tail,
                               log_path=str(item.probe.handle.stderr_path) if item.probe.handle else "")
        return retried

    # -- leaving ----------------------------------------------------------------------------------
    def abandon(self, *, why: str) -> None:
        """Stop this process's runs and queue their trials again (Ctrl-C, SIGTERM, an error)."""
        for item in self.active.values():
            try:
                self.cancel(item)
                record = self.study.record(item.trial._trial_id)
                if record.state == TrialState.RUNNING:
                    set_attrs(item.trial, stopped_attrs(f"its driver stopped ({why})"))
                    self.study.study.tell(item.trial, state=TrialState.FAIL)
                    liveness.requeue(self.study.study, record.frozen, reason=f"its driver stopped ({why})")
            except Exception:  # noqa: BLE001 - best effort on the way out; the heartbeat covers the rest
                logger.exception("could not close trial %d", item.trial.number)
        self.active.clear()

    def cancel(self, item: ActiveTrial) -> None:
        """Kill the trial's run if it is still going; the caller closes the trial."""
        if item.outcome is None and item.probe.handle is not None:
            self.launcher.cancel(item.probe.handle)

    def cancel_all(self) -> None:
        for item in self.active.values():
            self.cancel(item)
