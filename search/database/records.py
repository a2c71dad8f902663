"""Typed records of a staged study: what a trial is for, how it ended, what a stage decided.

verl-sweep keeps its state on Optuna's own objects (a trial's and a study's user attributes),
so that every process that resumes or joins reads the same chain from the database. This
module is the only code that knows those attribute names: everything else reads a
``TrialRecord`` built from a ``FrozenTrial`` and writes through the helpers below.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, overload

from verl_sweep.objectives.score import Score
from verl_sweep.search.database import compat
from verl_sweep.spaces.oom import FAILURE_KIND_ATTR, FIXED_PARAMS_ATTR, HARDWARE_ATTR

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial, TrialState

    from verl_sweep.search.spec.study_file import StageSettings, StudySpec
    from verl_sweep.verl_knowledge import Config


class Role(str, enum.Enum):
    """What a trial of a stage is for."""

    INCUMBENT = "incumbent"  # a run of the stage's base config (the baseline, then the last winner)
    CANDIDATE = "candidate"  # a point of the stage's space
    RERUN = "rerun"  # a confirmation of a candidate on a fresh seed
    SKIPPED = "skipped"  # given back unstarted (``CloseReason`` says why): it never ran

    def __str__(self) -> str:  # as the value, like 3.11's StrEnum, on every Python
        return self.value


class CloseReason(str, enum.Enum):
    """Why a trial was closed without a result that counts."""

    FAILED = "failed"  # its run failed
    REQUEUED = "requeued"  # its assignment was queued again (it runs later, as a new trial)
    WASTED = "wasted"  # run ahead from a leader that lost: its run did not fail, it no longer counts
    OVER_BUDGET = "over budget"  # the stage's budget was used up before it could start
    REDUNDANT = "redundant"  # a re-run that another worker's re-run made unnecessary
    STOPPED = "stopped"  # its driver was stopped (Ctrl-C, SIGTERM): queued again, it runs later

    def __str__(self) -> str:
        return self.value


#: the method's band of a flat stage: a stage whose gain, even a decided one, stays within
#: 1 + this leaves the study flat for ``stop_when_flat``
FLAT_BAND = 0.02


class Decision(str, enum.Enum):
    """What a stage decided (``StageResult.decision``), stored as its value. Code reads this;
    ``StageResult.summary`` says it to people and is never read back."""

    WON = "won"  # a candidate beat the incumbent, and its runs decide the gain
    WON_ON_BALANCE = "won on balance"  # undecided after every run it may get, but likely better
    KEPT = "kept"  # no candidate above 1 + tolerance (or none finished): the stage found nothing
    UNDECIDED = "undecided"  # kept: the leader is above 1 + tolerance, but its runs do not decide it
    SLOW_START = "slow start"  # kept: the incumbent's reward still rose fastest at its probes' end
    SKIPPED = "skipped"  # never run: the stages before it were flat (``stop_when_flat``)

    def __str__(self) -> str:
        return self.value

    @property
    def may_leave_a_leader(self) -> bool:
        """Kept the incumbent although its leader may be above 1 + tolerance: a gain its runs
        could not decide, or one judged on early speed (later stages may try the leader)."""
        return self in (Decision.UNDECIDED, Decision.SLOW_START)


# -- the attribute names: trials --------------------------------------------------------------
_ROLE, _SEED, _ATTEMPT, _RERUN_OF, _EXTRA, _IDLE_FILL, _ORIGIN = (
    "role", "seed", "attempt", "rerun_of", "extra", "idle_fill", "origin")
_OWNER, _RUN_ID, _RUN_DIR, _OVERRIDES = "owner", "run_id", "run_dir", "overrides"
_PROBE, _SCORE, _GPU, _ETA, _ETA_INTERVAL = "probe", "score", "gpu", "eta", "eta_interval"
_REASON, _CLOSED_AS, _CARRIED_FROM, _REQUEUED_BECAUSE = "reason", "closed_as", "carried_from", "requeued_because"
#: a running probe's rates read to its own last step, by step, where its reports (Optuna's
#: intermediate values) read to the run's horizon
_PROBE_RATES = "probe_rates"
#: system attributes: ours for a re-queued trial (Optuna's own for an enqueued one: FIXED_PARAMS_ATTR)
_RETRY_HISTORY, _FAILED_TRIAL = "retry_history", "failed_trial"

# -- the attribute names: studies -------------------------------------------------------------
#: the root study's: the study definition
SPEC_ATTR = "verl_sweep_spec"
#: the root study's: the launcher kind the study last ran with (``resume`` takes it again)
LAUNCHER_ATTR = "verl_sweep_launcher"
_BASE_CONFIG, _STAGE, _PROBE_STEPS, _AHEAD_OF, _RUN_PREFIX = "base_config", "stage", "probe_steps", "ahead_of", "run_prefix"
_INITIALIZED, _WALL_CLOCK_USED_S, _RESULT = "initialized", "wall_clock_used_s", "result"
#: a train-mode learning stage's: the chain's checkpoint its runs branch from (``ChainPoint``)
_BRANCH = "branch"


#: ``Assignment.origin`` of a stage's starting points (``Space.starting_points``), and of the
#: points its space proposes once they all ended (``Space.follow_up_points``)
START_ORIGIN, FOLLOW_UP_ORIGIN = "start", "follow-up"


@dataclasses.dataclass(frozen=True)
class Assignment:
    """What a trial is asked to do: what is queued again when its run is lost. Fields left None
    are not stored (a trial the sampler proposes has no seed until it starts)."""

    role: Role | None = None
    seed: int | None = None
    attempt: int | None = None
    rerun_of: int | None = None
    extra: bool | None = None
    idle_fill: bool | None = None
    origin: str | None = None

    def user_attrs(self) -> dict[str, Any]:
        attrs = {_ROLE: None if self.role is None else self.role.value, _SEED: self.seed, _ATTEMPT: self.attempt,
                 _RERUN_OF: self.rerun_of, _EXTRA: self.extra, _IDLE_FILL: self.idle_fill, _ORIGIN: self.origin}
        return {k: v for k, v in attrs.items() if v is not None}

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> Assignment:
        role = attrs.get(_ROLE)
        return cls(role=None if role is None else Role(role), seed=_int(attrs.get(_SEED)),
                   attempt=_int(attrs.get(_ATTEMPT)), rerun_of=_int(attrs.get(_RERUN_OF)),
                   extra=attrs.get(_EXTRA), idle_fill=attrs.get(_IDLE_FILL), origin=attrs.get(_ORIGIN))

    def requeued(self, *, because: str) -> dict[str, Any]:
        """The user attributes of its copy queued again."""
        return {**self.user_attrs(), _REQUEUED_BECAUSE: because}


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def stored_score(attrs: Mapping[str, Any], key: str = _SCORE) -> Score | None:
    """A score a trial stored under ``key`` (its own: ``score``), or None."""
    return Score(**attrs[key]) if key in attrs else None


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One trial of a stage study as verl-sweep reads it (from ``TrialRecord.of(frozen)``)."""

    frozen: FrozenTrial
    number: int
    state: TrialState
    value: float | None
    params: dict[str, Any]
    #: its parameters; for a queued trial (no params yet), the ones it was queued with
    point: dict[str, Any] | None
    assignment: Assignment
    role: Role
    overrides: dict[str, Any]
    run_id: str | None
    run_dir: str | None
    owner: Any
    score: Score | None
    eta: float | None
    eta_interval: tuple[float, float] | None
    reason: str | None
    closed_as: CloseReason | None
    failure_kind: str | None
    carried_from: str | None
    requeued_because: str | None
    #: the numbers of the trials whose assignment this one runs again (oldest first)
    retry_history: tuple[int, ...]
    probe: dict[str, Any]
    gpu: Any
    intermediate_values: dict[int, float]
    datetime_start: datetime.datetime | None
    datetime_complete: datetime.datetime | None
    #: a constraint is violated (out of memory, too little free GPU memory)
    infeasible: bool

    @classmethod
    def of(cls, t: FrozenTrial) -> TrialRecord:
        a = t.user_attrs
        assignment = Assignment.of(a)
        interval = a.get(_ETA_INTERVAL)
        closed, reason = compat.close_of(a.get(_CLOSED_AS), a.get(_REASON))
        constraints = getattr(t, "constraints", None) or {}
        return cls(
            frozen=t, number=t.number, state=t.state, value=t.value, params=t.params,
            point=t.params or t.system_attrs.get(FIXED_PARAMS_ATTR), assignment=assignment,
            role=assignment.role or Role.CANDIDATE, overrides=a.get(_OVERRIDES, {}),
            run_id=a.get(_RUN_ID), run_dir=a.get(_RUN_DIR), owner=a.get(_OWNER),
            score=stored_score(a), eta=a.get(_ETA),
            eta_interval=None if interval is None else (interval[0], interval[1]), reason=reason,
            closed_as=None if closed is None else CloseReason(closed), failure_kind=a.get(FAILURE_KIND_ATTR),
            carried_from=a.get(_CARRIED_FROM), requeued_because=a.get(_REQUEUED_BECAUSE),
            retry_history=tuple(t.system_attrs.get(_RETRY_HISTORY, ())), probe=a.get(_PROBE) or {},
            gpu=a.get(_GPU), intermediate_values=t.intermediate_values,
            datetime_start=t.datetime_start, datetime_complete=t.datetime_complete,
            infeasible=any(v > 0 for v in constraints.values()),
        )

    @property
    def seed(self) -> int | None:
        return self.assignment.seed

    @property
    def rerun_of(self) -> int | None:
        return self.assignment.rerun_of

    @property
    def extra(self) -> bool:
        return bool(self.assignment.extra)

    @property
    def idle_fill(self) -> bool:
        return bool(self.assignment.idle_fill)

    @property
    def attempt(self) -> int:
        return self.assignment.attempt or 0

    @property
    def started(self) -> bool:
        """Its run was started (it has a run id)."""
        return self.run_id is not None


