"""One stage as this process follows it: its study, space, policy and runs, ticked by the
driver's loop (``search/driver.py``).

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
from typing import TYPE_CHECKING, Any, Callable

from optuna.trial import TrialState

from objectives.probe import ProbeSettings
from search import liveness
from search.errors import BadInputError
from search.policy import SLOW_START, QueuedRun, StagePolicy, found_nothing, ranked_candidates, slow_start, structured_points
from search.records import FOLLOW_UP_ORIGIN, Assignment, Role, StageResult, TrialRecord, stage_study_name
from search.stage_study import StageClock, StageStudy
from search.storage import HEARTBEAT_INTERVAL_S, with_retries
from search.trials import TrialRunner
from spaces.base import Space, SpaceError
from spaces.overrides import Config

if TYPE_CHECKING:
    import optuna

    from launchers.base import Launcher
    from search.console import Console
    from search.study_file import StageSettings, StudySpec


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
    console: Console
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
        self.runner = TrialRunner(ctx.spec, ctx.launcher, ctx.console, study, policy, space, base,
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
        stage = spec.stages[index]
        try:
            space = ctx.build_space(stage.space, model=spec.model, hardware=spec.hardware, algorithm=spec.algorithm,
                                    base=base, options=stage.params, where=f"stages[{index}]",
                                    baseline=spec.baseline_config())
        except SpaceError as e:
            if ahead_of is not None:
                return None
            raise BadInputError(str(e)) from None
        seen = None if space.speed_only else slow_start_seen(ctx, index)
        if seen is None and not space.speed_only and ahead_of is not None:
            return None  # the probe length is decided by the stage still running
        policy = StagePolicy(spec, stage, probe_settings(spec, stage, space, slow_start=bool(seen)))
        if seen and ahead_of is None and policy.stretch > 1:
            console.note(f"{stage_study_name(spec, stage)}: probes of {policy.settings.steps} steps, not "
                         f"{spec.probe.steps}: the incumbent's reward was still accelerating at the end of the "
                         "first learning stage's probes (a slow start)")

        opened = with_retries(lambda: StageStudy.open(ctx.storage, spec, policy, base, ahead_of=ahead_of,
                                                      launcher=ctx.launcher, on_vacated=_vacated_note(console),
                                                      learn_ooms=not space.oom_clamped),
                              what="open the stage study")
        if opened is None:
            return None
        study, created = opened
        carried: list[TrialRecord] = []
        if created:
            earlier = StageStudy.earlier_runs(ctx.storage, spec, index, base, policy.settings.steps)
            leaders = undecided_leaders(ctx, index) if space.takes_earlier_leaders else []
            carried = study.enqueue_initial(spec, stage, space, base, carried=earlier, leaders=leaders)
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
        self.ctx.console.stage_started(self.index, self.stage, self.base, self.space.explain(),
                                       self.stage.budget.max_trials)

    # -- one pass ---------------------------------------------------------------------------------
    def tick(self, *, may_start_more: bool = True) -> Tick:
        """One pass of the stage loop. ``may_start_more`` False: follow the runs in flight,
        start nothing new."""
        ctx, study, policy, runner = self.ctx, self.study, self.policy, self.runner
        launcher = ctx.launcher
        wall_used = self.clock.used(launcher.clock())
        trials = study.trials()
        budget_s = self.stage.budget.max_wall_clock_s
        over_time = budget_s is not None and wall_used >= budget_s
        allowed = may_start_more and not over_time
        may_start = allowed and policy.may_start(trials)
        wants_ahead = False
        if not runner.active and not may_start:
            trials = study.trials(fresh=True)  # decide on the database as it is now
            if allowed and policy.may_start(trials):
                # The cached view was behind: another worker queued work (e.g. a required
                # confirmation) that this stage still needs; never decide without it.
                may_start = True
            elif self._waiting_on_others(trials):
                # Idle while other workers finish the stage: confirm the top candidates now
                # (required re-runs first), then re-run them again while that fits in the
                # wait; with nothing to re-run, start the next stage from the current leader.
                if allowed and launcher.free_slots() > 0:
                    if (self._queue_confirmations(trials, extra=False) or self._queue_confirmations(trials, extra=True)
                            or self._queue_early_confirmation(trials)):
                        pass
                    elif self.nothing_left_for_me(trials):
                        ctx.console.note(f"{study.name}: only other workers' confirmations are left; "
                                         "leaving (they finish the study)")
                        return Tick.LEAVE
                    else:
                        wants_ahead = True
            elif over_time or not self._queue_confirmations(trials, extra=False):
                return Tick.OVER
        if allowed and self.space.n_follow_ups and launcher.free_slots() > 0:
            if self._queue_follow_ups(trials):
                may_start = True
            elif may_start and self._round_in_flight(trials):
                # The sampler's draws wait for the round: drawn now, they would spend the
                # budget that the next round's points, read from this one, are for.
                may_start = False
        if may_start and launcher.free_slots() > 0:
            # Count on the database as it is now: with many workers, a cached view starts
            # trials the others have already filled the budget with.
            may_start = policy.may_start(study.trials(fresh=True))
        while may_start and launcher.free_slots() > 0:
            started = runner.start()
            trials = study.trials(fresh=True)
            if not started:
                break
            may_start = policy.may_start(trials)
        runner.poll()
        runner.stop_runs_that_no_longer_count(study.trials())
        if runner.tell_finished(study.trials()):
            study.stale = True
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

    def _waiting_on_others(self, trials: list[TrialRecord]) -> bool:
        """Trials RUNNING in other processes (workers) that this stage's result needs."""
        return any(t.state == TrialState.RUNNING and t.number not in self.runner.active for t in trials)

    def nothing_left_for_me(self, trials: list[TrialRecord]) -> bool:
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

    def _queue_confirmations(self, trials: list[TrialRecord], *, extra: bool) -> bool:
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

    def _queue_follow_ups(self, trials: list[TrialRecord]) -> bool:
        """In rounds: once the starting points and the follow-ups so far all ended, the space's
        next ``Space.follow_ups_per_round`` points from what they read
        (``Space.follow_up_points``), up to ``Space.n_follow_ups``, inside the stage's budget."""
        def wanted(trials: list[TrialRecord]) -> tuple[int, list[tuple[dict[str, Any], float]], list[dict[str, Any]]]:
            done = sum(1 for t in trials if t.assignment.origin == FOLLOW_UP_ORIGIN)
            ended, pending = structured_points(trials)
            if pending or not ended or len(ended) == self.no_follow_up_after:
                return 0, ended, pending
            return min(self.space.follow_ups_per_round - len(pending), self.space.n_follow_ups - done,
                       self.stage.budget.max_trials - self.policy.counted(trials)), ended, pending

        if wanted(trials)[0] <= 0:
            return False
        n, ended, pending = wanted(self.study.trials(fresh=True))  # another worker may have queued some
        if n <= 0:
            return False
        points = self.space.follow_up_points(self.base, [*ended, *((p, math.nan) for p in pending)], n)
        if not points:
            self.no_follow_up_after = len(ended)  # nothing new from these: ask again after more ended
        for point in points:
            self.study.queue(point, Assignment(role=Role.CANDIDATE, seed=self.ctx.spec.seeds[0], origin=FOLLOW_UP_ORIGIN))
        if points:
            params, best = max(ended, key=lambda r: r[1])
            self.ctx.console.note(f"{self.study.name}: {len(points)} more point(s) from the best so far "
                                  f"({', '.join(f'{k}={v}' for k, v in params.items())}: η {best:.3f})")
        return bool(points)

    def _round_in_flight(self, trials: list[TrialRecord]) -> bool:
        """A round of follow-ups (or the starting points) still runs, nothing is queued, and the
        space may have more to propose once it ended."""
        if any(t.state == TrialState.WAITING for t in trials):
            return False
        done = sum(1 for t in trials if t.assignment.origin == FOLLOW_UP_ORIGIN)
        ended, pending = structured_points(trials)
        return bool(pending) and done < self.space.n_follow_ups and len(ended) != self.no_follow_up_after

    def _queue_early_confirmation(self, trials: list[TrialRecord]) -> bool:
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


