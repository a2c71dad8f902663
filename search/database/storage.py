"""Opening the study database: SQLite on one machine, PostgreSQL on a cluster.

Optuna reports every database problem as ``StorageInternalError``; the real cause is in
``__cause__``, so it is unwrapped here and shown with the password masked. On PostgreSQL each
process keeps one pooled connection, pinged after it lay idle (see ``PG_POOL`` for why). The storage is
Optuna's RDBStorage with faster reads and writes of trials (``search/database/optuna_forks/rdb.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from verl_sweep.search.spec.errors import BadInputError, StorageError, never_stopped, pause
from verl_sweep.search.spec.masking import encoded_credentials, mask_secrets, mask_url

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: seconds between heartbeats of a running trial, and after how long without one a trial
#: counts as dead (long enough for a slow node or a database restart)
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 120

# The password runs to the LAST '@' (one with an unencoded '@' or '/' in it is still masked
# whole); the user name may itself hold an unencoded '@'.
#: the schemes a study database may have (SQLAlchemy's, with an optional +driver)
_SCHEMES = ("sqlite", "postgresql")
_SQLITE_MAGIC = b"SQLite format 3\x00"
#: the tables every Optuna storage has; a database without them holds no study. Alembic's
#: version table comes last (Optuna stamps it once its tables exist), in one transaction on
#: PostgreSQL: a database that has it is ready, and an opener then writes nothing of its own
_OPTUNA_TABLES = {"studies", "version_info", "trials", "alembic_version"}
#: seconds after which open_storage starts no new attempt at a server that does not answer
#: (each attempt waits up to the driver's connect_timeout, 10 s): a dead address fails in
#: about 20 s, two attempts, not three (docs/method.md, Evidence)
OPEN_DEADLINE_S = 12.0
#: seconds a SQLite file holding part of Optuna's schema is given to get the rest (a creator
#: makes the dozen tables in well under a second; a slow disk or a loaded machine takes longer)
SCHEMA_WAIT_S = 20.0


def _is_sqlite(url: str) -> bool:
    return url.split("://", 1)[0].split("+", 1)[0].lower() == "sqlite"


def _sqlite_path(url: str) -> Path:
    return Path(url.split("://", 1)[1][1:])


def check_url(url: str) -> str:
    """``url`` when verl-sweep can open it, else BadInputError naming what is wrong (the
    password masked). Refused: no scheme, a scheme other than sqlite or postgresql, an
    in-memory SQLite (nothing could resume its study), a SQLite URL with a host, user or query."""
    shown = mask_url(url)
    if "://" not in url:
        raise BadInputError(
            f"--storage must be a database URL like sqlite:///path/study.db or "
            f"postgresql://user@host/db, but got {shown!r}."
        )
    scheme, rest = url.split("://", 1)
    base = scheme.split("+", 1)[0].lower()
    if base == "postgres":
        raise BadInputError(f"a database URL must start with postgresql://, but got {shown!r} "
                            "(SQLAlchemy does not know postgres://). Write postgresql://.")
    if base not in _SCHEMES:
        raise BadInputError(f"a database URL must start with sqlite:/// or postgresql://, but got {shown!r}. "
                            "verl-sweep stores studies in SQLite (one machine) or PostgreSQL (a cluster).")
    if base == "sqlite":
        path = rest[1:]
        if rest in ("", "/") or path == ":memory:" or "mode=memory" in rest or path.startswith("file::memory:"):
            raise BadInputError(f"the study database must be a file, but {shown!r} is in memory: nothing could "
                                "resume the study. Use sqlite:///NAME.db.")
        if not rest.startswith("/"):
            what = "a user or password" if "@" in rest.split("/", 1)[0] else "a host"
            raise BadInputError(f"a SQLite URL must be sqlite:///relative/path.db or sqlite:////absolute/path.db, "
                                f"but {shown!r} has {what} after sqlite://. Drop it.")
        if "?" in path:
            raise BadInputError(f"a SQLite URL must name just the file, but {shown!r} has a query ('?…'). Drop it.")
    else:
        import sqlalchemy

        try:
            sqlalchemy.engine.make_url(encoded_credentials(url))
        except (sqlalchemy.exc.ArgumentError, ValueError) as e:
            raise BadInputError(f"the database URL {shown!r} cannot be parsed ({mask_secrets(str(e))}). "
                                "Write it as postgresql://user:password@host:port/db.") from None
    return url


def _check_writable(path: Path) -> None:
    """A command that writes (run, resume, worker) refuses a database it cannot write, with
    SQLite's own reason: Optuna would report the first failed write as "invalid data in the
    commit, e.g. exceeding max length"."""
    import sqlite3

    for target in (path, path.parent):  # SQLite writes its journal beside the file
        if not os.access(target, os.W_OK):
            raise BadInputError(f"the study database {path} cannot be written here ({target} is read-only); this "
                                "command writes to it. Make the file and its directory writable, or pass another "
                                "--storage.")
    try:
        conn = sqlite3.connect(path, timeout=60, isolation_level=None)
        try:  # a write rolled back: SQLite itself says whether it could write (a read-only mount)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("CREATE TABLE verl_sweep_write_check (x)")
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise BadInputError(f"the study database {path} cannot be written here ({e}); this command writes to "
                            "it. Make the file and its directory writable, or pass another --storage.") from None


