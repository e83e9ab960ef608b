"""Prepared statements, and the poolers that lose them (PgBouncer, and any proxy that hands
a client's transactions to the server connections it pools).

In transaction pooling, each transaction may run on another server connection, and a
statement prepared in one is missing from, or named otherwise in, the next: before
PgBouncer 1.21 (Debian 12 ships 1.18), or with ``max_prepared_statements = 0``, a prepared
statement fails with 26000 or 42P05, and psycopg's own prepared statements (``_pg3_N``,
numbered per client connection) may even meet another client's statement of the same name
(08P01, or the wrong statement). So, on such a connection, nothing is prepared: the sync
engine sends its statements unnamed (parsed with each execution, in the same round trip),
and psycopg's automatic preparation is switched off, for recoverypoint's statements and
phase code's alike.

A pooler is told by its cancel key: a client connected to PostgreSQL itself is told the
pid of its backend, which ``pg_backend_pid()`` names again; a pooler makes up a key of its
own (it relays cancel requests). Checked once per connection, as the pool makes it, unless
the engine was told (``prepared_statements=``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from sqlalchemy import event

logger = logging.getLogger("recoverypoint")

UNPREPARED = "recoverypoint_unprepared"
"""Set in a pooled connection's ``info`` when nothing may be prepared on it."""

# By pool: engines made with execution_options() share their parent's pool and its events.
_installed: weakref.WeakKeyDictionary[sa.pool.Pool, bool | None] = weakref.WeakKeyDictionary()
_warned: set[str] = set()


def install(db: sa.Engine, prepared_statements: bool | None) -> None:
    """Decide for every connection ``db``'s pool makes (an async engine's ``sync_engine``)
    whether statements may be prepared on it: ``None`` unless it reaches PostgreSQL through
    a pooler, ``True`` always (PgBouncer 1.21 on, with ``max_prepared_statements``, keeps
    them; before it, psycopg's statements, numbered per client connection, may run another
    client's), ``False`` never. Connections the pool made before this are not checked:
    make the recoverypoint engine before using a SQLAlchemy engine of your own."""
    if db.pool in _installed:
        if _installed[db.pool] != prepared_statements:
            raise ValueError(
                "this SQLAlchemy engine already serves a recoverypoint engine with "
                f"prepared_statements={_installed[db.pool]}; give both the same"
            )
        return
    _installed[db.pool] = prepared_statements
    if prepared_statements is not True:
        event.listen(db, "connect", _LISTENERS[prepared_statements])


def _never(dbapi_connection: Any, record: Any) -> None:
    _unprepared(dbapi_connection, record)


def _unless_pooled(dbapi_connection: Any, record: Any) -> None:
    driver = _driver(dbapi_connection)
    # In autocommit the SELECT is one round trip, where a transaction takes three (BEGIN,
    # the SELECT, the ROLLBACK that hands the connection to the pool outside one), at every
    # connection the pool makes. Unless a listener before this one left a transaction
    # open: the mode cannot change then, and the check ends it as it always has.
    autocommit = dbapi_connection.autocommit
    idle = driver.pgconn.transaction_status == TransactionStatus.IDLE
    if idle:
        dbapi_connection.autocommit = True
    # The adapter's cursor: an async engine's runs it on the event loop (SQLAlchemy's
    # greenlet), a sync engine's directly.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    finally:
        cursor.close()
    if idle:
        dbapi_connection.autocommit = autocommit
    else:
        dbapi_connection.rollback()  # the pool hands out no transaction
    if pid == driver.pgconn.backend_pid:
        return
    _unprepared(dbapi_connection, record)
    where = f"{driver.info.host}:{driver.info.port}"
    if where not in _warned:
        _warned.add(where)
        logger.info(
            "%s is a pooler, not PostgreSQL itself: recoverypoint prepares no statement on "
            "its connections (pass prepared_statements=True to the engine if it keeps them, "
            "as PgBouncer does from 1.21 on with max_prepared_statements)",
            where,
        )


_LISTENERS: dict[bool | None, Callable[[Any, Any], None]] = {
    None: _unless_pooled,
    False: _never,
}


def _unprepared(dbapi_connection: Any, record: Any) -> None:
    record.info[UNPREPARED] = True
    _driver(dbapi_connection).prepare_threshold = None  # psycopg prepares nothing on it


def _driver(dbapi_connection: Any) -> Any:
    """psycopg's connection, under SQLAlchemy's async adapter or not."""
    return getattr(dbapi_connection, "driver_connection", dbapi_connection)
