"""The stage policy: the method's rules over an immutable view of a stage's trial records.

Pure: no storage, no launcher and no clock of its own (the time is passed in). The proposer
(``search/method/proposer.py``) asks it which confirmations to queue, the stopper
(``search/method/stopper.py``) whether a trial may start, the trial runner whether an asked
trial starts and on which seed, the driver which config leads and what the stage decides.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
from typing import TYPE_CHECKING, Any, Sequence

from optuna.trial import TrialState

from verl_sweep.objectives.score import Eta, Score, ScoreError, eta as eta_of, paired_eta
from verl_sweep.search.spec.errors import SweepError
from verl_sweep.search.database.records import (
    FOLLOW_UP_ORIGIN, START_ORIGIN, Assignment, CloseReason, Decision, Role, StageResult, TrialRecord, requeued_numbers,
)
from verl_sweep.verl_knowledge import Config, merge

if TYPE_CHECKING:
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.spec.study_file import StageSettings, StudySpec

#: an idle worker starts an extra confirmation only while the stage is still expected to wait
#: this fraction of a probe for other workers' probes (it delays the stage by at most the rest)
EXTRA_RERUN_MIN_WAIT = 0.9
#: a leader above 1 + tolerance whose interval clears the incumbent (η 1) but still reaches
#: 1 + tolerance wins once it has this many runs (its first run, picked as the stage's best,
#: is then diluted by two fresh seeds). With a 2-run incumbent the interval's half
#: width cannot fall below ~1.2× a run's seed spread, so without this, gains of a few percent
#: are never decided (docs/method.md, Evidence).
CLEAR_OF_INCUMBENT_RUNS = 3
#: a leader above 1 + tolerance that has had every run it may get (``confirm_max_runs``) and
#: is still undecided wins if it beats the incumbent with at least this probability (normal
#: on the log scale of its interval): further runs cannot be had, and keeping the incumbent
#: throws away the better bet (docs/method.md, Evidence).
LIKELY_BETTER = 0.8
Trials = Sequence[TrialRecord]
#: a candidate's η over its runs: (value, low, high, number of runs)
Pooled = tuple[float, float, float, int]


#: a first learning stage whose incumbent runs' mean ``Score.late_gain`` is at least this saw
#: the reward still rising at its fastest in the probe's last quarter: a slow start. (A curve
#: that bends inside the probe reads well below it; docs/method.md, Evidence.)
SLOW_START_LATE_GAIN = 0.9


#: the reason of a run whose rate forms no ratio: a train-mode branch whose incumbent's reward
#: no longer rose over its window (search-mode probes always rise)
NO_RATIO = "no η"


def slow_start(incumbent_runs: Sequence[Score]) -> bool | None:
    """Did the incumbent's reward still accelerate at the probe's end? None without a reading."""
    gains = [s.late_gain for s in incumbent_runs if s.metric == "reward_rate" and s.late_gain is not None]
    return None if not gains else statistics.fmean(gains) >= SLOW_START_LATE_GAIN


def incumbent_run_etas(trials: Trials) -> dict[int, Eta]:
    """η of each finished incumbent run against the mean of all of them. (An incumbent run's
    Optuna value is its η against the runs told before it, which depends on their order.)"""
    runs = {t.number: t.score for t in trials
            if t.state == TrialState.COMPLETE and t.role is Role.INCUMBENT and t.score is not None}
    return {number: eta_of(score, list(runs.values())) for number, score in runs.items()}


@dataclasses.dataclass(frozen=True)
class QueuedRun:
    """A run to queue on ``of``'s point with ``assignment``: a confirmation (a re-run of a
    candidate) or an incumbent run that pairs a leader's (``incumbent_partners``)."""

    of: TrialRecord
    assignment: Assignment


@dataclasses.dataclass(frozen=True)
class Start:
    """``admit``: start the asked trial as ``role`` on ``seed`` (None: a point the sampler
    proposes, whose seed ``point_seed`` picks once its parameters are known)."""

    role: Role
    seed: int | None