def _check_sqlite_file(path: Path, *, create: bool, writable: bool = False) -> bool:
    """Checks of a SQLite study file before SQLAlchemy opens it; True when it already holds
    Optuna's tables. A file that is no SQLite database, or one that holds other tables but no
    study, is refused: verl-sweep writes Optuna's tables only into a new (or empty) file."""
    import sqlite3
    from urllib.parse import quote

    if not path.exists():
        if not create:
            hint = ("; sqlite:/// takes a relative path, an absolute one needs four slashes: "
                    f"sqlite:////{path}" if not path.is_absolute() and Path("/", path).exists() else "")
            raise BadInputError(
                f"no study database at {path}{hint}. Pass --storage with the URL the study was run with."
            )
        return False
    if not path.is_file():
        raise BadInputError(f"the study database must be a regular file, but {path} is not (a directory or a "
                            "device). Pass another --storage.")
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as e:
        raise BadInputError(f"cannot read the study database {path} ({e.strerror or e}).") from None
    if not head:
        if create:
            return False  # an empty file is a new SQLite database
        raise BadInputError(f"the study database {path} is empty: no study was ever stored there. "
                            "Pass the --storage the study was run with.")
    if head != _SQLITE_MAGIC:
        raise BadInputError(f"{path} must be a SQLite database, but it is not (it has no SQLite header). "
                            "Pass the study's database, or a new file name to start one.")
    def read_tables() -> set[str]:
        try:
            conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=60)
            try:
                return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            finally:
                conn.close()
        except sqlite3.Error as e:
            raise BadInputError(f"{path} must be a usable SQLite database, but reading it failed ({e}). "
                                "Pass the study's database, or a new file name to start one.") from None

    tables = read_tables()
    # Part of Optuna's schema and nothing else: another program (a second verl-sweep outside
    # this directory's lock, optuna.load_study, a dashboard) is creating it table by table
    # in autocommit. Wait for it rather than call the file foreign.
    deadline = time.monotonic() + SCHEMA_WAIT_S
    while tables and not _OPTUNA_TABLES <= tables and tables <= _optuna_table_names() \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        tables = read_tables()
    if tables and not _OPTUNA_TABLES <= tables and tables <= _optuna_table_names():
        if create:
            return False  # its creator died part-way; Optuna's create_all completes what is missing
        raise BadInputError(f"{path} holds part of Optuna's tables only (its creator stopped part-way; no study "
                            "was stored). Pass the study's database, or start the study again with `run`.")
    if _OPTUNA_TABLES <= tables:
        if writable:
            _check_writable(path)
        return True
    if tables or not create:
        listed = f"; its tables: {', '.join(sorted(tables)[:5])}" if tables else ""
        raise BadInputError(f"{path} holds no verl-sweep studies (it has no Optuna tables{listed}). "
                            "Pass the study's database, or a new file name to start one.")
    return False


