"""The staged driver: the method's coarse-to-fine steps as sequential Optuna studies.

Stage k is the Optuna study ``<study>.<stage>`` in one storage (``search/engine/stage_study.py``). It
first runs its incumbent (the baseline, then the previous stage's winner), then candidates
from its space; it ends at its budget or when η has stopped improving (``search/method/policy.py``);
its winner becomes the next stage's base. The chain is stored on the studies, so every process
that resumes — or joins as a worker — computes the same chain from the database.

One flat loop ticks every stage loop this process follows (``search/engine/stage_loop.py``): the
stage being decided and, while this worker would sit idle waiting for other workers to finish
it, the next stage run ahead from the current leader. If another config wins, the stage run
ahead is moved aside and the next stage opens afresh under its own name.
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Sequence

import optuna

from verl_sweep.launchers.base import Launcher
from verl_sweep.search.database import optuna_forks
from verl_sweep.search.spec.errors import Interrupted, SweepError, pause
from verl_sweep.search.engine.events import Broadcast, StudyListener
from verl_sweep.search.database.records import FLAT_BAND, Decision, StageResult
from verl_sweep.search.method.stage import Stage
from verl_sweep.search.engine.chain import CapLimit, cap_limit, chain_point
from verl_sweep.search.engine.continuation import Continuation
from verl_sweep.search.engine.final_check import FinalCheck, final_probe
from verl_sweep.search.engine.stage_loop import Context, StageLoop, Tick, slow_start_seen
from verl_sweep.search.engine.stage_study import StageStudy
from verl_sweep.search.database.storage import describe_db_error, is_transient, reset_connections, with_retries
from verl_sweep.search.spec.study_file import StageSettings, StudySpec
from verl_sweep.search.database.study_root import load_spec, save_spec, stored_stage_result
from verl_sweep.search.method.preflight import check_memory
from verl_sweep.spaces import build_space
from verl_sweep.spaces.base import Space
from verl_sweep.verl_knowledge import Config

#: seconds between polls at most while a speed stage runs: its probes end a few steps in,
#: once their tokens/s settles, and a poll that comes steps late pays those steps
SPEED_POLL_S = 30.0

logger = logging.getLogger(__name__)

#: what callers of the driver have always imported from here
__all__ = ["Interrupted", "StageResult", "StudyRunner", "load_spec", "save_spec", "stored_stage_result"]


class StudyRunner:
    """Runs (or resumes, or joins) a staged study. One instance per driver process."""

    def __init__(
        self,
        spec: StudySpec,
        storage: optuna.storages.RDBStorage,
        launcher: Launcher,
        *,
        console: StudyListener,
        listeners: Sequence[StudyListener] = (),
        build_space: Callable[..., Space] = build_space,
        poll_interval_s: float | None = None,
        leave_at_end: bool = False,
    ) -> None:
        """``console`` shows the study; ``listeners`` follow its events too (``verl_sweep.search.engine.events``:
        a benchmark's trace, a tracker)."""
        optuna_forks.install()
        self.spec = spec
        # A worker (not the driver that reports the result) leaves once the last stage has
        # nothing left but other processes' runs: its GPUs go back to the cluster.
        self.leave_at_end = leave_at_end
        self.left = False
        self.storage = storage
        self.launcher = launcher
        self.console: StudyListener = Broadcast(console, *listeners) if listeners else console
        self.build_space = build_space
        self.poll_interval_s = launcher.poll_interval_s if poll_interval_s is None else poll_interval_s
        self._stop_requested: str | None = None
        self.ctx = Context(spec, storage, launcher, self.console, build_space, leave_at_end=leave_at_end,
                           stop_requested=lambda: self._stop_requested)
        #: this process's runs ahead into the next stage, and whether the loop follows them now
        self.ahead: StageLoop | None = None
        self._following_ahead = False
        self._ahead_declined: set[tuple[str, str]] = set()  # (stage, leader) another worker runs ahead from

    # -- public ---------------------------------------------------------------------------------
    def request_stop(self, why: str) -> None:
        """Called from a signal handler: finish the current poll, then stop cleanly."""
        self._stop_requested = why

    def run(self) -> Config:
        """Run every stage not yet finished; returns the final config. Raises BadInputError
        before any probe starts when the memory pre-flight refuses the study's baseline
        (``verl_sweep.search.method.preflight.check_memory``: ``run`` and ``validate`` refuse it before, ``resume``
        and ``worker`` of a stored study here)."""
        check_memory(self.spec)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        base = self.spec.baseline_config()
        flat = 0  # stages in a row from the first whose gain stayed in the flat band (StageResult.flat)
        for index, stage in enumerate(self.spec.stages):
            result = self.stage_result(stage)
            cap = None if result is not None else self.cap_limit(index, base)
            why = None if result is not None else self.why_skip(flat, cap)
            if why is not None:
                result = self.skip_stage(index, base, why)
            elif result is None:
                result = self.run_stage(index, stage, base, cap)
                if result is None:
                    return base  # left before the end (leave_at_end): the others store the result
            else:
                self.console.stage_skipped(stage.name, result)
                ahead = self.take_ahead(index, base)
                if ahead is not None and ahead.active:  # a stage waits for every run of it
                    raise SweepError(f"stage {stage.name} was decided while this worker still ran it")
            flat = flat + 1 if flat == index and result.flat else flat
            base = result.config
        if self.leave_at_end:  # the driver's alone: one process queues and follows its runs
            return base
        if self.spec.train is not None:
            self.run_continuation(base)
        else:
            self.run_final_check(base)
        return base

    def run_continuation(self, final: Config) -> None:
        """Train mode: the chain's config trains on from the chain's last checkpoint to the
        run's end (``verl_sweep.search.engine.continuation``); a resume goes on from the last
        checkpoint it saved."""
        point = chain_point(self.storage, self.spec, len(self.spec.stages))
        run = with_retries(lambda: Continuation.open(self.storage, self.spec, final, point, self.launcher,
                                                     self.console), what="open the continuation",
                         stop_requested=self.ctx.stop_requested)
        if run is not None:
            self._follow(run)

    def run_final_check(self, final: Config) -> None:
        """The final config against the baseline on fresh paired seeds (``verl_sweep.search.engine.final_check``),
        unless skipped or already measured; a resume runs only what is missing."""
        probe = final_probe(self.spec, slow_start=bool(slow_start_seen(self.ctx, len(self.spec.stages))))
        check = with_retries(lambda: FinalCheck.open(self.storage, self.spec, final, self.launcher, self.console,
                                                     probe=probe), what="open the final check",
                           stop_requested=self.ctx.stop_requested)
        if check is not None:
            self._follow(check)

    def _follow(self, run: FinalCheck | Continuation) -> None:
        """Tick the final check or the continuation to its end; a stop abandons its runs."""
        try:
            while run.tick():
                if self._stop_requested:
                    raise Interrupted(self._stop_requested)
                self.launcher.wait(self.poll_interval_s)
        except BaseException as e:
            run.abandon(why=str(e) or type(e).__name__)
            raise

    def cap_limit(self, index: int, base: Config) -> CapLimit | None:
        """Train mode's cost cap on stage ``index`` (``train.max_cost_r``), priced once as it opens."""
        return with_retries(lambda: cap_limit(self.storage, self.spec, index, base), what="price the stage",
                            stop_requested=self.ctx.stop_requested)

    def why_skip(self, flat: int, cap: CapLimit | None) -> str | None:
        """Why the next stage runs no trial (None: it runs): the first ``flat`` stages found no
        gain (``stop_when_flat``), or in train mode it would take the study past its cost cap."""
        if self.spec.stop_when_flat and flat >= self.spec.stop_when_flat:
            return f"skipped: the first {flat} stages found no gain above {FLAT_BAND:.0%} (stop_when_flat)"
        return None if cap is None else cap.skip

    def skip_stage(self, index: int, base: Config, why: str) -> StageResult:
        """The study skips stage ``index`` (``why_skip``): it keeps ``base`` without a trial,
        and says why; runs this worker started ahead into it are closed as wasted."""
        if self.ahead is not None:
            ahead, self.ahead, self._following_ahead = self.ahead, None, False
            ahead.vacate(why=f"the study skipped it ({why.removeprefix('skipped: ')})")
        plan = Stage.of(self.spec, index)
        result = StageResult(
            stage=plan.name, decision=Decision.SKIPPED, winner_trial=None, eta=1.0, eta_low=1.0, eta_high=1.0,
            summary=why, config=base, overrides={},
        )
        result = with_retries(lambda: StageStudy.record_skipped(self.storage, plan, base, result),
                              what="store the stage result", stop_requested=self.ctx.stop_requested)
        self.console.stage_finished(plan.name, result)
        return result

    def stage_result(self, stage: StageSettings) -> StageResult | None:
        return stored_stage_result(self.storage, self.spec, stage)

    def open_stage(self, index: int, base: Config, *, ahead_of: str | None = None,
                   cap: CapLimit | None = None) -> StageLoop | None:
        """Open (create, or join) stage ``index`` from ``base`` (``StageLoop.open``)."""
        return StageLoop.open(self.ctx, index, base, ahead_of=ahead_of, cap=cap)

    def run_stage(self, index: int, stage: StageSettings, base: Config, cap: CapLimit | None = None) -> StageResult | None:
        """Run stage ``index`` from ``base`` to its end, within the cost cap's run limit
        (``cap``); its result (None: this worker left)."""
        loop = self.take_ahead(index, base) or self.open_stage(index, base, cap=cap)
        assert loop is not None  # only a stage run ahead gives up on opening
        loop.runner.adopt_or_close_orphans()
        delay = 1.0
        try:
            while True:
                if self._stop_requested:
                    raise Interrupted(self._stop_requested)
                try:
                    if self.tick(loop) is not Tick.GO_ON:
                        break
                    delay = 1.0
                except Exception as e:  # noqa: BLE001 - only database outages are survived here
                    if not is_transient(e):
                        raise
                    # The database is away (e.g. a PostgreSQL restart): the probes keep running;
                    # whatever was not stored is retried on the next pass.
                    self.console.note(f"database unavailable ({describe_db_error(e)}); retrying in {delay:.0f} s")
                    reset_connections(self.storage)
                    pause(delay, self.ctx.stop_requested)  # a back-off of up to 30 s: a SIGTERM ends it
                    delay = min(delay * 2, 30.0)
                    continue
                self.launcher.wait(self.poll_interval_s if loop.stage.learns else
                                   min(self.poll_interval_s, SPEED_POLL_S))
        except BaseException as e:
            why = str(e) or type(e).__name__
            loop.abandon(why=why)
            self._abandon_ahead(why)
            raise
        if self.left:
            return None
        result = with_retries(loop.record_result, what="store the stage result", stop_requested=self.ctx.stop_requested)
        self.console.stage_finished(stage.name, result)
        return result

    def tick(self, current: StageLoop) -> Tick:
        """One pass of the loop: ticks the stage being decided, or the stage run ahead while
        this worker follows it instead. GO_ON until the stage is over (or this worker leaves)."""
        if self._following_ahead:
            self._following_ahead = self._tick_ahead(current)
            if self._following_ahead:
                return Tick.GO_ON
        signal = current.tick()
        if signal is Tick.LEAVE:
            self.left = True
        elif signal is Tick.RUN_AHEAD and self._open_ahead(current):
            self._following_ahead = self._tick_ahead(current)
            return Tick.GO_ON
        return Tick.GO_ON if signal is Tick.RUN_AHEAD else signal

    # -- running ahead into the next stage ------------------------------------------------------
    def _open_ahead(self, current: StageLoop) -> bool:
        """Idle while other workers finish ``current``, with nothing of it to re-run: open the
        next stage from the current leader (the config the stage would choose if the leader
        holds up), once. The runs count only if the leader wins; if another config wins they
        are closed as wasted and the study is moved aside (``take_ahead``), so the winner's
        stage starts from a clean study under its own name. True when there is a stage ahead
        to follow."""
        if current.ahead_of is not None or current.index + 1 >= len(self.spec.stages):
            return False  # one stage ahead at most
        if self.spec.train is not None:
            return False  # a train-mode stage branches from the checkpoint its stage before chooses
        if self.ahead is not None:
            return True
        guess = current.policy.leading_config(current.study.view(), current.base)
        if guess is None:
            return False
        key = (current.study.name, json.dumps(guess, sort_keys=True, default=str))
        if key in self._ahead_declined:
            return False
        ahead = self.open_stage(current.index + 1, guess, ahead_of=current.study.name)
        if ahead is None:
            self._ahead_declined.add(key)  # not again on every poll
            return False
        self.ahead = ahead
        self.console.note(f"{ahead.study.name}: running ahead from the leader of "
                          f"{current.stage.name} while other workers finish it")
        return True

    def _tick_ahead(self, current: StageLoop) -> bool:
        """One pass of the stage run ahead; False once the loop goes back to ``current``: this
        worker has no run ahead left, ``current`` is decided, or ``current`` has queued work
        again (a failed run queued again, a required confirmation: then nothing new starts
        ahead)."""
        ahead = self.ahead
        if ahead is None or current.study.result_stored():
            return False  # decided: the next stage takes these runs over, or drops them
        ahead.tick(may_start_more=not current.study.has_waiting())
        return ahead.active

    def take_ahead(self, index: int, base: Config) -> StageLoop | None:
        """This worker's runs ahead into stage ``index``, if the stage before chose the config
        they started from; else they are stopped and dropped as wasted (None)."""
        ahead, self.ahead, self._following_ahead = self.ahead, None, False
        if ahead is None:
            return None
        if ahead.index == index and ahead.base == base:
            ahead.ahead_of = None
            ahead.announce()
            self.console.note(f"{ahead.study.name}: the runs started ahead count (the leader won)")
            return ahead
        ahead.vacate(why=f"ran ahead from a leader of {self.spec.stages[ahead.index - 1].name} that did not win")
        return None

    def _abandon_ahead(self, why: str) -> None:
        ahead, self.ahead, self._following_ahead = self.ahead, None, False
        if ahead is None:
            return
        ahead.abandon(why=why)
        if ahead.study.moved_aside():
            # Moved aside meanwhile: what abandon queued again there must not stay queued.
            ahead.vacate(why="its leader did not win")
