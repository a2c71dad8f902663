"""The study database on a real PostgreSQL server: one pooled connection per process, and a
server restart between calls costs no error."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from cluster import require_pg, require_pg_restart

pytestmark = [pytest.mark.postgres]


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


def test_postgres_calls_reuse_one_connection() -> None:
    from sqlalchemy import event

    from search.storage import open_storage

    storage = open_storage(require_pg())
    name = _new_study(storage)
    connects: list[object] = []
    event.listen(storage.engine, "connect", lambda *_: connects.append(1))
    _ask_tell(storage, name, 5)
    # One ask + tell is 10+ storage calls: without a pool each would open its own connection.
    assert len(connects) <= 1
    assert storage.engine.pool.checkedout() == 0, "a storage call kept its connection"


@pytest.mark.slow
def test_postgres_restart_between_calls_is_invisible() -> None:
    from search.storage import open_storage

    url = require_pg()
    restart = require_pg_restart()
    storage = open_storage(url)
    name = _new_study(storage)
    _ask_tell(storage, name, 2)
    subprocess.run(restart, shell=True, check=True, timeout=120)
    # The pooled connection died with the server; pool_pre_ping replaces it on checkout, so
    # the next calls succeed without going through with_retries.
    _ask_tell(storage, name, 2)
    import optuna

    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 4