def records(trials: Iterable[FrozenTrial]) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in trials]


class RecordCache:
    """``records`` for a study read again and again: Optuna's cached storage hands back the
    same FrozenTrial object for a finished trial on every read, so its record is built once
    (a driver reads its stage's trials a few times a tick)."""

    def __init__(self) -> None:
        self._by_id: dict[int, TrialRecord] = {}

    def records(self, trials: Iterable[FrozenTrial]) -> list[TrialRecord]:
        out = []
        for t in trials:
            record = self._by_id.get(t._trial_id)
            if record is None or record.frozen is not t:
                record = self._by_id[t._trial_id] = TrialRecord.of(t)
            out.append(record)
        return out


class StageView(Sequence[TrialRecord]):
    """A stage study's trials as one pass of its loop sees them (``StageStudy.view``): read
    once, with the trials this process wrote to since read again one by one. The policy
    decides on it; nobody reads the trial list again within the pass."""

    def __init__(self, trials: Iterable[TrialRecord]) -> None:
        self._trials = tuple(trials)
        self._by_number = {t.number: t for t in self._trials}

    @overload
    def __getitem__(self, index: int) -> TrialRecord: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[TrialRecord]: ...

    def __getitem__(self, index: int | slice) -> TrialRecord | Sequence[TrialRecord]:
        return self._trials[index]

    def __len__(self) -> int:
        return len(self._trials)

    def record(self, number: int) -> TrialRecord:
        """The trial numbered ``number``; KeyError when the view does not hold it."""
        return self._by_number[number]