@dataclasses.dataclass(frozen=True)
class Skip:
    """``admit``: give the asked trial back unstarted, closed as ``closed_as`` for ``reason``."""

    closed_as: CloseReason
    reason: str


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    """The rules of one stage of one study."""

    stage: Stage

    @property
    def spec(self) -> StudySpec:
        return self.stage.spec

    @property
    def rules(self) -> StageSettings:
        """The stage's settings in the study file: budget, stop rule, confirmations."""
        return self.stage.settings

    @property
    def threshold(self) -> float:
        """η a candidate must beat to win: 1 + the stop rule's tolerance."""
        return 1 + self.rules.stop.tolerance

    def significant(self, low: float, n_runs: int) -> bool:
        """Do a leader's runs decide its gain (its η already above 1 + tolerance)? Its interval
        clears 1 + tolerance, or it clears the incumbent over ``CLEAR_OF_INCUMBENT_RUNS`` runs."""
        return low > self.threshold or (low > 1.0 and n_runs >= CLEAR_OF_INCUMBENT_RUNS)

    def undecided(self, value: float, low: float, high: float, n_runs: int) -> bool:
        """Is a leader's gain still open: above the incumbent, its interval reaching above
        1 + tolerance, and not ``significant`` above it?"""
        return value > 1.0 and high > self.threshold and not (value > self.threshold and self.significant(low, n_runs))

    # -- admission ----------------------------------------------------------------------------------
    def admit(self, view: Trials, asked: TrialRecord, now: datetime.datetime) -> Start | Skip:
        """Whether the trial just asked (``asked``, in ``view``: the stage as read after the
        ask) starts, as what and on which seed; one decision on one view. A fresh candidate
        counts in the budget only if fewer than max_trials counted trials were asked before it
        (another worker may have taken the last place between our count and the ask); a
        queued incumbent or re-run is skipped when another worker queued the same one; an
        extra re-run queued to fill a wait that is over by now would lengthen the stage."""
        role, assignment = asked.role, asked.assignment
        if role is Role.CANDIDATE and self.over_budget(view, asked.number):
            return Skip(CloseReason.OVER_BUDGET, "over budget: the stage's budget was used up before this trial could start")
        if role is Role.INCUMBENT and assignment.seed is not None and self.redundant_incumbent_run(asked, view):
            return Skip(CloseReason.REDUNDANT, "redundant incumbent run: another worker queued the same one")
        if role is Role.RERUN:
            if assignment.idle_fill and not self.worth_waiting(view, now):
                return Skip(CloseReason.REDUNDANT, "extra re-run no longer fits in the stage's wait")
            seed = self.rerun_seed(asked, view)
            if seed is None:
                return Skip(CloseReason.REDUNDANT, "redundant re-run: other workers queued the same confirmation")
            return Start(role, seed)
        return Start(role, assignment.seed)

    def point_seed(self, view: Trials, number: int, params: dict[str, object]) -> int:
        """The seed of a point the sampler proposed (``Start.seed`` None): the study's first,
        or a fresh one when the point was measured already (``seed_for_point``)."""
        return self.seed_for_point(number, params, view, self.spec.seeds[0])

    # -- the budget and the stop rule ---------------------------------------------------------
    def counted(self, trials: Trials) -> int:
        """Trials that use the stage's search budget: all but failures that were queued again,
        the confirmation re-runs (which come on top, at most ``confirm_top``) and the extra
        incumbent runs carried from the previous stage."""
        requeued = requeued_numbers(trials)
        return sum(1 for t in trials if t.number not in requeued and t.role not in (Role.RERUN, Role.SKIPPED)
                   and not self.extra_incumbent_run(t))

    def extra_incumbent_run(self, t: TrialRecord) -> bool:
        """A run of the incumbent on a seed beyond the incumbent's own: carried from the
        previous stage (``StageStudy.enqueue_initial``), or run to pair a leader's runs
        (``incumbent_partners``). Like a confirmation, it is outside the search budget."""
        own = {self.spec.seeds[r % len(self.spec.seeds)] for r in range(self.spec.probe.incumbent_repeats)}
        return t.role is Role.INCUMBENT and t.seed not in own

    def redundant_incumbent_run(self, trial: TrialRecord, trials: Trials) -> bool:
        """An extra incumbent run whose seed an earlier incumbent run already has: two workers
        queued the same partner at once (``incumbent_partners``)."""
        return self.extra_incumbent_run(trial) and any(
            t.number < trial.number and t.role is Role.INCUMBENT and t.seed == trial.seed
            and t.state != TrialState.FAIL for t in trials)

    def may_start(self, trials: Trials) -> bool:
        if any(t.state == TrialState.WAITING for t in trials):
            return True  # queued work (incumbents, re-queued trials) is already inside the budget
        if self.counted(trials) >= self.rules.budget.max_trials:
            return False
        # A candidate started while others run is wasted if they end the stage: wait for them.
        return not self.stable(trials, running_as_flat=True)

    def over_budget(self, trials: Trials, number: int) -> bool:
        """Budgets hold across workers: a fresh trial counts only if fewer than max_trials
        counted trials have a smaller number (numbers are assigned by the database). The trial
        itself is in the count, so that a trial queued again replaces the failure it retries."""
        return self.counted([t for t in trials if t.number <= number]) > self.rules.budget.max_trials

    def stable(self, trials: Trials, *, running_as_flat: bool = False) -> bool:
        """The method's stop rule: none of the last N finished candidates (pruned ones too,
        under ``count_pruned``) beat the best before them (the incumbent at first, η = 1) by
        more than the tolerance. ``running_as_flat``: whether it holds once the candidates
        running now end without beating it."""
        ended = (TrialState.COMPLETE, TrialState.PRUNED) if self.rules.stop.count_pruned else (TrialState.COMPLETE,)
        done = sorted((t for t in trials if t.state in ended and t.role is Role.CANDIDATE),
                      key=lambda t: (t.datetime_complete, t.number))
        if running_as_flat:
            done += [t for t in trials if t.state == TrialState.RUNNING and t.role is Role.CANDIDATE]
        n = self.rules.stop.stable_trials
        if len(done) < n:
            return False
        best_before = max([1.0] + [float(t.value) for t in done[:-n]
                                   if t.value is not None and t.state == TrialState.COMPLETE])
        return all(t.state != TrialState.COMPLETE or (t.value or 0.0) <= best_before * self.threshold
                   for t in done[-n:])

    # -- seeds ----------------------------------------------------------------------------------
    def fresh_seeds(self) -> list[int]:
        """Seeds for confirmations, in order (``unused_fresh_seeds`` leaves out a point's own):
        the incumbent's seeds come first, so that a re-run has the incumbent's run on its seed
        to pair with (``paired_eta``); a candidate was chosen on its own seed only."""
        return list(self.spec.seeds)

    def unused_fresh_seeds(self, point: dict[str, object] | None, trials: Trials, *,
                           before: int | None = None) -> list[int]:
        """Fresh seeds no run of ``point`` has (queued, running or finished; only runs
        numbered below ``before`` when given). A queued trial's parameters are its fixed ones."""
        used = {t.seed for t in trials if t.seed is not None and t.state != TrialState.FAIL
                and (before is None or t.number < before) and t.point == point}
        return [s for s in self.fresh_seeds() if s not in used]

    def seed_for_point(self, number: int, params: dict[str, object], trials: Trials, seed: int) -> int:
        """A sampler that proposes a point already measured gets a fresh seed for it, so the
        probe is an independent replicate instead of an exact (deterministic) repeat."""
        if not params:
            return seed
        used = {t.seed for t in trials if t.number != number and t.params == params and t.seed is not None
                and t.state != TrialState.FAIL}
        return next((s for s in self.spec.seeds if s not in used), seed)

    def rerun_seed(self, trial: TrialRecord, trials: Trials) -> int | None:
        """The seed a queued re-run starts on; None when it is redundant. Workers that queue
        confirmations at the same moment queue the same ones: a required re-run counts only as
        the first required re-run of its trial, and every re-run takes the first fresh seed
        that no run of the same point numbered below it has (so no two runs of a point are the
        same run twice, which would pool as two); none left makes an extra re-run redundant."""
        target = trial.rerun_of
        if not trial.extra:
            requeued = requeued_numbers(trials)
            if any(t.number < trial.number and t.number not in requeued and t.role is Role.RERUN
                   and t.rerun_of == target and not t.extra for t in trials):
                return None
        original = next((t for t in trials if t.number == target), None)
        free = self.unused_fresh_seeds(original.params, trials, before=trial.number) if original else []
        if free:
            return free[0]
        if trial.extra:
            return None
        # A required re-run always runs (the decision needs it), even when twins of the point
        # have used every fresh seed: then on the seed it was queued with.
        return trial.seed if trial.seed is not None else self.fresh_seeds()[0]

    def worth_waiting(self, trials: Trials, now: datetime.datetime) -> bool:
        """True while the stage is expected to wait for other workers' probes for at least
        EXTRA_RERUN_MIN_WAIT of a probe's length (the median of its finished probes): an extra
        re-run started now uses a worker that would sit idle and delays the stage by at most
        the rest of a probe. Start times are the database's (Optuna's ask times); ``now`` on
        the same clock."""
        lengths = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials
                   if t.state == TrialState.COMPLETE and t.datetime_start and t.datetime_complete and t.started]
        if not lengths:
            return False
        probe_s = statistics.median(lengths)
        wait_s = max(((t.datetime_start - now).total_seconds() + probe_s for t in trials
                      if t.state == TrialState.RUNNING and t.datetime_start), default=0.0)
        return wait_s >= EXTRA_RERUN_MIN_WAIT * probe_s

    # -- confirmations ----------------------------------------------------------------------------
    def confirmations(self, trials: Trials, *, extra: bool, now: datetime.datetime) -> list[QueuedRun]:
        """Re-runs of the top candidates on fresh seeds to queue (none: nothing to queue).
        Required: one re-run of each of the top ``confirm_top`` that has none. Extra
        (``extra=True``, for workers that would sit idle while others finish the stage): one
        more re-run of the least-confirmed top candidate that has a fresh seed left, only
        while the stage is expected to wait for its other probes anyway (``worth_waiting``,
        checked again when it starts: ``idle_fill``)."""
        idle_fill = extra
        if self.rules.confirm_top == 0:
            return []
        requeued = requeued_numbers(trials)
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.role is Role.CANDIDATE
                and t.value is not None and not t.infeasible and float(t.value) > 1.0]
        top: list[TrialRecord] = []
        for t in sorted(done, key=lambda t: float(t.value), reverse=True):  # type: ignore[arg-type]
            # A point the sampler proposed twice is one candidate: confirm it once.
            if len(top) < self.rules.confirm_top and all(t.params != other.params for other in top):
                top.append(t)
        reruns = [t for t in trials if t.role is Role.RERUN and t.number not in requeued]
        count = {t.number: sum(r.rerun_of == t.number for r in reruns) for t in top}
        if extra:
            open_ = [t for t in top if self.unused_fresh_seeds(t.params, trials)]
            if not open_ or not self.worth_waiting(trials, now):
                return []
            targets = [min(open_, key=lambda t: count[t.number])]
        else:
            targets = [t for t in top if count[t.number] == 0]
            if not targets:
                # Runs beyond the first re-run are "extra": they need a fresh seed of their own.
                ranked, _ = ranked_candidates(trials)
                targets, extra = self.undecided_leader(trials, ranked), True
                if not targets:
                    return self.incumbent_partners(trials, ranked)
        # The seed is checked again when the re-run starts (rerun_seed): workers that queue at
        # the same moment pick the same one here.
        return [QueuedRun(t, Assignment(role=Role.RERUN, rerun_of=t.number, extra=extra, idle_fill=idle_fill,
                                    seed=(self.unused_fresh_seeds(t.params, trials) or self.fresh_seeds())[0]))
                for t in targets]

    def early_confirmation(self, trials: Trials) -> QueuedRun | None:
        """Idle, with nothing finished to re-run: the confirmation of the running candidate
        with the best running η above the tolerance, past the pruner's warm-up (no re-run yet,
        a fresh seed left). It is the one a finished leader would need anyway; started now,
        the stage does not wait a whole probe for it after the first run ends. If the first
        run is pruned after all, the re-run is stopped (``TrialRunner``)."""
        if self.rules.confirm_top == 0:
            return None
        rerun_of = {t.rerun_of for t in trials if t.role is Role.RERUN and t.state != TrialState.FAIL}
        running = [(e, t) for e, t in running_etas(trials)
                   if e is not None and e > self.threshold and t.state == TrialState.RUNNING
                   and max(t.intermediate_values) >= self.stage.prune_from and t.number not in rerun_of
                   and self.unused_fresh_seeds(t.params, trials)]
        if not running:
            return None
        _, target = max(running, key=lambda item: item[0])
        seed = self.unused_fresh_seeds(target.params, trials)[0]
        return QueuedRun(target, Assignment(role=Role.RERUN, rerun_of=target.number, seed=seed, extra=False,
                                            idle_fill=False))

    def undecided_leader(self, trials: Trials, ranked: list[tuple[Pooled, TrialRecord]] | None = None) -> list[TrialRecord]:
        """The would-be winner, when its runs so far neither decide its gain (``significant``)
        nor put it within the tolerance (η above 1 + tolerance) and it may run again: one more
        fresh seed decides more than the first runs could. Runs already queued or running count
        towards ``confirm_max_runs``: a worker that would sit idle while another runs the
        leader's re-run starts the next one beside it (one driver, which asks only when all its
        slots are free, runs them one after the other). ``ranked``: ``ranked_candidates``' when known."""
        ranked = ranked_candidates(trials)[0] if ranked is None else ranked
        if not ranked:
            return []
        (value, low, high, n_runs), leader = ranked[0]
        pending = sum(t.role is Role.RERUN and t.state in (TrialState.WAITING, TrialState.RUNNING)
                      and t.point == leader.params for t in trials)
        if (value <= self.threshold or not self.undecided(value, low, high, n_runs)
                or n_runs + pending >= self.rules.confirm_max_runs or not self.unused_fresh_seeds(leader.params, trials)):
            return []
        return [leader]

    def incumbent_partners(self, trials: Trials, ranked: list[tuple[Pooled, TrialRecord]] | None = None) -> list[QueuedRun]:
        """Incumbent runs on the seeds of the leader's runs where the incumbent has none, once
        the leader gets no more runs of its own (``undecided_leader``) and is still undecided:
        above the incumbent (η > 1) but not significantly above 1 + tolerance, its interval
        reaching above it. A seed moves two configs' curves alike, so each such run turns a run
        compared with the incumbent's mean (whose spread over its 2 runs never shrinks) into a
        paired one (docs/method.md, Evidence). Each seed is tried once (a failed run is not
        queued again here)."""
        ranked = ranked_candidates(trials)[0] if ranked is None else ranked
        if not ranked or self.rules.confirm_top == 0:
            return []
        (value, low, high, n_runs), leader = ranked[0]
        if not self.undecided(value, low, high, n_runs):
            return []
        incumbent = next((t for t in trials if t.role is Role.INCUMBENT), None)
        covered = {t.seed for t in trials if t.role is Role.INCUMBENT}
        seeds = [t.seed for t in trials if t.point == leader.params and t.state == TrialState.COMPLETE
                 and t.role in (Role.CANDIDATE, Role.RERUN) and t.seed is not None]
        missing = sorted(set(seeds) - covered, key=seeds.index)
        if incumbent is None or not missing:
            return []
        return [QueuedRun(incumbent, Assignment(role=Role.INCUMBENT, seed=seed, origin=f"pairs trial {leader.number}"))
                for seed in missing]

    def leading_config(self, trials: Trials, base: Config) -> Config | None:
        """The config this stage would choose if its leader held up: the leading candidate
        (by η over the runs it has so far, confirmed or not: the top ones are all confirmed
        before the decision) when its η is above the tolerance, else the incumbent. None while
        a candidate still running could take the lead (``running_etas``)."""
        ranked, _ = ranked_candidates(trials, confirmed_only=False)
        leader = ranked[0] if ranked and ranked[0][0][0] > self.threshold else None
        bar = leader[0][0] if leader else self.threshold
        if any(e is None or e > bar for e, _ in running_etas(trials)):
            return None
        return merge(base, dict(leader[1].overrides)) if leader else base

    # -- the decision ---------------------------------------------------------------------------
    def incumbent_scores(self, trials: Trials) -> tuple[list[Score], bool]:
        """Scores of the incumbent runs told so far, and whether all of them are told. Raises
        SweepError when every incumbent run failed: there is nothing to compare with."""
        runs, complete = self.incumbent_runs(trials)
        return [score for _, score in runs], complete

    def incumbent_runs(self, trials: Trials) -> tuple[list[tuple[int | None, Score]], bool]:
        """``incumbent_scores`` with each run's seed (candidates pair with them: ``paired_eta``)."""
        requeued = requeued_numbers(trials)
        # Runs closed as wasted (a stage run ahead and moved aside) did not fail.
        mine = [t for t in trials if t.role is Role.INCUMBENT and t.number not in requeued
                and t.closed_as is not CloseReason.WASTED]
        scores = [(t.seed, t.score) for t in mine if t.state == TrialState.COMPLETE and t.score is not None]
        pending = any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in mine)
        if not scores and not pending and mine and all((t.reason or "").startswith(NO_RATIO) for t in mine):
            return [], True  # a train-mode chain at its ceiling: no η, so the stage keeps its incumbent
        if not scores and not pending and mine:
            cause = next((t.reason for t in reversed(mine) if t.reason), "no reason recorded")
            raise SweepError(
                f"every run of the stage's incumbent failed ({cause}), so no η can be computed. "
                f"Fix the baseline in the study file and run it under a new name or database; the failed runs are "
                f"in `verl-sweep status {self.spec.name}`."
            )
        return scores, not pending

    def decide(self, trials: Trials, base: Config) -> StageResult:
        """The winner: the best candidate by η over its runs (the first and its re-runs on
        fresh seeds), if it beats the incumbent by more than the tolerance and its runs decide
        it (``significant``: its interval clears 1 + tolerance, or clears the incumbent over
        enough runs); otherwise the incumbent is kept."""
        rules = self.rules
        incumbent_scores, _ = self.incumbent_scores(trials)  # raises when every incumbent run failed
        incumbent_etas = [e.value for e in incumbent_run_etas(trials).values()]
        tolerance = f"{rules.stop.tolerance:.0%}"
        keep = StageResult(
            stage=self.stage.name, decision=Decision.KEPT, winner_trial=None, eta=1.0,
            eta_low=min(incumbent_etas, default=1.0), eta_high=max(incumbent_etas, default=1.0),
            summary=f"kept the incumbent: no candidate beat it by more than {tolerance}", config=base, overrides={},
        )
        if self.stage.may_stretch and slow_start(incumbent_scores):
            # Its candidates were ranked by early speed: keep the incumbent, and let the polish
            # stage try the leader (``verl_sweep.search.engine.stage_loop.undecided_leaders``) on longer probes.
            factor = self.spec.probe.slow_start_factor
            return dataclasses.replace(keep, decision=Decision.SLOW_START, summary=(
                f"slow start: kept the incumbent, whose reward still rose fastest at the end of its "
                f"{self.stage.probe_steps}-step probes, where a rate measures early speed; later learning "
                f"stages probe {factor}x longer"))
        ranked, why_none = ranked_candidates(trials)
        if not ranked:
            return dataclasses.replace(keep, summary=f"kept the incumbent: {why_none}")
        (value, low, high, n_runs), best = ranked[0]
        runs = "1 run" if n_runs == 1 else f"{n_runs} runs"
        threshold = self.threshold
        if value <= threshold:
            # "not above", not "within": a candidate far below the bar must not read "within 2%"
            return dataclasses.replace(keep, summary=f"kept the incumbent: best η {value:.3f} (trial {best.number}, "
                                                     f"{runs}) is not above 1 + {tolerance}")
        overrides = dict(best.overrides)
        won = StageResult(stage=self.stage.name, decision=Decision.WON, winner_trial=best.number, eta=value,
                          eta_low=low, eta_high=high, summary="", config=merge(base, overrides), overrides=overrides)
        interval = f"η {value:.3f} [{low:.3f}, {high:.3f}]"
        if not self.significant(low, n_runs) and n_runs >= rules.confirm_max_runs and likely_better(value, low):
            return dataclasses.replace(won, decision=Decision.WON_ON_BALANCE, summary=(
                f"trial {best.number} beat the incumbent on balance: {interval} over {runs}, the most a leader "
                f"gets (better with probability ≥ {LIKELY_BETTER:.0%})"))
        if not self.significant(low, n_runs):
            reaches = f"{threshold:.2f}" if low <= 1.0 else f"{threshold:.2f} (clear of 1 needs {CLEAR_OF_INCUMBENT_RUNS} runs)"
            return dataclasses.replace(keep, decision=Decision.UNDECIDED, summary=(
                f"no significant gain: trial {best.number} has η {value:.3f} over {runs}, "
                f"but its interval [{low:.3f}, {high:.3f}] reaches {reaches}"))
        return dataclasses.replace(won, summary=f"trial {best.number} beat the incumbent: {interval} over {runs}")


