"""Which errors mean "the same transaction may succeed if run again": a serialization
failure or a deadlock, however the database reports it.

PostgreSQL reports them as SQLSTATE 40001 and 40P01. Citus reports some as XX000 (an
internal error), with the worker's message as its own: a serialization failure a worker
raised inside the COPY Citus runs for a multi-row insert, a worker's COMMIT that failed
(``could not commit transaction for shard N on at least one active node``: nothing
committed, the coordinator's transaction aborts with it), a deadlock a worker detected.
Those messages are matched exactly, as PostgreSQL and Citus write them; any other XX000 is
a real internal error and is raised, never retried blindly.
"""

from __future__ import annotations

import re

import psycopg
import sqlalchemy as sa

__all__ = ["RETRYABLE_SQLSTATES", "is_conflict", "retryable", "sqlstate"]

RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
"""Serialization failure, deadlock."""

INTERNAL_ERROR = "XX000"

# PostgreSQL's messages for 40001 (relayed by Citus without their code), Citus's for a
# worker's failed COMMIT, and PostgreSQL's for 40P01.
_RELAYED = re.compile(
    r"could not serialize access due to"
    r" (?:read/write dependencies among transactions|concurrent (?:update|delete))"
    r"|could not commit transaction for shard \d+ on at least one active node"
    r"|deadlock detected"
)


def retryable(state: str | None, message: str | None) -> bool:
    """Whether an error of SQLSTATE ``state`` and primary message ``message`` is a
    serialization failure or a deadlock."""
    if state in RETRYABLE_SQLSTATES:
        return True
    return (
        state == INTERNAL_ERROR and message is not None and _RELAYED.fullmatch(message) is not None
    )


def sqlstate(exc: psycopg.Error | sa.exc.DBAPIError) -> str | None:
    """The SQLSTATE of a driver error, raised through SQLAlchemy (phase code) or not."""
    error = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    return getattr(error, "sqlstate", None)


def is_conflict(exc: psycopg.Error | sa.exc.DBAPIError) -> bool:
    """Whether a driver error is a serialization failure or a deadlock (:func:`retryable`)."""
    error = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    diag = getattr(error, "diag", None)
    return retryable(getattr(error, "sqlstate", None), getattr(diag, "message_primary", None))