def role_of(trial: FrozenTrial) -> Role:
    """A trial's role without reading the rest of it (the pruner asks on every report)."""
    role = trial.user_attrs.get(_ROLE)
    return Role.CANDIDATE if role is None else Role(role)


def seed_of(trial: FrozenTrial) -> int | None:
    return _int(trial.user_attrs.get(_SEED))


def probe_rates_attrs(rates: Mapping[int, float]) -> dict[str, Any]:
    """A running probe's rates read to its own last step (``Score.probe_rate``), by step."""
    return {_PROBE_RATES: {str(step): rate for step, rate in rates.items()}}


def probe_rate_of(trial: FrozenTrial, step: int) -> float | None:
    """A trial's running rate at ``step`` read to that step (None: not recorded)."""
    value = (trial.user_attrs.get(_PROBE_RATES) or {}).get(str(step))
    return None if value is None else float(value)


def requeued_numbers(trials: Iterable[TrialRecord]) -> set[int]:
    """Numbers of failed trials whose assignment was queued again (not counted in budgets)."""
    return {number for t in trials for number in t.retry_history}


# -- writing a trial's attributes ---------------------------------------------------------------
def set_attrs(trial: optuna.trial.Trial, attrs: Mapping[str, Any]) -> None:
    for key, value in attrs.items():
        trial.set_user_attr(key, value)