def likely_better(value: float, low: float, *, confidence: float = 0.9) -> bool:
    """Is η above 1 with probability ≥ ``LIKELY_BETTER``, reading a normal on the log scale
    off its value and the low end of its ``confidence`` interval?"""
    if value <= 1.0:
        return False
    if low >= value:
        return True  # no spread at all
    if not (low > 0.0 and math.isfinite(low)):
        return False  # an unbounded interval says nothing
    se = (math.log(value) - math.log(low)) / statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    return statistics.NormalDist().cdf(math.log(value) / se) >= LIKELY_BETTER


def running_etas(trials: Trials) -> list[tuple[float | None, TrialRecord]]:
    """Each queued or running candidate with its running η so far: its last reported running
    rate over the finished incumbent runs' mean at the same step; None before its first
    report."""
    curves = [t.intermediate_values for t in trials if t.state == TrialState.COMPLETE and t.role is Role.INCUMBENT]
    out: list[tuple[float | None, TrialRecord]] = []
    for t in trials:
        if t.role is not Role.CANDIDATE or t.state not in (TrialState.RUNNING, TrialState.WAITING):
            continue
        step = max(t.intermediate_values, default=None)
        at_step = [c[step] for c in curves if step in c and c[step] > 0]
        eta = t.intermediate_values[step] / statistics.fmean(at_step) if step is not None and at_step else None
        out.append((eta, t))
    return out


