"""``SweepStorage``: a fork of Optuna 5.0's RDBStorage with the calls of an ask + tell in fewer round trips.

One ask + tell creates a trial, reads it three times (``Trial``'s constructor, twice in
``tell``), reads the study's changed trials once or twice, writes each parameter in its own
transaction and finishes the trial. Optuna 5.0 loads a trial and then each of its five kinds of
child rows in turn (six statements; ``_get_trials`` seven), and every transaction adds a BEGIN
and a COMMIT to the pool's ping: about 85 round trips an ask + tell on PostgreSQL, most of its
time at 1,000 trials. Here:

- a read is one statement outside a transaction: the trials and all their child rows in one
  UNION ALL; Optuna's own ``_build_frozen_trial_from_trial_model`` makes the FrozenTrials, so
  what is read is what Optuna would read;
- a parameter of a distribution the study already holds is one INSERT that happens only while
  the trial is unfinished;
- a new trial is one INSERT under Optuna's lock on the study row, numbered as Optuna numbers it;
  an enqueued or added one (a template) adds one SELECT of the study's distributions of its
  parameters (Optuna's compatibility check) and one INSERT per kind of child row, where
  Optuna's session runs a query and a flush per row;
- finishing a trial is one UPDATE (only of an unfinished trial) and the INSERT of its values;
- a first user or system attribute of its key, or a first intermediate value of its step, is
  one INSERT that happens only while the trial is unfinished (the driver writes several of
  each per trial);
- a heartbeat is one UPDATE, and a trial's first one an INSERT after it.

Whatever a fast path cannot settle (a finished or missing trial, a first parameter of its name,
an attribute or step set again, a popped waiting trial)
goes to Optuna's code, which raises its usual errors.
"""

from __future__ import annotations

import copy
import json
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from optuna import distributions
from optuna.exceptions import StorageInternalError
from optuna.storages import RDBStorage
from optuna.storages._rdb import models
from optuna.trial import FrozenTrial, TrialState

_TRIALS = models.TrialModel.__table__
_PARAMS = models.TrialParamModel.__table__
_VALUES = models.TrialValueModel.__table__
_USER = models.TrialUserAttributeModel.__table__
_SYSTEM = models.TrialSystemAttributeModel.__table__
_STEPS = models.TrialIntermediateValueModel.__table__
_UNFINISHED = [TrialState.RUNNING, TrialState.WAITING]

def _rows_of(trials: Any) -> Any:
    """The trials that ``trials`` (a WHERE clause on the trials table) selects and all their
    child rows, in one statement, as (trial_id, kind, ord, key, num, body, started, completed);
    enums come as their names."""
    text, num, when = sa.Text, sa.Float(precision=models.FLOAT_PRECISION), _TRIALS.c.datetime_start.type
    t = _TRIALS.c
    ids = sa.select(t.trial_id).where(trials)

    def branch(table: Any, kind: str, order: Any, key: Any, number: Any, body: Any) -> Any:
        return sa.select(table.c.trial_id, sa.literal(kind, text).label("kind"), order.label("ord"),
                         sa.cast(key, text).label("key"), sa.cast(number, num).label("num"),
                         sa.cast(body, text).label("body"), sa.cast(sa.null(), when).label("started"),
                         sa.cast(sa.null(), when).label("completed")).where(table.c.trial_id.in_(ids))  # fmt: skip

    p, v, u, s, i = _PARAMS.c, _VALUES.c, _USER.c, _SYSTEM.c, _STEPS.c
    rows = sa.union_all(
        sa.select(t.trial_id, sa.literal("trial", text).label("kind"), t.number.label("ord"),
                  sa.cast(sa.null(), text).label("key"), sa.cast(sa.null(), num).label("num"),
                  sa.cast(t.state, text).label("body"), t.datetime_start.label("started"),
                  t.datetime_complete.label("completed")).where(trials),  # first: its column types are the union's
        branch(_PARAMS, "param", p.param_id, p.param_name, p.param_value, p.distribution_json),
        branch(_VALUES, "value", v.objective, sa.null(), v.value, v.value_type),
        branch(_USER, "user", u.trial_user_attribute_id, u.key, sa.null(), u.value_json),
        branch(_SYSTEM, "system", s.trial_system_attribute_id, s.key, sa.null(), s.value_json),
        branch(_STEPS, "step", i.step, sa.null(), i.intermediate_value, i.intermediate_value_type),
    ).subquery()  # fmt: skip
    return sa.select(rows).order_by(rows.c.kind, rows.c.ord)


