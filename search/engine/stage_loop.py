"""One stage as this process follows it: its study, space, proposer, stopper and runs, ticked
by the driver's loop (``search/engine/driver.py``).

``StageLoop.open`` creates or joins the stage's study and queues its first points; each
``tick`` asks the proposer what to try (``verl_sweep.search.method.proposer``), starts what
the policy admits, polls the runs (the stopper decides what stops), tells the finished ones,
keeps the heartbeats, and says what the driver should do next: go on, the stage is over, leave
(a worker with nothing left), or run ahead into the next stage (idle while other workers
finish this one).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Sequence

from optuna.trial import TrialState

from verl_sweep.search.database import liveness
from verl_sweep.search.spec.errors import BadInputError, never_stopped
from verl_sweep.search.method.policy import StagePolicy, ranked_candidates, slow_start
from verl_sweep.search.method.proposer import Proposer, Tick
from verl_sweep.search.method.stopper import Stopper
from verl_sweep.search.database.records import ChainPoint, Decision, Role, StageResult, TrialRecord, stage_study_name
from verl_sweep.search.engine.chain import CapLimit, chain_point
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
    #: why this process was asked to stop (None: it was not): blocking waits end on it
    stop_requested: Callable[[], str | None] = never_stopped


class StageLoop:
    """Stage ``index`` from ``base``; ``ahead_of`` names the stage still being decided while
    this one runs ahead of it (None once that stage chose the config it started from)."""

    def __init__(self, ctx: Context, index: int, policy: StagePolicy, base: Config, study: StageStudy,
                 space: Space, *, ahead_of: str | None, branch: ChainPoint | None = None,
                 max_runs: int | None = None) -> None:
        self.ctx = ctx
        self.index = index
        self.policy = policy
        self.stage = policy.stage
        self.base = base
        self.study = study
        self.space = space
        self.ahead_of = ahead_of
        attrs = study.attrs()
        self.stopper = Stopper(policy, max_runs)
        self.proposer = Proposer(policy, self.stopper, space, base, study, free_slots=ctx.launcher.free_slots,
                                 note=ctx.console.note, leaves=self.nothing_left_for_me)
        self.runner = TrialRunner(ctx.launcher, ctx.console, study, policy, self.stopper, space, base,
                                  run_prefix=attrs.run_prefix or f"{ctx.spec.name}.{self.stage.name}",
                                  branch=attrs.branch or branch)
        self.clock = StageClock(ctx.launcher.clock(), attrs.wall_clock_used_s)
        self.last_heartbeat = 0.0
        self.last_saved = time.monotonic()

    @property
    def active(self) -> bool:
        """This process follows runs of the stage."""
        return bool(self.runner.active)

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    def open(cls, ctx: Context, index: int, base: Config, *, ahead_of: str | None = None,
             cap: CapLimit | None = None) -> StageLoop | None:
        """Open (create, or join) stage ``index`` from ``base``. With ``ahead_of`` (the stage
        still being decided), the stage is opened ahead from that stage's leader; None when
        another worker already runs it ahead from another leader, or its space rejects the
        leader (the real chain reports that once it gets there). ``cap``: train mode's cost
        cap on the stage (``verl_sweep.search.engine.chain.cap_limit``), which the driver priced."""
        spec, console = ctx.spec, ctx.console
        try:
            plan = Stage.of(spec, index)
            space = plan.build_space(base, build=ctx.build_space).on_real_gpus(ctx.launcher.real_gpus)
        except SpaceError as e:
            if ahead_of is not None:
                return None
            raise BadInputError(str(e)) from None
        seen = slow_start_seen(ctx, index) if plan.learns and not plan.branches else False
        if seen is None and ahead_of is not None:
            return None  # the probe length is decided by the stage still running
        branch = chain_point(ctx.storage, spec, index) if plan.branches else None
        plan = Stage.of(spec, index, slow_start=bool(seen), start_step=branch.step if branch else 0)
        policy = StagePolicy(plan)
        if seen and ahead_of is None and plan.stretch > 1:
            console.note(f"{stage_study_name(spec, plan.settings)}: probes of {plan.probe_steps} steps, not "
                         f"{spec.probe.steps}: the incumbent's reward was still accelerating at the end of the "
                         "first learning stage's probes (a slow start)")

        opened = with_retries(lambda: StageStudy.open(ctx.storage, plan, base, ahead_of=ahead_of,
                                                      launcher=ctx.launcher, on_vacated=_vacated_note(console),
                                                      learn_ooms=not space.oom_clamped, branch=branch,
                                                      stop_requested=ctx.stop_requested),
                              what="open the stage study", stop_requested=ctx.stop_requested)
        if opened is None:
            return None
        study, created = opened
        carried: list[TrialRecord] = []
        if created:
            # A branch's runs cover later steps than the stage before's: none carries over.
            earlier = {} if plan.branches else StageStudy.earlier_runs(ctx.storage, spec, index, base, plan.probe_steps)
            leaders = undecided_leaders(ctx, index) if space.takes_earlier_leaders else []
            carried = study.enqueue_initial(plan, space, base, carried=earlier, leaders=leaders)
            study.mark_initialized()
        # Train mode's cost cap: the runs the room under it holds (priced from the stages before
        # it alone, so a resume or a worker gets the same limit).
        max_runs = cap.max_runs if cap is not None else None
        if cap is not None and cap.max_runs < plan.budget.max_trials + plan.settings.confirm_top:
            console.note(f"{study.name}: at most {cap.max_runs} runs, within the cost cap "
                         f"(train.max_cost_r {cap.cap:g} R)")
        loop = cls(ctx, index, policy, base, study, space, ahead_of=ahead_of, branch=branch, max_runs=max_runs)
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
        """One pass of the stage loop: ask the proposer what to try, admit and start it, poll
        the runs, tell the finished ones. ``may_start_more`` False: follow the runs in flight,
        start nothing new."""
        wall_used = self.clock.used(self.ctx.launcher.clock())
        over_time = self.stopper.over_time(wall_used, self.study.view())
        ask = self.proposer.ask(allowed=may_start_more and not over_time, over_time=over_time,
                                mine=self.runner.active)
        if ask.then in (Tick.OVER, Tick.LEAVE):
            return ask.then
        view = self.runner.start_while(ask.view, more=self.proposer.wants_more) if ask.start else ask.view
        self.runner.poll(view)
        self.runner.tell_finished(view)
        self._keep_alive(wall_used)
        return ask.then

    def _keep_alive(self, wall_used: float) -> None:
        """Heartbeats, stale and orphaned trials, and the wall clock used, every so often."""
        now = time.monotonic()
        if now - self.last_heartbeat >= HEARTBEAT_INTERVAL_S / 2:
            self.runner.heartbeat()
            self.study.fail_stale_trials()
            self.runner.adopt_or_close_orphans()
            self.last_heartbeat = now
        if now - self.last_saved > 5.0:
            self.study.save_wall_clock(wall_used)
            self.last_saved = now

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
