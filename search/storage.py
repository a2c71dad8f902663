"""Opening the study database: SQLite on one machine, PostgreSQL on a cluster.

Optuna reports every database problem as ``StorageInternalError``; the real cause is in
``__cause__``, so it is unwrapped here and shown with the password masked. On PostgreSQL each
process keeps one pooled connection, pinged after it lay idle (see ``PG_POOL`` for why). The storage is
Optuna's RDBStorage with faster reads and writes of trials (``search/_optuna_forks/rdb.py``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from search.errors import BadInputError, StorageError

if TYPE_CHECKING:
    import optuna

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: seconds between heartbeats of a running trial, and after how long without one a trial
#: counts as dead (long enough for a slow node or a database restart)
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 120

_PASSWORD = re.compile(r"(?P<head>://[^:/@]+:)(?P<password>[^@]*)(?P<tail>@)")


def mask_url(url: str) -> str:
    """``postgresql://user:secret@host/db`` → ``postgresql://user:***@host/db``."""
    return _PASSWORD.sub(lambda m: f"{m['head']}***{m['tail']}", url)


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
#: makes 10-13 storage calls, so a new connection per call (NullPool) was most of ask+tell's
#: time. max_overflow admits a second thread briefly (e.g. Optuna's heartbeat thread) without
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
    from search.pg_pool import IdlePingPool

    # application_name: a DBA sees in pg_stat_activity whose connections these are.
    return {**PG_POOL, "poolclass": IdlePingPool,
            "connect_args": {"connect_timeout": 10, "application_name": "verl-sweep"}}


def open_storage(url: str, *, create: bool = True) -> "optuna.storages.RDBStorage":
    """Open (and, for SQLite with ``create``, create) the database at ``url``."""
    import warnings

    import optuna
    from search._optuna_forks import storage_class
    from search.liveness import requeue_stale_trial

    # heartbeat_interval is "experimental" in Optuna 5.0, but it is what we rely on; and we
    # record heartbeats ourselves (ask/tell), which Optuna warns about on every ask.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")

    if "://" not in url:
        raise BadInputError(
            f"--storage must be a database URL like sqlite:///path/study.db or "
            f"postgresql://user@host/db, but got {mask_url(url)!r}."
        )
    if url.startswith("sqlite:///") and not create:
        path = Path(url[len("sqlite:///"):])
        if not path.exists():
            hint = ("; sqlite:/// takes a relative path, an absolute one needs four slashes: "
                    f"sqlite:////{path}" if not path.is_absolute() and Path("/", path).exists() else "")
            raise BadInputError(
                f"no study database at {path}{hint}. Pass --storage with the URL the study was run with."
            )
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        return with_retries(
            lambda: storage_class()(
                url,
                engine_kwargs=_engine_kwargs(url),
                heartbeat_interval=HEARTBEAT_INTERVAL_S,
                grace_period=GRACE_PERIOD_S,
                heartbeat_stale_trial_callback=requeue_stale_trial,
            ),
            what=f"open the study database {mask_url(url)}",
            attempts=3,
        )
    except ImportError as e:
        raise BadInputError(
            f"the database driver for {mask_url(url).split(':')[0]} is not installed ({e}). "
            "Install it, e.g. pip install 'verl-sweep[postgres]'."
        ) from None
    except StorageError as e:
        # Never reached it at all: a wrong URL, a server that is down, bad credentials.
        cause = describe_db_error(e)
        raise BadInputError(
            f"cannot reach the study database {mask_url(url)}: {cause}{'' if cause.endswith(('.', '?')) else '.'} "
            "Check the URL and that the server is running."
        ) from None
    except optuna.exceptions.OptunaError as e:  # e.g. schema version mismatch
        raise StorageError(f"cannot use the study database {mask_url(url)}: {e}") from e


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
    return mask_url(f"{type(cause).__name__}: {text}")[:300]


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
    storage: Any = None,
) -> T:
    """Run a database action, retrying with exponential backoff while the server is away
    (a PostgreSQL restart takes seconds). Raises StorageError with the real cause."""
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            if attempt == attempts:
                raise StorageError(f"could not {what}: {describe_db_error(e)}") from e
            logger.info("database error (%s), retry %d in %.1fs", describe_db_error(e), attempt, delay)
            if storage is not None:
                reset_connections(storage)
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)
    raise AssertionError("unreachable")