def _trial_filter(*, by_id: bool = False, states: bool = False, included: bool = False, after: bool = False) -> Any:
    """The trials a read selects, with bound parameters, as ``_get_trials`` takes them."""
    if by_id:
        return _TRIALS.c.trial_id == sa.bindparam("trial_id")
    where = _TRIALS.c.study_id == sa.bindparam("study_id")
    if states:
        where = sa.and_(where, _TRIALS.c.state.in_(sa.bindparam("states", expanding=True)))
    newer = _TRIALS.c.trial_id > sa.bindparam("after")
    if included:
        return sa.and_(where, sa.or_(_TRIALS.c.trial_id.in_(sa.bindparam("included", expanding=True)), newer))
    return sa.and_(where, newer) if after else where


_READS: dict[tuple[Any, ...], Any] = {}  # each built once: SQLAlchemy caches its compilation


def _read_statement(**shape: bool) -> Any:
    key = tuple(sorted(shape.items()))
    if key not in _READS:
        _READS[key] = _rows_of(_trial_filter(**shape))
    return _READS[key]


# Bound parameters named like a column of the table written are reserved by SQLAlchemy: b_*.
_LOCK_STUDY = (sa.select(models.StudyModel.study_id).where(models.StudyModel.study_id == sa.bindparam("b_study_id"))
               .with_for_update())  # fmt: skip
_INSERT_TRIAL = _TRIALS.insert().from_select(
    ["number", "study_id", "state", "datetime_start", "datetime_complete"],
    sa.select(sa.select(sa.func.count()).select_from(_TRIALS).where(_TRIALS.c.study_id == sa.bindparam("b_study_id"))
              .scalar_subquery(),
              sa.bindparam("b_study_id", type_=_TRIALS.c.study_id.type),
              sa.bindparam("b_state", type_=_TRIALS.c.state.type),
              sa.bindparam("b_started", type_=_TRIALS.c.datetime_start.type),
              sa.bindparam("b_completed", type_=_TRIALS.c.datetime_complete.type)),
).returning(_TRIALS.c.trial_id, _TRIALS.c.number)  # fmt: skip
# One stored distribution of each of these parameters in the study: Optuna checks a new
# trial's against the first it finds (they were all checked against each other).
_STORED_DISTRIBUTIONS = (
    sa.select(_PARAMS.c.param_name, _PARAMS.c.distribution_json)
    .join(_TRIALS, _TRIALS.c.trial_id == _PARAMS.c.trial_id)
    .where(_TRIALS.c.study_id == sa.bindparam("b_study_id"),
           _PARAMS.c.param_name.in_(sa.bindparam("b_names", expanding=True)))
    .distinct()  # a distribution per trial that holds it: in a large study, thousands of copies
)  # fmt: skip
_FINISH_TRIAL = (
    _TRIALS.update().where(_TRIALS.c.trial_id == sa.bindparam("b_trial_id"), _TRIALS.c.state.in_(_UNFINISHED))
    .values(state=sa.bindparam("b_state", type_=_TRIALS.c.state.type),
            datetime_complete=sa.bindparam("b_completed", type_=_TRIALS.c.datetime_complete.type))
    .returning(_TRIALS.c.trial_id)
)  # fmt: skip
_INSERT_PARAM = _PARAMS.insert().from_select(
    ["trial_id", "param_name", "param_value", "distribution_json"],
    sa.select(_TRIALS.c.trial_id, sa.bindparam("b_name", type_=_PARAMS.c.param_name.type),
              sa.bindparam("b_value", type_=_PARAMS.c.param_value.type),
              sa.bindparam("b_distribution", type_=_PARAMS.c.distribution_json.type))
    .where(_TRIALS.c.trial_id == sa.bindparam("b_trial_id"), _TRIALS.c.state.in_(_UNFINISHED)),
).returning(_PARAMS.c.param_id)  # RETURNING: psycopg's rowcount of an INSERT ... SELECT is -1  # fmt: skip



