"""The staged driver: the method's coarse-to-fine steps as sequential Optuna studies.

Stage k is the Optuna study ``<study>.<stage>`` in one storage. It first runs its incumbent
(the baseline, then the previous stage's winner), then candidates from its space; it ends at
its budget or when η has stopped improving; its winner becomes the next stage's base. The
chain is stored on the studies (``base_config`` and ``result`` user attributes), so every
process that resumes — or joins as a worker — computes the same chain from the database.
A worker with nothing left to do in a stage while others finish it opens the next stage
ahead, from the stage's leader (``_run_ahead``); if another config wins, that study is moved
aside (``_vacate``) and the next stage opens afresh under its own name.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import TrialState, create_trial

from launchers.base import Launcher, LauncherError, NoCapacityError, RunSpec
from objectives.probe import Probe, ProbeOutcome, ProbeSettings, ProbeState
from objectives.score import Eta, Score, combine, eta as eta_of
from objectives.utilisation import MIN_FREE_GB
from search import liveness
from search.console import Console
from search.errors import BadInputError, StudyNotFoundError, SweepError
from search.policy import incumbent_run_etas
from search.pruning import IncumbentPruner
from search.records import SPEC_ATTR, StageResult, records, requeued_numbers, stage_study_name
from search.sampler import build_sampler
from search.storage import HEARTBEAT_INTERVAL_S, describe_db_error, is_transient, reset_connections, with_retries
from search.study_file import StageSettings, StudySpec, spec_from_dict, spec_to_dict
from spaces import hardware_tag, template_for
from spaces.base import Space, SpaceError
from spaces.overrides import Config, merge, to_overrides

logger = logging.getLogger(__name__)



class Interrupted(SweepError):
    """The driver was asked to stop (Ctrl-C, SIGTERM); its trials were re-queued."""

    exit_code = 130


# -- the study root: what was asked, stored so that resume needs only the database ------------


def save_spec(storage: optuna.storages.BaseStorage, spec: StudySpec) -> list[str]:
    """Create the root study holding the study definition; refuse a different definition
    under the same name (that would mix two experiments in one database). Changes to where
    and how probes run (``_is_operational``) and to the budgets of stages not finished are
    stored instead; returns their field paths."""

    data = spec_to_dict(spec)
    try:
        root = optuna.create_study(study_name=spec.name, storage=storage, direction="maximize")
        root.set_user_attr(SPEC_ATTR, data)
        return []
    except optuna.exceptions.DuplicatedStudyError:
        pass
    root = optuna.load_study(study_name=spec.name, storage=storage)
    stored = root.user_attrs.get(SPEC_ATTR)
    for _ in range(25):  # another `run` may have created it this instant and not stored it yet
        if stored is not None:
            break
        time.sleep(0.2)
        stored = root.user_attrs.get(SPEC_ATTR)
    if stored is None:
        raise BadInputError(
            f"the database already has an Optuna study named {spec.name!r} that verl-sweep did not "
            "create. Pick another study name or another --storage."
        )
    changed = [path for path in _differences(stored, data) if path != "source_dir"]  # where the file lies
    refused = [path for path in changed if not _is_operational(path) and not _BUDGET.match(path)]
    if refused:
        shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise BadInputError(
            f"study {spec.name!r} already exists in this database with a different definition ({shown} "
            f"changed). Run `verl-sweep resume {spec.name}` to continue it as stored, or rename the study."
        )
    # A stage's budget may change until the stage has chosen its winner: the stages after it
    # start from that winner, so a finished stage stays as it ran.
    budgets = {int(m["index"]) for path in changed if (m := _BUDGET.match(path))}
    finished = [spec.stages[i].name for i in sorted(budgets) if stored_stage_result(storage, spec, spec.stages[i]) is not None]
    if finished:
        raise BadInputError(
            f"study {spec.name!r}: the budget of a finished stage cannot change (changed: {', '.join(finished)}; "
            "the stages after it started from its winner). Change only the budgets of stages not "
            "finished, or rename the study to run it again."
        )
    if changed:  # resume and workers read the stored definition: give them the new settings too
        root.set_user_attr(SPEC_ATTR, data)
    return changed


#: a definition field that may change while its stage has not finished (``save_spec``)
_BUDGET = re.compile(r"stages\[(?P<index>\d+)\]\.budget\.")


def stored_stage_result(storage: optuna.storages.BaseStorage, spec: StudySpec,
                        stage: StageSettings) -> StageResult | None:
    """The stage's recorded result; None while it has not chosen its winner (or not started)."""
    try:
        study = optuna.load_study(study_name=stage_study_name(spec, stage), storage=storage)
    except KeyError:
        return None
    data = study.user_attrs.get("result")
    return None if data is None else StageResult(**data)


def _is_operational(path: str) -> bool:
    """A definition field that says where and how probes run, not what they measure: more
    slots, other GPUs, another Ray address, a moved database. The simulator's landscape is
    what its probes measure, and the launcher kind stays (``--launcher`` overrides it per
    command)."""
    return path in ("storage", "launcher.max_concurrent") or (
        path.startswith("launcher.options.") and path != "launcher.options.landscape")


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Field paths where two study definitions differ, e.g. ``stages[1].budget.max_trials``."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in sorted(old.keys() | new.keys(), key=str)
                for d in _differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if old == new else [path or "(the whole definition)"]


def _known_studies_hint(name: str, known: list[str], shown: int = 10) -> str:
    """The studies a mistyped name may have meant: all of them when few, else the closest."""
    if not known:
        return " This database has no studies."
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    guess = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    if len(known) <= shown:
        return f"{guess} Studies here: {', '.join(known)}."
    return f"{guess} {len(known)} studies here, e.g. {', '.join(known[:shown])}, …"


def load_spec(storage: optuna.storages.BaseStorage, name: str) -> StudySpec:
    try:
        root = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        # Names only: summaries would read every trial of every study (26 s on a server with 480).
        known = sorted(n for n in optuna.get_all_study_names(storage) if "." not in n)
        hint = _known_studies_hint(name, known)
        raise StudyNotFoundError(f"no study named {name!r} in this database.{hint}") from None
    stored = root.user_attrs.get(SPEC_ATTR)
    if stored is None:
        study, _, stage = name.rpartition(".")
        if study and study in optuna.get_all_study_names(storage):
            raise BadInputError(f"{name!r} is the study of stage {stage!r}; pass the study's name, {study!r}.")
        raise BadInputError(f"study {name!r} was not created by verl-sweep; verl-sweep cannot use it.")
    return spec_from_dict(stored)


# -- pruners, rebuilt from the saved settings on every resume --------------------------------


def pruning_steps(stage: StageSettings, settings: ProbeSettings) -> tuple[int, int]:
    """(report every N steps, no pruning before step M) for this stage's probes. Speed probes
    are short (30 steps) and steady from step to step, so the 500-step settings would never
    act on them: they report every tenth of the probe and may stop from its middle."""
    if settings.speed_only:
        return max(1, settings.steps // 10), settings.steps // 2
    return stage.pruner.interval_steps, stage.pruner.warmup_steps


def build_pruner(stage: StageSettings, settings: ProbeSettings) -> optuna.pruners.BasePruner:
    p = stage.pruner
    _, warmup = pruning_steps(stage, settings)
    if p.name == "none":
        return optuna.pruners.NopPruner()
    if p.name == "incumbent":
        return IncumbentPruner(margin=p.margin, n_warmup_steps=warmup, patience=p.patience)
    if p.name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.n_startup_trials, n_warmup_steps=warmup)
    if p.name == "wilcoxon":
        return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=warmup)
    return optuna.pruners.PatientPruner(
        optuna.pruners.PercentilePruner(
            p.percentile, n_startup_trials=p.n_startup_trials, n_warmup_steps=warmup
        ),
        patience=p.patience,
    )


# -- one trial in flight -----------------------------------------------------------------------


@dataclasses.dataclass
class ActiveTrial:
    trial: optuna.trial.Trial
    probe: Probe
    role: str
    seed: int
    overrides: Config
    next_report_step: int
    outcome: ProbeOutcome | None = None


