"""The study database: on a real PostgreSQL server one pooled connection per process, and a
server restart between calls costs no error; on it and on SQLite, ``SweepStorage`` reads and
writes what Optuna's RDBStorage does, in fewer round trips."""

from __future__ import annotations

import math
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from benchmarks.overhead import _optuna_storage
from support.cluster import require_pg, require_pg_restart

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def _ask_tell(storage: object, name: str, n: int) -> None:
    import optuna
    from optuna.distributions import FloatDistribution

    study = optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(n):
        trial = study.ask({"x": FloatDistribution(0.0, 1.0)})
        study.tell(trial, trial.params["x"])


def _new_study(storage: object) -> str:
    import optuna

    name = f"storage{uuid.uuid4().hex[:10]}"
    optuna.create_study(study_name=name, storage=storage, direction="maximize")
    return name


@pytest.mark.fast
def test_a_stop_request_ends_the_back_off_of_a_database_that_is_away() -> None:
    import time

    import sqlalchemy

    from verl_sweep.search.database.storage import with_retries
    from verl_sweep.search.spec.errors import Interrupted

    engine = sqlalchemy.create_engine("postgresql+psycopg://sweep@127.0.0.1:9/none")  # nothing listens there
    calls: list[float] = []

    def connect() -> None:
        calls.append(time.monotonic())
        engine.connect().close()

    started = time.monotonic()
    with pytest.raises(Interrupted, match="SIGTERM"):
        with_retries(connect, what="connect", first_delay_s=30.0, stop_requested=lambda: "SIGTERM" if calls else None)
    assert len(calls) == 1 and time.monotonic() - started < 10.0  # not the 30 s back-off


@pytest.mark.postgres
def test_postgres_calls_reuse_one_connection() -> None:
    from sqlalchemy import event

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(require_pg())
    name = _new_study(storage)
    connects: list[object] = []
    event.listen(storage.engine, "connect", lambda *_: connects.append(1))
    _ask_tell(storage, name, 5)
    # One ask + tell is 10+ storage calls: without a pool each would open its own connection.
    assert len(connects) <= 1
    assert storage.engine.pool.checkedout() == 0, "a storage call kept its connection"