def _insert_child(table: Any, **columns: Any) -> Any:
    """INSERT of one child row of the trial ``b_trial_id`` (bound parameters ``b_<column>``)
    that happens only while the trial is unfinished; RETURNING its id, as ``_INSERT_PARAM``."""
    return table.insert().from_select(
        ["trial_id", *columns],
        sa.select(_TRIALS.c.trial_id, *(sa.bindparam(f"b_{name}", type_=table.c[name].type) for name in columns))
        .where(_TRIALS.c.trial_id == sa.bindparam("b_trial_id"), _TRIALS.c.state.in_(_UNFINISHED)),
    ).returning(*table.primary_key.columns)


_INSERT_USER_ATTR = _insert_child(_USER, key=True, value_json=True)
_INSERT_SYSTEM_ATTR = _insert_child(_SYSTEM, key=True, value_json=True)
_INSERT_STEP = _insert_child(_STEPS, step=True, intermediate_value=True,
                             intermediate_value_type=True)
_HEARTBEAT = models.TrialHeartbeatModel.__table__
_BEAT = (_HEARTBEAT.update().where(_HEARTBEAT.c.trial_id == sa.bindparam("b_trial_id"))
         .values(heartbeat=sa.func.now()).returning(_HEARTBEAT.c.trial_id))  # as Optuna: the database's now()
_FIRST_BEAT = _HEARTBEAT.insert().from_select(  # the column's default, as Optuna's model inserts it
    ["trial_id", "heartbeat"],
    sa.select(_TRIALS.c.trial_id, sa.func.current_timestamp()).where(_TRIALS.c.trial_id == sa.bindparam("b_trial_id")),
).returning(_HEARTBEAT.c.trial_id)


def _check_stored_distributions(conn: Any, study_id: int, new: dict[str, Any]) -> None:
    """Optuna's check of a new trial's distributions against the study's (ValueError)."""
    stored: dict[str, str] = {}
    for name, text in conn.execute(_STORED_DISTRIBUTIONS, {"b_study_id": study_id, "b_names": list(new)}):
        stored.setdefault(name, text)
    for name, text in stored.items():
        distributions.check_distribution_compatibility(distributions.json_to_distribution(text), new[name])


def _insert_template_rows(conn: Any, trial_id: int, template: FrozenTrial) -> None:
    """The child rows of a trial created from ``template``, as Optuna's template path writes them."""
    def insert(table: Any, rows: list[dict[str, Any]]) -> None:
        if rows:
            conn.execute(table.insert(), [{"trial_id": trial_id, **row} for row in rows])

    insert(_VALUES, [dict(zip(("value", "value_type"), models.TrialValueModel.value_to_stored_repr(value)),
                          objective=objective) for objective, value in enumerate(template.values or ())])
    insert(_PARAMS, [{"param_name": name, "param_value": dist.to_internal_repr(template.params[name]),
                      "distribution_json": distributions.distribution_to_json(dist)}
                     for name, dist in template.distributions.items()])
    insert(_USER, [{"key": key, "value_json": json.dumps(value)} for key, value in template.user_attrs.items()])
    insert(_SYSTEM, [{"key": key, "value_json": json.dumps(value)} for key, value in template.system_attrs.items()])
    insert(_STEPS, [dict(zip(("intermediate_value", "intermediate_value_type"),
                             models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(value)), step=step)
                    for step, value in template.intermediate_values.items()])


# Child rows as Optuna's builder reads them (by attribute); tuples are the cheapest to make.
_Param = namedtuple("_Param", "param_id param_name param_value distribution_json")
_Value = namedtuple("_Value", "objective value value_type")
_Attr = namedtuple("_Attr", "key value_json")
_Step = namedtuple("_Step", "step intermediate_value intermediate_value_type")


