"""One stage as this process follows it: its study, space, policy and runs, ticked by the
driver's loop (``search/engine/driver.py``).

``StageLoop.open`` creates or joins the stage's study; each ``tick`` starts what the policy
allows, follows and tells the runs, keeps the heartbeats, and says what the driver should do
next: go on, the stage is over, leave (a worker with nothing left), or run ahead into the next
stage (idle while other workers finish this one).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from optuna.trial import TrialState

from verl_sweep.search.database import liveness
from verl_sweep.search.spec.errors import BadInputError
from verl_sweep.search.method.policy import QueuedRun, StagePolicy, ranked_candidates, slow_start, structured_points
from verl_sweep.search.database.records import FOLLOW_UP_ORIGIN, Assignment, Decision, Role, StageResult, TrialRecord, stage_study_name
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.engine.stage_study import StageClock, StageStudy
from verl_sweep.search.database.storage import HEARTBEAT_INTERVAL_S, with_retries
from verl_sweep.search.engine.trials import TrialRunner
from verl_sweep.spaces.base import Space, SpaceError
from verl_sweep.verl_knowledge import Config

if TYPE_CHECKING:
    import optuna

    from verl_sweep.launchers.base import Launcher
    from verl_sweep.search.engine.events import StudyListener
    from verl_sweep.search.spec.study_file import StudySpec


class Tick(enum.Enum):
    """What the driver does after a tick of a stage loop."""

    GO_ON = "go on"
    OVER = "over"  # the stage is over, for every worker: decide it
    LEAVE = "leave"  # a worker with nothing left in the last stage
    RUN_AHEAD = "run ahead"  # idle while other workers finish the stage, nothing of it to re-run


@dataclasses.dataclass(frozen=True)
class Context:
    """What every stage loop of one driver process shares."""

    spec: StudySpec
    storage: optuna.storages.RDBStorage
    launcher: Launcher
    console: StudyListener
    build_space: Callable[..., Space]
    #: a worker that leaves once the last stage has nothing left but other processes' runs
    leave_at_end: bool = False


class StageLoop:
    """Stage ``index`` from ``base``; ``ahead_of`` names the stage still being decided while
    this one runs ahead of it (None once that stage chose the config it started from)."""

    def __init__(self, ctx: Context, index: int, policy: StagePolicy, base: Config, study: StageStudy,
                 space: Space, *, ahead_of: str | None) -> None:
        self.ctx = ctx
        self.index = index
        self.policy = policy
        self.stage = policy.stage
        self.base = base
        self.study = study
        self.space = space
        self.ahead_of = ahead_of
        attrs = study.attrs()
        self.runner = TrialRunner(ctx.launcher, ctx.console, study, policy, space, base,
                                  run_prefix=attrs.run_prefix or f"{ctx.spec.name}.{self.stage.name}")
        self.clock = StageClock(ctx.launcher.clock(), attrs.wall_clock_used_s)
        self.last_heartbeat = 0.0
        self.last_saved = time.monotonic()
        #: the number of readings from which the space proposed no follow-up
        self.no_follow_up_after = -1

    @property
    def active(self) -> bool:
        """This process follows runs of the stage."""
        return bool(self.runner.active)

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    def open(cls, ctx: Context, index: int, base: Config, *, ahead_of: str | None = None) -> StageLoop | None:
        """Open (create, or join) stage ``index`` from ``base``. With ``ahead_of`` (the stage
        still being decided), the stage is opened ahead from that stage's leader; None when
        another worker already runs it ahead from another leader, or its space rejects the
        leader (the real chain reports that once it gets there)."""
        spec, console = ctx.spec, ctx.console
        try:
            plan = Stage.of(spec, index)
            space = plan.build_space(base, build=ctx.build_space).on_real_gpus(ctx.launcher.real_gpus)
        except SpaceError as e:
            if ahead_of is not None:
                return None
            raise BadInputError(str(e)) from None
        seen = slow_start_seen(ctx, index) if plan.learns else False
        if seen is None and ahead_of is not None:
            return None  # the probe length is decided by the stage still running
        plan = Stage.of(spec, index, slow_start=bool(seen))
        policy = StagePolicy(plan)
        if seen and ahead_of is None and plan.stretch > 1:
            console.note(f"{stage_study_name(spec, plan.settings)}: probes of {plan.probe_steps} steps, not "
                         f"{spec.probe.steps}: the incumbent's reward was still accelerating at the end of the "
                         "first learning stage's probes (a slow start)")

        opened = with_retries(lambda: StageStudy.open(ctx.storage, plan, base, ahead_of=ahead_of,
                                                      launcher=ctx.launcher, on_vacated=_vacated_note(console),
                                                      learn_ooms=not space.oom_clamped),
                              what="open the stage study")
        if opened is None:
            return None
        study, created = opened
        carried: list[TrialRecord] = []
        if created:
            earlier = StageStudy.earlier_runs(ctx.storage, spec, index, base, plan.probe_steps)
            leaders = undecided_leaders(ctx, index) if space.takes_earlier_leaders else []
            carried = study.enqueue_initial(plan, space, base, carried=earlier, leaders=leaders)
            study.mark_initialized()
        loop = cls(ctx, index, policy, base, study, space, ahead_of=ahead_of)
        if ahead_of is None:
            loop.announce()
        if carried:
            console.note(f"{study.name}: incumbent runs on seed(s) {', '.join(str(t.seed) for t in carried)} "
                         "carried over from the previous stage (same config, seed and probe length)")
        for t in carried:
            assert t.eta is not None and t.eta_interval is not None  # carried_attrs stores them
            console.trial_finished(study.study, t.number, Role.INCUMBENT, {}, eta=t.eta, interval=t.eta_interval)
        return loop

    def announce(self) -> None:
        self.ctx.console.stage_started(self.index, self.stage.settings, self.base, self.space.explain(),
                                       self.stage.budget.max_trials)

    # -- one pass ---------------------------------------------------------------------------------
    def tick(self, *, may_start_more: bool = True) -> Tick:
        """One pass of the stage loop. ``may_start_more`` False: follow the runs in flight,
        start nothing new."""
        ctx, study, policy, runner = self.ctx, self.study, self.policy, self.runner
        launcher = ctx.launcher
        wall_used = self.clock.used(launcher.clock())
        view = study.view()  # this pass's view: read again only after events that add or close trials
        budget_s = self.stage.budget.max_wall_clock_s
        over_time = budget_s is not None and wall_used >= budget_s
        allowed = may_start_more and not over_time
        may_start = allowed and policy.may_start(view) and self._may_draw(view)
        wants_ahead = False
        if not runner.active and not may_start:
            view = study.view(fresh=True)  # decide on the database as it is now
            if allowed and policy.may_start(view) and self._may_draw(view):
                # The view held was behind: another worker queued work (e.g. a required
                # confirmation) that this stage still needs; never decide without it.
                may_start = True
            elif self._waiting_on_others(view):
                # Idle while other workers finish the stage: confirm the top candidates now
                # (required re-runs first), then re-run them again while that fits in the
                # wait; with nothing to re-run, start the next stage from the current leader.
                if allowed and launcher.free_slots() > 0:
                    if (self._queue_confirmations(view, extra=False) or self._queue_confirmations(view, extra=True)
                            or self._queue_early_confirmation(view)):
                        pass
                    elif self.nothing_left_for_me(view):
                        ctx.console.note(f"{study.name}: only other workers' confirmations are left; "
                                         "leaving (they finish the study)")
                        return Tick.LEAVE
                    else:
                        wants_ahead = True
            elif over_time or not self._queue_confirmations(view, extra=False):
                return Tick.OVER
        if allowed and self.space.n_follow_ups and launcher.free_slots() > 0:
            if self._queue_follow_ups(view):
                may_start = True
            elif may_start and self._round_in_flight(view):
                # The sampler's draws wait for the round: drawn now, they would spend the
                # budget that the next round's points, read from this one, are for.
                may_start = False
        if may_start and not self._sampler_may_draw(view):
            view = study.view()
            may_start = self._queued(view)  # its own points only, never the sampler's
        # Each start reads the stage once, after its ask, and the policy admits the trial on
        # that view (``TrialRunner.start``): with many workers, a view held from before starts
        # nothing that the others have already filled the budget with.
        while may_start and launcher.free_slots() > 0:
            started = runner.start()
            view = study.view()
            if not started:
                break
            may_start = policy.may_start(view) and (self._sampler_may_draw(view) or self._queued(view))
        runner.poll()
        runner.stop_runs_that_no_longer_count(view)
        runner.tell_finished(view)
        now = time.monotonic()
        if now - self.last_heartbeat >= HEARTBEAT_INTERVAL_S / 2:
            runner.heartbeat()
            study.fail_stale_trials()
            runner.adopt_or_close_orphans()
            self.last_heartbeat = now
        if now - self.last_saved > 5.0:
            study.save_wall_clock(wall_used)
            self.last_saved = now
        return Tick.RUN_AHEAD if wants_ahead else Tick.GO_ON

    @staticmethod
    def _queued(trials: Sequence[TrialRecord]) -> bool:
        return any(t.state == TrialState.WAITING for t in trials)

    def _may_draw(self, trials: Sequence[TrialRecord]) -> bool:
        """Whether this pass may start a trial: always, unless the sampler may not draw (a
        pattern search, or follow-ups that end the stage) with nothing queued and no follow-up
        round to come."""
        if self._sampler_may_draw(trials) or self._queued(trials):
            return True
        _, ended, pending, more = self._follow_ups(trials)
        return more and bool(pending or ended)

    def _n_follow_ups(self) -> int:
        n = self.space.n_follow_ups
        return min(n, self.stage.budget.max_trials // 5) if self.space.follow_ups_last else n

    def _sampler_may_draw(self, trials: Sequence[TrialRecord]) -> bool:
        """The sampler draws, unless the space is a pattern search or its follow-ups end the
        stage (``Space.follow_ups_last``) and the budget left is theirs."""
        if not self.space.follow_ups_last:
            return self.space.sampler_draws
        return self.policy.counted(trials) < self.stage.budget.max_trials - self._n_follow_ups()

    def _follow_ups(self, trials: Sequence[TrialRecord]) -> tuple[int, list[tuple[dict[str, Any], float]], list[dict[str, Any]], bool]:
        """The follow-ups run so far, the structured points that ended (with their η) and those
        pending, and whether the space may still propose follow-ups from them."""
        done = sum(1 for t in trials if t.assignment.origin == FOLLOW_UP_ORIGIN)
        ended, pending = structured_points(trials, every_candidate=self.space.follow_ups_last)
        more = done < self._n_follow_ups() and len(ended) != self.no_follow_up_after
        return done, ended, pending, more and not (self.space.follow_ups_last and self._sampler_may_draw(trials))

    def _waiting_on_others(self, trials: Sequence[TrialRecord]) -> bool:
        """Trials RUNNING in other processes (workers) that this stage's result needs."""
        return any(t.state == TrialState.RUNNING and t.number not in self.runner.active for t in trials)

    def nothing_left_for_me(self, trials: Sequence[TrialRecord]) -> bool:
        """A worker in the last stage, idle, whose stage only waits on other processes'
        confirmation runs: nothing it could start there or ahead. A run whose process on this
        host is gone (SIGKILL) is work left: the next heartbeat round queues it again, and
        this worker may be the last one to take it."""

        def work_left(t: TrialRecord) -> bool:
            if t.state not in (TrialState.RUNNING, TrialState.WAITING):
                return False
            return t.role is not Role.RERUN or liveness.owner_is_dead(t.owner)

        return (self.ctx.leave_at_end and self.ahead_of is None and self.index == len(self.ctx.spec.stages) - 1
                and not any(work_left(t) for t in trials))

    def _queue(self, reruns: list[QueuedRun]) -> bool:
        for rerun in reruns:
            self.study.queue(rerun.of.params, rerun.assignment)
        return bool(reruns)

    def _queue_confirmations(self, trials: Sequence[TrialRecord], *, extra: bool) -> bool:
        reruns = self.policy.confirmations(trials, extra=extra, now=datetime.datetime.now())
        if self._queue(reruns):
            partners = [r.assignment for r in reruns if r.assignment.role is Role.INCUMBENT]
            if partners:
                self.ctx.console.note(f"{self.study.name}: running the incumbent on seed(s) "
                                      f"{', '.join(str(a.seed) for a in partners)}: it {partners[0].origin}")
            else:
                self.ctx.console.note(f"{self.study.name}: re-running on fresh seeds: "
                                      + ", ".join(f"trial {r.of.number}" for r in reruns))
        return bool(reruns)

    def _queue_follow_ups(self, trials: Sequence[TrialRecord]) -> bool:
        """In rounds: once the starting points and the follow-ups so far all ended, the space's
        next ``Space.follow_ups_per_round`` points from what they read
        (``Space.follow_up_points``), up to ``Space.n_follow_ups``, inside the stage's budget."""
        def wanted(trials: Sequence[TrialRecord]) -> tuple[int, list[tuple[dict[str, Any], float]], list[dict[str, Any]]]:
            done, ended, pending, more = self._follow_ups(trials)
            if pending or not ended or not more:
                return 0, ended, pending
            return min(self.space.follow_ups_per_round - len(pending), self._n_follow_ups() - done,
                       self.stage.budget.max_trials - self.policy.counted(trials)), ended, pending

        if wanted(trials)[0] <= 0:
            return False
        n, ended, pending = wanted(self.study.view(fresh=True))  # another worker may have queued some
        if n <= 0:
            return False
        points = self.space.follow_up_points(self.base, [*ended, *((p, math.nan) for p in pending)], n)
        points = [p for p in (self.space.fitted(p, self.base) for p in points) if p]  # only what fits
        if not points:
            self.no_follow_up_after = len(ended)  # nothing new from these: ask again after more ended
        for point in points:
            self.study.queue(point, Assignment(role=Role.CANDIDATE, seed=self.ctx.spec.seeds[0], origin=FOLLOW_UP_ORIGIN))
        if points:
            params, best = max(ended, key=lambda r: r[1])
            self.ctx.console.note(f"{self.study.name}: {len(points)} more point(s) from the best so far "
                                  f"({', '.join(f'{k}={v}' for k, v in params.items())}: η {best:.3f})")
        return bool(points)

    def _round_in_flight(self, trials: Sequence[TrialRecord]) -> bool:
        """A round of follow-ups (or the starting points) still runs, nothing is queued, and the
        space may have more to propose once it ended."""
        if any(t.state == TrialState.WAITING for t in trials):
            return False
        _, _, pending, more = self._follow_ups(trials)
        return more and bool(pending)

    def _queue_early_confirmation(self, trials: Sequence[TrialRecord]) -> bool:
        rerun = self.policy.early_confirmation(trials)
        if rerun is None:
            return False
        self._queue([rerun])
        self.ctx.console.note(f"{self.study.name}: re-running trial {rerun.of.number} on a fresh seed "
                              "while its first run is still going (it runs ahead of the incumbent)")
        return True

    # -- ending -----------------------------------------------------------------------------------
    def record_result(self) -> StageResult:
        """Decide once (``StageStudy.record_result``); the stage's result for every worker."""
        used = self.clock.used(self.ctx.launcher.clock())
        return self.study.record_result(lambda trials: self.policy.decide(trials, self.base), used)

    def abandon(self, *, why: str) -> None:
        self.runner.abandon(why=why)

    def vacate(self, *, why: str) -> None:
        """Stop this process's runs of a stage run ahead and move its study aside
        (``StageStudy.vacate``)."""
        self.runner.cancel_all()
        self.study.vacate(why=why, launcher=self.ctx.launcher, on_vacated=_vacated_note(self.ctx.console))