def owner_attrs(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {_OWNER: dict(owner)}


def started_attrs(*, role: Role, seed: int, overrides: Config, run_id: str, run_dir: str) -> dict[str, Any]:
    """What a trial records when its run starts."""
    return {_ROLE: role.value, _SEED: seed, _OVERRIDES: overrides, _RUN_ID: run_id, _RUN_DIR: run_dir}


def skipped_attrs(closed_as: CloseReason, reason: str) -> dict[str, Any]:
    """A trial given back unstarted."""
    return {_ROLE: Role.SKIPPED.value, _REASON: reason, _CLOSED_AS: closed_as.value}


def stopped_attrs(why: str) -> dict[str, Any]:
    """A run closed because its driver was stopped (its assignment is queued again)."""
    return {_REASON: why, _CLOSED_AS: CloseReason.STOPPED.value}


def wasted_attrs(why: str) -> dict[str, Any]:
    return {_REASON: why, _CLOSED_AS: CloseReason.WASTED.value}


def outcome_attrs(*, probe: dict[str, Any], score: dict[str, Any] | None, gpu: dict[str, Any] | None) -> dict[str, Any]:
    attrs: dict[str, Any] = {_PROBE: probe}
    if score is not None:
        attrs[_SCORE] = score
    if gpu is not None:
        attrs[_GPU] = gpu
    return attrs


def eta_attrs(value: float, low: float, high: float) -> dict[str, Any]:
    return {_ETA: value, _ETA_INTERVAL: [low, high]}


def reason_attrs(reason: str) -> dict[str, Any]:
    return {_REASON: reason}


def failure_attrs(kind: str, hardware: str | None = None) -> dict[str, Any]:
    """The failure's kind; an out-of-memory one with the hardware it ran out on (spaces keep
    later trials on that hardware below the value that ran out: ``verl_sweep.spaces.stages``)."""
    attrs = {FAILURE_KIND_ATTR: kind}
    if hardware is not None:
        attrs[HARDWARE_ATTR] = hardware
    return attrs


def carried_attrs(source: TrialRecord, *, eta: tuple[float, float, float], role: Role = Role.INCUMBENT,
                  score: dict[str, Any] | None = None) -> dict[str, Any]:
    """A previous stage's run stored as a finished run of this study (an incumbent run of the
    next stage; a final config's run in the final check, ``score``: as the check scores it):
    its record with the assignment of ``role``, and no GPU time of its own."""
    dropped = (_OWNER, _RERUN_OF, _EXTRA, _IDLE_FILL, _ORIGIN, _REQUEUED_BECAUSE)
    attrs = {k: v for k, v in source.frozen.user_attrs.items() if k not in dropped}
    if score is not None:
        attrs[_SCORE] = score
    attrs.update({_ROLE: role.value, _OVERRIDES: {}, **eta_attrs(*eta),
                  _CARRIED_FROM: source.run_id or f"trial {source.number}",
                  _PROBE: {**source.probe, "gpu_time_s": 0.0}})
    return attrs


def requeue_system_attrs(history: list[int]) -> dict[str, Any]:
    return {_FAILED_TRIAL: history[0], _RETRY_HISTORY: history}


# -- stage studies --------------------------------------------------------------------------------
def stage_study_name(spec: StudySpec, stage: StageSettings) -> str:
    """The Optuna study of a stage: ``<study>.<stage>``."""
    return f"{spec.name}.{stage.name}"


@dataclasses.dataclass(frozen=True)
class StageResult:
    """What a stage decided: the decision, the winner (None: the incumbent kept), its η and
    the config it hands on; ``summary`` says it to people."""

    stage: str
    decision: Decision
    winner_trial: int | None
    eta: float
    eta_low: float
    eta_high: float
    summary: str
    config: Config
    overrides: Config

    @property
    def flat(self) -> bool:
        """No gain outside the method's band ("η stable in 0.98-1.02: done"): the incumbent
        kept with no candidate above 1 + tolerance, or a win of at most ``FLAT_BAND`` (a
        speed stage's bar is lower). What ``stop_when_flat`` counts."""
        won = self.decision in (Decision.WON, Decision.WON_ON_BALANCE)
        return self.decision is Decision.KEPT or (won and self.eta <= 1 + FLAT_BAND)

    def to_attr(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "decision": self.decision.value}

    @classmethod
    def of(cls, attr: Mapping[str, Any]) -> StageResult:
        """A stored result; one stored by a release before decisions were data is read
        through ``compat.stage_result_fields``."""
        fields = dict(attr) if "summary" in attr else compat.stage_result_fields(attr)
        return cls(**{**fields, "decision": Decision(fields["decision"])})


@dataclasses.dataclass(frozen=True)
class StageStudyAttrs:
    """A stage study's own attributes, as its creator stored them."""

    base_config: Config | None
    stage: dict[str, Any] | None
    probe_steps: int | None
    ahead_of: str | None
    run_prefix: str | None
    initialized: bool
    wall_clock_used_s: float
    result: StageResult | None
    #: train mode: where its runs branch from (None in search mode)
    branch: ChainPoint | None = None

    @classmethod
    def of(cls, attrs: Mapping[str, Any]) -> StageStudyAttrs:
        result, branch = attrs.get(_RESULT), attrs.get(_BRANCH)
        return cls(base_config=attrs.get(_BASE_CONFIG), stage=attrs.get(_STAGE), probe_steps=attrs.get(_PROBE_STEPS),
                   ahead_of=attrs.get(_AHEAD_OF), run_prefix=attrs.get(_RUN_PREFIX),
                   initialized=bool(attrs.get(_INITIALIZED)),
                   wall_clock_used_s=float(attrs.get(_WALL_CLOCK_USED_S, 0.0)),
                   result=None if result is None else StageResult.of(result),
                   branch=None if branch is None else ChainPoint(**branch))


@dataclasses.dataclass(frozen=True)
class ChainPoint:
    """A point of a train-mode chain: step ``step`` of the model, in the checkpoint folder
    ``step_dir`` (verl's ``global_step_N``; None at step 0: from scratch), left by trial
    ``trial`` of stage ``stage`` (None: the chain's start)."""

    step: int
    step_dir: str | None = None
    stage: str | None = None
    trial: int | None = None


def created_study_attrs(*, base: Config, stage: dict[str, Any], probe_steps: int,
                        branch: ChainPoint | None = None) -> dict[str, Any]:
    attrs = {_BASE_CONFIG: base, _STAGE: stage, _PROBE_STEPS: probe_steps}
    return attrs if branch is None else {**attrs, _BRANCH: dataclasses.asdict(branch)}


def ahead_study_attrs(*, ahead_of: str, run_prefix: str) -> dict[str, Any]:
    return {_AHEAD_OF: ahead_of, _RUN_PREFIX: run_prefix}


def initialized_attr() -> dict[str, Any]:
    return {_INITIALIZED: True}


def wall_clock_attr(used_s: float) -> dict[str, Any]:
    return {_WALL_CLOCK_USED_S: used_s}


def result_attr(result: StageResult) -> dict[str, Any]:
    return {_RESULT: result.to_attr()}