class _LoadedTrial:
    """What ``_build_frozen_trial_from_trial_model`` reads of a TrialModel, from rows."""

    datetime_start = models.TrialModel.datetime_start  # Optuna's naive UTC → local time
    datetime_complete = models.TrialModel.datetime_complete

    def __init__(self, row: Any) -> None:
        self.trial_id, self.number, self.state = row.trial_id, row.ord, TrialState[row.body]
        self._datetime_start_utc, self._datetime_complete_utc = row.started, row.completed
        self.params: list[Any] = []
        self.values: list[Any] = []
        self.user_attributes: list[Any] = []
        self.system_attributes: list[Any] = []
        self.intermediate_values: list[Any] = []

    def add(self, kind: str, order: Any, key: Any, number: Any, body: Any) -> None:
        if kind == "step":  # most rows: a running probe reports every few steps
            step_kind = models.TrialIntermediateValueModel.TrialIntermediateValueType[body]
            self.intermediate_values.append(_Step(order, number, step_kind))
        elif kind == "user":
            self.user_attributes.append(_Attr(key, body))
        elif kind == "param":
            self.params.append(_Param(order, key, number, body))
        elif kind == "system":
            self.system_attributes.append(_Attr(key, body))
        else:
            self.values.append(_Value(order, number, models.TrialValueModel.TrialValueType[body]))


class _Fallback(Exception):
    """Leave a fast path, rolling back, for Optuna's own."""