class StudyRunner:
    """Runs (or resumes, or joins) a staged study. One instance per driver process."""

    def __init__(
        self,
        spec: StudySpec,
        storage: optuna.storages.RDBStorage,
        launcher: Launcher,
        *,
        console: Console,
        build_space: Callable[..., Space],
        poll_interval_s: float | None = None,
        leave_at_end: bool = False,
    ) -> None:
        self.spec = spec
        # A worker (not the driver that reports the result) leaves once the last stage has
        # nothing left but other processes' runs: its GPUs go back to the cluster.
        self.leave_at_end = leave_at_end
        self.left = False
        self.storage = storage
        self.launcher = launcher
        self.console = console
        self.build_space = build_space
        self.poll_interval_s = launcher.poll_interval_s if poll_interval_s is None else poll_interval_s
        self._stop_requested: str | None = None
        self._ahead: _StageRun | None = None  # this process's runs ahead into the next stage
        self._ahead_declined: set[tuple[str, str]] = set()  # (stage, leader) another worker runs ahead from

    # -- public ---------------------------------------------------------------------------------
    def request_stop(self, why: str) -> None:
        """Called from a signal handler: finish the current poll, then stop cleanly."""
        self._stop_requested = why

    def run(self) -> Config:
        """Run every stage not yet finished; returns the final config."""

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        base = self.spec.baseline_config()
        for index, stage in enumerate(self.spec.stages):
            result = self.stage_result(stage)
            if result is None:
                result = self.run_stage(index, stage, base)
                if result is None:
                    return base  # left before the end (leave_at_end): the others store the result
            else:
                self.console.stage_skipped(stage.name, result)
                ahead = self._take_ahead(index, base)
                if ahead is not None and ahead.active:  # a stage waits for every run of it
                    raise SweepError(f"stage {stage.name} was decided while this worker still ran it")
            base = result.config
        return base

    def stage_result(self, stage: StageSettings) -> StageResult | None:
        return stored_stage_result(self.storage, self.spec, stage)

    # -- one stage ------------------------------------------------------------------------------
    def _open_stage(self, stage: StageSettings, base: Config, settings: ProbeSettings, *,
                    ahead_of: str | None = None) -> tuple[optuna.Study, bool] | None:
        name = stage_study_name(self.spec, stage)
        created = False
        try:
            study = optuna.create_study(
                study_name=name,
                storage=self.storage,
                direction="maximize",
                sampler=build_sampler(stage, 0),
                pruner=build_pruner(stage, settings),
            )
            study.set_metric_names(["eta"])  # how the dashboard and the optuna CLI label the value
            study.set_user_attr("base_config", base)
            study.set_user_attr("stage", stage.model_dump(mode="json"))
            study.set_user_attr("probe_steps", settings.steps)
            if ahead_of is not None:
                study.set_user_attr("ahead_of", ahead_of)
                # Its run ids stay unique if it is moved aside and the stage opened again.
                study.set_user_attr("run_prefix", f"{name}.ahead{study._study_id}")
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            existing = optuna.load_study(study_name=name, storage=self.storage)
            # Its creator sets the base (and whether it runs ahead) before "initialized".
            self._wait_initialized(existing)
            stored_base = existing.user_attrs.get("base_config")
            if stored_base is not None and stored_base != base:
                if ahead_of is not None:
                    return None  # another worker runs this stage ahead from another leader
                if existing.user_attrs.get("ahead_of"):
                    # Opened ahead from a leader that then lost: move it aside, start afresh.
                    self._vacate(existing, why="the stage before chose another config")
                    return self._open_stage(stage, base, settings)
                raise SweepError(
                    f"stage {stage.name}: the database's base config differs from the chain computed "
                    "now; the study was changed after it started. Start a new study name."
                )
            n = len(existing.get_trials(deepcopy=False))
            study = optuna.load_study(
                study_name=name,
                storage=self.storage,
                sampler=build_sampler(stage, n),
                pruner=build_pruner(stage, settings),
            )
        return study, created

    def run_stage(self, index: int, stage: StageSettings, base: Config) -> StageResult | None:
        run = self._take_ahead(index, base) or self._open_run(index, stage, base)
        assert run is not None  # only a run ahead gives up on opening
        self._adopt_or_close_orphans(run.study, stage, run.settings, run.active)
        delay = 1.0
        try:
            while True:
                if self._stop_requested:
                    raise Interrupted(f"stopped by {self._stop_requested}")
                try:
                    if self._iterate(run):
                        break
                    delay = 1.0
                except Exception as e:  # noqa: BLE001 - only database outages are survived here
                    if not is_transient(e):
                        raise
                    # The database is away (e.g. a PostgreSQL restart): the probes keep running;
                    # whatever was not stored is retried on the next pass.
                    self.console.note(f"database unavailable ({describe_db_error(e)}); retrying in {delay:.0f} s")
                    reset_connections(self.storage)
                    time.sleep(delay)
                    delay = min(delay * 2, 30.0)
                    continue
                self.launcher.wait(self.poll_interval_s)
        except BaseException as e:
            why = str(e) or type(e).__name__
            self._abandon(run.study, run.active, why=why)
            self._abandon_ahead(why)
            raise
        if self.left:
            return None
        result = with_retries(lambda: self._record_result(run.study, stage, base, run.loop),
                              what="store the stage result")
        self.console.stage_finished(stage.name, result)
        return result

    def _open_run(self, index: int, stage: StageSettings, base: Config, *,
                  ahead_of: str | None = None) -> "_StageRun | None":
        """Open (create, or join) stage ``index`` from ``base``. With ``ahead_of`` (the stage
        still being decided), the stage is opened ahead from that stage's leader; None when
        another worker already runs it ahead from another leader, or its space rejects the
        leader (the real chain reports that once it gets there)."""
        try:
            space = self.build_space(
                stage.space,
                model=self.spec.model,
                hardware=self.spec.hardware,
                algorithm=self.spec.algorithm,
                base=base,
                options=stage.params,
                where=f"stages[{index}]",
                baseline=self.spec.baseline_config(),
            )
        except SpaceError as e:
            if ahead_of is not None:
                return None
            raise BadInputError(str(e)) from None
        probe_steps = self.spec.stage_probe_steps(stage, speed_only=space.speed_only)
        settings = ProbeSettings(
            steps=probe_steps,
            speed_only=space.speed_only,
            warmup_steps=self.spec.probe.speed_warmup_steps if space.speed_only else self.spec.probe.warmup_steps,
            hang_timeout_s=self.spec.probe.hang_timeout_s,
            n_gpus=self.spec.hardware.n_gpus,
        )
        opened = with_retries(lambda: self._open_stage(stage, base, settings, ahead_of=ahead_of),
                              what="open the stage study")
        if opened is None:
            return None
        study, created = opened
        carried: list[optuna.trial.FrozenTrial] = []
        if created:
            carried = self._enqueue_initial(study, stage, space, base,
                                            carried=self._earlier_runs(index, base, probe_steps))
            study.set_user_attr("initialized", True)
        if ahead_of is None:
            self.console.stage_started(index, stage, base, space.explain(), stage.budget.max_trials)
        if carried:
            self.console.note(f"{study.study_name}: incumbent runs on seed(s) "
                              f"{', '.join(str(t.user_attrs['seed']) for t in carried)} carried over from the "
                              "previous stage (same config, seed and probe length)")
        for t in carried:
            self.console.trial_finished(study, t.number, "incumbent", {}, eta=t.user_attrs["eta"],
                                        interval=tuple(t.user_attrs["eta_interval"]))
        loop = _LoopClock(self.launcher.clock(), float(study.user_attrs.get("wall_clock_used_s", 0.0)))
        return _StageRun(index, stage, base, study, space, settings, loop, ahead_of=ahead_of,
                         run_prefix=study.user_attrs.get("run_prefix", f"{self.spec.name}.{stage.name}"))

    def _iterate(self, run: "_StageRun", *, may_start_more: bool = True) -> bool:
        """One pass of the stage loop; True when the stage is over (for every worker).
        ``may_start_more`` False: follow the runs in flight, start nothing new."""

        study, stage, active, loop = run.study, run.stage, run.active, run.loop
        wall_used = loop.used(self.launcher.clock())
        trials = loop.trials(study)
        over_time = stage.budget.max_wall_clock_s is not None and wall_used >= stage.budget.max_wall_clock_s
        allowed = may_start_more and not over_time
        may_start = allowed and self._may_start(study, trials, stage, active)
        if not active and not may_start:
            trials = loop.trials(study, fresh=True)  # decide on the database as it is now
            if allowed and self._may_start(study, trials, stage, active):
                # The cached view was behind: another worker queued work (e.g. a required
                # confirmation) that this stage still needs; never decide without it.
                may_start = True
            elif self._waiting_on_others(trials, active):
                # Idle while other workers finish the stage: confirm the top candidates now
                # (required re-runs first), then re-run them again while that fits in the
                # wait; with nothing to re-run, start the next stage from the current leader.
                if allowed and self.launcher.free_slots() > 0:
                    if (self._enqueue_confirmations(study, stage, trials, extra=False)
                            or self._enqueue_confirmations(study, stage, trials, extra=True)
                            or self._enqueue_early_confirmation(run, trials)):
                        loop.stale = True
                    elif self._nothing_left_for_me(run, trials):
                        self.left = True
                        self.console.note(f"{study.study_name}: only other workers' confirmations are left; "
                                          "leaving (they finish the study)")
                        return True
                    else:
                        self._run_ahead(run, trials)
            elif over_time or not self._enqueue_confirmations(study, stage, trials, extra=False):
                return True
            else:
                loop.stale = True
        if may_start and self.launcher.free_slots() > 0:
            # Count on the database as it is now: with many workers, a cached view starts
            # trials the others have already filled the budget with.
            trials = loop.trials(study, fresh=True)
            may_start = self._may_start(study, trials, stage, active)
        while may_start and self.launcher.free_slots() > 0:
            started = self._start_trial(run)
            trials = loop.trials(study, fresh=True)
            if not started:
                break
            may_start = self._may_start(study, trials, stage, active)
        self._poll_active(study, stage, run.settings, active)
        self._stop_runs_that_no_longer_count(active, loop.trials(study))
        if self._tell_finished(study, active, loop.trials(study)):
            loop.stale = True
        now = time.monotonic()
        if now - loop.last_heartbeat >= HEARTBEAT_INTERVAL_S / 2:
            for item in active.values():
                self.storage.record_heartbeat(item.trial._trial_id)
            optuna.storages.fail_stale_trials(study)
            self._adopt_or_close_orphans(study, stage, run.settings, active)
            loop.last_heartbeat = now
        if now - loop.last_saved > 5.0:
            study.set_user_attr("wall_clock_used_s", wall_used)
            loop.last_saved = now
        return False

    def _nothing_left_for_me(self, run: "_StageRun", trials: list[optuna.trial.FrozenTrial]) -> bool:
        """A worker in the last stage, idle, whose stage only waits on other processes'
        confirmation runs: nothing it could start there or ahead. A run whose process on this
        host is gone (SIGKILL) is work left: the next heartbeat round queues it again, and
        this worker may be the last one to take it."""

        def work_left(t: optuna.trial.FrozenTrial) -> bool:
            if t.state not in (TrialState.RUNNING, TrialState.WAITING):
                return False
            return t.user_attrs.get("role") != "rerun" or liveness.owner_is_dead(t.user_attrs.get("owner"))

        return (self.leave_at_end and run.ahead_of is None and run.index == len(self.spec.stages) - 1
                and not any(work_left(t) for t in trials))

    # -- running ahead into the next stage (issue 7) ---------------------------------------------
    def _run_ahead(self, current: "_StageRun", trials: list[optuna.trial.FrozenTrial]) -> None:
        """Idle while other workers finish ``current``, with nothing of it to re-run: run the
        next stage from the current leader (the config ``_decide`` would pick if the leader
        holds up). Follows those runs until this worker has none left, ``current`` is
        decided, or ``current`` has queued work again (a failed run queued again, a required
        confirmation): then back to ``current``. The runs count only if the leader wins; if
        another config wins they are closed as wasted and the study is moved aside
        (``_vacate``), so the winner's stage starts from a clean study under its own name."""

        if current.ahead_of is not None or current.index + 1 >= len(self.spec.stages):
            return  # one stage ahead at most
        ahead = self._ahead
        if ahead is None:
            guess = self._leading_config(current.stage, trials, current.base)
            if guess is None:
                return
            key = (current.study.study_name, json.dumps(guess, sort_keys=True, default=str))
            if key in self._ahead_declined:
                return
            ahead = self._open_run(current.index + 1, self.spec.stages[current.index + 1], guess,
                                   ahead_of=current.study.study_name)
            if ahead is None:
                self._ahead_declined.add(key)  # not again on every poll
                return
            self._ahead = ahead
            self.console.note(f"{ahead.study.study_name}: running ahead from the leader of "
                              f"{current.stage.name} while other workers finish it")
        while True:
            if self._stop_requested:
                raise Interrupted(f"stopped by {self._stop_requested}")
            if self.storage.get_study_user_attrs(current.study._study_id).get("result") is not None:
                return  # decided: the next stage takes these runs over, or drops them
            queued = current.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            self._iterate(ahead, may_start_more=not queued)
            if not ahead.active:
                return
            self.launcher.wait(self.poll_interval_s)

    def _leading_config(self, stage: StageSettings, trials: list[optuna.trial.FrozenTrial],
                        base: Config) -> Config | None:
        """The config this stage would choose if its leader held up: the leading candidate
        (by η over the runs it has so far, confirmed or not: the top ones are all confirmed
        before the decision) when its η is above the tolerance, else the incumbent. None while
        a candidate still running could take the lead (``_running_etas``)."""
        ranked, _ = _ranked_candidates(trials, confirmed_only=False)
        threshold = 1 + stage.stop.tolerance
        leader = ranked[0] if ranked and ranked[0][0][0] > threshold else None
        bar = leader[0][0] if leader else threshold
        if any(e is None or e > bar for e, _ in _running_etas(trials)):
            return None
        return merge(base, dict(leader[1].user_attrs.get("overrides", {}))) if leader else base

    def _enqueue_early_confirmation(self, run: "_StageRun", trials: list[optuna.trial.FrozenTrial]) -> bool:
        """Idle, with nothing finished to re-run: queue the confirmation of the running
        candidate with the best running η above the tolerance, past the pruner's warm-up (no
        re-run yet, a fresh seed left). It is the one a finished leader would need anyway;
        started now, the stage does not wait a whole probe for it after the first run ends.
        If the first run is pruned after all, the re-run is stopped
        (``_stop_runs_that_no_longer_count``)."""

        study, stage = run.study, run.stage
        if stage.confirm_top == 0:
            return False
        _, warmup = pruning_steps(stage, run.settings)
        rerun_of = {int(t.user_attrs["rerun_of"]) for t in trials
                    if t.user_attrs.get("role") == "rerun" and t.state != TrialState.FAIL}
        running = [(e, t) for e, t in _running_etas(trials)
                   if e is not None and e > 1 + stage.stop.tolerance and t.state == TrialState.RUNNING
                   and max(t.intermediate_values) >= warmup and t.number not in rerun_of
                   and self._unused_fresh_seeds(t.params, trials)]
        if not running:
            return False
        _, target = max(running, key=lambda item: item[0])
        seed = self._unused_fresh_seeds(target.params, trials)[0]
        _queue_rerun(study, target, seed, extra=False)
        self.console.note(f"{study.study_name}: re-running trial {target.number} on a fresh seed "
                          "while its first run is still going (it runs ahead of the incumbent)")
        return True

    def _take_ahead(self, index: int, base: Config) -> "_StageRun | None":
        """This worker's runs ahead into stage ``index``, if the stage before chose the config
        they started from; else they are dropped as wasted."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.index == index and ahead.base == base:
            ahead.ahead_of = None
            self.console.stage_started(index, ahead.stage, base, ahead.space.explain(), ahead.stage.budget.max_trials)
            self.console.note(f"{ahead.study.study_name}: the runs started ahead count (the leader won)")
            return ahead
        why = f"ran ahead from a leader of {self.spec.stages[ahead.index - 1].name} that did not win"
        for item in ahead.active.values():
            self._cancel_run(item)
        self._vacate(ahead.study, why=why)
        return None

    def _abandon_ahead(self, why: str) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        self._abandon(ahead.study, ahead.active, why=why)
        if self.storage.get_study_name_from_id(ahead.study._study_id) != ahead.study.study_name:
            # Moved aside meanwhile: what _abandon queued again there must not stay queued.
            self._vacate(ahead.study, why="its leader did not win")

    def _vacate(self, study: optuna.Study, *, why: str) -> None:
        """Move aside a stage study opened ahead from a leader that lost: close its queued and
        running trials (as wasted, never queued again; a dead owner's run is cleaned up) and
        rename it ``<name>~lost<id>``, so the stage opens afresh under its own name while the
        wasted runs stay on record. Optuna has no rename; the name is a column of its
        ``studies`` table, and the update only applies if no other process renamed it first."""
        import sqlalchemy as sa
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.storages._rdb.models import StudyModel

        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING)):
            try:
                self.storage.set_trial_user_attr(t._trial_id, "reason", f"{WASTED}{why}")
                self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue
            if t.state == TrialState.RUNNING and liveness.owner_is_dead(t.user_attrs.get("owner")):
                self.launcher.cleanup_leftover(Path(t.user_attrs.get("run_dir", "")))
        name, lost = study.study_name, f"{study.study_name}~lost{study._study_id}"
        with self.storage.engine.begin() as conn:
            renamed = conn.execute(sa.update(StudyModel)
                                   .where(StudyModel.study_id == study._study_id, StudyModel.study_name == name)
                                   .values(study_name=lost)).rowcount
        if renamed:
            self.console.note(f"{name}: closed the runs started ahead ({why}); kept as {lost}")

    def _record_result(self, study: optuna.Study, stage: StageSettings, base: Config, loop: "_LoopClock") -> StageResult:
        """Decide once: the first worker to finish the stage stores the result; the others
        (and every later resume) read the stored one, so the chain is the same for all."""

        stored = optuna.load_study(study_name=study.study_name, storage=self.storage).user_attrs.get("result")
        if stored is not None:
            return StageResult(**stored)
        study.set_user_attr("wall_clock_used_s", loop.used(self.launcher.clock()))
        result = self._decide(study, stage, base)
        study.set_user_attr("result", result.to_attr())
        return result

    # -- starting ---------------------------------------------------------------------------------
    def _wait_initialized(self, study: optuna.Study, timeout_s: float = 60.0) -> None:
        """Another worker created the stage: wait until it has queued the stage's first trials,
        or a fresh trial could take a place in the budget before them."""

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if optuna.load_study(study_name=study.study_name, storage=self.storage).user_attrs.get("initialized"):
                return
            time.sleep(0.5)

    def _earlier_runs(self, index: int, base: Config, probe_steps: int) -> dict[int, optuna.trial.FrozenTrial]:
        """Finished runs of the previous stage that are this stage's incumbent runs already:
        the same config, seed and probe length (a stage that kept its incumbent, or the
        winner's own runs), by seed."""

        if index == 0:
            return {}
        try:
            previous = optuna.load_study(study_name=stage_study_name(self.spec, self.spec.stages[index - 1]),
                                         storage=self.storage)
        except KeyError:
            return {}
        if previous.user_attrs.get("probe_steps") != probe_steps:
            return {}
        prev_base = previous.user_attrs.get("base_config") or {}
        runs: dict[int, optuna.trial.FrozenTrial] = {}
        for t in previous.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if ("score" in t.user_attrs and "seed" in t.user_attrs
                    and merge(prev_base, t.user_attrs.get("overrides", {})) == base):
                runs.setdefault(int(t.user_attrs["seed"]), t)
        return runs

    def _enqueue_initial(self, study: optuna.Study, stage: StageSettings, space: Space, base: Config,
                         carried: dict[int, optuna.trial.FrozenTrial] | None = None) -> list[optuna.trial.FrozenTrial]:
        """The stage's first trials: the incumbent (repeated), starting points, a template.
        An incumbent run the previous stage already made (``carried``) is copied, not re-run;
        returns the copies."""
        params = space.incumbent_params(base) or {}
        carried = carried or {}
        scores: list[Score] = []
        for repeat in range(self.spec.probe.incumbent_repeats):
            seed = self.spec.seeds[repeat % len(self.spec.seeds)]
            if seed in carried:
                scores.append(Score(**carried[seed].user_attrs["score"]))
                self._add_carried(study, space, base, params, carried[seed], scores)
                continue
            study.enqueue_trial(params, user_attrs={"role": "incumbent", "seed": seed}, skip_if_exists=False)
        copies = [t for t in study.get_trials(deepcopy=False) if "carried_from" in t.user_attrs]
        # The sampler's startup trials come from the space's starting points (the method's
        # first moves, or spread points), leaving at least one place for the sampler itself.
        n_start = min(stage.sampler.n_startup_trials,
                      stage.budget.max_trials - self.spec.probe.incumbent_repeats - 1)
        for point in space.starting_points(base, n_start):
            study.enqueue_trial(point, user_attrs={"role": "candidate", "seed": self.spec.seeds[0], "origin": "start"},
                                skip_if_exists=False)
        if space.kind == "systems":
            # The source's layout for this model size and GPU count is the first candidate.
            template = template_for(self.spec.model, self.spec.hardware, self.spec.algorithm)
            template_params = space.incumbent_params(merge(base, template.config))
            if template_params and template_params != params:
                study.enqueue_trial(
                    template_params,
                    user_attrs={"role": "candidate", "seed": self.spec.seeds[0], "origin": f"template {template.name}"},
                    skip_if_exists=False,
                )
        return copies

    def _add_carried(self, study: optuna.Study, space: Space, base: Config, params: dict[str, Any],
                     source: optuna.trial.FrozenTrial, scores: list[Score]) -> None:
        """Store a previous stage's run as a finished incumbent run of this stage: its score,
        curve and intermediate values (the pruner pairs seeds on them), no GPU time of its own."""

        fixed = optuna.trial.FixedTrial(params)
        if params:
            space.suggest(fixed, base)  # the parameters' distributions, for the sampler
        e = eta_of(scores[-1], scores)
        attrs = {k: v for k, v in source.user_attrs.items()
                 if k not in ("owner", "rerun_of", "extra", "idle_fill", "origin", "requeued_because")}
        attrs.update(role="incumbent", overrides={}, eta=e.value, eta_interval=[e.low, e.high],
                     carried_from=source.user_attrs.get("run_id", f"trial {source.number}"),
                     probe={**source.user_attrs.get("probe", {}), "gpu_time_s": 0.0})
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=e.value, params=fixed.params if params else {},
            distributions=fixed.distributions if params else {}, user_attrs=attrs,
            intermediate_values=dict(source.intermediate_values),
        ))

    def _counted(self, trials: list[optuna.trial.FrozenTrial]) -> int:
        """Trials that use the stage's search budget: all but failures that were queued again
        and the confirmation re-runs (which come on top, at most ``confirm_top``)."""
        requeued = requeued_numbers(records(trials))
        return sum(1 for t in trials
                   if t.number not in requeued and t.user_attrs.get("role") not in ("rerun", "skipped"))

    def _enqueue_confirmations(
        self, study: optuna.Study, stage: StageSettings, trials: list[optuna.trial.FrozenTrial], *, extra: bool
    ) -> bool:
        """Queue re-runs of the top candidates on fresh seeds; False when there is nothing to
        queue. Required: one re-run of each of the top ``confirm_top`` that has none. Extra
        (``extra=True``, for workers that would sit idle while others finish the stage): one
        more re-run of the least-confirmed top candidate that has a fresh seed left, only
        while the stage is expected to wait for its other probes anyway (``_worth_waiting``,
        checked again when it starts: ``idle_fill``)."""

        idle_fill = extra
        if stage.confirm_top == 0:
            return False
        requeued = requeued_numbers(records(trials))
        done = [
            t for t in trials
            if t.state == TrialState.COMPLETE and t.user_attrs.get("role") == "candidate" and t.value is not None
            and not _infeasible(t) and float(t.value) > 1.0
        ]
        top: list[optuna.trial.FrozenTrial] = []
        for t in sorted(done, key=lambda t: float(t.value), reverse=True):  # type: ignore[arg-type]
            # A point the sampler proposed twice is one candidate: confirm it once.
            if len(top) < stage.confirm_top and all(t.params != other.params for other in top):
                top.append(t)
        reruns = [t for t in trials if t.user_attrs.get("role") == "rerun" and t.number not in requeued]
        count = {t.number: sum(int(r.user_attrs.get("rerun_of", -1)) == t.number for r in reruns) for t in top}
        if extra:
            open_ = [t for t in top if self._unused_fresh_seeds(t.params, trials)]
            if not open_ or not self._worth_waiting(trials):
                return False
            targets = [min(open_, key=lambda t: count[t.number])]
        else:
            targets = [t for t in top if count[t.number] == 0]
            if not targets:
                # Runs beyond the first re-run are "extra": they need a fresh seed of their own.
                targets, extra = self._undecided_leader(stage, trials), True
        for trial in targets:
            # The seed is checked again when the re-run starts (_rerun_seed): workers that
            # queue at the same moment pick the same one here.
            seed = (self._unused_fresh_seeds(trial.params, trials) or self._fresh_seeds())[0]
            _queue_rerun(study, trial, seed, extra=extra, idle_fill=idle_fill)
        if targets:
            self.console.note(f"{study.study_name}: re-running on fresh seeds: "
                              + ", ".join(f"trial {t.number}" for t in targets))
        return bool(targets)

    def _undecided_leader(self, stage: StageSettings,
                          trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
        """The would-be winner, when its runs so far neither clear the tolerance nor fall
        within it (η above 1 + tolerance, interval reaching it) and it may run again: one more
        fresh seed decides more than the first runs could. Runs already queued or running count
        towards ``confirm_max_runs``: a worker that would sit idle while another runs the
        leader's re-run starts the next one beside it (one driver, which asks only when all its
        slots are free, runs them one after the other)."""

        ranked, _ = _ranked_candidates(trials)
        if not ranked:
            return []
        (value, low, _high, n_runs), leader = ranked[0]
        threshold = 1 + stage.stop.tolerance
        pending = sum(t.user_attrs.get("role") == "rerun" and t.state in (TrialState.WAITING, TrialState.RUNNING)
                      and _point(t) == leader.params for t in trials)
        if (value <= threshold or low > threshold or n_runs + pending >= stage.confirm_max_runs
                or not self._unused_fresh_seeds(leader.params, trials)):
            return []
        return [leader]

    def _may_start(
        self,
        study: optuna.Study,
        trials: list[optuna.trial.FrozenTrial],
        stage: StageSettings,
        active: dict[int, ActiveTrial],
    ) -> bool:
        if any(t.state == TrialState.WAITING for t in trials):
            return True  # queued work (incumbents, re-queued trials) is already inside the budget
        if self._counted(trials) >= stage.budget.max_trials:
            return False
        return not self._stable(trials, stage)

    def _waiting_on_others(self, trials: list[optuna.trial.FrozenTrial], active: dict[int, ActiveTrial]) -> bool:
        """Trials RUNNING in other processes (workers) that this stage's result needs."""

        return any(t.state == TrialState.RUNNING and t.number not in active for t in trials)

    def _start_trial(self, run: "_StageRun") -> bool:
        study = run.study
        trial = study.ask()
        try:
            # Heartbeat and owner first: a trial without them could never be found stale.
            self.storage.record_heartbeat(trial._trial_id)
            trial.set_user_attr("owner", liveness.owner_record())
            return self._start_asked(run, trial)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Closed by another process while starting (its stage moved aside): nothing to give back.
            return False
        except BaseException as e:
            if trial.number not in run.active:
                try:
                    self._release(study, trial, reason=f"could not start: {str(e)[:200] or type(e).__name__}")
                except Exception:  # noqa: BLE001 - the heartbeat closes it later
                    logger.warning("could not release trial %d", trial.number, exc_info=True)
            raise

    def _start_asked(self, run: "_StageRun", trial: optuna.trial.Trial) -> bool:
        study, stage, space, base, settings, active = run.study, run.stage, run.space, run.base, run.settings, run.active
        if trial.user_attrs.get("role", "candidate") == "candidate" and self._over_budget(study, trial, stage):
            # Another worker took the last place in the budget between our count and ask.
            trial.set_user_attr("role", "skipped")
            trial.set_user_attr("reason", "over budget: the stage's budget was used up before this trial could start")
            study.tell(trial, state=TrialState.FAIL)
            return False
        role = trial.user_attrs.get("role", "candidate")
        seed = int(trial.user_attrs.get("seed", self.spec.seeds[0]))
        if role == "rerun":
            if trial.user_attrs.get("idle_fill") and not self._worth_waiting(study.get_trials(deepcopy=False)):
                # Queued to fill a wait that is over by now: started, it would lengthen the stage.
                trial.set_user_attr("role", "skipped")
                trial.set_user_attr("reason", "extra re-run no longer fits in the stage's wait")
                study.tell(trial, state=TrialState.FAIL)
                return False
            rerun_seed = self._rerun_seed(study, trial)
            if rerun_seed is None:
                trial.set_user_attr("role", "skipped")
                trial.set_user_attr("reason", "redundant re-run: other workers queued the same confirmation")
                study.tell(trial, state=TrialState.FAIL)
                return False
            seed = rerun_seed
        try:
            overrides = space.suggest(trial, base) if (role != "incumbent" or trial.params) else {}
        except SpaceError as e:
            study.tell(trial, state=TrialState.FAIL)
            raise BadInputError(f"stage {stage.name}: {e}") from None
        if role == "incumbent":
            overrides = {k: v for k, v in overrides.items() if base.get(k) != v}
        if "seed" not in trial.user_attrs:
            seed = self._unused_seed(study, trial, seed)
        config = merge(base, overrides, {"data.seed": seed})
        run_id = f"{run.run_prefix}.t{trial.number:04d}"
        spec = RunSpec(
            run_id=run_id,
            overrides=tuple(to_overrides(config)),
            n_gpus=self.spec.hardware.n_gpus,
            metadata={"study": self.spec.name, "stage": stage.name, "trial": str(trial.number)},
        )
        probe = Probe(self.launcher, spec, settings)
        try:
            handle = probe.start()
        except NoCapacityError:
            self._release(study, trial, reason="no free launcher slot")
            return False
        except LauncherError as e:
            self._release(study, trial, reason=str(e))
            raise
        try:
            trial.set_user_attr("role", role)
            trial.set_user_attr("seed", seed)
            trial.set_user_attr("overrides", overrides)
            trial.set_user_attr("run_id", run_id)
            trial.set_user_attr("run_dir", str(handle.run_dir))
            self.storage.record_heartbeat(trial._trial_id)
        except BaseException:
            self.launcher.cancel(handle)  # nobody would follow it: never leave it running
            raise
        interval, _ = pruning_steps(stage, settings)
        active[trial.number] = ActiveTrial(trial, probe, role, seed, overrides, next_report_step=interval)
        self.console.trial_started(stage.name, trial.number, role, overrides)
        return True

    def _unused_seed(self, study: optuna.Study, trial: optuna.trial.Trial, seed: int) -> int:
        """A sampler that proposes a point already measured gets a fresh seed for it, so the
        probe is an independent replicate instead of an exact (deterministic) repeat."""

        params = study._storage.get_trial(trial._trial_id).params
        if not params:
            return seed
        used = {int(t.user_attrs["seed"]) for t in study.get_trials(deepcopy=False)
                if t.number != trial.number and t.params == params and "seed" in t.user_attrs
                and t.state != TrialState.FAIL}
        return next((s for s in self.spec.seeds if s not in used), seed)

    def _rerun_seed(self, study: optuna.Study, trial: optuna.trial.Trial) -> int | None:
        """The seed a queued re-run starts on; None when it is redundant. Workers that queue
        confirmations at the same moment queue the same ones: a required re-run counts only as
        the first required re-run of its trial, and every re-run takes the first fresh seed
        that no run of the same point numbered below it has (so no two runs of a point are the
        same run twice, which would pool as two); none left makes an extra re-run redundant."""
        trials = study.get_trials(deepcopy=False)
        target = trial.user_attrs.get("rerun_of")
        if not trial.user_attrs.get("extra"):
            requeued = requeued_numbers(records(trials))
            earlier = [t for t in trials if t.number < trial.number and t.number not in requeued
                       and t.user_attrs.get("role") == "rerun" and t.user_attrs.get("rerun_of") == target
                       and not t.user_attrs.get("extra")]
            if earlier:
                return None
        original = next((t for t in trials if t.number == target), None)
        free = self._unused_fresh_seeds(original.params, trials, before=trial.number) if original else []
        if free:
            return free[0]
        if trial.user_attrs.get("extra"):
            return None
        # A required re-run always runs (the decision needs it), even when twins of the point
        # have used every fresh seed: then on the seed it was queued with.
        return int(trial.user_attrs.get("seed", self._fresh_seeds()[0]))

    def _fresh_seeds(self) -> list[int]:
        """Seeds for confirmations: those the incumbent runs did not use."""
        return list(self.spec.seeds[self.spec.probe.incumbent_repeats:] or self.spec.seeds)

    def _unused_fresh_seeds(self, params: dict[str, Any], trials: list[optuna.trial.FrozenTrial], *,
                            before: int | None = None) -> list[int]:
        """Fresh seeds no run of ``params`` has (queued, running or finished; only runs
        numbered below ``before`` when given). A queued trial's parameters are its fixed ones."""

        used = {int(t.user_attrs["seed"]) for t in trials
                if "seed" in t.user_attrs and t.state != TrialState.FAIL
                and (before is None or t.number < before)
                and _point(t) == params}
        return [s for s in self._fresh_seeds() if s not in used]

    def _worth_waiting(self, trials: list[optuna.trial.FrozenTrial]) -> bool:
        """True while the stage is expected to wait for other workers' probes for at least
        EXTRA_RERUN_MIN_WAIT of a probe's length (the median of its finished probes): an extra
        re-run started now uses a worker that would sit idle and delays the stage by at most
        the rest of a probe. Start times are the database's (Optuna's ask times)."""
        import datetime

        lengths = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials
                   if t.state == TrialState.COMPLETE and t.datetime_start and t.datetime_complete
                   and "run_id" in t.user_attrs]
        if not lengths:
            return False
        probe_s = statistics.median(lengths)
        now = datetime.datetime.now()
        wait_s = max(((t.datetime_start - now).total_seconds() + probe_s for t in trials
                      if t.state == TrialState.RUNNING and t.datetime_start), default=0.0)
        return wait_s >= EXTRA_RERUN_MIN_WAIT * probe_s

    def _over_budget(self, study: optuna.Study, trial: optuna.trial.Trial, stage: StageSettings) -> bool:
        """Budgets hold across workers: a fresh trial counts only if fewer than max_trials
        counted trials have a smaller number (numbers are assigned by the database). The trial
        itself is in the count, so that a trial queued again replaces the failure it retries."""
        up_to_it = [t for t in study.get_trials(deepcopy=False) if t.number <= trial.number]
        return self._counted(up_to_it) > stage.budget.max_trials

    def _release(self, study: optuna.Study, trial: optuna.trial.Trial, *, reason: str) -> None:
        """Give back a trial we asked for but could not start (its assignment re-queued)."""
        frozen = study._storage.get_trial(trial._trial_id)
        if frozen.state.is_finished():
            return  # closed meanwhile by another process, which queued it again where needed
        study.tell(trial, state=TrialState.FAIL)
        liveness.requeue(study, frozen, reason=reason)

    def _adopt_or_close_orphans(
        self, study: optuna.Study, stage: StageSettings, settings: ProbeSettings, active: dict[int, ActiveTrial]
    ) -> None:
        """Trials a dead driver left RUNNING: follow their run again where the launcher can
        re-attach (a Ray job outlives its submitter), else close them, kill what their run
        left behind, and queue them again."""
        adopted, closed = [], []
        interval, _ = pruning_steps(stage, settings)
        for frozen in liveness.orphaned_trials(study):
            run_id = frozen.user_attrs.get("run_id")
            handle = self.launcher.reattach(run_id) if run_id else None
            if handle is not None:
                probe = Probe(self.launcher, RunSpec(run_id=run_id, overrides=(), n_gpus=self.spec.hardware.n_gpus),
                              settings)
                probe.attach(handle)
                outcome = probe.poll()
                if outcome is not None and outcome.state is ProbeState.FAILED:
                    handle = None  # it died with its driver: nothing to follow
            if handle is not None:
                trial = optuna_trial(study, frozen)
                trial.set_user_attr("owner", liveness.owner_record())
                self.storage.record_heartbeat(frozen._trial_id)
                active[frozen.number] = ActiveTrial(
                    trial, probe, frozen.user_attrs.get("role", "candidate"), int(frozen.user_attrs.get("seed", 0)),
                    dict(frozen.user_attrs.get("overrides", {})), next_report_step=interval,
                    outcome=outcome,
                )
                adopted.append(frozen.number)
                continue
            if liveness.close_and_requeue(study, frozen, reason="its driver process died"):
                closed.append(frozen.number)
                self.launcher.cleanup_leftover(Path(frozen.user_attrs.get("run_dir", "")))
        if adopted:
            self.console.note(f"re-attached to the runs of trial(s) {', '.join(map(str, adopted))} left by a dead driver")
        if closed:
            self.console.note(
                f"closed {len(closed)} trial(s) left running by a dead driver and queued them again: "
                + ", ".join(map(str, closed))
            )

    # -- following --------------------------------------------------------------------------------
    def _poll_active(
        self, study: optuna.Study, stage: StageSettings, settings: ProbeSettings, active: dict[int, ActiveTrial]
    ) -> None:
        for item in list(active.values()):
            if item.outcome is not None:
                continue
            outcome = item.probe.poll()
            if outcome is None:
                self._report(study, stage, item)
            else:
                item.outcome = outcome
            self.console.trial_progress(stage.name, item.trial.number, item.probe)

    def _stop_runs_that_no_longer_count(self, active: dict[int, ActiveTrial],
                                        trials: list[optuna.trial.FrozenTrial]) -> None:
        """Stop this worker's runs whose trial another process closed (a stage run ahead and
        moved aside, a heartbeat that looked stale), and early confirmations whose first run
        was then pruned: their results could no longer count."""

        state = {t.number: t.state for t in trials}
        pruned = {t.number for t in trials if t.state == TrialState.PRUNED and t.user_attrs.get("role") == "candidate"}
        for number, item in active.items():
            if item.outcome is not None:
                continue
            target = item.trial.user_attrs.get("rerun_of")
            if state.get(number, TrialState.RUNNING).is_finished():
                item.outcome = item.probe.stop(ProbeState.STOPPED, reason="closed by another worker")
            elif item.role == "rerun" and target is not None and int(target) in pruned:
                item.outcome = item.probe.stop(ProbeState.STOPPED, reason=f"its first run (trial {target}) was pruned")

    def _report(self, study: optuna.Study, stage: StageSettings, item: ActiveTrial) -> None:
        """Report the running rate every K steps and let the pruner decide (candidates only)."""

        follower = item.probe.follower
        if follower is None or follower.last_step < item.next_report_step:
            return
        step = item.next_report_step
        item.next_report_step += pruning_steps(stage, item.probe.settings)[0]
        score = item.probe.running_score()
        if score is None or not math.isfinite(score.rate):
            return
        try:
            item.trial.report(score.rate, step)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Closed meanwhile by another process (its heartbeat looked stale) and queued again
            # there: stop this run; _tell then drops the result instead of doubling it.
            item.outcome = item.probe.stop(ProbeState.STOPPED, reason="closed by another worker")
            return
        if item.role == "candidate" and item.trial.should_prune():
            rule = {"incumbent": "clearly below the incumbent's on the same seed",
                    "median": "below the median of the stage's other trials"}.get(stage.pruner.name, "below the stage's others")
            item.outcome = item.probe.stop(
                ProbeState.PRUNED, reason=f"pruned at step {step}: running rate {score.rate:.3g} {rule}"
            )

    def _incumbent_scores(self, trials: list[optuna.trial.FrozenTrial]) -> tuple[list[Score], bool]:
        """Scores of the incumbent runs told so far, and whether all of them are told."""

        requeued = requeued_numbers(records(trials))
        # Runs closed as wasted (a stage run ahead and moved aside, _vacate) did not fail.
        mine = [t for t in trials if t.user_attrs.get("role") == "incumbent" and t.number not in requeued
                and not str(t.user_attrs.get("reason", "")).startswith(WASTED)]
        scores = [Score(**t.user_attrs["score"]) for t in mine
                  if t.state == TrialState.COMPLETE and "score" in t.user_attrs]
        pending = any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in mine)
        if not scores and not pending and mine:
            cause = next((t.user_attrs["reason"] for t in reversed(mine) if t.user_attrs.get("reason")), "no reason recorded")
            raise SweepError(
                f"every run of the stage's incumbent failed ({cause}), so no η can be computed. "
                f"Fix the baseline in the study file and run it under a new name or database; the failed runs are "
                f"in `verl-sweep status {self.spec.name}`."
            )
        return scores, not pending

    def _tell_finished(self, study: optuna.Study, active: dict[int, ActiveTrial],
                       trials: list[optuna.trial.FrozenTrial]) -> bool:
        """Tell Optuna every finished probe it can; True when something was told.

        Incumbent runs are told at once, with η against the incumbent runs told so far (so
        workers never wait on each other's incumbents); candidates wait until every incumbent
        run is told, then get η against their mean."""

        finished = [item for item in active.values() if item.outcome is not None]
        if not finished:
            return False
        told = False
        scores, complete = self._incumbent_scores(trials)
        for item in sorted(finished, key=lambda i: i.role != "incumbent"):
            outcome = item.outcome
            assert outcome is not None
            if outcome.state is ProbeState.COMPLETE and item.role != "incumbent" and not complete:
                continue  # η needs every incumbent run; tell once they are done
            against = scores
            if item.role == "incumbent" and outcome.score is not None and outcome.state is ProbeState.COMPLETE:
                against = scores + [outcome.score]
            try:
                self._tell(study, item, outcome, against)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Closed meanwhile by another process (its heartbeat looked stale): its
                # assignment was queued again there, so this result is dropped, not doubled.
                self.console.note(f"{study.study_name}: trial {item.trial.number} was closed by another worker")
            del active[item.trial.number]
            told = True
            if item.role == "incumbent":
                return told  # re-read before telling candidates against the new incumbent set
        return told

    def _tell(self, study: optuna.Study, item: ActiveTrial, outcome: ProbeOutcome, incumbents: list[Score]) -> None:
        trial = item.trial
        trial.set_user_attr("probe", outcome.summary())
        if outcome.score is not None:
            trial.set_user_attr("score", dataclasses.asdict(outcome.score))
        if outcome.gpu is not None:
            trial.set_user_attr("gpu", outcome.gpu)
            free = outcome.gpu.get("min_free_gb")
            if free is not None:
                # The method's guard as a constraint: free GPU memory must stay above 5 GB.
                trial.set_constraint("free_gpu_memory", MIN_FREE_GB - float(free))
        if outcome.state is ProbeState.COMPLETE:
            assert outcome.score is not None
            eta = eta_of(outcome.score, incumbents)
            trial.set_user_attr("eta", eta.value)
            trial.set_user_attr("eta_interval", [eta.low, eta.high])
            study.tell(trial, eta.value, skip_if_finished=True)
            self.console.trial_finished(study, trial.number, item.role, item.overrides, eta=eta.value,
                                        interval=(eta.low, eta.high))
            return
        trial.set_user_attr("reason", outcome.reason)
        if outcome.state in (ProbeState.PRUNED, ProbeState.STOPPED):
            study.tell(trial, state=TrialState.PRUNED)
            self.console.trial_finished(study, trial.number, item.role, item.overrides, reason=outcome.reason,
                                        state="pruned")
            return
        failure = outcome.failure
        if failure is not None:
            trial.set_user_attr("failure_kind", failure.value)
            if failure.value == "oom":
                # Infeasible, not broken: a constraint the sampler and the spaces can learn from
                # (spaces keep later trials on this hardware below the value that ran out).
                trial.set_user_attr("hardware", hardware_tag(self.spec.hardware))
                trial.set_constraint("oom", 1.0)
        frozen = study._storage.get_trial(trial._trial_id)
        study.tell(trial, state=TrialState.FAIL)
        retried = ""
        attempt = int(item.trial.user_attrs.get("attempt", 0))
        if failure is not None and failure.retryable and attempt < self.spec.probe.max_retries:
            frozen.user_attrs["attempt"] = attempt + 1
            if liveness.requeue(study, frozen, reason=outcome.reason) is not None:
                retried = " (queued again)"
        self.console.trial_finished(study, trial.number, item.role, item.overrides,
                                    reason=outcome.reason + retried, state="failed", requeued=bool(retried),
                                    stderr_tail=outcome.stderr_tail)

    def _abandon(self, study: optuna.Study, active: dict[int, ActiveTrial], *, why: str) -> None:
        """Stop this process's runs and queue their trials again (Ctrl-C, SIGTERM, an error)."""

        for item in active.values():
            try:
                self._cancel_run(item)
                frozen = study._storage.get_trial(item.trial._trial_id)
                if frozen.state == TrialState.RUNNING:
                    study.tell(item.trial, state=TrialState.FAIL)
                    liveness.requeue(study, frozen, reason=f"its driver stopped ({why})")
            except Exception:  # noqa: BLE001 - best effort on the way out; the heartbeat covers the rest
                logger.exception("could not close trial %d", item.trial.number)
        active.clear()

    def _cancel_run(self, item: ActiveTrial) -> None:
        """Kill the trial's run if it is still going; the caller closes the trial."""
        if item.outcome is None and item.probe.handle is not None:
            self.launcher.cancel(item.probe.handle)

    # -- ending -----------------------------------------------------------------------------------
    def _stable(self, trials: list[optuna.trial.FrozenTrial], stage: StageSettings) -> bool:
        """The method's stop rule: none of the last N finished candidates beat the best before
        them (the incumbent at first, η = 1) by more than the tolerance."""

        done = sorted(
            (t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("role") == "candidate"),
            key=lambda t: (t.datetime_complete, t.number),
        )
        n = stage.stop.stable_trials
        if len(done) < n:
            return False
        best_before = max([1.0] + [float(t.value) for t in done[:-n] if t.value is not None])
        return all((t.value or 0.0) <= best_before * (1 + stage.stop.tolerance) for t in done[-n:])

    def _decide(self, study: optuna.Study, stage: StageSettings, base: Config) -> StageResult:
        """The winner: the best candidate by η over its runs (the first and its re-runs on
        fresh seeds), if it beats the incumbent by more than the tolerance and its interval
        stays clear of the incumbent; otherwise the incumbent is kept."""

        trials = study.get_trials(deepcopy=False)
        self._incumbent_scores(trials)  # raises when every incumbent run failed: nothing to compare with
        incumbent_etas = [e.value for e in incumbent_run_etas(records(trials)).values()]
        keep = StageResult(
            stage=stage.name, winner_trial=None, eta=1.0,
            eta_low=min(incumbent_etas, default=1.0), eta_high=max(incumbent_etas, default=1.0),
            decision=f"kept the incumbent: no candidate beat it by more than {stage.stop.tolerance:.0%}",
            config=base, overrides={},
        )
        ranked, why_none = _ranked_candidates(trials)
        if not ranked:
            return dataclasses.replace(keep, decision=f"kept the incumbent: {why_none}")
        (value, low, high, n_runs), best = ranked[0]
        runs = "1 run" if n_runs == 1 else f"{n_runs} runs"
        threshold = 1 + stage.stop.tolerance
        if value <= threshold:
            return dataclasses.replace(keep, decision=f"kept the incumbent: best η {value:.3f} (trial {best.number}, "
                                                      f"{runs}) is within {stage.stop.tolerance:.0%}")
        if low <= threshold:
            return dataclasses.replace(
                keep,
                decision=f"no significant gain: trial {best.number} has η {value:.3f} over {runs}, "
                         f"but its interval [{low:.3f}, {high:.3f}] reaches {threshold:.2f}",
            )
        overrides = dict(best.user_attrs.get("overrides", {}))
        return StageResult(
            stage=stage.name, winner_trial=best.number, eta=value, eta_low=low, eta_high=high,
            decision=f"trial {best.number} beat the incumbent: η {value:.3f} [{low:.3f}, {high:.3f}] over {runs}",
            config=merge(base, overrides), overrides=overrides,
        )