def structured_points(trials: Trials, *, every_candidate: bool = False
                      ) -> tuple[list[tuple[dict[str, Any], float]], list[dict[str, Any]]]:
    """The stage's starting points and follow-ups (``START_ORIGIN``, ``FOLLOW_UP_ORIGIN``), or
    with ``every_candidate`` its every candidate (the sampler's draws too): the
    params of each that ended with its η (when it finished; its running η when it was stopped:
    its last report over the incumbent runs' mean at that step; 0 when its run failed), and
    the params of those still queued or running."""
    points = [t for t in trials if t.role is Role.CANDIDATE
              and (every_candidate or t.assignment.origin in (START_ORIGIN, FOLLOW_UP_ORIGIN))]
    curves = [t.intermediate_values for t in trials if t.state == TrialState.COMPLETE and t.role is Role.INCUMBENT]
    finished = [(t.intermediate_values, t.eta) for t in points if t.state == TrialState.COMPLETE and t.eta is not None]
    ended: list[tuple[dict[str, Any], float]] = []
    pending: list[dict[str, Any]] = []
    for t in points:
        params = dict(t.point or t.params)
        if t.state in (TrialState.WAITING, TrialState.RUNNING):
            pending.append(params)
            continue
        if t.state == TrialState.COMPLETE and t.eta is not None:
            ended.append((params, t.eta))
            continue
        step = max(t.intermediate_values, default=None)
        at_step = [c[step] for c in curves if step is not None and step in c and c[step] > 0]
        if t.state == TrialState.PRUNED and step is not None and at_step:
            value = t.intermediate_values[step]
            # A stopped run reads no higher than a finished one that ran above it at that step
            # (scaled by that one's η): early running rates favour fast starters that may fail late.
            over = [value / c[step] * eta for c, eta in finished if c.get(step, 0) > value]
            ended.append((params, min([value / statistics.fmean(at_step), *over])))
        else:
            ended.append((params, 0.0))
    return ended, pending


