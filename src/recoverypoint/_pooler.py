"""A connection that reaches PostgreSQL through a pooler (PgBouncer, and any proxy that
hands a client's transactions to the server connections it pools).

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
own (it relays cancel requests). Checked once per connection, as the pool makes it.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

logger = logging.getLogger("recoverypoint")

POOLED = "recoverypoint_behind_pooler"
"""Set in a pooled connection's ``info`` when a pooler sits between it and PostgreSQL."""

_warned: set[str] = set()


def install(db: sa.Engine) -> None:
    """Check every connection ``db``'s pool makes (an async engine's ``sync_engine``)."""
    if not event.contains(db, "connect", _check):
        event.listen(db, "connect", _check)


def _check(dbapi_connection: Any, record: Any) -> None:
    # The adapter's cursor: an async engine's runs it on the event loop (SQLAlchemy's
    # greenlet), a sync engine's directly.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    finally:
        cursor.close()
    dbapi_connection.rollback()  # the SELECT began a transaction: the pool hands out none
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    if pid == driver.pgconn.backend_pid:
        return
    record.info[POOLED] = True
    driver.prepare_threshold = None  # psycopg prepares nothing on it
    where = f"{driver.info.host}:{driver.info.port}"
    if where not in _warned:
        _warned.add(where)
        logger.info(
            "%s is a pooler, not PostgreSQL itself: recoverypoint prepares no statement on "
            "its connections (each transaction may run on another server connection)",
            where,
        )