def default_storage_for(name: str) -> str | None:
    """Where ``resume NAME`` looks when no --storage is given: $VERL_SWEEP_STORAGE, then
    ``NAME.db`` in the working directory or ``studies/``."""
    env = os.environ.get("VERL_SWEEP_STORAGE")
    if env:
        return env
    for candidate in (Path(f"{name}.db"), Path("studies") / f"{name}.db"):
        if candidate.exists():
            return f"sqlite:///{candidate.resolve()}"
    return None


#: Per-process connection pool for PostgreSQL. One connection is all a driver or worker needs:
#: it calls the storage from one thread and Optuna returns the connection after each call.
#: Opening a connection costs ~5-10 ms (TCP + SCRAM auth + backend start) and one ask+tell
#: makes 10-13 storage calls, so a new connection per call (NullPool) would be most of
#: ask+tell's time. max_overflow admits a second thread briefly (e.g. Optuna's heartbeat thread) without
#: piling up: 16 workers hold at most 16 idle connections, far below max_connections (100).
#: The pool (``IdlePingPool``) pings a connection that lay idle before handing it out (one round
#: trip, ~0.25 ms) and replaces it when the server restarted meanwhile; pool_recycle replaces
#: one older than that, before a server or firewall idle timeout can drop it. A failure inside
#: a call still goes through with_retries/reset_connections, which dispose of the pool.
PG_POOL: dict[str, Any] = {"pool_size": 1, "max_overflow": 2, "pool_recycle": 600, "pool_timeout": 30}