def ranked_candidates(trials: Trials, *, confirmed_only: bool = True) -> tuple[list[tuple[Pooled, TrialRecord]], str]:
    """The stage's finished candidates by η (value, low, high, runs), best first, and why
    the list is empty when it is. Confirmed candidates (with re-runs) are judged on the mean of
    all runs of their point; while none has a re-run (or ``confirmed_only`` is False), every
    candidate on the runs it has."""
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    incumbents = [(t.seed, t.score) for t in done if t.role is Role.INCUMBENT and t.score is not None]
    candidates = [t for t in done if t.role is Role.CANDIDATE and t.value is not None
                  and not t.infeasible and t.score is not None]
    if not candidates or not incumbents:
        return [], "no candidate finished"
    reruns: dict[int | None, list[tuple[int | None, Score]]] = {}
    for t in done:
        if t.role is Role.RERUN and t.score is not None:
            reruns.setdefault(t.rerun_of, []).append((t.seed, t.score))
    # A confirmation run stopped by the health screen (divergence, NaN) disqualifies its trial.
    failed = {t.rerun_of for t in trials if t.state == TrialState.PRUNED and t.role is Role.RERUN}
    candidates = [t for t in candidates if t.number not in failed]
    if not candidates:
        return [], "no candidate held up on a fresh seed"

    def pooled(t: TrialRecord) -> Pooled | None:
        # Every run of the same point counts: the sampler may have proposed it twice.
        twins = [c for c in candidates if c.params == t.params]
        runs = [(c.seed, c.score) for c in twins if c.score is not None] + [r for c in twins for r in reruns.get(c.number, [])]
        try:
            e = paired_eta(runs, incumbents)
        except ScoreError:  # no ratio: the incumbent's runs on these seeds did not rise (a branch at a ceiling)
            return None
        return e.value, e.low, e.high, len(runs)

    confirmed = [t for t in candidates if t.number in reruns or not confirmed_only] or candidates
    ranked = [(p, t) for t in confirmed if (p := pooled(t)) is not None]
    return sorted(ranked, key=lambda item: item[0][0], reverse=True), "" if ranked else "no candidate has an η"
