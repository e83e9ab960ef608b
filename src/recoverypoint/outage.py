"""What counts as the database being unavailable, and what a caller gets for it.

A failover, a restart, ``pg_terminate_backend``, a pooler's ``RECONNECT`` or ``KILL``, a
server refusing connections: the driver raises one of a dozen errors, none of which says
what the caller should do. Each is :class:`~recoverypoint.errors.DatabaseUnavailable` to
the caller (503, retry in a moment with the same key), and the connections the pool made
before it are never handed out again.

What is not an outage stays what it was: a serialization failure (retried in-process), a
lock or statement timeout, and the errors of phase code's own SQL.
"""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa

from .errors import DatabaseUnavailable

# SQLSTATEs of a server that is going, gone, full, or no longer the primary.
_OUTAGE_CLASSES = ("08", "53")  # connection exception, insufficient resources
_OUTAGE_STATES = frozenset(
    {
        "57P01",  # admin_shutdown: a fast shutdown, pg_terminate_backend
        "57P02",  # crash_shutdown: another backend crashed, every session is ended
        "57P03",  # cannot_connect_now: starting up, shutting down, in recovery
        "57P05",  # idle_session_timeout
        "25006",  # read_only_sql_transaction: connected to a standby, or a demoted primary
        "58000",  # system_error
        "58030",  # io_error (58P01 and 58P02, a file a statement names, are the statement's)
    }
)


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the database (or the way to it) failed, not the request."""
    if isinstance(exc, DatabaseUnavailable | sa.exc.TimeoutError):  # or no connection came
        return True
    error: BaseException | None = exc
    if isinstance(exc, sa.exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        error = exc.orig
    if not isinstance(error, psycopg.Error):
        return False
    state = error.sqlstate
    if state is None:
        # Raised by the client, not the server: a connection lost, refused or closed. (A
        # DataError without one is the client refusing a value, as for a NUL.)
        return isinstance(error, psycopg.OperationalError | psycopg.InterfaceError) or (
            type(error) is psycopg.DatabaseError
        )
    return state in _OUTAGE_STATES or state.startswith(_OUTAGE_CLASSES)


def unavailable(exc: BaseException) -> DatabaseUnavailable:
    """The error a caller gets for the outage ``exc``; raise it ``from exc``."""
    if isinstance(exc, sa.exc.TimeoutError):
        what = "no database connection came free in time (the pool is exhausted)"
    else:
        error = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
        state = getattr(error, "sqlstate", None)
        what = f"the database is unavailable ({type(error).__name__}"
        what += f", SQLSTATE {state})" if state else ")"
    return DatabaseUnavailable(
        f"{what}; nothing was lost that a retry cannot finish: retry with the same "
        "idempotency key in a moment"
    )


def drop_older_connections(pool: Any, pooled: Any) -> None:
    """After ``pooled`` broke, have the pool reconnect every connection it made before now
    (a failover or a restart broke them all), on their next checkout, instead of handing
    each out to fail once. This is what SQLAlchemy's own ``Connection`` does on a
    disconnect (``Pool._invalidate``); the request path borrows raw connections, so it
    asks for it here; the caller invalidates ``pooled`` itself."""
    pool._invalidate(pooled, None, False)