def _engine_kwargs(url: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        # Wait for a lock instead of failing at once when several processes write.
        return {"connect_args": {"timeout": 60}}
    from verl_sweep.search.database.pg_pool import IdlePingPool

    # application_name: a DBA sees in pg_stat_activity whose connections these are.
    return {**PG_POOL, "poolclass": IdlePingPool,
            "connect_args": {"connect_timeout": 10, "application_name": "verl-sweep"}}


def preflight(url: str) -> bool:
    """The checks of :func:`open_storage` for a command that writes (``run``), creating
    nothing: the file or server is one verl-sweep can use, and a server answers. True when
    the database holds studies already (:func:`holds_studies`)."""
    check_url(url)
    if not _is_sqlite(url):
        return holds_studies(url)
    path = _sqlite_path(url)
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise BadInputError(f"cannot create the directory of the study database {path.parent}: {existing} is not "
                            "a directory. Pass another --storage.")
    return _check_sqlite_file(path, create=True, writable=True)


def open_storage(url: str, *, create: bool = True, readonly: bool = False) -> "optuna.storages.RDBStorage":
    """Open (and, for SQLite with ``create``, create) the database at ``url``; BadInputError
    for a URL or file that is not a study database. Without ``create`` no schema is created
    or migrated (an unrelated database stays as it was); ``readonly`` (status, export,
    report) opens a SQLite file in SQLite's read-only mode."""
    import contextlib
    import warnings

    import optuna

    # heartbeat_interval is "experimental" in Optuna 5.0, but it is what we rely on; and we
    # record heartbeats ourselves (ask/tell), which Optuna warns about on every ask.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")

    check_url(url)
    shown = mask_url(url)
    url = encoded_credentials(url)  # a password holding "@", ":" or "/" is read whole
    with contextlib.ExitStack() as held:
        if _is_sqlite(url):
            path = _sqlite_path(url)
            if create:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise BadInputError(f"cannot create the directory of the study database {path.parent} "
                                        f"({e.strerror or e}). Pass another --storage.") from None
                # Two `run`s creating one new file at once would race creating the schema,
                # and a file another process is creating holds part of its schema only: an
                # opening that may create tables checks and opens the file under the
                # directory's lock.
                held.enter_context(_DirectoryLock(path.parent))
            _check_sqlite_file(path, create=create, writable=not readonly)
            if readonly and not create:
                # SQLite's own read-only mode: nothing this process does can change the file.
                from urllib.parse import quote

                url = f"sqlite:///file:{quote(str(path.resolve()))}?mode=ro&uri=true"
        elif not holds_studies(url) and not create:
            raise BadInputError(f"the database {shown} holds no verl-sweep studies (it has no Optuna tables). "
                                "Pass the --storage the study was run with.")
        return _open(url, shown, create=create)


def _open(url: str, shown: str, *, create: bool) -> "optuna.storages.RDBStorage":
    import optuna
    import sqlalchemy

    from verl_sweep.search.database.optuna_forks import storage_class
    from verl_sweep.search.database.liveness import requeue_stale_trial

    try:
        return with_retries(
            lambda: storage_class()(
                url,
                engine_kwargs=_engine_kwargs(url),
                heartbeat_interval=HEARTBEAT_INTERVAL_S,
                grace_period=GRACE_PERIOD_S,
                heartbeat_stale_trial_callback=requeue_stale_trial,
                # an existing study database is used as it is: no schema created or migrated
                skip_table_creation=not create,
            ),
            what=f"open the study database {shown}",
            attempts=3,
            max_total_s=OPEN_DEADLINE_S,
        )
    except ImportError as e:
        raise BadInputError(
            f"the database driver for {shown.split(':')[0]} is not installed ({e}). "
            "Install it, e.g. pip install 'verl-sweep[postgres]'."
        ) from None
    except StorageError as e:
        # Never reached it at all: a wrong URL, a server that is down, bad credentials.
        cause = describe_db_error(e)
        if "readonly" in cause or "read-only" in cause:
            raise BadInputError(f"the study database {shown} is read-only here ({cause}). This command "
                                "writes to it: make the file and its directory writable.") from None
        raise BadInputError(
            f"cannot reach the study database {shown}: {cause}{'' if cause.endswith(('.', '?')) else '.'} "
            "Check the URL and that the server is running."
        ) from None
    except optuna.exceptions.OptunaError as e:  # e.g. schema version mismatch
        raise StorageError(f"cannot use the study database {shown}: {describe_db_error(e)}") from None
    except sqlalchemy.exc.SQLAlchemyError as e:  # not transient: e.g. a file that is no database
        raise BadInputError(f"cannot use the study database {shown}: {describe_db_error(e)}. "
                            "Pass the study's database, or a new file name to start one.") from None


class DriverLock:
    """The one driver of a SQLite study database: an exclusive flock, held while the driver
    runs, on a lock file in this user's run-time directory named by the database file's
    device and inode (:func:`runtime_dir`; so nothing lands beside the user's files, and two
    paths to one file share it). SQLite cannot hand a queued trial to one of two processes, so
    a second ``run`` or ``resume`` on the file is refused in one line (workers need
    PostgreSQL). The kernel drops the lock with its process: a lock file a dead driver left
    holds only its pid, and is taken over. Enter it once the database file exists."""

    def __init__(self, url: str) -> None:
        self.database = _sqlite_path(url) if _is_sqlite(url) else None
        self.path: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> "DriverLock":
        import fcntl

        if self.database is None:
            return self
        found = self.database.stat()
        self.path = runtime_dir() / f"driver-{found.st_dev}-{found.st_ino}.lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BadInputError(
                f"one driver per SQLite study database, but {self.database} is driven by pid {holder} already. "
                "Wait for it (or stop it); several workers need PostgreSQL (README: on a cluster).") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays (removing it would race)
            self._fd = None


