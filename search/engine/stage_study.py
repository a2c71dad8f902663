"""One stage's Optuna study: the only code that touches Optuna's study and storage internals.

Stage k of study S is the Optuna study ``S.<stage>`` in one storage. It first holds its
incumbent runs (the baseline, then the previous stage's winner; a run the previous stage
already made is carried over, not run again), then candidates from its space. A study opened
ahead from a leader that then lost is moved aside (``vacate``) so that the stage opens afresh
under its own name.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import optuna
from optuna.trial import TrialState, create_trial

from verl_sweep.objectives.score import Score, eta as eta_of
from verl_sweep.search.database import liveness
from verl_sweep.search.spec.errors import SweepError, never_stopped, pause
from verl_sweep.search.method.proposer import first_points
from verl_sweep.search.method.pruning import IncumbentPruner
from verl_sweep.search.database.study_root import stored_study
from verl_sweep.search.database.records import (
    Assignment, ChainPoint, RecordCache, Role, StageResult, StageStudyAttrs, StageView, TrialRecord,
    ahead_study_attrs, carried_attrs, created_study_attrs, initialized_attr, records, result_attr, stage_study_name,
    wall_clock_attr, wasted_attrs,
)
from verl_sweep.search.method.sampler import build_sampler
from verl_sweep.verl_knowledge import Config, merge

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from verl_sweep.launchers.base import Launcher
    from verl_sweep.search.method.stage import Stage
    from verl_sweep.search.spec.study_file import StageSettings, StudySpec
    from verl_sweep.spaces.base import Space

logger = logging.getLogger(__name__)

#: how often a driver re-reads a stage's trials when nothing happened locally (many workers
#: polling every 50 ms would otherwise saturate the database)
TRIALS_REFRESH_S = 1.0
#: how many times opening a stage study starts over when other workers move it aside meanwhile
_OPEN_ATTEMPTS = 10
#: who created the stage study (``liveness.owner_record``): a joiner tells a creator that died
#: before queueing the stage's first trials, and queues them itself
_CREATOR = "creator"


@dataclasses.dataclass(frozen=True)
class StoredStage:
    """An earlier stage as another stage reads it: its stored result, its trials on request."""

    result: StageResult | None
    study: optuna.Study

    def trials(self) -> list[TrialRecord]:
        return records(self.study.get_trials(deepcopy=False))


class StageStudy:
    """A stage study as one driver process uses it, with a view of its trials (``view``):
    read whole after local events that add or close trials, on request, or every
    TRIALS_REFRESH_S; the trials this process starts or reports on are read again one by one
    (``refresh``). The stage's pruner reads the same view instead of the study."""

    def __init__(self, study: optuna.Study, storage: optuna.storages.RDBStorage) -> None:
        self.study = study
        self.storage = storage
        self.stale = True
        self._frozen: list[FrozenTrial] = []
        self._view = StageView(())
        self._read_at = 0.0
        self._records = RecordCache()
        if isinstance(study.pruner, IncumbentPruner):
            study.pruner.trials = self.pruning_trials

    @property
    def name(self) -> str:
        return self.study.study_name

    @property
    def study_id(self) -> int:
        return self.study._study_id

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    def open(cls, storage: optuna.storages.RDBStorage, plan: Stage, base: Config, *,
             ahead_of: str | None = None, launcher: Launcher | None = None,
             on_vacated: Callable[[str, str, str], None] | None = None,
             learn_ooms: bool = True, branch: ChainPoint | None = None,
             stop_requested: Callable[[], str | None] = never_stopped) -> tuple[StageStudy, bool] | None:
        """Create or join the study of stage ``plan`` from ``base``; (study, created). None
        when ``ahead_of`` is given and another worker already runs the stage ahead from
        another leader. A study opened ahead from a leader that lost is moved aside first.
        ``learn_ooms``: for ``build_sampler``; ``branch``: train mode's checkpoint its runs
        branch from; ``stop_requested``: why this process was asked to stop (None: it was not),
        which ends a wait for another worker (``wait_initialized``)."""
        spec, stage = plan.spec, plan.settings
        name = stage_study_name(spec, stage)
        pruner = plan.pruner()
        # Another worker may move a study opened ahead aside (rename it) between any two of the
        # calls below: then the name is free again, or names a newer study, and opening starts over.
        for _ in range(_OPEN_ATTEMPTS):
            try:
                study = optuna.create_study(study_name=name, storage=storage, direction="maximize",
                                            sampler=build_sampler(stage, 0, learn_ooms=learn_ooms), pruner=pruner)
                study.set_user_attr(_CREATOR, liveness.owner_record())
                study.set_metric_names(["eta"])  # how the dashboard and the optuna CLI label the value
                attrs = created_study_attrs(base=base, stage=stage.model_dump(mode="json"),
                                            probe_steps=plan.probe_steps, branch=branch)
                if ahead_of is not None:
                    # Its run ids stay unique if it is moved aside and the stage opened again.
                    attrs.update(ahead_study_attrs(ahead_of=ahead_of, run_prefix=f"{name}.ahead{study._study_id}"))
                for key, value in attrs.items():
                    study.set_user_attr(key, value)
                return cls(study, storage), True
            except optuna.exceptions.DuplicatedStudyError:
                pass
            try:
                existing = cls(optuna.load_study(study_name=name, storage=storage), storage)
            except KeyError:
                continue  # moved aside since create_study found it
            # Its creator sets the base (and whether it runs ahead) before "initialized".
            initialized = existing.wait_initialized(stop_requested=stop_requested)
            stored = existing.attrs()
            if not initialized and stored.base_config in (None, base) and not stored.ahead_of and ahead_of is None:
                # Its creator died (or is a minute late) before queueing the first trials: queue them here.
                logger.warning("stage %s: its study's creator queued no trials; this worker does", stage.name)
                existing._set_attrs({_CREATOR: liveness.owner_record(),
                                     **created_study_attrs(base=base, stage=stage.model_dump(mode="json"),
                                                           probe_steps=plan.probe_steps, branch=branch)})
                study = optuna.load_study(study_name=name, storage=storage,
                                          sampler=build_sampler(stage, 0, learn_ooms=learn_ooms), pruner=pruner)
                if study._study_id == existing.study_id:
                    return cls(study, storage), True
                continue
            if stored.base_config is not None and stored.base_config != base:
                if ahead_of is not None:
                    return None  # another worker runs this stage ahead from another leader
                if stored.ahead_of:
                    # Opened ahead from a leader that then lost: move it aside, start afresh.
                    existing.vacate(why="the stage before chose another config", launcher=launcher,
                                    on_vacated=on_vacated)
                    continue
                raise SweepError(
                    f"stage {stage.name}: the database's base config differs from the chain computed "
                    "now; the study was changed after it started. Start a new study name."
                )
            n = len(existing.study.get_trials(deepcopy=False))
            try:
                study = optuna.load_study(study_name=name, storage=storage,
                                          sampler=build_sampler(stage, n, learn_ooms=learn_ooms), pruner=pruner)
            except KeyError:
                continue
            if study._study_id == existing.study_id:  # else moved aside and opened again meanwhile
                return cls(study, storage), False
        raise SweepError(f"stage {stage.name}: its study was moved aside by other workers {_OPEN_ATTEMPTS} times "
                         "while this worker opened it; start it again (nothing is lost).")

    @staticmethod
    def record_skipped(storage: optuna.storages.RDBStorage, plan: Stage, base: Config,
                       result: StageResult) -> StageResult:
        """Store ``result`` as the decision of a stage that runs no trial (the study stopped
        early): its study is created with the base and the result, so status, export and every
        resume or worker read it as decided. A result already stored wins."""
        stage = plan.settings
        name = stage_study_name(plan.spec, stage)
        try:
            study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=name, storage=storage)
            stored = StageStudyAttrs.of(study.user_attrs).result
            if stored is not None:
                return stored
        attrs = {**created_study_attrs(base=base, stage=stage.model_dump(mode="json"), probe_steps=plan.probe_steps),
                 **initialized_attr(), **result_attr(result)}
        for key, value in attrs.items():
            study.set_user_attr(key, value)
        return result

    def wait_initialized(self, timeout_s: float = 60.0,
                         stop_requested: Callable[[], str | None] = never_stopped) -> bool:
        """Another worker created the stage: wait until it has queued the stage's first trials,
        or a fresh trial could take a place in the budget before them; False when it has not
        within ``timeout_s``, or its creator's process is gone (on this host). A stop request
        (SIGTERM) ends the wait."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            attrs = self.storage.get_study_user_attrs(self.study_id)  # by id: it may be moved aside meanwhile
            if StageStudyAttrs.of(attrs).initialized:
                return True
            if liveness.owner_is_dead(attrs.get(_CREATOR)):
                return False
            pause(0.5, stop_requested)
        return False

    def stored_attrs(self) -> StageStudyAttrs:
        """The study's attributes as the database holds them now (by the stage's name)."""
        return StageStudyAttrs.of(optuna.load_study(study_name=self.name, storage=self.storage).user_attrs)

    def attrs(self) -> StageStudyAttrs:
        """The attributes of this study (by its id, also once moved aside)."""
        return StageStudyAttrs.of(self.storage.get_study_user_attrs(self.study_id))

    def mark_initialized(self) -> None:
        self._set_attrs(initialized_attr())

    def save_wall_clock(self, used_s: float) -> None:
        self._set_attrs(wall_clock_attr(used_s))

    def _set_attrs(self, attrs: dict[str, Any]) -> None:
        for key, value in attrs.items():
            self.study.set_user_attr(key, value)

    def moved_aside(self) -> bool:
        return self.storage.get_study_name_from_id(self.study_id) != self.name

    # -- the first trials -------------------------------------------------------------------------
    @staticmethod
    def earlier_runs(storage: optuna.storages.BaseStorage, spec: StudySpec, index: int, base: Config,
                     probe_steps: int) -> dict[int, TrialRecord]:
        """Finished runs of the previous stage that are this stage's incumbent runs already:
        the same config, seed and probe length (a stage that kept its incumbent, or the
        winner's own runs), by seed."""
        if index == 0:
            return {}
        previous = stored_study(storage, stage_study_name(spec, spec.stages[index - 1]))
        if previous is None:
            return {}
        attrs = StageStudyAttrs.of(previous.user_attrs)
        if attrs.probe_steps != probe_steps:
            return {}
        prev_base = attrs.base_config or {}
        runs: dict[int, TrialRecord] = {}
        for t in records(previous.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))):
            if t.score is not None and t.seed is not None and merge(prev_base, t.overrides) == base:
                runs.setdefault(t.seed, t)
        return runs

    @staticmethod
    def stored_stage(storage: optuna.storages.BaseStorage, spec: StudySpec, stage: StageSettings) -> StoredStage | None:
        """A stage's study as stored (its result, None while undecided; its trials read on
        request: a whole study's rows, which most callers do not need); None before it opened."""
        study = stored_study(storage, stage_study_name(spec, stage))
        if study is None:
            return None
        return StoredStage(StageStudyAttrs.of(study.user_attrs).result, study)

    def enqueue_initial(self, plan: Stage, space: Space, base: Config, carried: dict[int, TrialRecord],
                        leaders: list[tuple[str, Config]] | None = None) -> list[TrialRecord]:
        """The stage's first trials: the incumbent (repeated), then the proposer's first points
        (``verl_sweep.search.method.proposer.first_points``: earlier stages' undecided leaders,
        ``leaders``, starting points, a template). An incumbent run the
        previous stage already made (``carried``) is copied, not re-run, and its runs on other
        seeds are copied as extra incumbent runs (``StagePolicy.counted`` leaves them out of
        the budget); returns the copies."""
        study, spec = self.study, plan.spec
        params = space.incumbent_params(base) or {}
        scores: list[Score] = []
        for repeat in range(spec.probe.incumbent_repeats):
            seed = spec.seeds[repeat % len(spec.seeds)]
            if seed in carried:
                score = carried[seed].score
                assert score is not None  # earlier_runs takes scored runs only
                scores.append(score)
                self._add_carried(space, base, params, carried[seed], scores)
                continue
            self.queue(params, Assignment(role=Role.INCUMBENT, seed=seed))
        # The previous stage's other runs of this config (the winner's confirmations on fresh
        # seeds) are incumbent runs too, outside the budget: a 2-run incumbent's spread kept
        # the interval of every η from falling below ~1.2× a run's seed spread.
        incumbent_seeds = {spec.seeds[r % len(spec.seeds)] for r in range(spec.probe.incumbent_repeats)}
        for seed in sorted(carried):
            if seed not in incumbent_seeds and carried[seed].score is not None:
                scores.append(carried[seed].score)  # type: ignore[arg-type]
                self._add_carried(space, base, params, carried[seed], scores)
        copies = [t for t in records(study.get_trials(deepcopy=False)) if t.carried_from is not None]
        for point, assignment in first_points(plan, space, base, incumbent=params, leaders=leaders or []):
            self.queue(point, assignment)
        return copies

    def _add_carried(self, space: Space, base: Config, params: dict[str, Any], source: TrialRecord,
                     scores: list[Score]) -> None:
        """Store a previous stage's run as a finished incumbent run of this stage: its score,
        curve and intermediate values (the pruner pairs seeds on them), no GPU time of its own."""
        fixed = optuna.trial.FixedTrial(params)
        if params:
            space.suggest(fixed, base)  # the parameters' distributions, for the sampler
        e = eta_of(scores[-1], scores)
        self.study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=e.value, params=fixed.params if params else {},
            distributions=fixed.distributions if params else {},
            user_attrs=carried_attrs(source, eta=(e.value, e.low, e.high)),
            intermediate_values=dict(source.intermediate_values),
        ))

    def queue(self, params: dict[str, Any], assignment: Assignment) -> None:
        self.study.enqueue_trial(params, user_attrs=assignment.user_attrs(), skip_if_exists=False)
        self.stale = True

    # -- reading ----------------------------------------------------------------------------------
    def view(self, *, fresh: bool = False) -> StageView:
        """The stage's trials: read whole when ``fresh``, after a local event that added or
        closed trials (``stale``), or TRIALS_REFRESH_S after the last read; else the view held."""
        now = time.monotonic()
        if fresh or self.stale or now - self._read_at >= TRIALS_REFRESH_S:
            self._frozen = self.study.get_trials(deepcopy=False)
            self._view = StageView(self._records.records(self._frozen))
            self._read_at = now
            self.stale = False
        return self._view

    def refresh(self, trial_id: int) -> None:
        """Read again one trial this process wrote to (started, reported on) into the view
        held: one row, not the whole list."""
        frozen = self.storage.get_trial(trial_id)
        held = [t for t in self._frozen if t._trial_id != trial_id]
        self._frozen = sorted([*held, frozen], key=lambda t: t.number)
        self._view = StageView(self._records.records(self._frozen))

    def pruning_trials(self) -> list[FrozenTrial]:
        """The finished and running trials of the view held, for the stage's pruner: every
        report would otherwise read the whole study."""
        return [t for t in self._frozen if t.state in (TrialState.COMPLETE, TrialState.RUNNING)]

    def read_trials(self, states: tuple[TrialState, ...] | None = None) -> list[TrialRecord]:
        """The trials as the database holds them now, bypassing the cached view."""
        return self._records.records(self.study.get_trials(deepcopy=False, states=states))

    def record(self, trial_id: int) -> TrialRecord:
        return TrialRecord.of(self.storage.get_trial(trial_id))

    def has_waiting(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    # -- liveness ---------------------------------------------------------------------------------
    def heartbeat(self, trial_ids: list[int]) -> None:
        for trial_id in trial_ids:
            self.storage.record_heartbeat(trial_id)

    def fail_stale_trials(self) -> None:
        optuna.storages.fail_stale_trials(self.study)

    # -- ending -----------------------------------------------------------------------------------
    def result_stored(self) -> bool:
        return self.attrs().result is not None

    def record_result(self, decide: Callable[[list[TrialRecord]], StageResult], wall_used_s: float) -> StageResult:
        """Decide once: the first worker to finish the stage stores the result; the others
        (and every later resume) read the stored one, so the chain is the same for all."""
        stored = self.stored_attrs().result
        if stored is not None:
            return stored
        self.save_wall_clock(wall_used_s)
        result = decide(self.read_trials())
        self._set_attrs(result_attr(result))
        return result

    def vacate(self, *, why: str, launcher: Launcher | None = None,
               on_vacated: Callable[[str, str, str], None] | None = None) -> None:
        """Move aside a stage study opened ahead from a leader that lost: close its queued and
        running trials (as wasted, never queued again; a dead owner's run is cleaned up) and
        rename it ``<name>~lost<id>``, so the stage opens afresh under its own name while the
        wasted runs stay on record. Optuna has no rename; the name is a column of its
        ``studies`` table, and the update only applies if no other process renamed it first.
        ``on_vacated(name, why, lost_name)`` is called when this process renamed it."""
        import sqlalchemy as sa
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.storages._rdb.models import StudyModel

        for t in self.read_trials(states=(TrialState.WAITING, TrialState.RUNNING)):
            try:
                for key, value in wasted_attrs(why).items():
                    self.storage.set_trial_user_attr(t.frozen._trial_id, key, value)
                self.storage.set_trial_state_values(t.frozen._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue
            if t.state == TrialState.RUNNING and liveness.owner_is_dead(t.owner) and launcher is not None:
                launcher.cleanup_leftover(Path(t.run_dir or ""))
        name, lost = self.name, f"{self.name}~lost{self.study_id}"
        with self.storage.engine.begin() as conn:
            renamed = conn.execute(sa.update(StudyModel)
                                   .where(StudyModel.study_id == self.study_id, StudyModel.study_name == name)
                                   .values(study_name=lost)).rowcount
        if renamed and on_vacated is not None:
            on_vacated(name, why, lost)


@dataclasses.dataclass
class StageClock:
    """A stage's wall-clock budget as one driver follows it, on the launcher's clock."""

    started: float
    used_before: float

    def used(self, now: float) -> float:
        return self.used_before + now - self.started