def _vacated_note(console: StudyListener) -> Callable[[str, str, str], None]:
    def note(name: str, why: str, lost: str) -> None:
        console.note(f"{name}: closed the runs started ahead ({why}); kept as {lost}")

    return note


def undecided_leaders(ctx: Context, index: int) -> list[tuple[str, Config]]:
    """(stage name, overrides) of the leader of each stage before ``index`` that kept its
    incumbent although the leader was above 1 + tolerance: a gain its runs could not decide."""
    out: list[tuple[str, Config]] = []
    for stage in ctx.spec.stages[:index]:
        stored = StageStudy.stored_stage(ctx.storage, ctx.spec, stage)
        if stored is None or stored.result is None:
            continue
        if not stored.result.decision.may_leave_a_leader:
            continue
        ranked, _ = ranked_candidates(stored.trials())
        if ranked and ranked[0][0][0] > 1 + stage.stop.tolerance:
            out.append((stage.name, dict(ranked[0][1].overrides)))
    return out


def slow_start_seen(ctx: Context, index: int) -> bool | None:
    """Did a learning stage before ``index`` decide on a slow start (``Decision.SLOW_START``)?
    None while a stage before it is still being decided and its incumbent runs so far do not
    rule one out (stage ``index`` is then being opened ahead). Read from the stored decisions,
    so a resume and every worker decide the same."""
    if ctx.spec.probe.slow_start_factor == 1:
        return False
    for earlier, stage in enumerate(ctx.spec.stages[:index]):
        if not Stage.of(ctx.spec, earlier).learns:
            continue  # a speed stage decides no slow start
        stored = StageStudy.stored_stage(ctx.storage, ctx.spec, stage)
        if stored is None:
            continue
        if stored.result is not None:
            if stored.result.decision is Decision.SLOW_START:
                return True
            continue
        trials = stored.trials()
        runs = [t.score for t in trials if t.role is Role.INCUMBENT and t.state == TrialState.COMPLETE
                and t.score is not None]
        if not runs or slow_start(runs):
            return None  # no reading yet, or its decision will be a slow start
        # (no reading from runs too short for one: the decision will not be a slow start either)
    return False