def runtime_dir() -> Path:
    """This user's directory for run-time files (locks): ``$XDG_RUNTIME_DIR/verl-sweep``, else
    ``verl-sweep-UID`` in the temporary directory; made on first use, readable by the user only."""
    import tempfile

    base = os.environ.get("XDG_RUNTIME_DIR", "")
    path = (Path(base) / "verl-sweep" if base and os.access(base, os.W_OK | os.X_OK)
            else Path(tempfile.gettempdir()) / f"verl-sweep-{os.getuid()}")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise BadInputError(f"cannot make the run-time directory {path} ({e.strerror or e}). Set XDG_RUNTIME_DIR "
                            "to a directory you can write.") from None
    if path.stat().st_uid != os.getuid():
        raise BadInputError(f"the run-time directory {path} belongs to another user. Set XDG_RUNTIME_DIR to a "
                            "directory of your own.")
    return path


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL; None for a server."""
    return _sqlite_path(url) if _is_sqlite(url) else None


def is_new_sqlite_file(url: str) -> bool:
    """A SQLite URL whose file does not exist yet."""
    return _is_sqlite(url) and not _sqlite_path(url).exists()


@contextlib.contextmanager
def removed_if_refused(runs_dir: Path, database: Path | None) -> Iterator[None]:
    """Undo what a ``run`` makes before its study is stored, if it fails there: the runs
    directory and the folders above it that it made (while still empty), and a database
    file it made that holds no study (another process's study in it stays)."""
    def missing(folder: Path) -> list[Path]:  # the folder and those above it not there yet, deepest first
        return [] if folder.exists() or folder == folder.parent else [folder, *missing(folder.parent)]

    new_database = database is not None and not database.exists()
    made_dirs = missing(runs_dir) + (missing(database.parent) if database is not None else [])
    try:
        yield
    except BaseException:
        if new_database and database is not None and database.is_file() and not _stores_a_study(database):
            for path in (database, Path(f"{database}-journal"), Path(f"{database}-wal"), Path(f"{database}-shm")):
                path.unlink(missing_ok=True)
        for folder in made_dirs:
            with contextlib.suppress(OSError):  # not empty (or gone): kept
                folder.rmdir()
        raise


def _stores_a_study(path: Path) -> bool:
    import sqlite3

    try:
        conn = sqlite3.connect(path, timeout=60)
        try:
            return bool(conn.execute("SELECT count(*) FROM studies").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:  # no table of studies: none is stored
        return False


def is_read_only_file(url: str) -> bool:
    """A SQLite study database this process cannot write (the file, or its directory, where
    SQLite writes its journal)."""
    if not _is_sqlite(url):
        return False
    path = _sqlite_path(url)
    return path.is_file() and not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))