@dataclasses.dataclass
class _StageRun:
    """One stage as this process follows it: its study, space and probe settings, the trials
    running here, and the loop's clock. ``ahead_of`` names the stage still being decided
    while this one runs ahead of it."""

    index: int
    stage: StageSettings
    base: Config
    study: optuna.Study
    space: Space
    settings: ProbeSettings
    loop: "_LoopClock"
    active: dict[int, ActiveTrial] = dataclasses.field(default_factory=dict)
    ahead_of: str | None = None
    run_prefix: str = ""


#: how the reason of a trial closed by _vacate begins (its run did not fail: it no longer counts)
WASTED = "wasted: "

#: an idle worker starts an extra confirmation only while the stage is still expected to wait
#: this fraction of a probe for other workers' probes (it delays the stage by at most the rest)
EXTRA_RERUN_MIN_WAIT = 0.9

#: how often a driver re-reads a stage's trials when nothing happened locally (many workers
#: polling every 50 ms would otherwise saturate the database)
TRIALS_REFRESH_S = 1.0


@dataclasses.dataclass
class _LoopClock:
    """Per-stage loop state of one driver: wall-clock budget, heartbeat times, and a cached
    view of the stage's trials (re-read after local events or every TRIALS_REFRESH_S)."""

    started: float
    used_before: float
    last_heartbeat: float = 0.0
    last_saved: float = dataclasses.field(default_factory=time.monotonic)
    stale: bool = True
    _trials: list[Any] = dataclasses.field(default_factory=list)
    _read_at: float = 0.0

    def used(self, now: float) -> float:
        return self.used_before + now - self.started

    def trials(self, study: optuna.Study, *, fresh: bool = False) -> list[optuna.trial.FrozenTrial]:
        now = time.monotonic()
        if fresh or self.stale or now - self._read_at >= TRIALS_REFRESH_S:
            self._trials = study.get_trials(deepcopy=False)
            self._read_at = now
            self.stale = False
        return self._trials


