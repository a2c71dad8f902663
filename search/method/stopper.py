"""The stopper: the one place that decides what stops, in a stage and its trials.

A running trial stops when the pruner finds it hopeless (candidates only, at a report), when
its probe's health screen finds it unhealthy (the probe ends STOPPED), or when it no longer
counts (another process closed it; the first run a confirmation checks was pruned). An ended
trial closes as COMPLETE, PRUNED or FAIL, and a failure is queued again while its retries
last. A stage starts no more trials past its wall-clock budget, the runs train mode's cost cap
leaves it, its trial budget or its stop rule (``StagePolicy.may_start``). The trial runner and
the proposer report what they see and carry out what it says; it reads records only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

from optuna.trial import TrialState

from verl_sweep.objectives.probe import ProbeState
from verl_sweep.search.database.records import Assignment, Role, TrialRecord

if TYPE_CHECKING:
    from verl_sweep.objectives.probe import ProbeOutcome
    from verl_sweep.search.method.policy import StagePolicy

#: how a pruned run's reason names its pruner's rule
PRUNE_RULES = {"incumbent": "clearly below the incumbent's on the same seed",
               "median": "below the median of the stage's other trials"}


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop a running probe as ``state`` (PRUNED: hopeless; STOPPED: it no longer counts)."""

    state: ProbeState
    reason: str


#: a trial that another process closed meanwhile: its result would be dropped
CLOSED_ELSEWHERE = Stop(ProbeState.STOPPED, "closed by another worker")


@dataclasses.dataclass(frozen=True)
class Running:
    """A run this process follows, as the stopper reads it."""

    number: int
    role: Role
    rerun_of: int | None


@dataclasses.dataclass(frozen=True)
class Stopper:
    """What stops in one stage (``policy``: its rules)."""

    policy: StagePolicy
    #: train mode's cost cap: the most runs the stage may start (None: no such limit)
    max_runs: int | None = None

    # -- the stage ----------------------------------------------------------------------------------
    def over_time(self, wall_used_s: float, trials: Sequence[TrialRecord]) -> bool:
        """The stage's wall-clock budget is spent, or the runs the cost cap leaves it: nothing
        new starts, and it decides on what it measured."""
        budget_s = self.policy.stage.budget.max_wall_clock_s
        return (budget_s is not None and wall_used_s >= budget_s) or self._out_of_runs(trials)

    def _out_of_runs(self, trials: Sequence[TrialRecord]) -> bool:
        return self.max_runs is not None and sum(t.started for t in trials) >= self.max_runs

    def may_start(self, trials: Sequence[TrialRecord]) -> bool:
        """Queued work, or budget left and the stop rule not met (``StagePolicy.may_start``),
        within the runs the cost cap leaves."""
        return not self._out_of_runs(trials) and self.policy.may_start(trials)

    # -- a running trial ----------------------------------------------------------------------------
    def after_report(self, role: Role, step: int, rate: float, should_prune: Callable[[], bool]) -> Stop | None:
        """A run reported ``rate`` at ``step``: the stage's pruner judges candidates only
        (incumbents and confirmations are never pruned)."""
        if role is not Role.CANDIDATE or not should_prune():
            return None
        rule = PRUNE_RULES.get(self.policy.rules.pruner.name, "below the stage's others")
        return Stop(ProbeState.PRUNED, f"pruned at step {step}: running rate {rate:.3g} {rule}")

    def no_longer_counting(self, runs: Sequence[Running], trials: Sequence[TrialRecord]) -> dict[int, Stop]:
        """Runs whose results could no longer count, by trial number: their trial closed by
        another process (a stage run ahead and moved aside, a heartbeat that looked stale), or
        early confirmations whose first run was then pruned."""
        state = {t.number: t.state for t in trials}
        pruned = {t.number for t in trials if t.state == TrialState.PRUNED and t.role is Role.CANDIDATE}
        stops: dict[int, Stop] = {}
        for run in runs:
            if state.get(run.number, TrialState.RUNNING).is_finished():
                stops[run.number] = CLOSED_ELSEWHERE
            elif run.role is Role.RERUN and run.rerun_of is not None and run.rerun_of in pruned:
                stops[run.number] = Stop(ProbeState.STOPPED, f"its first run (trial {run.rerun_of}) was pruned")
        return stops

    # -- an ended trial -----------------------------------------------------------------------------
    @staticmethod
    def closes_as(outcome: ProbeOutcome) -> TrialState:
        """Optuna's state for a trial whose probe ended: scored, stopped (pruned, unhealthy, no
        longer counting) or failed."""
        if outcome.state is ProbeState.COMPLETE:
            return TrialState.COMPLETE
        if outcome.state in (ProbeState.PRUNED, ProbeState.STOPPED):
            return TrialState.PRUNED
        return TrialState.FAIL

    def retry(self, outcome: ProbeOutcome, record: TrialRecord) -> Assignment | None:
        """The assignment to queue again for a failed run: a retryable failure, within the
        study's ``probe.max_retries``; None: the failure stands."""
        failure = outcome.failure
        if failure is None or not failure.retryable or record.attempt >= self.policy.spec.probe.max_retries:
            return None
        return dataclasses.replace(record.assignment, attempt=record.attempt + 1)
