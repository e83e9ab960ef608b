"""Keeping phase code from ending the engine's transaction.

An atomic phase's writes and its recovery point must commit together. Phase code that
commits or rolls back the transaction itself breaks that: after a commit its writes stand
without a recovery point, and a retry applies them twice; after a rollback the key would
record a point for writes that never happened. So, while a phase runs:

- ``tx.connection.commit()`` and ``.rollback()`` raise :class:`TransactionEnded` at once,
  before anything happens;
- so does a statement that ends a transaction (``COMMIT``, ``ROLLBACK``, ``END``,
  ``ABORT``, ``PREPARE TRANSACTION``) executed through SQLAlchemy; ``ROLLBACK TO
  SAVEPOINT`` is fine;

once the transaction has ended anyway (a commit on the driver's connection, a
multi-statement string, an ORM ``Session.rollback()``), no further statement of the phase
runs through ``tx.execute`` or ``tx.connection`` (each would commit on its own, or
begin a transaction nothing commits); and once the phase returns, :func:`check_still_open` fails the
attempt rather than record a point, as does the write that records it when it finds itself
in another transaction than the phase began in (:func:`ended`). Writes made
before the slip and committed by it stand, which no engine can undo: a retry runs the phase
again.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Any, NoReturn, Protocol, TypeVar

import sqlalchemy as sa
import sqlalchemy.ext.asyncio as sa_async
from sqlalchemy import Connection, event

from ..errors import TransactionEnded

C = TypeVar("C")


class Transaction(Protocol):
    """What the guard reads of a transaction, sync (``_pg``) or async (``_pg_async``)."""

    @property
    def open(self) -> bool: ...

    @property
    def sqlalchemy_made(self) -> Connection | None: ...

    def note(self, statement: object) -> None: ...


_ENDS_TRANSACTION = re.compile(
    r"\s*(?:COMMIT|END|ABORT|PREPARE\s+TRANSACTION"
    r"|ROLLBACK(?!\s+(?:WORK\s+|TRANSACTION\s+)?TO\b))\b",
    re.IGNORECASE,
)

# The transaction and recovery point of the atomic phase running in this context, if any.
_PHASE: ContextVar[tuple[Transaction, str] | None] = ContextVar("recoverypoint_phase", default=None)


def install(db: sa.Engine) -> None:
    """Watch the statements run on ``db``'s connections (once per engine; an async engine's
    ``sync_engine``)."""
    if not event.contains(db, "before_cursor_execute", _refuse_ending_statement):
        event.listen(db, "before_cursor_execute", _refuse_ending_statement)


class Guarding:
    """While inside, SQLAlchemy statements on ``tx`` that would end it refuse to run. (A
    class rather than a generator: every atomic phase enters it. Made afresh for each
    phase, and entered once: it keeps the token that restores the context.)"""

    def __init__(self, tx: Transaction, point: str) -> None:
        self._phase = (tx, point)

    def __enter__(self) -> None:
        self._reset = _PHASE.set(self._phase)

    def __exit__(self, *exc_info: object) -> None:
        _PHASE.reset(self._reset)


def refusing_to_end(conn: C, point: str) -> C:
    """``conn``, with ``commit()`` and ``rollback()`` raising :class:`TransactionEnded`
    (instance attributes shadow the methods; the engine ends it with the class's own)."""

    def refuse() -> NoReturn:
        raise TransactionEnded(_message(point))

    conn.commit = conn.rollback = refuse  # type: ignore[attr-defined]
    return conn


class AsyncConnection(sa_async.AsyncConnection):
    """SQLAlchemy's AsyncConnection with room for :func:`refusing_to_end`'s attributes
    (SQLAlchemy's own has ``__slots__``)."""


def check_statement(statement: object, point: str) -> None:
    """Raise :class:`TransactionEnded` for a statement that would end the transaction."""
    if isinstance(statement, str) and _ENDS_TRANSACTION.match(statement):
        raise TransactionEnded(_message(point))


def check_still_open(tx: Transaction, point: str) -> None:
    """Raise :class:`TransactionEnded` if the phase's transaction is over already."""
    if not tx.open:
        raise TransactionEnded(_message(point))


def ended(point: str) -> TransactionEnded:
    """The error for phase ``point`` that ended its transaction and began another (found by
    the write that records the phase, which then misses its row)."""
    return TransactionEnded(_message(point))


def _refuse_ending_statement(conn: Connection, cursor: Any, statement: str, *args: Any) -> None:
    phase = _PHASE.get()
    if phase is not None and conn is phase[0].sqlalchemy_made:
        phase[0].note(statement)
        if not phase[0].open:
            # Ended already (a Session's rollback): this statement would commit on its own
            # (in autocommit) or begin a transaction nothing commits.
            raise TransactionEnded(_message(phase[1]))
        check_statement(statement, phase[1])


def _message(point: str) -> str:
    return (
        f"atomic phase {point!r} tried to end the engine's transaction (commit, rollback or "
        "a COMMIT statement); the engine commits each phase with its recovery point. "
        "Remove the commit, or use a savepoint (tx.connection.begin_nested()) to undo part "
        "of a phase"
    )
