"""The psycopg transaction under every request: BEGIN, pipelines, COMMIT, and the retry of a
transaction that hit a serialization failure or a deadlock.

The request path borrows a connection from the SQLAlchemy engine's pool (the application's
own settings apply), switches psycopg to autocommit so that psycopg sends nothing by itself,
and writes the transaction out:

- ``BEGIN ISOLATION LEVEL SERIALIZABLE`` travels with the transaction's first statement, in
  one round trip, and nothing about the session changes;
- ``COMMIT`` travels with its last write (:meth:`Transaction.commit_with`);
- a statement before ``BEGIN`` (:meth:`Transaction.lookup`) runs on its own, the way a
  replay needs it: one round trip, no transaction to commit.

Phase code that wants SQLAlchemy gets a ``Connection`` on the same transaction, made on first
use (:meth:`Transaction.sqlalchemy`); it may not commit or roll back (see phase_guard).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import psycopg
import sqlalchemy as sa
from psycopg.pq import TransactionStatus
from psycopg.rows import RowFactory

from .backoff import backoff_delay
from .errors import ConcurrentUpdate
from .observe import NO_OBSERVER, Observer

T = TypeVar("T")
Row = TypeVar("Row")

# SQLSTATEs that mean "the same transaction may succeed if run again".
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})

_BEGIN = "BEGIN ISOLATION LEVEL SERIALIZABLE"
_COMMIT = "COMMIT"


class Transaction:
    """One SERIALIZABLE transaction on a borrowed connection; made by :func:`serializable`."""

    def __init__(self, db: sa.Engine, pooled: Any, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection
        self._db = db
        self._pooled = pooled
        self._began = False
        self._done = False
        self._sqlalchemy: sa.Connection | None = None

    @property
    def open(self) -> bool:
        """Whether the server still has this transaction open."""
        return self.connection.info.transaction_status == TransactionStatus.INTRANS

    def lookup(self, sql: str, params: dict[str, Any], row_factory: RowFactory[Row]) -> Row | None:
        """One row read on its own, before the transaction begins."""
        assert not self._began, "a lookup runs before the transaction"
        with self.connection.cursor(row_factory=row_factory) as cursor:
            return cursor.execute(sql, params).fetchone()

    def execute(
        self, sql: str, params: dict[str, Any] | Sequence[Any] | None = None
    ) -> psycopg.Cursor[Any]:
        """Run one statement in the transaction; the first takes the BEGIN along."""
        return self.fetch(sql, params, None)

    def fetch(
        self,
        sql: str,
        params: dict[str, Any] | Sequence[Any] | None,
        row_factory: RowFactory[Any] | None,
    ) -> psycopg.Cursor[Any]:
        connection = self.connection
        cursor = connection.cursor(row_factory=row_factory) if row_factory else connection.cursor()
        if self._began:
            return cursor.execute(sql, params)
        with _pipeline(self.connection):  # BEGIN and the statement: one round trip
            self.connection.execute(_BEGIN)
            cursor.execute(sql, params)
        self._began = True
        return cursor

    def commit_with(
        self,
        sql: str,
        params: dict[str, Any],
        jobs: tuple[str, Sequence[dict[str, Any]]] | None = None,
    ) -> tuple[Any, ...] | None:
        """Insert ``jobs`` (a statement and its rows), run ``sql`` and COMMIT, in one round
        trip; return the row ``sql`` returned. Should ``sql`` fail, the COMMIT is skipped,
        and the caller (or :func:`serializable`) rolls the transaction back."""
        with self.connection.cursor() as cursor, self.connection.cursor() as jobs_cursor:
            with _pipeline(self.connection):
                if not self._began:
                    self.connection.execute(_BEGIN)
                    self._began = True
                if jobs:
                    jobs_cursor.executemany(*jobs)
                cursor.execute(sql, params)
                self.connection.execute(_COMMIT)
            self._done = True
            return cursor.fetchone()

    def commit(self) -> None:
        """COMMIT, if anything began; read-only work costs no round trip."""
        if self._began and not self._done:
            self.connection.execute(_COMMIT)
        self._done = True

    @property
    def sqlalchemy_made(self) -> sa.Connection | None:
        """The SQLAlchemy Connection of :meth:`sqlalchemy`, if phase code asked for one."""
        return self._sqlalchemy

    def sqlalchemy(self) -> sa.Connection:
        """A SQLAlchemy Connection on this transaction, for phase code that uses one.

        Only the engine ends the transaction: phase code gets it through
        :func:`recoverypoint.phase_guard.refusing_to_end`.
        """
        if self._sqlalchemy is None:
            if not self._began:
                self.execute("SELECT 1")  # begins the transaction the Connection joins
            conn = sa.Connection(self._db, connection=self._pooled)
            conn.begin()  # SQLAlchemy's view of the transaction already open; sends nothing
            self._sqlalchemy = conn
        return self._sqlalchemy

    def _end_sqlalchemy(self) -> None:
        # After COMMIT or ROLLBACK psycopg is idle, so SQLAlchemy's own commit sends nothing;
        # it only closes SQLAlchemy's view of the transaction. The pooled connection is
        # checked in by `serializable`, not by this Connection.
        if self._sqlalchemy is not None:
            sa.Connection.commit(self._sqlalchemy)
            self._sqlalchemy = None


def serializable(
    db: sa.Engine,
    work: Callable[[Transaction], T],
    retries: int,
    observer: Observer = NO_OBSERVER,
) -> T:
    """Run ``work`` in one SERIALIZABLE transaction on a connection of ``db``'s pool, again
    on serialization failure or deadlock with capped, jittered backoff, then
    :class:`ConcurrentUpdate`. ``work`` commits with its last write, or it is committed
    for it when it returns. ``observer`` hears of each retry and of running out."""
    with borrowed(db) as (pooled, connection):
        for attempt in range(retries + 1):
            tx = Transaction(db, pooled, connection)
            try:
                result = work(tx)
                tx.commit()
                return result
            except (psycopg.Error, sa.exc.DBAPIError) as exc:
                state = sqlstate(exc)
                if state not in RETRYABLE_SQLSTATES:
                    raise
                if attempt == retries:
                    observer.serialization_exhausted(state)
                    raise ConcurrentUpdate() from exc
                observer.serialization_retry(attempt + 1, state)
            finally:
                _roll_back_leftovers(tx)
            if attempt:  # the first retry at once: most conflicts are false positives
                time.sleep(backoff_delay(attempt - 1, base=0.005, cap=0.25))
    raise AssertionError("unreachable")


@contextmanager
def _pipeline(connection: psycopg.Connection[Any]) -> Iterator[None]:
    """psycopg's pipeline, where a failure the server reported inside the block is raised
    once the pipeline has ended: raised from inside, it would make psycopg log "error
    ignored terminating <Pipeline>" at every serialization failure. The body's remaining
    statements (a COMMIT) are skipped all the same."""
    kept: list[psycopg.Error] = []
    try:
        with connection.pipeline():
            try:
                yield
            except psycopg.Error as exc:
                # An error of the client's own (a parameter it could not adapt) was never
                # sent: raise it at once.
                if exc.sqlstate is None and not isinstance(exc, psycopg.errors.PipelineAborted):
                    raise
                kept.append(exc)
    except psycopg.errors.PipelineAborted:
        if not kept:
            raise
    # The end of the pipeline raises nothing more, or only "aborted", for what was raised
    # inside: that first failure (a 40001 to retry) is the one to report.
    if kept:
        raise kept[0]


def sqlstate(exc: psycopg.Error | sa.exc.DBAPIError) -> str | None:
    """The SQLSTATE of a driver error, raised through SQLAlchemy (phase code) or not."""
    error = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
    return getattr(error, "sqlstate", None)


def _roll_back_leftovers(tx: Transaction) -> None:
    """Roll back whatever the transaction left open (an error, a refused request)."""
    connection = tx.connection
    if not connection.closed and connection.info.transaction_status != TransactionStatus.IDLE:
        # A connection that broke cannot roll back: borrowed() drops it from the pool.
        with contextlib.suppress(psycopg.Error):
            connection.rollback()
    tx._end_sqlalchemy()


@contextmanager
def borrowed(db: sa.Engine) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
    """A connection of ``db``'s pool in autocommit mode, handed back as the pool gave it (an
    application's engine may be in autocommit itself), or dropped if it broke."""
    pooled = db.raw_connection()
    connection = cast("psycopg.Connection[Any]", pooled.driver_connection)
    was = connection.autocommit
    try:
        connection.autocommit = True
        yield pooled, connection
    finally:
        if not connection.closed and connection.info.transaction_status == TransactionStatus.IDLE:
            connection.autocommit = was
        else:
            pooled.invalidate()  # broken, or stuck in a transaction: never hand it out again
        pooled.close()


def run_alone(db: sa.Engine, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """One statement in a transaction of its own (autocommit); its first row."""
    with borrowed(db) as (_, connection):
        return connection.execute(sql, params).fetchone()