def _vacated_note(console: Console) -> Callable[[str, str, str], None]:
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
        result = stored.result
        if result.winner_trial is not None or found_nothing(result) or result.decision.startswith("skipped"):
            continue
        ranked, _ = ranked_candidates(stored.trials())
        if ranked and ranked[0][0][0] > 1 + stage.stop.tolerance:
            out.append((stage.name, dict(ranked[0][1].overrides)))
    return out


def slow_start_seen(ctx: Context, index: int) -> bool | None:
    """Did a learning stage before ``index`` decide on a slow start (``policy.SLOW_START``)?
    None while a stage before it is still being decided and its incumbent runs so far do not
    rule one out (stage ``index`` is then being opened ahead). Read from the stored decisions,
    so a resume and every worker decide the same."""
    if ctx.spec.probe.slow_start_factor == 1:
        return False
    for stage in ctx.spec.stages[:index]:
        stored = StageStudy.stored_stage(ctx.storage, ctx.spec, stage)
        if stored is None:
            continue
        if stored.result is not None:
            if stored.result.decision.startswith(SLOW_START):
                return True
            continue
        trials = stored.trials()
        scores = [t.score for t in trials if t.state == TrialState.COMPLETE and t.score is not None]
        if any(s.metric == "throughput" for s in scores):
            continue  # a speed stage
        runs = [t.score for t in trials if t.role is Role.INCUMBENT and t.state == TrialState.COMPLETE
                and t.score is not None]
        if not runs or slow_start(runs):
            return None  # no reading yet, or its decision will be a slow start
        # (no reading from runs too short for one: the decision will not be a slow start either)
    return False


def probe_settings(spec: StudySpec, stage: StageSettings, space: Space, *, slow_start: bool = False) -> ProbeSettings:
    """How the stage's probes run, resolved once: a speed-only space runs short probes with
    their own warm-up; a learning stage after a slow start runs longer ones."""
    return ProbeSettings(
        steps=spec.stage_probe_steps(stage, speed_only=space.speed_only, slow_start=slow_start),
        speed_only=space.speed_only,
        warmup_steps=spec.probe.speed_warmup_steps if space.speed_only else spec.probe.warmup_steps,
        hang_timeout_s=spec.probe.hang_timeout_s,
        n_gpus=spec.hardware.n_gpus,
        settle_tolerance=spec.probe.speed_settle_tolerance if space.speed_only else 0.0,
    )
