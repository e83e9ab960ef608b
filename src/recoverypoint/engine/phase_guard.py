"""Keeping phase code from ending the engine's transaction.

An atomic phase's writes and its recovery point must commit together. Phase code that
commits or rolls back the transaction itself breaks that: after a commit its writes stand
without a recovery point, and a retry applies them twice; after a rollback the key would
record a point for writes that never happened. So, while a phase runs (:class:`Guarding`),
whatever would end its transaction raises :class:`TransactionEnded` before anything is
sent, whichever layer phase code reaches it through:

- psycopg's connection under them all: its ``commit()`` and ``rollback()``, and every
  statement a cursor of it sends (``execute``, ``executemany``, ``stream``, ``copy``):
  ``tx.execute``, ``tx.cursor()``, SQLAlchemy's ``tx.connection`` and ORM Session, Django's
  ORM and cursors all send theirs through it. A statement is refused when it ends a
  transaction as the server reads it (:func:`recoverypoint.engine.endings.ends_transaction`:
  ``COMMIT``, ``ROLLBACK``, ``END``, ``ABORT``, ``PREPARE TRANSACTION``, anywhere in a
  string of several); ``ROLLBACK TO SAVEPOINT`` is fine;
- SQLAlchemy's ``tx.connection.commit()`` and ``.rollback()`` (:func:`refusing_to_end`),
  before SQLAlchemy's own bookkeeping;
- an integration's own layer, through :func:`shadow` (Django's ``transaction.commit()``).

What still reaches the server another way (libpq's own ``pgconn``) is found after: once the
transaction has ended, no further statement of the phase runs through a cursor (each
would commit on its own, or begin a transaction nothing commits); once the phase returns,
:func:`check_still_open` fails the attempt rather than record a point, as does the write
that records it when it finds itself in another transaction than the phase began in
(:func:`ended`). Writes committed by such a slip stand, which no engine can undo: a retry
runs the phase again.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, NoReturn, Protocol, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from ..errors import TransactionEnded
from .endings import ends_transaction

C = TypeVar("C")


class GuardedTransaction(Protocol):
    """What the guard reads of a transaction, sync (``_pg``) or async (``_pg_async``)."""

    @property
    def connection(self) -> psycopg.Connection[Any] | psycopg.AsyncConnection[Any]: ...

    @property
    def open(self) -> bool: ...

    def note(self, statement: object) -> None: ...


# The transaction and recovery point of the atomic phase running in this context, if any.
_PHASE: ContextVar[tuple[GuardedTransaction, str] | None] = ContextVar(
    "recoverypoint_phase", default=None
)

# What ends a transaction on a DB-API connection (psycopg's, Django's wrapper of it).
ENDING_METHODS = ("commit", "rollback")

# The ways a psycopg cursor sends SQL: each checks its statement first (_guarded).
_SENDING_METHODS = ("execute", "executemany", "stream", "copy")


class Guarding:
    """While inside, the phase's psycopg connection refuses to end ``tx``: its
    ``commit()`` and ``rollback()`` raise, and its cursors check what they send. (A class
    rather than a generator: every atomic phase enters it. Made afresh for each phase, and
    entered once: it keeps what it restores.)"""

    def __init__(self, tx: GuardedTransaction, point: str) -> None:
        self._phase = (tx, point)

    def __enter__(self) -> None:
        self._reset = _PHASE.set(self._phase)
        connection = self._phase[0].connection
        self._cursors = connection.cursor_factory
        connection.cursor_factory = _guarded(self._cursors)
        shadow(connection, ENDING_METHODS)

    def __exit__(self, *exc_info: object) -> None:
        connection = self._phase[0].connection
        unshadow(connection, ENDING_METHODS)
        connection.cursor_factory = self._cursors
        _PHASE.reset(self._reset)


def refuse(*args: object, **kwargs: object) -> NoReturn:
    """Raise :class:`TransactionEnded` for the atomic phase running in this context: what
    stands for a method that would end its transaction."""
    phase = _PHASE.get()
    raise TransactionEnded(None if phase is None else _message(phase[1]))


def shadow(target: object, methods: tuple[str, ...]) -> None:
    """Make ``target``'s ``methods`` :func:`refuse`, until :func:`unshadow` (instance
    attributes shadow the methods; whoever ends the transaction rightly calls the class's
    own)."""
    vars(target).update(dict.fromkeys(methods, refuse))


def unshadow(target: object, methods: tuple[str, ...]) -> None:
    for method in methods:
        vars(target).pop(method, None)


def refusing_to_end(conn: C) -> C:
    """``conn``, a SQLAlchemy Connection, with ``commit()`` and ``rollback()`` refused (the
    engine ends it with the class's own)."""
    shadow(conn, ENDING_METHODS)
    return conn


# Each cursor class of a phase's connection, and its guarded subclass (made once).
_GUARDED: dict[type[Any], type[Any]] = {}


def _guarded(cursors: type[Any]) -> type[Any]:
    """``cursors``, a psycopg cursor class, whose every way of sending SQL checks it first
    (see :func:`_check`)."""
    guarded = _GUARDED.get(cursors)
    if guarded is None:
        methods = {method: _checking(cursors, method) for method in _SENDING_METHODS}
        guarded = _GUARDED[cursors] = type(f"Guarded{cursors.__name__}", (cursors,), methods)
    return guarded


def _checking(cursors: type[Any], method: str) -> Any:
    """``cursors``'s ``method``, checking the SQL it is given first. The method is looked up
    at each call, not once: what instruments psycopg's cursor classes later (a tracer, a
    test) still sees the statements of phases."""

    def checked(cursor: Any, *args: Any, **kwargs: Any) -> Any:
        # The SQL by position, or by psycopg's names for it (copy's is ``statement``).
        query = args[0] if args else kwargs.get("query", kwargs.get("statement"))
        _check(cursor, query)
        return getattr(cursors, method)(cursor, *args, **kwargs)

    return checked


def _text(query: object, cursor: Any) -> str | None:
    """The SQL text of a query psycopg accepts, if it has one."""
    if isinstance(query, str):
        return query
    if isinstance(query, bytes):
        return query.decode(cursor.connection.info.encoding, errors="replace")
    if isinstance(query, sql.Composable):
        return query.as_string(cursor)
    return None


def check_statement(statement: object, point: str) -> None:
    """Raise :class:`TransactionEnded` for SQL text that would end the transaction."""
    if isinstance(statement, str) and ends_transaction(statement):
        raise TransactionEnded(_message(point))


def check_still_open(tx: GuardedTransaction, point: str) -> None:
    """Raise :class:`TransactionEnded` if the phase's transaction is over already; a
    :class:`psycopg.errors.InFailedSqlTransaction` if an error the phase caught aborted it,
    as its COMMIT would (the phase's writes roll back and the attempt fails)."""
    if tx.open:
        return
    if tx.connection.pgconn.transaction_status == TransactionStatus.INERROR:
        raise psycopg.errors.InFailedSqlTransaction(
            f"atomic phase {point!r} returned from a transaction that an error it caught "
            "aborted; catch it inside a savepoint (tx.connection.begin_nested(), or "
            "transaction.atomic() with Django) to go on after it"
        )
    raise TransactionEnded(_message(point))


def ended(point: str) -> TransactionEnded:
    """The error for phase ``point`` that ended its transaction and began another (found by
    the write that records the phase, which then misses its row)."""
    return TransactionEnded(_message(point))


def _check(cursor: Any, query: object) -> None:
    """Check a query that ``cursor`` is about to send: raise :class:`TransactionEnded` for
    one that would end the transaction of the atomic phase running in this context, or
    that comes after it ended; nothing outside a phase, or on another connection than the
    phase's (a phase's code that calls the engine again)."""
    phase = _PHASE.get()
    if phase is None or cursor.connection is not phase[0].connection:
        return
    tx, point = phase
    statement = _text(query, cursor)
    tx.note(statement)
    if cursor.connection.pgconn.transaction_status in _ENDED:
        # Ended already (by libpq's own hand): this statement would commit on its own (in
        # autocommit) or begin a transaction nothing commits. Not so a transaction that a
        # caught error aborted (the server answers the statement itself) or a pipeline's
        # (active between its statements).
        raise TransactionEnded(_message(point))
    check_statement(statement, point)


_ENDED = (TransactionStatus.IDLE, TransactionStatus.UNKNOWN)


def _message(point: str) -> str:
    return (
        f"atomic phase {point!r} tried to end the engine's transaction (commit, rollback or "
        "a COMMIT statement); the engine commits each phase with its recovery point. "
        "Remove the commit, or use a savepoint (tx.connection.begin_nested(), or "
        "transaction.atomic() with Django) to undo part of a phase"
    )
