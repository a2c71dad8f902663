"""The PostgreSQL connection pool: SQLAlchemy's QueuePool, pinging a connection only when it
lay idle (an ask + tell checks connections out 11 times within milliseconds)."""

from __future__ import annotations

import math
import time
from typing import Any

import sqlalchemy as sa

#: A pooled connection is pinged on checkout only after lying idle this long. A PostgreSQL
#: restart takes seconds, so a connection used a moment ago did not die of one; an ask + tell
#: checks connections out about a dozen times within milliseconds, and a ping on every checkout
#: (SQLAlchemy's pool_pre_ping) costs a share of it (docs/method.md, Evidence). A connection lost in between
#: fails its call, as one lost during a call always could (``with_retries`` takes over).
PING_AFTER_IDLE_S = 0.1


class IdlePingPool(sa.pool.QueuePool):
    """SQLAlchemy's QueuePool for PostgreSQL, pinging a connection on checkout only when it
    lay idle for ``PING_AFTER_IDLE_S``; one that fails the ping is replaced, with every other
    pooled one, as ``pool_pre_ping`` does (the ``checkout`` event below)."""


@sa.event.listens_for(IdlePingPool, "checkin")
def _idle_from_now(dbapi_connection: Any, record: Any) -> None:
    record.info["idle_since"] = time.monotonic()


@sa.event.listens_for(IdlePingPool, "checkout")
def _ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    # a connection never checked in is new: it just answered
    if time.monotonic() - record.info.get("idle_since", math.inf) >= PING_AFTER_IDLE_S:
        _ping(dbapi_connection)


def _ping(dbapi_connection: Any) -> None:
    import psycopg  # this pool serves PostgreSQL only

    autocommit = dbapi_connection.autocommit
    try:
        dbapi_connection.autocommit = True  # a ping must not leave a transaction open
        dbapi_connection.execute("SELECT 1")
        dbapi_connection.autocommit = autocommit
    except psycopg.OperationalError as e:  # the server went away
        raise sa.exc.InvalidatePoolError(f"ping failed: {e}") from e
