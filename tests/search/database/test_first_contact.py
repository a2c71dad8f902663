"""A command's first contact with a storage: a new study on an empty SQLite file or PostgreSQL
database, or on one beside another application's tables; a study that is not there; and what
a command leaves beside the user's files: a refused one nothing, a finished `run` only its
database and runs folder."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest

from support.cluster import require_pg, start_cli, stop_all, tiny_study
from support import cli

NAMED_COMMANDS = ["status", "resume", "report", "export", "worker"]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _one_line_refusal(result: object, pattern: str) -> None:
    import re

    assert result.returncode == 2, (result.stdout, result.stderr)  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert re.search(pattern, lines[0]), lines[0]


@pytest.fixture
def runtime(tmp_path: Path) -> dict[str, str]:
    """The environment of a command whose run-time files (its driver lock) land in the test's
    own folder, outside the study's."""
    (tmp_path / "xdg").mkdir()
    return {"XDG_RUNTIME_DIR": str(tmp_path / "xdg")}


@pytest.mark.newest  # a whole study, in scripts/test.sh --newest
def test_run_starts_a_study_on_an_empty_sqlite_file_and_leaves_only_the_database_and_runs(
        tmp_path: Path, runtime: dict[str, str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    study, name = tiny_study(home, budgets=(4,), final_check=False)
    (home / f"{name}.db").write_bytes(b"")  # made by `touch`, or by another tool's first step
    before = _tree(home)
    result = cli("run", study.name, cwd=home, env=runtime)
    assert result.returncode == 0, result.stderr
    assert f"study {name} finished." in result.stdout
    assert result.stderr == "", result.stderr  # quiet on every release in range: no warning
    new = _tree(home) - before
    assert new and all(path == "runs" or path.startswith("runs/") for path in new), sorted(new)[:5]
    assert cli("status", name, cwd=home).returncode == 0
    assert [p.name for p in (tmp_path / "xdg" / "verl-sweep").iterdir()][0].startswith("driver-")


@pytest.mark.parametrize("command", NAMED_COMMANDS)
def test_a_study_that_is_not_there_is_one_line(tmp_path: Path, command: str) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    result = cli(command, "nope", "--storage", f"sqlite:///{empty}", cwd=tmp_path)
    _one_line_refusal(result, r"^error: no study named 'nope' in the database sqlite:///.*empty\.db: it holds no "
                              r"verl-sweep studies yet\. Pass the --storage the study was run with\.")
    with sqlite3.connect(tmp_path / "other.db") as conn:  # another tool's tables
        conn.execute("CREATE TABLE notes (id INTEGER)")
    result = cli(command, "nope", "--storage", f"sqlite:///{tmp_path}/other.db", cwd=tmp_path)
    _one_line_refusal(result, r"holds no verl-sweep studies \(it has no Optuna tables; its tables: notes\)")
    assert empty.read_bytes() == b""


def _refusals(tmp_path: Path) -> list[tuple[str, list[str], str]]:
    study, name = tiny_study(tmp_path, budgets=(4,), final_check=False)
    bad = study.read_text().replace("max_trials: 4", "max_trials: -3")
    (tmp_path / "bad.yaml").write_text(bad)
    return [
        ("a bad study file", ["run", "bad.yaml"], r"max_trials"),
        ("an unknown launcher", ["run", study.name, "--launcher", "nosuch"], r"nosuch"),
        ("a server that does not answer", ["run", study.name, "--storage", "postgresql://u:pw@127.0.0.1:1/db"],
         r"cannot reach the study database"),
        ("a database in a missing folder, read", ["status", name, "--storage", "sqlite:///no/such/dir/x.db"],
         r"no study database at"),
        *[(f"{command} of no study", [command, name], r"no database found for study")
          for command in NAMED_COMMANDS],
        ("export of no study to a file", ["export", name, "--storage", "sqlite:///x.db", "-o", "out/best.yaml"],
         r"no study database at"),
        ("report of no study to a file", ["report", name, "--storage", "sqlite:///x.db", "-o", "out/r.html"],
         r"no study database at"),
        ("init of a command without a model", ["init", "-o", "studies/x.yaml", "--gpu-memory-gb", "80", "--", "python3",
                                               "-m", "verl.trainer.main_ppo", "data.train_batch_size=8"],
         r"must set actor_rollout_ref.model.path"),
    ]


def test_a_refused_command_creates_no_file(tmp_path: Path, runtime: dict[str, str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    for why, args, pattern in _refusals(home):
        before = _tree(home) | {f"xdg/{p}" for p in _tree(tmp_path / "xdg")}
        result = cli(*args, cwd=home, env=runtime, timeout=120)
        assert result.returncode == 2, (why, result.stdout, result.stderr)
        assert pattern in result.stderr or __import__("re").search(pattern, result.stderr), (why, result.stderr)
        after = _tree(home) | {f"xdg/{p}" for p in _tree(tmp_path / "xdg")}
        assert after == before, (why, sorted(after - before))


def test_a_run_refused_after_it_made_its_folders_takes_them_back(tmp_path: Path) -> None:
    """What `run` makes before its study is stored goes again when it fails there; a database
    another process stored a study in meanwhile stays."""
    from verl_sweep.search.database.storage import open_storage, removed_if_refused

    runs = tmp_path / "runs" / "s"
    database = tmp_path / "db" / "s.db"
    with pytest.raises(RuntimeError), removed_if_refused(runs, database):
        runs.mkdir(parents=True)
        open_storage(f"sqlite:///{database}")
        raise RuntimeError("refused")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError), removed_if_refused(runs, database):
        runs.mkdir(parents=True)
        import optuna

        optuna.create_study(study_name="other", storage=open_storage(f"sqlite:///{database}"))
        raise RuntimeError("refused")
    assert sorted(_tree(tmp_path)) == ["db", "db/s.db"]


# -- PostgreSQL --------------------------------------------------------------------------

def _psql(url: str, *statements: str) -> list[tuple[object, ...]]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.begin() as connection:
            rows: list[tuple[object, ...]] = []
            for statement in statements:
                result = connection.execute(sqlalchemy.text(statement))
                rows = [tuple(r) for r in result] if result.returns_rows else []
            return rows
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.newest  # a whole study, in scripts/test.sh --newest
def test_postgres_first_run_on_an_empty_database_and_beside_another_applications_tables(tmp_path: Path) -> None:
    study, name = tiny_study(tmp_path, budgets=(4,), final_check=False)
    empty = require_pg()
    for command in NAMED_COMMANDS:  # nothing there yet
        result = cli(command, name, "--storage", empty, cwd=tmp_path)
        _one_line_refusal(result, rf"no study named '{name}' in the database postgresql://.*: it holds no verl-sweep "
                                  "studies yet")
    shared = require_pg()
    _psql(shared, "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)",
          "INSERT INTO customers VALUES (1, 'ada'), (2, 'grace')")
    for url in (empty, shared):
        result = cli("run", study.name, "--storage", url, cwd=tmp_path)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        status = cli("status", name, "--storage", url, cwd=tmp_path)
        assert status.returncode == 0 and status.stderr == "", status.stderr
    assert _psql(shared, "SELECT id, name FROM customers ORDER BY id") == [(1, "ada"), (2, "grace")]


@pytest.mark.postgres
def test_postgres_database_with_tables_named_like_optunas_is_refused_untouched(tmp_path: Path) -> None:
    study, _ = tiny_study(tmp_path, budgets=(4,), final_check=False)
    url = require_pg()
    _psql(url, "CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)",
          "INSERT INTO alembic_version VALUES ('their_head')", "CREATE TABLE trials (id INTEGER)")
    result = cli("run", study.name, "--storage", url, cwd=tmp_path)
    _one_line_refusal(result, r"must hold Optuna's tables or none of them, but it has alembic_version, trials "
                              r"without the rest \(another application's\)\. Give the study a database of its own")
    tables = _psql(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")
    assert tables == [("alembic_version",), ("trials",)]
    assert not (tmp_path / "runs").exists()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.newest  # a whole study, in scripts/test.sh --newest
def test_postgres_worker_started_first_waits_on_an_empty_database_and_joins(tmp_path: Path) -> None:
    study, name = tiny_study(tmp_path, budgets=(4,), final_check=False)
    url = require_pg()
    worker = start_cli("worker", name, "--storage", url, "--wait", "120", cwd=tmp_path, log=tmp_path / "worker.log")
    try:
        time.sleep(3)  # the worker looks at a database without Optuna's tables, and waits
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        result = cli("run", study.name, "--storage", url, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()
    finally:
        stop_all([worker])
    assert f"worker joined study {name}" in (tmp_path / "worker.log").read_text()
    assert os.path.exists(tmp_path / "runs" / name)


def _part_of_optunas_schema(path: Path, tables: list[str]) -> None:
    """The first tables of Optuna's schema, as a creator that has not finished leaves them."""
    import sqlalchemy
    from optuna.storages._rdb import models

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    models.BaseModel.metadata.create_all(engine, tables=[models.BaseModel.metadata.tables[t] for t in tables])
    engine.dispose()


@pytest.mark.fast
def test_a_schema_another_program_is_creating_is_waited_for_not_called_foreign(tmp_path: Path) -> None:
    """optuna.load_study, a dashboard or a second verl-sweep may be making Optuna's tables in a new
    file at the moment a command first looks at it: the command waits for the schema and opens it."""
    import threading

    import optuna

    from verl_sweep.search.database.storage import holds_studies, open_storage

    path = tmp_path / "shared.db"
    _part_of_optunas_schema(path, ["studies", "study_directions", "study_system_attributes"])
    url = f"sqlite:///{path}"

    def finish_creating() -> None:
        time.sleep(1.0)
        optuna.storages.RDBStorage(url)  # makes the rest, stamps the version

    creator = threading.Thread(target=finish_creating)
    creator.start()
    try:
        assert holds_studies(url)  # read only: waited for the creator, then saw Optuna's schema
    finally:
        creator.join()
    storage = open_storage(url, create=False)
    assert storage.get_all_studies() == []


@pytest.mark.fast
def test_a_schema_whose_creator_died_part_way_is_completed_by_run_and_refused_by_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_sweep.search.database import storage as storage_module
    from verl_sweep.search.spec.errors import BadInputError

    monkeypatch.setattr(storage_module, "SCHEMA_WAIT_S", 0.5)
    path = tmp_path / "half.db"
    _part_of_optunas_schema(path, ["studies", "version_info"])
    url = f"sqlite:///{path}"
    with pytest.raises(BadInputError, match=r"holds part of Optuna's tables only"):
        storage_module.open_storage(url, create=False)
    storage = storage_module.open_storage(url, create=True)  # a new study may start here
    assert storage.get_all_studies() == []
    assert storage_module.holds_studies(url)