@pytest.mark.postgres
def test_postgres_pool_pings_only_a_connection_that_lay_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from verl_sweep.search.database import pg_pool
    from verl_sweep.search.database.storage import open_storage

    pings: list[object] = []
    real_ping = pg_pool._ping
    monkeypatch.setattr(pg_pool, "_ping", lambda connection: (pings.append(1), real_ping(connection)))
    # The pool's clock stands still unless the test moves it: on a busy machine real checkouts
    # a few milliseconds apart can lie a second apart, and the count below is about idleness,
    # not about how fast this machine is.
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(pg_pool, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    storage = open_storage(require_pg())
    name = _new_study(storage)
    assert pings == [], "a new connection needs no ping"
    clock.now += pg_pool.PING_AFTER_IDLE_S * 1.1
    _ask_tell(storage, name, 3)  # 30+ checkouts, each right after the last
    assert len(pings) == 1, "only the first checkout, after lying idle, should ping"
    clock.now += pg_pool.PING_AFTER_IDLE_S * 1.1
    _ask_tell(storage, name, 1)
    assert len(pings) == 2


@pytest.mark.postgres
@pytest.mark.slow
def test_postgres_restart_between_calls_is_invisible() -> None:
    from verl_sweep.search.database.storage import open_storage

    url = require_pg()
    restart = require_pg_restart()
    storage = open_storage(url)
    name = _new_study(storage)
    _ask_tell(storage, name, 2)
    subprocess.run(restart, shell=True, check=True, timeout=120)
    # The pooled connection died with the server; idle for seconds, it is pinged and replaced
    # on checkout, so the next calls succeed without going through with_retries.
    _ask_tell(storage, name, 2)
    import optuna

    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 4


def _url(backend: str, tmp_path: Path) -> str:
    return require_pg() if backend == "postgresql" else f"sqlite:///{tmp_path}/study.db"


def _trials_of_every_kind(storage: Any) -> list[int]:
    """Two studies holding a trial in each state, with values ±inf, intermediate values NaN
    and ±inf, user and system attributes, and each kind of distribution; their ids."""
    import optuna
    from optuna.trial import TrialState

    two = optuna.create_study(storage=storage, directions=["maximize", "minimize"],
                              sampler=optuna.samplers.RandomSampler(seed=0))
    trial = two.ask()
    trial.suggest_float("x", 0, 1)
    trial.suggest_int("n", 1, 9, log=True)
    trial.suggest_categorical("c", ["a", None, 3])
    trial.set_user_attr("probe", {"steps": [1, 2]})
    storage.set_trial_system_attr(trial._trial_id, "slot", 3)
    two.tell(trial, [math.inf, -math.inf])
    one = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=1))
    pruned = one.ask()
    pruned.suggest_float("lr", 1e-6, 1e-3, log=True)
    for step, value in enumerate([0.5, math.nan, math.inf, -math.inf, 0.25]):
        pruned.report(value, step)
    one.tell(pruned, state=TrialState.PRUNED)
    one.tell(one.ask(), state=TrialState.FAIL)
    one.enqueue_trial({"lr": 1e-4}, user_attrs={"role": "confirm"})
    running = one.ask({"mini_batch": optuna.distributions.IntDistribution(384, 640, step=16)})
    running.set_user_attr("role", "candidate")
    one.enqueue_trial({"lr": 2e-4})  # stays WAITING
    one.add_trial(optuna.trial.create_trial(  # as a stage adds the previous stage's run it carries over
        value=0.75, params={"lr": 3e-4, "c": None}, user_attrs={"role": "incumbent", "score": {"rate": 0.1}},
        distributions={"lr": optuna.distributions.FloatDistribution(1e-6, 1e-3, log=True),
                       "c": optuna.distributions.CategoricalDistribution(["a", None])},
        system_attrs={"retry_history": [1, 2]}, intermediate_values={10: 0.5, 20: math.nan, 30: -math.inf}))
    return [two._study_id, one._study_id]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_storage_reads_every_trial_as_optuna_s_storage_does(backend: str, tmp_path: Path) -> None:
    from optuna.trial import TrialState

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(_url(backend, tmp_path))
    assert type(storage).__name__ == "SweepStorage"
    optuna_s = _optuna_storage(storage)
    study_ids = _trials_of_every_kind(storage)
    seen = set()
    for study_id in study_ids:
        everything = optuna_s._get_trials(study_id, None, set(), -1)
        seen |= {t.state for t in everything}
        ids = [t._trial_id for t in everything]
        # repr: FrozenTrial's == is False for a NaN intermediate value even against itself
        assert repr(storage._get_trials(study_id, None, set(), -1)) == repr(everything)
        for trial in everything:
            assert repr(storage.get_trial(trial._trial_id)) == repr(trial)
            assert list(storage.get_trial(trial._trial_id).params) == list(trial.params)
        # as _CachedStorage reads what changed: unfinished ones by id, and those after the last finished one
        for shape in [(None, {ids[0]}, ids[0]), ((TrialState.RUNNING, TrialState.WAITING), set(), -1),
                      ((TrialState.COMPLETE,), set(ids), ids[-1]), (None, set(), ids[0])]:  # fmt: skip
            assert repr(storage._get_trials(study_id, *shape)) == repr(optuna_s._get_trials(study_id, *shape))
    assert seen == set(TrialState)
    with pytest.raises(KeyError):
        storage.get_trial(10**9)
    with pytest.raises(KeyError):
        storage._get_trials(10**9, None, set(), -1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_storage_writes_parameters_as_optuna_s_storage_does(backend: str, tmp_path: Path) -> None:
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution
    from sqlalchemy import event

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(_url(backend, tmp_path))
    study = optuna.create_study(storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    lr = FloatDistribution(5e-7, 5e-6, log=True)
    study.tell(study.ask({"lr": lr}), 1.0)  # now the cache knows lr's distribution
    statements: list[str] = []
    event.listen(storage.engine, "before_cursor_execute", lambda _c, _cur, sql, *_: statements.append(sql))
    trial = study.ask()
    statements.clear()
    value = trial.suggest_float("lr", 5e-7, 5e-6, log=True)
    assert len(statements) == 1  # Optuna: the trial, then the insert, in a transaction
    assert storage.get_trial(trial._trial_id).params == {"lr": value} == _optuna_storage(storage).get_trial(trial._trial_id).params
    assert trial.suggest_float("lr", 5e-7, 5e-6, log=True) == value  # set already: no new row, no error
    with pytest.raises(ValueError, match="Cannot set different distribution kind"):
        storage.set_trial_param(trial._trial_id, "lr", 3.0, IntDistribution(1, 5))
    study.tell(trial, 2.0)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        study._storage.set_trial_param(trial._trial_id, "lr", lr.to_internal_repr(1e-6), lr)
    with pytest.raises(KeyError):
        study._storage.set_trial_param(10**9, "lr", lr.to_internal_repr(1e-6), lr)
    assert [t.params for t in study.trials] == [t.params for t in _optuna_storage(storage).get_all_trials(study._study_id)]


def _as_written(storage: Any, study_ids: list[int]) -> list[Any]:
    """The studies' trials without what differs between two writes of them (ids, times)."""
    return [repr((t.number, t.state, t.values, t.params, t.distributions, t.user_attrs, t.system_attrs,
                  t.intermediate_values, t.datetime_start is not None, t.datetime_complete is not None))
            for study_id in study_ids for t in storage.get_all_trials(study_id)]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_storage_writes_trials_as_optuna_s_storage_does(backend: str, tmp_path: Path) -> None:
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution
    from optuna.storages._rdb import models
    from sqlalchemy import event, select

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(_url(backend, tmp_path))
    optuna_s = _optuna_storage(storage)
    ours, theirs = _trials_of_every_kind(storage), _trials_of_every_kind(optuna_s)
    assert _as_written(optuna_s, ours) == _as_written(optuna_s, theirs)
    trial_id = storage.get_all_trials(ours[0])[0]._trial_id  # told already
    for handle in (storage, optuna_s):
        with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
            handle.set_trial_state_values(trial_id, optuna.trial.TrialState.COMPLETE, [1.0, 2.0])
        with pytest.raises(KeyError):
            handle.set_trial_state_values(10**9, optuna.trial.TrialState.FAIL)
        with pytest.raises(KeyError):
            handle.create_new_trial(10**9)
    created = storage._create_new_trial(ours[1])
    assert repr(created) == repr(optuna_s.get_trial(created._trial_id))
    # A template whose distribution contradicts the study's: the same error, nothing written.
    clash = optuna.trial.create_trial(value=1.0, params={"lr": 3}, distributions={"lr": IntDistribution(1, 5)})
    for handle in (storage, optuna_s):
        before = len(handle.get_all_trials(ours[1]))
        with pytest.raises(ValueError, match="Cannot set different distribution kind"):
            handle.create_new_trial(ours[1], template_trial=clash)
        assert len(handle.get_all_trials(ours[1])) == before
    # A trial's first heartbeat and its next: one row, at the database's time, as Optuna writes it.
    beats, beat = [], models.TrialHeartbeatModel.__table__
    for handle in (storage, optuna_s):
        trial_id = handle.create_new_trial(ours[1])
        handle.record_heartbeat(trial_id)
        handle.record_heartbeat(trial_id)
        with handle.engine.connect() as conn:
            beats += conn.execute(select(beat.c.heartbeat).where(beat.c.trial_id == trial_id)).all()
    assert len(beats) == 2 and abs((beats[0][0] - beats[1][0]).total_seconds()) < 60, beats
    # An added trial with 20 intermediate values: a handful of statements, not a few per row.
    added = optuna.trial.create_trial(value=1.0, params={"lr": 1e-4}, user_attrs={"role": "incumbent"},
                                      distributions={"lr": FloatDistribution(1e-6, 1e-3, log=True)},
                                      intermediate_values={step: step / 20 for step in range(20)})
    counts = {}
    for label, handle in (("sweep", storage), ("optuna", optuna_s)):
        statements: list[str] = []
        event.listen(handle.engine, "before_cursor_execute", lambda _c, _cur, sql, *_, _s=statements: _s.append(sql))
        handle.create_new_trial(ours[1], template_trial=added)
        counts[label] = len(statements)
    assert counts["sweep"] <= 8 < counts["optuna"], counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_storage_numbers_trials_created_at_once_without_gaps_or_repeats(backend: str, tmp_path: Path) -> None:
    """Four threads create 15 trials each on one study: as with Optuna's storage, the study's
    row lock hands out the numbers one at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(_url(backend, tmp_path))
    name = _new_study(storage)
    study_id = storage.get_study_id_from_name(name)
    with ThreadPoolExecutor(4) as pool:
        created = list(pool.map(lambda _: [storage.create_new_trial(study_id) for _ in range(15)], range(4)))
    numbers = sorted(storage.get_trial(trial_id).number for ids in created for trial_id in ids)
    assert numbers == list(range(60))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_storage_halves_the_statements_of_an_ask_and_tell(backend: str, tmp_path: Path) -> None:
    """What the latency gain rests on, counted rather than timed: an ask + tell of four
    parameters makes under half the statements it makes on Optuna's RDBStorage."""
    import optuna
    from optuna.distributions import FloatDistribution
    from sqlalchemy import event

    from verl_sweep.search.database.storage import open_storage

    storage = open_storage(_url(backend, tmp_path))
    name = _new_study(storage)
    dists = {name: FloatDistribution(0.0, 1.0) for name in ("a", "b", "c", "d")}
    counts = {}
    for label, handle in (("sweep", storage), ("optuna", _optuna_storage(storage))):
        study = optuna.load_study(study_name=name, storage=handle, sampler=optuna.samplers.RandomSampler(seed=0))
        study.tell(study.ask(dists), 0.0)  # warm: the distributions are known after this
        statements: list[str] = []
        event.listen(handle.engine, "before_cursor_execute", lambda _c, _cur, sql, *_, _s=statements: _s.append(sql))
        for i in range(3):
            study.tell(study.ask(dists), float(i))
        counts[label] = len(statements) / 3
    assert counts["sweep"] <= counts["optuna"] / 2, counts