def _point(trial: optuna.trial.FrozenTrial) -> dict[str, Any] | None:
    """A trial's parameters; for a queued trial (no params yet), the ones it was queued with."""
    return trial.params or trial.system_attrs.get("fixed_params")


def _queue_rerun(study: optuna.Study, of: optuna.trial.FrozenTrial, seed: int, *, extra: bool,
                 idle_fill: bool = False) -> None:
    """Queue a confirmation run of ``of``'s point on ``seed`` (the seed is checked again when
    it starts, ``_rerun_seed``; ``idle_fill`` re-runs also check that the wait is still there)."""
    study.enqueue_trial(of.params, skip_if_exists=False, user_attrs={
        "role": "rerun", "rerun_of": of.number, "seed": seed, "extra": extra, "idle_fill": idle_fill})


def _running_etas(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[float | None, optuna.trial.FrozenTrial]]:
    """Each queued or running candidate with its running η so far: its last reported running
    rate over the finished incumbent runs' mean at the same step; None before its first
    report."""

    curves = [t.intermediate_values for t in trials
              if t.state == TrialState.COMPLETE and t.user_attrs.get("role") == "incumbent"]
    out: list[tuple[float | None, optuna.trial.FrozenTrial]] = []
    for t in trials:
        if t.user_attrs.get("role") != "candidate" or t.state not in (TrialState.RUNNING, TrialState.WAITING):
            continue
        step = max(t.intermediate_values, default=None)
        at_step = [c[step] for c in curves if step in c and c[step] > 0]
        eta = t.intermediate_values[step] / statistics.fmean(at_step) if step is not None and at_step else None
        out.append((eta, t))
    return out