class _DirectoryLock:
    """An exclusive flock on a directory while a new SQLite file gets its schema (on the
    directory, not the file: SQLite's own POSIX locks on the file must not be disturbed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def __enter__(self) -> "_DirectoryLock":
        import fcntl

        try:
            self._fd = os.open(self.directory, os.O_RDONLY)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: Optuna's own retries remain
            logger.debug("cannot lock %s", self.directory, exc_info=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def _optuna_table_names() -> set[str]:
    """Every table Optuna's RDB storage makes (alembic's version table among them)."""
    from optuna.storages._rdb import models

    return set(models.BaseModel.metadata.tables) | {"alembic_version"}


def _server_tables(url: str) -> set[str]:
    """The tables of the server database at ``url`` (one connection, nothing written)."""
    import sqlalchemy

    connect_args = _engine_kwargs(url)["connect_args"]
    engine = sqlalchemy.create_engine(url, connect_args=connect_args, poolclass=sqlalchemy.pool.NullPool)
    try:
        return set(with_retries(lambda: sqlalchemy.inspect(engine).get_table_names(),
                                what=f"open the study database {mask_url(url)}", attempts=3,
                                max_total_s=OPEN_DEADLINE_S))
    except StorageError as e:
        cause = describe_db_error(e)
        raise BadInputError(f"cannot reach the study database {mask_url(url)}: {cause}"
                            f"{'' if cause.endswith(('.', '?')) else '.'} Check the URL and that the server is running.") from None
    except ImportError as e:
        raise BadInputError(f"the database driver for {mask_url(url).split(':')[0]} is not installed ({e}). "
                            "Install it, e.g. pip install 'verl-sweep[postgres]'.") from None
    finally:
        engine.dispose()


def holds_studies(url: str) -> bool:
    """Whether the database at ``url`` holds Optuna's tables (True) or is new to verl-sweep
    (False: no SQLite file yet, an empty one, or a server database without any of Optuna's
    tables, another application's beside them or not). Reads only: creates nothing. Refused
    (BadInputError): a database verl-sweep cannot use (unreachable, not SQLite, another
    application's SQLite file, tables named like Optuna's that are not its schema)."""
    check_url(url)
    url = encoded_credentials(url)
    if _is_sqlite(url):
        path = _sqlite_path(url)
        return path.exists() and _check_sqlite_file(path, create=True)
    tables = _server_tables(url)
    if _OPTUNA_TABLES <= tables:
        return True
    if _OPTUNA_TABLES - {"alembic_version"} <= tables:
        # Another process is making Optuna's schema right now (its version stamp comes last):
        # opening it too would stamp the version a second time, and one of the two would fail.
        return False
    clash = sorted(tables & _optuna_table_names())
    if clash:
        raise BadInputError(f"the database {mask_url(url)} must hold Optuna's tables or none of them, but it has "
                            f"{', '.join(clash[:4])} without the rest (another application's). Give the study a "
                            "database of its own (createdb NAME).")
    return False


def reset_connections(storage: Any) -> None:
    """After the server went away, drop the thread's session and every connection, so the
    next call starts clean (otherwise SQLAlchemy can stay in "invalid transaction")."""
    try:
        storage.scoped_session.remove()
    except Exception:  # noqa: BLE001 - removing a broken session may itself fail
        logger.debug("could not remove the session", exc_info=True)
    try:
        storage.engine.dispose()
    except Exception:  # noqa: BLE001
        logger.debug("could not dispose the engine", exc_info=True)


def root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def describe_db_error(error: BaseException) -> str:
    cause = root_cause(error)
    text = " ".join(str(cause).split())
    return mask_secrets(f"{type(cause).__name__}: {text}")[:300]


def is_transient(error: BaseException) -> bool:
    import optuna
    import sqlalchemy.exc

    if isinstance(error, optuna.exceptions.StorageInternalError):
        return True
    return isinstance(error, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError))


def with_retries(
    action: Callable[[], T],
    *,
    what: str,
    attempts: int = 8,
    first_delay_s: float = 0.5,
    max_delay_s: float = 15.0,
    max_total_s: float | None = None,
    storage: Any = None,
    stop_requested: Callable[[], str | None] = never_stopped,
) -> T:
    """Run a database action, retrying with exponential backoff while the server is away
    (a PostgreSQL restart takes seconds); no new attempt starts ``max_total_s`` after the
    first. Raises StorageError with the real cause, Interrupted when a stop is requested
    during the back-off."""
    delay = first_delay_s
    started = time.monotonic()
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            late = max_total_s is not None and time.monotonic() + delay - started > max_total_s
            if attempt == attempts or late:
                raise StorageError(f"could not {what}: {describe_db_error(e)}") from e
            logger.info("database error (%s), retry %d in %.1fs", describe_db_error(e), attempt, delay)
            if storage is not None:
                reset_connections(storage)
            pause(delay, stop_requested)
            delay = min(delay * 2, max_delay_s)
    raise AssertionError("unreachable")
