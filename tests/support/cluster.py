"""Helpers for the cluster tests: a PostgreSQL URL, tiny studies, worker processes."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from support import REPO, demo_data, write_study
from support.strict_skips import strict

PG_URL = os.environ.get("VERL_SWEEP_TEST_PG_URL")


def require_pg() -> str:
    """The URL of a new, empty database on the test PostgreSQL server, made for the caller
    (no test reads tables another left) and dropped when the test process ends; in CI a
    missing server is a failure, not a skip."""
    if not PG_URL:
        if strict():
            pytest.fail("VERL_SWEEP_TEST_PG_URL is not set in CI: .ci/run must start PostgreSQL")
        pytest.skip("no PostgreSQL server (set VERL_SWEEP_TEST_PG_URL)")
    name = f"sweep_test_{uuid.uuid4().hex[:12]}"
    _server_command(f'CREATE DATABASE "{name}"')
    atexit.register(_server_command, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return f"{PG_URL.rsplit('/', 1)[0]}/{name}"


def _server_command(statement: str) -> None:
    """One statement outside a transaction (CREATE and DROP DATABASE need that), as the test
    server's role (which may create databases)."""
    import sqlalchemy

    assert PG_URL is not None
    engine = sqlalchemy.create_engine(PG_URL, isolation_level="AUTOCOMMIT", poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text(statement))
    finally:
        engine.dispose()


def require_pg_restart() -> str:
    """The shell command that restarts the test PostgreSQL server: required in CI, else the
    test is skipped."""
    restart = os.environ.get("VERL_SWEEP_TEST_PG_RESTART")
    if not restart:
        if strict():
            pytest.fail("VERL_SWEEP_TEST_PG_RESTART is not set in CI")
        pytest.skip("no command to restart PostgreSQL (VERL_SWEEP_TEST_PG_RESTART)")
    return restart


def tiny_study(tmp_path: Path, *, budgets: tuple[int, ...] = (8, 8), steps: int = 150, **extra: Any) -> tuple[Path, str]:
    """A two-stage study (mini-batch, lr) with short probes; returns (file, name)."""
    data = demo_data()
    name = f"t{uuid.uuid4().hex[:10]}"
    data["name"] = name
    data["launcher"] = {"kind": "sim", "max_concurrent": 1, "options": {"time_scale": 20000}}
    # slow_start_factor 1: on the default world a 150-step probe ends before the reward bends,
    # which would lengthen the later stages; these studies test the orchestration
    data["probe"] = {"steps": steps, "incumbent_repeats": 2, "slow_start_factor": 1}
    kinds = [("minibatch", "mini_batch"), ("lr", "lr")]
    data["stages"] = [
        {"name": n, "space": k, "budget": {"max_trials": b}, "confirm_top": 1,
         "stop": {"stable_trials": 100}, "pruner": {"name": "none"}}
        for (n, k), b in zip(kinds, budgets)
    ]
    data.update(extra)
    return write_study(tmp_path, data, f"{name}.yaml"), name


def start_cli(*args: str, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen([sys.executable, "-m", "verl_sweep.search.commands.cli", *args], cwd=cwd, stdout=handle,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@contextlib.contextmanager
def unpooled_storage(storage: str) -> Iterator[Any]:
    """One storage without a pool, disposed on leaving. The fault tests poll the database every
    fraction of a second beside 6-16 workers; a pooled storage per poll leaves its connections
    to the garbage collector, which late in a long pytest run collects rarely, until PostgreSQL
    answers "too many clients already"."""
    import optuna

    import sqlalchemy

    opened = optuna.storages.RDBStorage(storage, engine_kwargs={"poolclass": sqlalchemy.pool.NullPool},
                                        skip_table_creation=True)
    try:
        yield opened
    finally:
        opened.engine.dispose()


def wait_for_root(storage: str, name: str, timeout_s: float = 180) -> None:
    """Wait for ``run`` to create the study: on a 2-core machine loaded by other tests its
    start took over a minute."""
    import optuna

    from verl_sweep.search.database.storage import holds_studies

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # Before `run` creates the schema on an empty database there is no table to read.
        # Opening the storage while `run` makes the schema would stamp Optuna's version twice:
        # first the read-only look that a worker takes too.
        if holds_studies(storage):
            try:
                with unpooled_storage(storage) as opened:
                    optuna.load_study(study_name=name, storage=opened)
                return
            except KeyError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"study {name} was never created")


def all_trials(storage: str, name: str, *, retry_s: float = 60.0) -> dict[str, list[Any]]:
    """Every stage study's trials, studies moved aside included. A server that is restarting (the
    fault tests restart it; its shutdown can outlast the restart command's return) is asked again
    for up to ``retry_s``."""
    import optuna
    import sqlalchemy

    deadline = time.monotonic() + retry_s
    while True:
        try:
            out = {}
            with unpooled_storage(storage) as opened:
                # Names only: summaries read every study in the database (26 s on a server that
                # holds 480 studies), far slower than the fault test's polling needs.
                for study_name in optuna.get_all_study_names(opened):
                    if study_name.startswith(name + "."):
                        out[study_name] = optuna.load_study(study_name=study_name,
                                                            storage=opened).get_trials(deepcopy=False)
            return out
        except KeyError:
            # A worker moved a study opened ahead aside (renamed it) between the listing and the
            # load: list again, it shows under its new name.
            if time.monotonic() > deadline:
                raise
        except (sqlalchemy.exc.OperationalError, optuna.exceptions.StorageInternalError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)


def processes_mentioning(marker: str) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


_ = REPO