def _ranked_candidates(
    trials: list[optuna.trial.FrozenTrial], *, confirmed_only: bool = True,
) -> tuple[list[tuple[tuple[float, float, float, int], optuna.trial.FrozenTrial]], str]:
    """The stage's finished candidates by η (value, low, high, runs), best first, and why
    the list is empty when it is. Confirmed candidates (with re-runs) are judged on the mean of
    all runs of their point; while none has a re-run (or ``confirmed_only`` is False), every
    candidate on the runs it has."""

    done = [t for t in trials if t.state == TrialState.COMPLETE]
    incumbents = [Score(**t.user_attrs["score"]) for t in done
                  if t.user_attrs.get("role") == "incumbent" and "score" in t.user_attrs]
    candidates = [t for t in done if t.user_attrs.get("role") == "candidate" and t.value is not None
                  and not _infeasible(t) and "score" in t.user_attrs]
    if not candidates or not incumbents:
        return [], "no candidate finished"
    reruns: dict[int, list[Score]] = {}
    for t in done:
        if t.user_attrs.get("role") == "rerun" and "score" in t.user_attrs:
            reruns.setdefault(int(t.user_attrs["rerun_of"]), []).append(Score(**t.user_attrs["score"]))
    # A confirmation run stopped by the health screen (divergence, NaN) disqualifies its trial.
    failed = {int(t.user_attrs["rerun_of"]) for t in trials
              if t.state == TrialState.PRUNED and t.user_attrs.get("role") == "rerun"}
    candidates = [t for t in candidates if t.number not in failed]
    if not candidates:
        return [], "no candidate held up on a fresh seed"

    def pooled(t: optuna.trial.FrozenTrial) -> tuple[float, float, float, int]:
        # Every run of the same point counts: the sampler may have proposed it twice.
        twins = [c for c in candidates if c.params == t.params]
        scores = [Score(**c.user_attrs["score"]) for c in twins] + [s for c in twins for s in reruns.get(c.number, [])]
        e = eta_of(combine(scores) if len(scores) > 1 else scores[0], incumbents)
        return e.value, e.low, e.high, len(scores)

    confirmed = [t for t in candidates if t.number in reruns or not confirmed_only] or candidates
    return sorted(((pooled(t), t) for t in confirmed), key=lambda item: item[0][0], reverse=True), ""


def optuna_trial(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> optuna.trial.Trial:
    """A live handle on a RUNNING trial another process started (to report and tell on it)."""

    return optuna.trial.Trial(study, frozen._trial_id)


def _infeasible(trial: optuna.trial.FrozenTrial) -> bool:
    return any(v > 0 for v in (trial.constraints or {}).values()) if hasattr(trial, "constraints") else False




def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