class SweepStorage(RDBStorage):
    """Optuna's RDBStorage; an ask + tell in under half its statements (see the module)."""

    @contextmanager
    def _connection(self, *, transaction: bool) -> Iterator[Any]:
        """A pooled connection, in a transaction or not; database errors other than integrity
        ones come out as Optuna's StorageInternalError, as from Optuna's code."""
        try:
            if transaction:
                with self.engine.begin() as conn:
                    yield conn
            else:
                # Under PostgreSQL's READ COMMITTED each statement of a transaction sees its own
                # snapshot anyway, and BEGIN and COMMIT are round trips.
                with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    yield conn
        except (sa.exc.IntegrityError, _Fallback):
            raise
        except sa.exc.SQLAlchemyError as e:
            raise StorageInternalError(f"a database call failed: {type(e).__name__}") from e

    def _read_trials(self, shape: dict[str, bool], values: dict[str, Any]) -> list[FrozenTrial]:
        with self._connection(transaction=False) as conn:
            rows = conn.execute(_read_statement(**shape), values).all()
        trials = sorted((row for row in rows if row.kind == "trial"), key=lambda row: row.trial_id)
        loaded = {row.trial_id: _LoadedTrial(row) for row in trials}
        for trial_id, kind, order, key, number, body, _, _ in rows:
            if kind != "trial":
                loaded[trial_id].add(kind, order, key, number, body)
        return [self._build_frozen_trial_from_trial_model(trial) for trial in loaded.values()]  # type: ignore[arg-type]

    def get_trial(self, trial_id: int) -> FrozenTrial:
        found = self._read_trials({"by_id": True}, {"trial_id": trial_id})
        if not found:
            raise KeyError(models.NOT_FOUND_MSG)
        return found[0]

    def _get_trials(self, study_id: int, states: Any, included_trial_ids: set[int],
                    trial_id_greater_than: int) -> list[FrozenTrial]:  # fmt: skip
        included = [i for i in included_trial_ids if i <= trial_id_greater_than]
        after = trial_id_greater_than > -1
        shape = {"states": states is not None, "included": bool(included) and after, "after": after}
        values = {"study_id": study_id, "states": list(states or ()), "included": included,
                  "after": trial_id_greater_than}  # fmt: skip
        found = self._read_trials(shape, values)
        if not found:
            self.get_study_name_from_id(study_id)  # raises KeyError for a study that is not there
        return found

    def _create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> FrozenTrial:
        template = template_trial  # enqueued or added trials: all their rows in one transaction
        created = models.TrialModel()  # as Optuna stores the times: local time → naive UTC
        created.datetime_start = datetime.now() if template is None else template.datetime_start
        created.datetime_complete = None if template is None else template.datetime_complete
        # As Optuna: the lock on the study row makes creations take their numbers one at a
        # time; the number is the count of the study's trials before this one.
        with self._connection(transaction=True) as conn:
            if conn.execute(_LOCK_STUDY, {"b_study_id": study_id}).first() is None:
                raise KeyError(models.NOT_FOUND_MSG)
            if template is not None and template.distributions:
                _check_stored_distributions(conn, study_id, template.distributions)
            trial_id, number = conn.execute(_INSERT_TRIAL, {
                "b_study_id": study_id, "b_state": TrialState.RUNNING if template is None else template.state,
                "b_started": created._datetime_start_utc, "b_completed": created._datetime_complete_utc}).one()  # fmt: skip
            if template is not None:
                _insert_template_rows(conn, trial_id, template)
        if template is not None:
            frozen = copy.deepcopy(template)  # what Optuna returns
            frozen.number, frozen.datetime_start, frozen._trial_id = number, created.datetime_start, trial_id
            return frozen
        return FrozenTrial(number=number, state=TrialState.RUNNING, value=None, values=None,
                           datetime_start=created.datetime_start, datetime_complete=None, params={},
                           distributions={}, user_attrs={}, system_attrs={}, intermediate_values={},
                           trial_id=trial_id)  # fmt: skip

    def _set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                         distribution: Any, previous_distribution: Any) -> None:  # fmt: skip
        if previous_distribution is not None:  # the study holds this parameter already
            distributions.check_distribution_compatibility(previous_distribution, distribution)
            try:
                with self._connection(transaction=False) as conn:
                    inserted = conn.execute(_INSERT_PARAM, {
                        "b_trial_id": trial_id, "b_name": param_name, "b_value": param_value_internal,
                        "b_distribution": distributions.distribution_to_json(distribution)}).first()  # fmt: skip
            except sa.exc.IntegrityError:
                return  # set already: Optuna ignores it too
            if inserted is not None:
                return
        super()._set_trial_param(trial_id, param_name, param_value_internal, distribution, previous_distribution)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Any = None) -> bool:
        if state.is_finished():  # told, pruned or failed
            finished = models.TrialModel()
            finished.datetime_complete = datetime.now()
            try:
                with self._connection(transaction=True) as conn:
                    if conn.execute(_FINISH_TRIAL, {"b_trial_id": trial_id, "b_state": state,
                                                    "b_completed": finished._datetime_complete_utc}).first() is None:  # fmt: skip
                        raise _Fallback  # finished already, or not there
                    if values is not None:
                        conn.execute(_VALUES.insert(), [
                            dict(zip(("value", "value_type"), models.TrialValueModel.value_to_stored_repr(value)),
                                 trial_id=trial_id, objective=objective) for objective, value in enumerate(values)])  # fmt: skip
                return True
            except (_Fallback, sa.exc.IntegrityError):
                pass  # rolled back; Optuna's path raises, or updates values stored already
        return super().set_trial_state_values(trial_id, state, values)

    def _insert_first(self, statement: Any, values: dict[str, Any]) -> bool:
        """Run a fast-path INSERT of a child row; False where Optuna's path must decide (the
        row exists already, the trial is finished or missing)."""
        try:
            with self._connection(transaction=False) as conn:
                return conn.execute(statement, values).first() is not None
        except sa.exc.IntegrityError:
            return False  # set already: Optuna's path updates it

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        if not self._insert_first(_INSERT_USER_ATTR, {"b_trial_id": trial_id, "b_key": key,
                                                      "b_value_json": json.dumps(value)}):  # fmt: skip
            super().set_trial_user_attr(trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        if not self._insert_first(_INSERT_SYSTEM_ATTR, {"b_trial_id": trial_id, "b_key": key,
                                                        "b_value_json": json.dumps(value)}):  # fmt: skip
            super().set_trial_system_attr(trial_id, key, value)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        stored, kind = models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(intermediate_value)
        if not self._insert_first(_INSERT_STEP, {"b_trial_id": trial_id, "b_step": step, "b_intermediate_value": stored,
                                                 "b_intermediate_value_type": kind}):  # fmt: skip
            super().set_trial_intermediate_value(trial_id, step, intermediate_value)

    def record_heartbeat(self, trial_id: int) -> None:
        with self._connection(transaction=False) as conn:
            if conn.execute(_BEAT, {"b_trial_id": trial_id}).first() is not None:
                return
        if not self._insert_first(_FIRST_BEAT, {"b_trial_id": trial_id}):  # its first heartbeat
            super().record_heartbeat(trial_id)  # a missing trial, or another process's first
